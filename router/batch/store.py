"""The Batch API's durable state: files, batches and each batch's lines, in one SQLite database.

The database (``batches.sqlite`` in the deployment's state folder, ``router.state_dir``) is in WAL
mode, so a reader never waits for the runner's writes and a process killed mid-write leaves the
last committed state. Every change is one transaction; the one that matters most is
:meth:`Store.finish_line`, which writes a line's answer and marks it done together, and only if
it was not done yet: a line answered twice (its router died after the worker answered, before
the commit; the next router ran it again) keeps its first answer, so each input line is in the
output exactly once. Everything is scoped by ``owner`` (a digest of the API key that made it,
:func:`router.batch.api.owner_of`): a caller sees only its own files and batches.

Statuses are OpenAI's: ``validating`` -> ``in_progress`` -> ``finalizing`` -> ``completed``;
``failed``; ``expired`` (past the completion window); ``cancelling`` -> ``cancelled``.
This object is the only writer of the database; it is not thread-safe by itself, so one lock
serialises its calls (the router calls it from its event loop and from worker threads).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ACTIVE = ("validating", "in_progress", "cancelling", "finalizing")
FINISHED = ("completed", "failed", "expired", "cancelled")
TIMES = {  # the column stamped when a batch enters each status
    "in_progress": "in_progress_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "failed": "failed_at",
    "expired": "expired_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}
SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS files_owner ON files (owner, created_at);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
    failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_file_id TEXT, error_file_id TEXT, errors TEXT, metadata TEXT,
    total INTEGER NOT NULL, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner, created_at);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    done INTEGER NOT NULL DEFAULT 0, ok INTEGER, result TEXT, PRIMARY KEY (batch_id, idx));
"""


class Conflict(Exception):
    """A change the object's status does not allow (cancelling a finished batch...)."""


@dataclass(frozen=True)
class Line:
    """One request of a batch: its place in the input file, ``custom_id`` and JSON ``body``."""

    batch_id: str
    idx: int
    custom_id: str
    body: str


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class Store:
    """The database at ``folder / batches.sqlite`` (created, with its folder, mode 0700)."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = folder / "batches.sqlite"
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: a commit survives a crash of the process
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self, fn, *args):
        """Run ``fn(db, *args)`` in one transaction (all or nothing) under the lock."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                out = fn(self._db, *args)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return out

    def _one(self, sql: str, args: Iterable = ()) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchone()

    def _all(self, sql: str, args: Iterable = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    # ---- files -------------------------------------------------------------------------------

    def add_file(self, owner: str, purpose: str, filename: str, content: bytes, now: int) -> sqlite3.Row:
        """Store a file; returns its row (without the content)."""
        fid = new_id("file-")
        self._tx(
            lambda db: db.execute(
                "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                (fid, owner, purpose, filename, len(content), now, content),
            )
        )
        return self.file(owner, fid)

    def file(self, owner: str, fid: str) -> sqlite3.Row | None:
        return self._one(
            "SELECT id, owner, purpose, filename, bytes, created_at FROM files WHERE id = ? AND owner = ?", (fid, owner)
        )

    def file_content(self, owner: str, fid: str) -> bytes | None:
        row = self._one("SELECT content FROM files WHERE id = ? AND owner = ?", (fid, owner))
        return None if row is None else bytes(row["content"])

    def files(self, owner: str, purpose: str | None, limit: int, after: str | None, newest_first: bool) -> list:
        """Up to ``limit + 1`` of ``owner``'s files (the extra one says there are more), after ``after``."""
        order = "DESC" if newest_first else "ASC"
        where, args = ["owner = ?"], [owner]
        if purpose:
            where.append("purpose = ?")
            args.append(purpose)
        if after and (cursor := self.file(owner, after)) is not None:
            op = "<" if newest_first else ">"
            where.append(f"(created_at, id) {op} (?, ?)")
            args += [cursor["created_at"], cursor["id"]]
        sql = (
            "SELECT id, owner, purpose, filename, bytes, created_at FROM files WHERE "
            + " AND ".join(where)
            + f" ORDER BY created_at {order}, id {order} LIMIT ?"
        )
        return self._all(sql, [*args, limit + 1])

    def delete_file(self, owner: str, fid: str) -> bool:
        return (
            self._tx(lambda db: db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (fid, owner)).rowcount) > 0
        )

    # ---- batches -----------------------------------------------------------------------------

    def create_batch(
        self,
        owner: str,
        endpoint: str,
        input_file_id: str,
        window_s: int,
        metadata: dict | None,
        lines: list[tuple[str, str]],
        now: int,
    ) -> sqlite3.Row:
        """A new ``validating`` batch of ``lines`` (``(custom_id, body JSON)`` in file order)."""
        bid = new_id("batch_")

        def insert(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, created_at,"
                " expires_at, metadata, total) VALUES (?, ?, ?, ?, ?, 'validating', ?, ?, ?, ?)",
                (
                    bid,
                    owner,
                    endpoint,
                    input_file_id,
                    f"{window_s // 3600}h",
                    now,
                    now + window_s,
                    json.dumps(metadata) if metadata is not None else None,
                    len(lines),
                ),
            )
            db.executemany(
                "INSERT INTO lines (batch_id, idx, custom_id, body) VALUES (?, ?, ?, ?)",
                ((bid, i, cid, body) for i, (cid, body) in enumerate(lines)),
            )

        self._tx(insert)
        return self.batch(owner, bid)

    def batch(self, owner: str | None, bid: str) -> sqlite3.Row | None:
        """``owner``'s batch ``bid`` (``owner`` None: whoever owns it, for the runner)."""
        if owner is None:
            return self._one("SELECT * FROM batches WHERE id = ?", (bid,))
        return self._one("SELECT * FROM batches WHERE id = ? AND owner = ?", (bid, owner))

    def batches(self, owner: str | None, limit: int, after: str | None = None) -> list[sqlite3.Row]:
        """Up to ``limit + 1`` batches, newest first, after ``after`` (``owner`` None: everyone's)."""
        where, args = ["1"], []
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if after and (cursor := self.batch(owner, after)) is not None:
            where.append("(created_at, id) < (?, ?)")
            args += [cursor["created_at"], cursor["id"]]
        sql = f"SELECT * FROM batches WHERE {' AND '.join(where)} ORDER BY created_at DESC, id DESC LIMIT ?"
        return self._all(sql, [*args, limit + 1])

    def active(self) -> list[sqlite3.Row]:
        """Every batch not finished, oldest first (what the runner works through)."""
        marks = ",".join("?" * len(ACTIVE))
        return self._all(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY created_at, id", ACTIVE)

    def set_status(self, bid: str, status: str, now: int, errors: dict | None = None) -> None:
        """Move batch ``bid`` to ``status`` (stamping its time column); a finished batch stays as it is."""

        def move(db: sqlite3.Connection) -> None:
            stamp = f", {TIMES[status]} = {int(now)}" if status in TIMES else ""
            marks = ",".join("?" * len(FINISHED))
            db.execute(
                f"UPDATE batches SET status = ?, errors = COALESCE(?, errors){stamp} WHERE id = ? "
                f"AND status NOT IN ({marks})",
                (status, json.dumps(errors) if errors is not None else None, bid, *FINISHED),
            )

        self._tx(move)

    def request_cancel(self, owner: str, bid: str, now: int) -> sqlite3.Row | None:
        """``cancelling`` (the runner ends it); None when there is no such batch; :class:`Conflict`
        when it is finished or finalizing. Cancelling a cancelling batch changes nothing."""
        row = self.batch(owner, bid)
        if row is None:
            return None
        if row["status"] in ("validating", "in_progress"):
            self.set_status(bid, "cancelling", now)
        elif row["status"] != "cancelling":
            raise Conflict(f"Cannot cancel a batch with status '{row['status']}'")
        return self.batch(owner, bid)

    # ---- lines -------------------------------------------------------------------------------

    def pending(self, bid: str, limit: int, skip: set[int]) -> list[Line]:
        """Up to ``limit`` lines of ``bid`` not done, in file order, leaving out those in ``skip`` (running)."""
        rows = self._all(
            "SELECT idx, custom_id, body FROM lines WHERE batch_id = ? AND done = 0 ORDER BY idx LIMIT ?",
            (bid, limit + len(skip)),
        )
        return [Line(bid, r["idx"], r["custom_id"], r["body"]) for r in rows if r["idx"] not in skip][:limit]

    def undone(self, bid: str) -> int:
        """How many lines of ``bid`` are not answered yet."""
        row = self._one("SELECT COUNT(*) AS n FROM lines WHERE batch_id = ? AND done = 0", (bid,))
        return row["n"]

    def finish_line(self, line: Line, ok: bool, result: str) -> bool:
        """Record ``line``'s output line ``result`` and mark it done, in one transaction, unless it
        is done already (then nothing changes: its first answer stands). True when recorded."""

        def record(db: sqlite3.Connection) -> bool:
            hit = db.execute(
                "UPDATE lines SET done = 1, ok = ?, result = ? WHERE batch_id = ? AND idx = ? AND done = 0",
                (int(ok), result, line.batch_id, line.idx),
            ).rowcount
            if hit:
                column = "completed" if ok else "failed"
                db.execute(f"UPDATE batches SET {column} = {column} + 1 WHERE id = ?", (line.batch_id,))
            return bool(hit)

        return self._tx(record)

    def close_pending(self, bid: str, result_of) -> int:
        """Answer every line of ``bid`` not done with ``result_of(line)`` (an error line: the batch
        expired or was cancelled), counted as failed; returns how many."""

        def close(db: sqlite3.Connection) -> int:
            rows = db.execute("SELECT idx, custom_id, body FROM lines WHERE batch_id = ? AND done = 0", (bid,))
            pending = [Line(bid, r["idx"], r["custom_id"], r["body"]) for r in rows.fetchall()]
            db.executemany(
                "UPDATE lines SET done = 1, ok = 0, result = ? WHERE batch_id = ? AND idx = ?",
                ((result_of(x), bid, x.idx) for x in pending),
            )
            db.execute("UPDATE batches SET failed = failed + ? WHERE id = ?", (len(pending), bid))
            return len(pending)

        return self._tx(close)

    def finalize(self, bid: str, status: str, now: int) -> None:
        """End batch ``bid`` with ``status`` (``completed``, ``expired``, ``cancelled``) in one
        transaction: its output file (the answered lines, in input order) and error file (the
        failed ones), each only when not empty, its status, and its lines dropped (their answers
        now live in the files). :class:`Conflict` while a line is not answered: every input line
        is in the files, once."""

        def end(db: sqlite3.Connection) -> None:
            row = db.execute("SELECT owner, status FROM batches WHERE id = ?", (bid,)).fetchone()
            if row is None or row["status"] in FINISHED:
                return
            if db.execute("SELECT 1 FROM lines WHERE batch_id = ? AND done = 0 LIMIT 1", (bid,)).fetchone():
                raise Conflict(f"batch {bid} has lines not answered: it cannot end as {status}")
            ids = {}
            for ok, name in ((1, "output"), (0, "errors")):
                results = db.execute(
                    "SELECT result FROM lines WHERE batch_id = ? AND done = 1 AND ok = ? ORDER BY idx", (bid, ok)
                ).fetchall()
                if results:
                    content = "".join(r["result"] + "\n" for r in results).encode()
                    ids[ok] = new_id("file-")
                    db.execute(
                        "INSERT INTO files VALUES (?, ?, 'batch_output', ?, ?, ?, ?)",
                        (ids[ok], row["owner"], f"{bid}_{name}.jsonl", len(content), now, content),
                    )
            db.execute(
                f"UPDATE batches SET status = ?, {TIMES[status]} = ?, output_file_id = ?, error_file_id = ? WHERE id = ?",
                (status, now, ids.get(1), ids.get(0), bid),
            )
            db.execute("DELETE FROM lines WHERE batch_id = ?", (bid,))

        self._tx(end)

    # ---- retention ---------------------------------------------------------------------------

    def cleanup(self, before: int) -> tuple[int, int]:
        """Delete files created before ``before`` (Unix seconds) and finished batches created
        before it; returns (files, batches) deleted. Running batches are kept whatever their age."""

        def drop(db: sqlite3.Connection) -> tuple[int, int]:
            marks = ",".join("?" * len(FINISHED))
            files = db.execute("DELETE FROM files WHERE created_at < ?", (before,)).rowcount
            batches = db.execute(
                f"DELETE FROM batches WHERE created_at < ? AND status IN ({marks})", (before, *FINISHED)
            ).rowcount
            return files, batches

        return self._tx(drop)

    def summary(self, owner: str | None = None) -> list[dict]:
        """The batches not finished, then the last finished ones (20 at most), of ``owner`` (None:
        everyone's), for ``llamadeploy status`` and the status page: id, status, endpoint,
        created_at and request counts (no owner, no content)."""
        marks = ",".join("?" * len(ACTIVE))
        where, args = ("WHERE owner = ?", [owner]) if owner is not None else ("", [])
        rows = self._all(
            f"SELECT id, status, endpoint, created_at, total, completed, failed FROM batches {where} "
            f"ORDER BY status NOT IN ({marks}), created_at DESC LIMIT 20",
            [*args, *ACTIVE],
        )
        return [dict(r) for r in rows]
