"""Hosts a test may reach, learned from this machine's configuration at run time.

The repository names no package-registry host (``tests/system/test_scripts.py`` checks): a test that
needs a real, reachable host asks the machine which package index or registry it uses, as its
installers would, and skips with the reason when nothing is configured.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from urllib.parse import urlsplit

import pytest


def _web_url(value: str) -> str | None:
    # uv's UV_INDEX takes `name=url` items.
    url = value.split("=", 1)[1] if "=" in value.split("://")[0] else value
    return url if urlsplit(url).scheme in ("http", "https") and urlsplit(url).hostname else None


def package_index_url() -> str:
    """The Python package index this machine's installers use: uv's or pip's index variable,
    else the ``index-url`` of pip's configuration, else the index pip uses by default."""
    for key in ("UV_DEFAULT_INDEX", "UV_INDEX_URL", "UV_INDEX", "PIP_INDEX_URL"):
        for item in os.environ.get(key, "").split():
            if url := _web_url(item):
                return url
    pip = shutil.which("pip3") or shutil.which("pip")
    if pip is None:
        pytest.skip("no package index is configured (UV_DEFAULT_INDEX, PIP_INDEX_URL) and no pip to ask")
    config = subprocess.run([pip, "config", "list"], capture_output=True, text=True, check=False).stdout
    for line in config.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".index-url") and (url := _web_url(value.strip().strip("'\""))):
            return url
    help_text = subprocess.run([pip, "install", "--help"], capture_output=True, text=True, check=False).stdout
    match = re.search(r"--index-url <url>.*?\(default (\S+?)\)", " ".join(help_text.split()))
    if match is None or (url := _web_url(match.group(1))) is None:
        pytest.skip("pip names no default index here")
    return url


def npm_registry_url() -> str:
    """The registry npm uses on this machine (``npm config get registry``)."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    value = subprocess.run([npm, "config", "get", "registry"], capture_output=True, text=True, check=False)
    url = _web_url(value.stdout.strip())
    if url is None:
        pytest.skip(f"npm names no web registry here ({value.stdout.strip()!r})")
    return url


def host_of(url: str) -> str:
    """The host name of `url`."""
    host = urlsplit(url).hostname
    assert host, url
    return host
