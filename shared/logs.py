"""Logging for both processes: one line per record, text or JSON, each tagged with the request
it is about.

The request id lives in a context variable: the gateway sets it for each HTTP request (the
client's `X-Request-Id`, or one it makes), the worker for each request it runs (carried in the
envelope). A task started while serving a request inherits it, so every line logged on the
request's behalf carries it without being passed around.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import time
from typing import Any

import orjson

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("llmfleet_request_id", default="")

FORMATS = ("text", "json")


class _Tagged(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    """`2026-11-23 02:00:00,123 INFO gateway.access: [id] message key=value ...`

    A gateway writes a line per request, so the line is put together in one step, and the
    date and time of its second only once a second."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._second = -1
        self._stamp = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        second = int(record.created)
        if second != self._second:  # format() runs under its handler's lock: one thread at a time
            self._stamp, self._second = time.strftime("%Y-%m-%d %H:%M:%S", self.converter(second)), second
        return f"{self._stamp},{int(record.msecs):03d}"

    def formatMessage(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", "")
        line = f"{record.asctime} {record.levelname} {record.name}: " \
               f"{f'[{request_id}] ' if request_id else ''}{record.message}"
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join([f"{key}={_text(value)}" for key, value in fields.items() if value is not None])
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id, and the record's
    `fields` (structured extras, as the access line's) as top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", "")
        if request_id:
            entry["request_id"] = request_id
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    text = value if type(value) is str else str(value)
    return orjson.dumps(text).decode() if not text or " " in text or '"' in text else text


def setup(level: str = "info", fmt: str = "text") -> None:
    """Log to stderr at `level`, in `fmt` ("text" or "json"), every line tagged with its request."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_Tagged())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
