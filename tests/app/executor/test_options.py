"""Option objects (`KernelOptions`, `ToolOptions`, `RemoteGateway`) and the keyword arguments they
group: the same settings either way, for `CodeExecutor` and `KernelPool` alike."""

from __future__ import annotations

import inspect
from dataclasses import fields
from pathlib import Path

import pytest

from ipybox import CodeExecutor, KernelOptions, KernelPool, RemoteGateway, ToolOptions

# private: the keyword sets are typing aids of the constructors, not public names
from ipybox.app._settings import ExecutorKeywords, KernelKeywords

_KERNEL = KernelOptions(
    working_dir=".",
    memory_limit="1G",
    max_processes=64,
    warm_imports=("json",),
    approve_shell_cmds=True,
    require_shell_escape=True,
    sandbox_hidden=(Path("/nonexistent-hidden"),),
)
_TOOLS = ToolOptions(approve_tool_calls=False, max_result_size=1024, tool_channel="stdin")


def _as_keywords(options: KernelOptions | ToolOptions) -> dict[str, object]:
    return {field.name: getattr(options, field.name) for field in fields(options)}


def test_kernel_and_tool_options_give_the_executor_the_settings_their_keywords_give() -> None:
    grouped = CodeExecutor(kernel=_KERNEL, tools=_TOOLS)
    flat = CodeExecutor(**_as_keywords(_KERNEL), **_as_keywords(_TOOLS))  # type: ignore[arg-type]
    assert grouped.settings == flat.settings
    assert grouped.settings.memory_limit == "1G" and grouped.settings.max_result_size == 1024
    assert grouped.settings.working_dir == Path(".").resolve()


def test_a_remote_gateway_gives_the_settings_of_the_kernel_gateway_keywords() -> None:
    grouped = CodeExecutor(
        remote=RemoteGateway(url="http://gateway.invalid:8888", token="t", kernel_name="py", start_timeout=5)
    )
    flat = CodeExecutor(
        kernel_gateway_url="http://gateway.invalid:8888",
        kernel_gateway_token="t",
        kernel_name="py",
        kernel_start_timeout=5,
    )
    assert grouped.settings == flat.settings
    assert grouped.settings.remote and grouped.settings.tool_channel == "stdin"
    assert "s3cret" not in repr(RemoteGateway(url="http://gateway.invalid:8888", token="s3cret"))


def test_the_pool_takes_the_same_kernel_options_as_the_executor() -> None:
    kernel = KernelOptions(working_dir=".", max_processes=64, approve_shell_cmds=True)
    grouped = KernelPool(size=0, kernel=kernel)
    flat = KernelPool(size=0, working_dir=".", max_processes=64, approve_shell_cmds=True)
    assert grouped.settings == flat.settings
    # The executor given the pool's options is admitted; without them it is refused.
    CodeExecutor(pool=grouped, kernel=kernel)
    with pytest.raises(ValueError, match="max_processes"):
        CodeExecutor(pool=grouped)


def test_a_setting_given_twice_or_an_unknown_keyword_is_refused_naming_it() -> None:
    with pytest.raises(
        ValueError, match=r"memory_limit was given both as a keyword and in kernel=KernelOptions"
    ):
        CodeExecutor(memory_limit="1G", kernel=KernelOptions(memory_limit="2G"))
    with pytest.raises(ValueError, match=r"kernel_name was given both"):
        CodeExecutor(kernel_name="py", remote=RemoteGateway(url="http://gateway.invalid:8888"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'memory_limt'"):
        CodeExecutor(memory_limt="1G")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected keyword argument 'approve_tool_calls'"):
        KernelPool(approve_tool_calls=False)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="kernel must be a KernelOptions"):
        CodeExecutor(kernel={"memory_limit": "1G"})  # type: ignore[arg-type]
    # The checks of each value are those of the keyword.
    with pytest.raises(ValueError, match="max_processes must be at least 16"):
        CodeExecutor(kernel=KernelOptions(max_processes=2))


def test_every_option_field_is_also_a_keyword_and_the_constructors_stay_short() -> None:
    kernel_fields = {field.name for field in fields(KernelOptions)}
    tool_fields = {field.name for field in fields(ToolOptions)}
    remote_keywords = {"kernel_gateway_url", "kernel_gateway_token", "kernel_name", "kernel_start_timeout"}
    assert set(KernelKeywords.__optional_keys__) == kernel_fields
    assert set(ExecutorKeywords.__optional_keys__) == kernel_fields | tool_fields | remote_keywords
    named = [p for p in inspect.signature(CodeExecutor).parameters.values() if p.kind != p.VAR_KEYWORD]
    assert len(named) == 20
    assert (
        len([p for p in inspect.signature(KernelPool).parameters.values() if p.kind != p.VAR_KEYWORD]) == 12
    )
