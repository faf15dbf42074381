import ipybox


def test_public_names_are_exported_and_importable() -> None:
    exported = [
        "ApprovalRequest",
        "CodeExecutionChunk",
        "CodeExecutionError",
        "CodeExecutionResult",
        "CodeExecutor",
        "KernelOptions",
        "KernelPool",
        "RemoteGateway",
        "SnapshotReport",
        "ToolOptions",
        "generate_mcp_sources",
    ]
    assert ipybox.__all__ == exported
    for name in exported:
        assert getattr(ipybox, name).__name__ == name


def test_the_kernel_side_client_does_not_import_the_application_stack() -> None:
    import subprocess
    import sys

    code = (
        "import sys, ipybox.tool_exec.client\n"
        "heavy = [m for m in ('httpx2', 'mcp', 'starlette', 'pydantic', 'ipybox.app', 'ipybox.code_exec') if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_whole_error_tree_is_public_and_rooted_in_one_class() -> None:
    import inspect

    import ipybox.errors

    classes = [
        name
        for name, value in vars(ipybox.errors).items()
        if inspect.isclass(value) and issubclass(value, Exception)
    ]
    assert sorted(classes) == sorted(name for name in ipybox.errors.__all__ if name != "ToolCallOutcome")
    assert ipybox.errors.__all__ == sorted(ipybox.errors.__all__)
    for name in classes:
        assert issubclass(getattr(ipybox.errors, name), ipybox.errors.IpyboxError)
        assert name in (ipybox.errors.__doc__ or ""), (
            f"{name} is missing from the tree drawn in the docstring"
        )
    assert ipybox.CodeExecutionError is ipybox.errors.CodeExecutionError
