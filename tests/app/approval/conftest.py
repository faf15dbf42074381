"""The tool tests' fixtures (tests/app/tools/conftest.py), for the approval tests that call tools."""

from tests.app.tools.conftest import close_runners, demo_params

__all__ = ["close_runners", "demo_params"]
