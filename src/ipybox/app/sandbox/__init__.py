"""The sandbox: what confines a kernel and what confines the trusted side's own file access.

Owns Anthropic's sandbox-runtime (``srt``: finding it, its settings, the wrapped command, the
stand-ins for protected names), the one confined, descriptor-relative module through which
trusted code touches the workspace (`Confined`), and the runner of a walled kernel's approved
shell commands (`ShellRunner`, `KernelConfinement`: what confines one kernel).

May import (within ``ipybox.app``): ``_state``.

Only the kernel runs inside the sandbox; the gateway stays outside and launches each kernel
through a kernel spec whose command is a launcher (`ipybox.gateway._kernel_launch`) that
becomes ``srt -s <settings> -c 'exec python -m ipykernel_launcher …'``. The gateway talks to the
kernel over ZMQ ``ipc://`` sockets in a folder of that kernel's own, the only private folder its
sandbox shows it (srt removes the network namespace, so TCP ports opened inside are unreachable
from outside), and the kernel reaches the tool server through a Unix socket.

Settings are srt's own format. The defaults allow no network at all, hide the home folder (but
the working directory and the kernel's own Python), the shared folders where the host's Unix
sockets live, ``.env`` and the credential files, on Linux everything outside the system folders
(`SYSTEM_READABLE`), and allow writes only to the working directory and the private folders
(which hold the kernel's temporary, IPython and Jupyter folders). A custom settings file
replaces the defaults, but `sandbox_settings` always adds the rules the rest of ipybox depends
on: the protected names in the working directory, the credential files and the stored OAuth
logins (and, for a kernel started as root, what only root may read in ``/etc``), the secrets of the folders the kernel
imports from outside its Python, the trusted registry, the kernel's Python and its tool socket.

srt and the gateway run in a private folder, never in the working directory (`_kernel_launch.wrap`); the
protected names missing in the working directory are held by stand-ins that ipybox makes and
removes, however the application ends (`make_placeholders`).

Modules: `_srt` finds srt, makes the private folders and checks that a sandbox starts; `_rules`
builds the settings; `_placeholders` keeps the stand-ins; `_confined` is the trusted side's file
access in the workspace; `_shell` runs approved shell commands; `_container` checks a container's
workspace mount.
"""

from ipybox.app.sandbox._confined import (
    Confined,
    ConfinedPathError,
    TooLargeError,
    check_unprotected,
    relative_parts,
    remove_entry,
    write_new,
)
from ipybox.app.sandbox._placeholders import make_placeholders, remove_placeholders, sweep
from ipybox.app.sandbox._rules import (
    CREDENTIAL_STORES,
    HIDDEN_SYSTEM_DIRS,
    IMPORT_PATH_SECRETS,
    PROTECTED_WORKSPACE_DIRS,
    PROTECTED_WORKSPACE_FILES,
    SYSTEM_READABLE,
    SYSTEM_SECRETS,
    default_settings,
    import_path_secrets,
    load_config,
    nested_protected,
    oauth_store,
    python_paths,
    root_only,
    sandbox_settings,
)
from ipybox.app.sandbox._shell import (
    KernelConfinement,
    ShellProgramError,
    ShellRequest,
    ShellResult,
    ShellRunner,
    run_while_connected,
    shell_call,
)
from ipybox.app.sandbox._srt import (
    SRT_VERSION,
    check,
    find_srt,
    private_base,
    srt_command,
    srt_support,
    tools_dir,
)

__all__ = [
    "CREDENTIAL_STORES",
    "HIDDEN_SYSTEM_DIRS",
    "IMPORT_PATH_SECRETS",
    "PROTECTED_WORKSPACE_DIRS",
    "PROTECTED_WORKSPACE_FILES",
    "SRT_VERSION",
    "SYSTEM_READABLE",
    "SYSTEM_SECRETS",
    "Confined",
    "ConfinedPathError",
    "KernelConfinement",
    "ShellProgramError",
    "ShellRequest",
    "ShellResult",
    "ShellRunner",
    "TooLargeError",
    "check",
    "check_unprotected",
    "default_settings",
    "find_srt",
    "import_path_secrets",
    "load_config",
    "make_placeholders",
    "nested_protected",
    "oauth_store",
    "private_base",
    "python_paths",
    "relative_parts",
    "remove_entry",
    "remove_placeholders",
    "root_only",
    "run_while_connected",
    "sandbox_settings",
    "shell_call",
    "srt_command",
    "srt_support",
    "sweep",
    "tools_dir",
    "write_new",
]
