"""``ipybox audit``: the audit trail of tool calls and shell commands, as a table or as JSON."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path

from ipybox.app.approval import AuditRecord, AuditTrail, default_audit_path

_DESCRIPTION = """\
Show the audit trail: one record per tool call and shell command the executors of this user
were asked for (the MCP server's sessions, and CodeExecutor(audit=True)), oldest first, with
its decision and who made it, its duration, outcome and result size. A call still marked
`running` was under way when its application stopped, or crashed.
"""
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _since(text: str) -> float:
    """`--since`: ``30m``, ``2h``, ``1d`` ago, or a date and time (``2026-11-26T10:00``, local time)."""
    relative = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if relative:
        return time.time() - float(relative[1]) * _UNITS[relative[2]]
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a duration (30m, 2h, 1d) nor a date and time (2026-11-26T10:00)"
        ) from None


def main(argv: list[str]) -> None:
    """Run ``ipybox audit`` with the arguments after ``audit``."""
    parser = argparse.ArgumentParser(prog="ipybox audit", description=_DESCRIPTION)
    parser.add_argument("--session", help="only this session's records")
    parser.add_argument("--server", help="only calls of this MCP server ('ipybox' for shell commands)")
    parser.add_argument("--tool", help="only calls of this tool")
    parser.add_argument("--decision", choices=["allowed", "denied", "none"], help="only these decisions")
    parser.add_argument(
        "--since", type=_since, metavar="WHEN", help="only records since WHEN (30m, 2h, 1d, or ISO time)"
    )
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="only the last N records")
    parser.add_argument("--json", action="store_true", help="one JSON object per record, one per line")
    parser.add_argument(
        "--db",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"the audit database (default: {default_audit_path()})",
    )
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit {args.limit}: give a positive number of records.")
    path = args.db or default_audit_path()
    if not path.is_file():
        print(f"ipybox audit: no audit trail at {path} yet (nothing was recorded).", file=sys.stderr)
        raise SystemExit(1 if args.db else 0)
    trail = AuditTrail(path)
    try:
        records = trail.query(
            session=args.session,
            server=args.server,
            tool=args.tool,
            decision=args.decision,
            since=args.since,
            limit=args.limit,
        )
    finally:
        trail.close()
    if args.json:
        for record in records:
            # ASCII only: JSON leaves C1 controls and invisible marks as they are, a terminal would not.
            print(json.dumps(record.as_dict()))
    else:
        print(_table(records))


_HEADERS = ("id", "time", "session", "server", "tool", "decision", "by", "ms", "outcome", "size", "arguments")


_WIDTH = 60


def _shown(text: str, width: int = _WIDTH) -> str:
    """A text column as printed: cut to `width` characters, then every character a terminal would act
    on or not show (controls, escapes, line breaks, invisible marks) and every backslash escaped, so
    that what is printed is what was recorded, on one line, and no record can paint over another."""
    cut = text if len(text) <= width else text[: width - 3] + "..."
    return "".join(
        char if char.isprintable() and char != "\\" else char.encode("unicode_escape").decode("ascii")
        for char in cut
    )


def _row(record: AuditRecord) -> tuple[str, ...]:
    return (
        str(record.id),
        datetime.fromtimestamp(record.started).strftime("%Y-%m-%d %H:%M:%S"),
        _shown(record.session),
        _shown(record.server),
        _shown(record.tool),
        _shown(record.decision),
        _shown(record.decided_by),
        "" if record.duration_ms is None else f"{record.duration_ms:.1f}",
        _shown(record.outcome),
        "" if record.result_size is None else str(record.result_size),
        _shown(record.arguments),
    )


def _table(records: list[AuditRecord]) -> str:
    rows = [_HEADERS, *(_row(record) for record in records)]
    widths = [max(len(row[column]) for row in rows) for column in range(len(_HEADERS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )
