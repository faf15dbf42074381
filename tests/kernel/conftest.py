"""Every `ToolRunner` a test made is closed after it, as in the tool tests (tests/app/tools/conftest.py)."""

from tests.app.tools.conftest import close_runners

__all__ = ["close_runners"]
