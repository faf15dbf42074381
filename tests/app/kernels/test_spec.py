"""What a sandboxed kernel may never write: the installation the trusted side runs from."""

from __future__ import annotations

# private-ok: the list of trusted folders is internal; the sandboxed attack in
# tests/tool_exec/test_trusted_side.py shows its effect, this shows its content without srt.
import sys
from pathlib import Path

import ipybox
from ipybox.app.kernels._spec import _trusted_installation


def test_the_trusted_installation_is_the_environment_ipybox_s_own_package_and_srt(tmp_path: Path) -> None:
    srt = tmp_path / "node_modules" / "@anthropic-ai" / "sandbox-runtime" / "dist" / "cli.js"
    assert _trusted_installation(str(srt)) == [
        Path(sys.prefix),
        Path(ipybox.__file__).resolve().parent,
        tmp_path.resolve() / "node_modules",
    ]
