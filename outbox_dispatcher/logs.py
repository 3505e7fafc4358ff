"""Structured logs: one JSON object per line (or a console format for humans), with the stdlib
loggers of asyncpg and aiokafka routed through the same formatter."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson
import structlog

CLIENT_LOGGERS = ("aiokafka", "asyncpg")


class RepeatFilter(logging.Filter):
    """Let a repeated message of a client library through once per window: during an outage
    aiokafka retries every 100 ms and would log each retry."""

    def __init__(self, prefixes: tuple[str, ...], window_seconds: float = 30.0) -> None:
        super().__init__()
        self._prefixes = prefixes
        self._window = window_seconds
        self._seen: dict[tuple[str, int, object], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self._prefixes):
            return True
        key = (record.name, record.levelno, record.msg)
        seen = self._seen.get(key)
        if seen is not None and record.created - seen[0] < self._window:
            last, suppressed = seen
            self._seen[key] = (last, suppressed + 1)
            return False
        self._seen[key] = (record.created, 0)
        if seen is not None and seen[1]:
            record.suppressed_repeats = seen[1]
        return True


def _dumps(obj: Any, default: Any = None) -> str:
    return orjson.dumps(obj, default=default).decode()


def configure(fmt: str = "json", level: str = "INFO") -> None:
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    if fmt == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    else:
        renderer = structlog.processors.JSONRenderer(serializer=_dumps)
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.format_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    handler.addFilter(RepeatFilter(CLIENT_LOGGERS))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # The clients are chatty at INFO about reconnects that we already report.
    for name in CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLevelName(level)))
