"""`CodeExecutor`'s arguments become one frozen settings object, checked when the executor is made."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from ipybox import CodeExecutor


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"approval_timeout": 0}, "approval_timeout must be a positive number of seconds, not 0"),
        ({"connect_timeout": -1}, "connect_timeout must be a positive number of seconds, not -1"),
        ({"max_result_size": 0}, "max_result_size must be a positive number of bytes, not 0"),
        ({"tool_server_port": 70000}, "tool_server_port must be a TCP port"),
        ({"kernel_gateway_port": "8888"}, "kernel_gateway_port must be a TCP port"),
        ({"log_level": "LOUD"}, "Unknown log level 'LOUD'"),
        ({"memory_limit": "lots"}, "memory_limit must be bytes or a size such as '512M'"),
        ({"max_processes": 3}, "max_processes must be at least 16"),
        ({"sandbox_config": Path("srt.json")}, "was given without sandbox=True"),
        ({"kernel_env": {"A": 1}}, r"kernel_env\['A'\] is 1 \(int\)"),
        ({"warm_imports": "matplotlib"}, "warm_imports must be a tuple of module names"),
        (
            {"warm_imports": ("matplotlib pyplot",)},
            "warm_imports has 'matplotlib pyplot', which is not a module",
        ),
    ],
)
def test_a_bad_argument_is_refused_when_the_executor_is_made_naming_it(
    arguments: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        CodeExecutor(**arguments)


def test_the_settings_are_the_arguments_frozen_with_a_copy_of_kernel_env(tmp_path: Path) -> None:
    env = {"A": "1"}
    executor = CodeExecutor(kernel_env=env, working_dir=tmp_path / "." / "work", memory_limit="512M")
    settings = executor.settings
    env["A"] = "changed"
    assert settings.kernel_env == {"A": "1"}
    assert settings.working_dir == (tmp_path / "work").resolve() and settings.memory_limit == "512M"
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.sandbox = True  # type: ignore[misc]  # the point: it cannot be assigned
    with pytest.raises(TypeError):
        settings.kernel_env["B"] = "2"  # type: ignore[index]  # the point: a read-only mapping


def test_the_executor_has_no_public_state_to_reassign() -> None:
    executor = CodeExecutor()
    assert [name for name in vars(executor) if not name.startswith("_")] == []
    with pytest.raises(AttributeError):
        executor.settings = executor.settings  # type: ignore[misc]  # the point: read-only
