"""The Batch API's objects in OpenAI's shapes: a file, a batch, a list page, an output line."""

from __future__ import annotations

import json
import sqlite3

from router.batch.store import TIMES, Line


def file_object(row: sqlite3.Row, retention_s: int) -> dict:
    """OpenAI's ``file`` object (``expires_at``: when retention deletes it)."""
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "expires_at": row["created_at"] + retention_s,
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
    }


def batch_object(row: sqlite3.Row) -> dict:
    """OpenAI's ``batch`` object, with ``request_counts`` (total, completed, failed)."""
    out = {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": json.loads(row["errors"]) if row["errors"] else None,
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "created_at": row["created_at"],
        "expires_at": row["expires_at"],
    }
    out.update({column: row[column] for column in TIMES.values()})
    out["request_counts"] = {"total": row["total"], "completed": row["completed"], "failed": row["failed"]}
    out["metadata"] = json.loads(row["metadata"]) if row["metadata"] else None
    return out


def page(objects: list[dict], limit: int) -> dict:
    """A list page of at most ``limit`` of ``objects`` (one more was fetched to say ``has_more``)."""
    shown = objects[:limit]
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(objects) > limit,
    }


def line_request_id(line: Line) -> str:
    """The ``id`` of a line's output line (and the ``X-Request-ID`` of its generation, in the logs)."""
    return f"batch_req_{line.batch_id.removeprefix('batch_')}_{line.idx}"


def output_line(request_id: str, custom_id: str, status: int, body: dict) -> str:
    """One line of an output (2xx) or error file for an answered request, OpenAI's shape."""
    response = {"status_code": status, "request_id": request_id, "body": body}
    return json.dumps({"id": request_id, "custom_id": custom_id, "response": response, "error": None})


def unanswered_line(request_id: str, custom_id: str, code: str, message: str) -> str:
    """One error-file line of a request never answered (``batch_expired``, ``batch_cancelled``)."""
    return json.dumps(
        {"id": request_id, "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}
    )
