"""What a `KernelPool`'s kernels are: the gateway its settings make, and the executors they admit.

Runs in the application. The pool fixes its kernels' settings once; this module turns them into
the pool's `KernelGateway` (per-kernel environment, hidden folders, the registry kept read-only)
and refuses an executor whose kernels would differ from the pool's, naming each setting.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from ipybox._wire import KernelEnv, PoolEnv, ToolServerEnv
from ipybox.app._settings import ExecutorSettings
from ipybox.app.kernels import KernelGateway
from ipybox.app.mcp_client import ServerRegistry

__all__ = ["check_executor", "check_hidden", "pool_gateway"]

# Settings that make a kernel what it is: an executor on a pool must have the pool's.
_KERNEL_FIELDS = (
    "kernel_gateway_host",
    "sandbox",
    "sandbox_config",
    "memory_limit",
    "max_processes",
    "approve_shell_cmds",
    "require_shell_escape",
    "sandbox_hidden",
)


def pool_gateway(
    settings: ExecutorSettings, token: str, base: Path, registry_dir: Path, trail_dir: Path
) -> KernelGateway:
    """The (not yet started) gateway of a pool with `settings`, whose kernels' folders are in `base`,
    that hides the audit trail's folder `trail_dir` and keeps `registry_dir` out of reach."""
    return KernelGateway(
        host=settings.kernel_gateway_host,
        port=0,
        sandbox=settings.sandbox,
        sandbox_config=settings.sandbox_config,
        log_level=settings.log_level,
        env=settings.kernel_settings(),
        auth_token=token,
        working_dir=settings.working_dir,
        memory_limit=settings.memory_limit,
        max_processes=settings.max_processes,
        sandbox_hidden=(*settings.sandbox_hidden, trail_dir),
        registry_dir=registry_dir,
        per_kernel_env=(
            *((ToolServerEnv.SOCKET, PoolEnv.SETTINGS) if settings.sandbox else ("TMPDIR", "IPYTHONDIR")),
            KernelEnv.START_DIR,
            KernelEnv.WORKING_DIR,
            *settings.kernel_env,
        ),
        tools_base=base if settings.sandbox else None,
    )


def check_executor(
    pool: ExecutorSettings, registry_dir: Path, settings: ExecutorSettings, registry: ServerRegistry
) -> None:
    """Refuse an executor whose kernels would differ from those of the `pool`'s settings.

    Raises:
        ValueError: Naming each setting that differs, and the pool's value.
    """
    known = {field.name for field in fields(ExecutorSettings)}
    assert set(_KERNEL_FIELDS) <= known
    differ = [
        f"{name}={getattr(settings, name)!r} (the pool's: {getattr(pool, name)!r})"
        for name in _KERNEL_FIELDS
        if getattr(settings, name) != getattr(pool, name)
    ]
    if set(settings.kernel_env) != set(pool.kernel_env):
        differ.append(
            f"kernel_env names {sorted(settings.kernel_env)} (the pool's: {sorted(pool.kernel_env)})"
        )
    working_dir = settings.working_dir or Path.cwd().resolve()
    if not working_dir.is_relative_to(pool.working_dir or Path.cwd().resolve()):
        differ.append(f"working_dir={str(working_dir)!r} (not in the pool's: {str(pool.working_dir)!r})")
    if settings.kernel_gateway_port is not None:
        differ.append(
            f"kernel_gateway_port={settings.kernel_gateway_port!r} (the pool's gateway picks its own)"
        )
    if settings.sandbox and registry.path.parent != registry_dir:
        differ.append(f"registry in {registry.path.parent} (the pool's: {registry_dir})")
    if differ:
        raise ValueError(
            "This executor's kernels would differ from the pool's: "
            + "; ".join(differ)
            + ". Give the executor the pool's settings, or make a pool with these."
        )


def check_hidden(
    pool: ExecutorSettings, trail_dir: Path, settings: ExecutorSettings, hidden: tuple[Path, ...]
) -> None:
    """Refuse a sandboxed executor whose audit trail's folders (`hidden`) the pool's kernels see.

    Raises:
        ValueError: Naming the first such folder and what to do.
    """
    if not settings.sandbox:
        return
    pool_hidden = (*pool.sandbox_hidden, trail_dir)
    for folder in hidden:
        if not any(folder.resolve().is_relative_to(Path(h).resolve()) for h in pool_hidden):
            raise ValueError(
                f"The audit trail in {folder} is not hidden from the pool's kernels; pass "
                f"sandbox_hidden=({str(folder)!r},) to the pool as well, or audit=False."
            )
