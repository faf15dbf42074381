"""Where a `KernelPool`'s kernels work: the pool's working directory, or new folders of their own.

Runs in the application. A place is a working directory with the `kernel_env` of the kernels that
work there. `PoolPlaces` owns what a sandboxed kernel needs to work elsewhere than the gateway's
working directory: an srt settings file of its own, the confinement the tool server is told, and a
private folder of placeholder files, made once per place and dropped when the gateway is stopped or
replaced.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ipybox._wire import KernelEnv, PoolEnv
from ipybox.app import sandbox as _sandbox
from ipybox.app._settings import ExecutorSettings
from ipybox.app.kernels import KernelGateway
from ipybox.app.sandbox import KernelConfinement

__all__ = ["Place", "PoolPlaces"]


@dataclass(frozen=True)
class Place:
    """Where a kernel works and with what environment (`kernel_env`)."""

    working_dir: Path
    env: tuple[tuple[str, str], ...]


class PoolPlaces:
    """The places of a pool's kernels, and the sandbox settings of those away from the gateway's.

    Args:
        settings: What the pool's kernels are.
        new_folder: Makes a new working folder for each kernel started ahead; ``None``: they all
            work in the gateway's working directory.
        folder_env: The `kernel_env` of kernels working in such a folder (default: the pool's).
    """

    def __init__(
        self,
        settings: ExecutorSettings,
        new_folder: Callable[[], Path] | None,
        folder_env: Callable[[Path], Mapping[str, str]] | None,
    ) -> None:
        self._settings = settings
        self.new_folder = new_folder
        self._folder_env = folder_env
        self._names = itertools.count()
        # Sandboxed kernels working elsewhere than the gateway: their settings file, confinement
        # and placeholder journal folder, per place (until the gateway is replaced).
        self._prepared: dict[Place, tuple[Path, KernelConfinement, Path]] = {}

    def default(self, gateway: KernelGateway) -> Place:
        """The gateway's working directory, with the pool's `kernel_env`."""
        return Place(gateway.working_dir, tuple(sorted(self._settings.kernel_env.items())))

    def of(self, settings: ExecutorSettings, gateway: KernelGateway) -> Place:
        """Where an executor's kernels work: its working directory, with its `kernel_env`."""
        working_dir = settings.working_dir or gateway.working_dir
        return Place(working_dir, tuple(sorted(settings.kernel_env.items())))

    def new(self, gateway: KernelGateway) -> Place:
        """The place of the next kernel started ahead: a new folder, or the pool's working directory."""
        if self.new_folder is None:
            return self.default(gateway)
        folder = Path(self.new_folder()).resolve()
        env = (
            dict(self._folder_env(folder))
            if self._folder_env is not None
            else dict(self._settings.kernel_env)
        )
        return Place(folder, tuple(sorted(env.items())))

    def confinement(self, place: Place, gateway: KernelGateway) -> KernelConfinement:
        """What the tool server of an executor working at `place` must know of its kernels."""
        prepared = self._prepared.get(place)
        return prepared[1] if prepared is not None else gateway.confinement

    def prepare(self, place: Place, gateway: KernelGateway, base: Path) -> dict[str, str]:
        """The environment that makes a kernel work at `place` (sandboxed elsewhere than the
        gateway: settings of its own, written once per place into `base`)."""
        if place == self.default(gateway):
            return {}
        env = {**dict(place.env), KernelEnv.START_DIR: str(place.working_dir)}
        if self._settings.working_dir is not None:
            env[KernelEnv.WORKING_DIR] = str(place.working_dir)
        if self._settings.sandbox:
            prepared = self._prepared.get(place)
            if prepared is None:
                private = Path(tempfile.mkdtemp(prefix="ipybox-jupyter-pool-", dir=_sandbox.private_base()))
                settings_file = base / f"p{next(self._names)}.json"
                kernel_env = {**self._settings.kernel_settings(), **dict(place.env)}
                confinement = gateway.folder_confinement(
                    place.working_dir, kernel_env, settings_file, private
                )
                prepared = self._prepared[place] = (settings_file, confinement, private)
            env[PoolEnv.SETTINGS] = str(prepared[0])
        return env

    def drop(self) -> None:
        """Forget every prepared place and remove its private folder (the gateway is gone)."""
        prepared, self._prepared = self._prepared, {}
        for _, _, private in prepared.values():
            _sandbox.remove_placeholders(private)
            shutil.rmtree(private, ignore_errors=True)
