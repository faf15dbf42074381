#!/usr/bin/env bash
# Checks ipybox's OpenTelemetry traces in a real trace backend: starts Arize Phoenix (in a virtual
# environment of its own, never in ipybox's), runs a cell with tool calls through `ipybox --otel
# --approve-tool-calls` with OTEL_EXPORTER_OTLP_ENDPOINT pointing at Phoenix, and reads the trace
# back from Phoenix's REST API: the MCP request, the cell under it, each tool call under the cell,
# and under a call its approval wait and the MCP server start.
#
#   bash scripts/test-traces.sh
#
# Phoenix's environment goes to $IPYBOX_PHOENIX_VENV (default ~/.cache/ipybox/phoenix-venv) and is
# kept for the next run. Where Phoenix cannot be installed or started it prints
# "test-traces: SKIPPED: <reason>" and exits 0; a trace that is missing or wrongly linked fails.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_uv.sh

venv="${IPYBOX_PHOENIX_VENV:-$HOME/.cache/ipybox/phoenix-venv}"
work="$(mktemp -d)"
phoenix_pid=""
cleanup() {
    if [ -n "$phoenix_pid" ]; then
        kill "$phoenix_pid" 2>/dev/null || true
        wait "$phoenix_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

skip() {
    echo "test-traces: SKIPPED: $*"
    exit 0
}

if [ ! -x "$venv/bin/phoenix" ]; then
    echo "test-traces: installing arize-phoenix into $venv"
    { uv venv -q --allow-existing "$venv" >"$work/install.log" 2>&1 \
        && timeout 1200 uv pip install -q --python "$venv/bin/python" arize-phoenix >>"$work/install.log" 2>&1; } \
        || skip "arize-phoenix could not be installed: $(tail -1 "$work/install.log")"
fi

free_port() {
    uv run --frozen python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
port="$(free_port)"
grpc_port="$(free_port)"
mkdir -p "$work/phoenix" "$work/workspace"
PHOENIX_WORKING_DIR="$work/phoenix" PHOENIX_HOST=127.0.0.1 PHOENIX_PORT="$port" PHOENIX_GRPC_PORT="$grpc_port" \
    "$venv/bin/phoenix" serve >"$work/phoenix.log" 2>&1 &
phoenix_pid=$!
url="http://127.0.0.1:$port"
# Phoenix migrates its database and builds its app at start: up to minutes on a loaded machine.
deadline=$((SECONDS + 300))
until curl -sf "$url/healthz" >/dev/null 2>&1; do
    kill -0 "$phoenix_pid" 2>/dev/null || skip "Phoenix did not start: $(grep -m1 -iE 'error' "$work/phoenix.log" || tail -1 "$work/phoenix.log")"
    [ "$SECONDS" -lt "$deadline" ] || skip "Phoenix did not answer on $url within 300 s"
    sleep 1
done
echo "test-traces: Phoenix $("$venv/bin/python" -c 'from importlib.metadata import version; print(version("arize-phoenix"))') listens on $url"

OTEL_EXPORTER_OTLP_ENDPOINT="$url" IPYBOX_STATE_DIR="$work/state" \
    uv run --frozen python scripts/traces_cell.py "$work/workspace"

PHOENIX_URL="$url" uv run --frozen python - <<'PY'
"""Read the cell's trace back from Phoenix and check how its spans are linked."""
import json, os, sys, time, urllib.request

url = os.environ["PHOENIX_URL"]
deadline = time.monotonic() + 60
while True:  # Phoenix stores spans it received a moment later
    with urllib.request.urlopen(f"{url}/v1/projects/default/spans?limit=1000") as response:
        spans = json.load(response)["data"]
    tools = [s for s in spans if s["name"] == "ipybox.tool_call"]
    if len(tools) >= 2 or time.monotonic() > deadline:
        break
    time.sleep(0.5)
by_id = {s["context"]["span_id"]: s for s in spans}
cells = [s for s in spans if s["name"] == "ipybox.execute" and "greet" in s["attributes"].get("ipybox.code", "")]
if len(cells) != 1:
    sys.exit(f"test-traces: FAILED: expected one traced cell in Phoenix, found {len(cells)} among {len(spans)} spans")
cell = cells[0]
trace = [s for s in spans if s["context"]["trace_id"] == cell["context"]["trace_id"]]
children = {}
for s in trace:
    children.setdefault(s.get("parent_id"), []).append(s)

def show(span, depth=0):
    attributes = span["attributes"]
    detail = " ".join(f"{k}={attributes[k]}" for k in ("ipybox.server", "ipybox.tool", "ipybox.accepted") if k in attributes)
    print(f"  {'  ' * depth}{span['name']} {detail}".rstrip())
    for child in sorted(children.get(span["context"]["span_id"], []), key=lambda s: s["start_time"]):
        show(child, depth + 1)

roots = [s for s in trace if s.get("parent_id") not in by_id]
print(f"test-traces: trace {cell['context']['trace_id']} as Phoenix stores it:")
for root in roots:
    show(root)
calls = [s for s in children.get(cell["context"]["span_id"], []) if s["name"] == "ipybox.tool_call"]
problems = []
if sorted(c["attributes"].get("ipybox.tool") for c in calls) != ["add", "greet"]:
    problems.append("the cell's two tool calls are not both under its span")
parent = by_id.get(cell.get("parent_id"))
if parent is None or parent["name"] != "tools/call execute_ipython_cell":
    problems.append("the cell is not under the MCP request that ran it")
for call in calls:
    names = [s["name"] for s in children.get(call["context"]["span_id"], [])]
    if "ipybox.approval" not in names:
        problems.append(f"the call of {call['attributes'].get('ipybox.tool')} has no approval span under it")
if not any(s["name"] == "ipybox.mcp_server.start" and by_id.get(s.get("parent_id"), {}).get("name") == "ipybox.tool_call" for s in trace):
    problems.append("no MCP server start under a tool call")
if problems:
    sys.exit("test-traces: FAILED: " + "; ".join(problems))
print("test-traces: OK: the cell, its tool calls, their approval waits and the MCP server start are one linked trace")
PY
