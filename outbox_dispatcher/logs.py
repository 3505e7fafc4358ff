"""Structured logs: one JSON object per line (or a console format for humans), with the stdlib
loggers of asyncpg and aiokafka routed through the same formatter."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson
import structlog
from structlog.typing import EventDict, WrappedLogger

from outbox_dispatcher.display import inert, inert_multiline

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


# aiokafka's messages at error level that are normal operation for us: (logger, template).
NOT_ERRORS = frozenset(
    # On every first use of a topic the metadata does not know yet (it is then fetched or
    # auto-created); a topic that really is missing fails the send, and that we report.
    {("aiokafka.cluster", "Topic %s not found in cluster metadata")}
)


class NotErrorsFilter(logging.Filter):
    """Drop a client library's normal-operation messages that it logs at ERROR: they would trip
    log-based alerting. The client loggers are at WARNING or above, so as INFO they would be
    dropped anyway."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and (record.name, record.msg) in NOT_ERRORS)


def make_inert(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """For the console format: escape control characters in every string field (keys and
    reasons come from writers); a traceback keeps its lines. JSON escapes them itself."""
    for name, value in event_dict.items():
        if isinstance(value, str):
            event_dict[name] = (
                inert_multiline(value) if name in ("exception", "stack") else inert(value)
            )
    return event_dict


def _dumps(obj: Any, default: Any = None) -> str:
    return orjson.dumps(obj, default=default).decode()


def configure(fmt: str = "json", level: str = "INFO") -> None:
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: list[Any]
    if fmt == "console":
        renderer = [make_inert, structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    else:
        renderer = [structlog.processors.JSONRenderer(serializer=_dumps)]
    structlog.configure(
        processors=[
            # A debug line on the hot path (batch_settled) is dropped before the chain
            # timestamps and renders it, not after.
            structlog.stdlib.filter_by_level,
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
                *renderer,
            ],
        )
    )
    handler.addFilter(NotErrorsFilter())
    handler.addFilter(RepeatFilter(CLIENT_LOGGERS))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # The clients are chatty at INFO about reconnects that we already report.
    for name in CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLevelName(level)))
