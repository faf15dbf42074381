"""The user's state folder: where the trusted side keeps what must outlive a process.

The folder is ``$IPYBOX_STATE_DIR``, else ``$XDG_STATE_HOME/ipybox`` or ``~/.local/state/ipybox``
on Linux and ``~/Library/Application Support/ipybox`` on macOS: never the working directory or
``~/.ipython``, which a sandboxed kernel may write to. It holds the trusted registry
(``servers.json``), the stored OAuth logins (``oauth/``) and the audit trail (``audit/``); the
sandbox's settings always deny it. A shared leaf: it imports nothing of ``ipybox.app``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ipybox._wire import UserEnv

__all__ = ["oauth_dir", "private_dir", "state_dir"]


def state_dir() -> Path:
    """The user's state folder (see the module docstring), resolved when called; not made."""
    state = os.environ.get(UserEnv.STATE_DIR)
    if state:
        return Path(state).expanduser()
    home = Path.home()
    if sys.platform == "darwin":
        base = home / "Library" / "Application Support"
    elif sys.platform == "win32":  # pragma: no cover
        base = Path(os.environ.get("LOCALAPPDATA") or home / "AppData" / "Local")
    else:
        base = Path(os.environ.get("XDG_STATE_HOME") or home / ".local" / "state")
    return base / "ipybox"


def oauth_dir() -> Path:
    """The folder of the stored OAuth logins: ``oauth/`` in the state folder; not made."""
    return state_dir() / "oauth"


def private_dir(folder: Path) -> Path:
    """`folder`, made if missing and kept owner-only (``0700``)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if folder.stat().st_mode & 0o077:
        os.chmod(folder, 0o700)
    return folder
