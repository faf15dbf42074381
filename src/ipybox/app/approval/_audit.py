"""The audit trail: one SQLite record per tool call and shell command the tool server was asked for.

Each record says when, in which session, which server and tool, with which arguments (every
value a ``${VAR}`` placeholder of the server was filled with replaced by ``***``), the decision
and who made it, how long the call ran, its outcome and the size of its result. The record is
written once the decision is made and before the call runs, then updated with the outcome, so a
crash of the application loses no record of a call that ran (it stays ``running``).

The database lives in the user's state folder (``audit/audit.sqlite3`` beside the trusted
registry, see ``ipybox.app.mcp_client._registry``), never in the working directory; a sandboxed kernel can
neither read nor write that folder (``CodeExecutor`` hides it from the sandbox). It is in WAL
mode with ``synchronous=NORMAL``: a commit is a write to the log without ``fsync``, which
survives the application's crash (not the machine's), and many executors and processes can
write it at once.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ipybox.app._state import state_dir

__all__ = ["AuditRecord", "AuditTrail", "default_audit_path"]

# Argument text kept per record; a longer one is cut, with a note of its full size.
MAX_ARGUMENTS = 16 * 1024
# Error text kept per record (an MCP server's error message can be of any size), cut the same way.
MAX_ERROR = 4 * 1024
_SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
    id INTEGER PRIMARY KEY,
    started REAL NOT NULL,
    session TEXT NOT NULL,
    server TEXT NOT NULL,
    tool TEXT NOT NULL,
    arguments TEXT NOT NULL,
    decision TEXT NOT NULL,
    decided_by TEXT NOT NULL,
    duration_ms REAL,
    outcome TEXT NOT NULL,
    result_size INTEGER,
    error TEXT
);
CREATE INDEX IF NOT EXISTS calls_started ON calls (started);
"""
_COLUMNS = (
    "id",
    "started",
    "session",
    "server",
    "tool",
    "arguments",
    "decision",
    "decided_by",
    "duration_ms",
    "outcome",
    "result_size",
    "error",
)


def default_audit_path() -> Path:
    """The audit database's default location: ``audit/audit.sqlite3`` in the user's state folder."""
    return state_dir() / "audit" / "audit.sqlite3"


@dataclass(frozen=True)
class AuditRecord:
    """One row of the trail (see the module docstring); ``duration_ms`` is ``None`` while running."""

    id: int
    started: float
    session: str
    server: str
    tool: str
    arguments: str
    decision: str
    decided_by: str
    duration_ms: float | None
    outcome: str
    result_size: int | None
    error: str | None

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _COLUMNS}


class AuditTrail:
    """An open audit database (created on first use, folder ``0700``, file ``0600``).

    Args:
        path: The database file; by default :func:`default_audit_path`.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_audit_path()
        self._db: sqlite3.Connection | None = None
        self._closed = False

    def open(self) -> None:
        """Create (if needed) and open the database.

        Raises:
            OSError: The folder could not be made.
            sqlite3.Error: The file is not a database this can use.
        """
        if self._db is not None:
            return
        if self._closed:
            raise sqlite3.ProgrammingError(f"The audit trail {self.path} was closed.")
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Created with mode 0600 before sqlite opens it (sqlite would follow the umask).
        os.close(os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600))
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA busy_timeout = 5000")
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
            db.executescript(_SCHEMA)
        except BaseException:
            db.close()
            raise
        self._db = db

    def close(self) -> None:
        """Close the database for good (a call still finishing then leaves its record as it was)."""
        self._closed = True
        db, self._db = self._db, None
        if db is not None:
            db.close()

    def begin(
        self,
        *,
        session: str,
        server: str,
        tool: str,
        arguments: Mapping[str, Any],
        decision: str,
        decided_by: str,
        secrets: Iterable[str] = (),
        outcome: str = "running",
        started: float | None = None,
    ) -> int:
        """Write the record of a decided call (before it runs); returns its id for `end`."""
        db = self._require()
        cursor = db.execute(
            "INSERT INTO calls (started, session, server, tool, arguments, decision, decided_by, outcome) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                time.time() if started is None else started,
                session,
                server,
                tool,
                redacted_arguments(arguments, secrets),
                decision,
                decided_by,
                outcome,
            ),
        )
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    def end(
        self,
        record: int,
        *,
        outcome: str,
        duration_ms: float,
        result_size: int | None,
        error: str | None = None,
    ) -> None:
        """Add a call's outcome to its record."""
        if error is not None and len(error) > MAX_ERROR:
            error = f"{error[:MAX_ERROR]}... ({len(error)} characters)"
        self._require().execute(
            "UPDATE calls SET outcome = ?, duration_ms = ?, result_size = ?, error = ? WHERE id = ?",
            (outcome, duration_ms, result_size, error, record),
        )

    def query(
        self,
        *,
        session: str | None = None,
        server: str | None = None,
        tool: str | None = None,
        decision: str | None = None,
        since: float | None = None,
        limit: int | None = None,
    ) -> list[AuditRecord]:
        """Records matching every filter given (exact names; `since` a Unix time), oldest first."""
        conditions: list[str] = []
        values: list[Any] = []
        for column, value in (
            ("session", session),
            ("server", server),
            ("tool", tool),
            ("decision", decision),
        ):
            if value is not None:
                conditions.append(f"{column} = ?")
                values.append(value)
        if since is not None:
            conditions.append("started >= ?")
            values.append(since)
        where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        sql = f"SELECT {', '.join(_COLUMNS)} FROM calls{where} ORDER BY id"
        if limit is not None:
            # The last `limit` records, still oldest first.
            sql = f"SELECT * FROM ({sql} DESC LIMIT {int(limit)}) ORDER BY id"
        return [AuditRecord(*row) for row in self._require().execute(sql, values)]

    def _require(self) -> sqlite3.Connection:
        if self._db is None:
            self.open()
        assert self._db is not None
        return self._db


def redacted_arguments(arguments: Mapping[str, Any], secrets: Iterable[str] = ()) -> str:
    """The arguments as JSON, each secret value replaced by ``***``, cut at `MAX_ARGUMENTS` characters."""
    try:
        text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"), default=repr)
    except (TypeError, ValueError):
        text = repr(arguments)
    for secret in secrets:
        if secret:
            # As it appears inside a JSON string, and as it is.
            for form in {json.dumps(secret, ensure_ascii=False)[1:-1], secret}:
                text = text.replace(form, "***")
    if len(text) > MAX_ARGUMENTS:
        text = f"{text[:MAX_ARGUMENTS]}... ({len(text)} characters)"
    return text
