import ipybox


def test_public_names_are_exported_and_importable() -> None:
    exported = [
        "ApprovalRequest",
        "CodeExecutionChunk",
        "CodeExecutionError",
        "CodeExecutionResult",
        "CodeExecutor",
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
        "heavy = [m for m in ('httpx', 'mcp', 'starlette', 'pydantic', 'ipybox.code_exec') if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
