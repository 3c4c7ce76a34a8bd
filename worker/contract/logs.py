"""Logging set-up, once per process, with the process's role in every line.

``text`` gives ``time level [role] logger: message`` (plus ``request_id=...`` when the line belongs
to a request); ``json`` gives one JSON object per line (keys ``ts``, ``level``, ``role``,
``logger``, ``msg``, and ``request_id`` / ``exc`` when present).

A line belongs to a request when the record carries ``request_id`` (``extra={"request_id": ...}``)
or when it is logged while :data:`REQUEST_ID` is set: the router sets it for each HTTP request
(its ``X-Request-ID``), so every line logged while handling that request carries it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextvars import ContextVar

REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="")


class RequestIdFilter(logging.Filter):
    """Copies the current :data:`REQUEST_ID` onto records that do not carry one already."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", None):
            record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self, role: str):
        super().__init__(f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", "")
        return f"{line} request_id={rid}" if rid else line


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "role": self.role,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if getattr(record, "request_id", None):
            entry["request_id"] = record.request_id
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(role: str, fmt: str = "text", level: str = "INFO") -> None:
    """Configure the root logger to write to stderr. ``fmt`` is ``text`` or ``json``.

    Python warnings are routed through logging, and libraries that print their own progress bars
    or banners (Hugging Face) are told not to, so ``json`` output stays one object per line.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(role) if fmt == "json" else TextFormatter(role))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)
    for noisy in ("aiohttp.access", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if fmt == "json":
        # Read when transformers / huggingface_hub are first imported (after this call in every role).
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
