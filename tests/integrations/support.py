"""What the integration tests share: the demo MCP server's parameters and a scripted model's plan."""

from __future__ import annotations

import sys

from tests.conftest import DEMO_SERVER

DEMO = {"command": sys.executable, "args": [str(DEMO_SERVER)]}

# One task in cells, as a model would write them: state kept between steps, an MCP tool call
# accepted and one rejected in the same cell, an error and the recovery from it, and a plot.
STATE = "total = 40"
STATE_USED = "total += 2\nprint('total', total)"
TOOLS = """
from mcptools.demo import echo
print(echo.run(echo.Params(text="allowed")))
try:
    echo.run(echo.Params(text="forbidden"))
except Exception as exc:
    print("refused:", exc)
"""
FAILING = "print(undefined_name)"
RECOVERY = "undefined_name = total * 2\nprint('recovered', undefined_name)"
PLOT = """
import matplotlib.pyplot as plt
plt.plot([1, 2, 3], [total, total + 1, total + 4])
plt.show()
print("plotted")
"""


def only_allowed(request: object) -> bool:
    """The application's decision: the demo's echo runs unless it is asked to echo 'forbidden'."""
    return getattr(request, "tool_args", {}).get("text") != "forbidden"
