"""The tool tests' fixtures (tests/app/tools/conftest.py): the same real MCP servers, and every
`ToolRunner` a test made closed after it."""

from tests.app.tools.conftest import close_runners, demo_params, filesystem_params, time_params

__all__ = ["close_runners", "demo_params", "filesystem_params", "time_params"]
