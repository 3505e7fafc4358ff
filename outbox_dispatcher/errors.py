"""One root exception; each subclass says whether retrying can help and what the operator does.

A class's docstring is its default message, as in procrastinate. How a failed publish is
handled (`classify`) and what a Kafka error means to an operator (`describe` with its hints) are
the Kafka side's knowledge, kafka/failures.py: an error of ours declares its `failure` here when
it has one. This module imports nothing of ours but the models.
"""

from __future__ import annotations

from typing import ClassVar

from outbox_dispatcher.models import Failure


class OutboxDispatcherError(Exception):
    """The outbox dispatcher failed."""

    retriable: bool = False
    # How a publish that failed with it is handled (kafka/failures.py); None: as a row error.
    failure: ClassVar[Failure | None] = None

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(OutboxDispatcherError):
    """The configuration is invalid: fix the named setting and start again."""


class SchemaVersionError(OutboxDispatcherError):
    """The database schema does not match this dispatcher version."""


class DatabaseUnavailableError(OutboxDispatcherError):
    """PostgreSQL cannot be reached: check OUTBOX_DATABASE_URL and that the server is up."""

    retriable = True


class BrokerUnavailableError(OutboxDispatcherError):
    """Kafka cannot be reached: check OUTBOX_KAFKA_BOOTSTRAP_SERVERS and that the broker is up."""

    retriable = True
    failure = Failure.TRANSIENT


class RoutingError(OutboxDispatcherError):
    """The row has no topic the dispatcher can use: give it a topic, or set the topic template or
    default topic, then requeue it."""

    failure = Failure.PERMANENT


class UnpublishableRowError(OutboxDispatcherError):
    """The row can never become a Kafka record as it is: fix it, then requeue it."""

    failure = Failure.PERMANENT


class TopicMissingError(OutboxDispatcherError):
    """The topic does not exist and the broker did not create it: create it or fix the row."""


class NotAttempted(OutboxDispatcherError):  # noqa: N818 - an outcome, not an error
    """The record was not sent: an earlier record of its key failed or is not acknowledged, or
    the dispatcher stopped; it keeps its place and is retried, not counted."""

    retriable = True
    # How long the row waits before it is retried (0: at once); with a delay, the reason is
    # recorded in last_error.
    delay: float = 0.0


class LoopDiedError(OutboxDispatcherError):
    """A dispatcher loop stopped unexpectedly; the process exits so that it is restarted."""


def describe(exc: BaseException) -> str:
    """A one-line reason for last_error and the logs: the class name once, then the message."""
    name = type(exc).__name__
    text = str(exc).strip()
    # aiokafka repeats the class name ("[Error 10] MessageSizeTooLargeError: The message ...",
    # "KafkaConnectionError: KafkaConnectionError: ..."): keep the code, drop the repeats.
    code, _, rest = text.partition("] ") if text.startswith("[Error ") else ("", "", text)
    while rest.startswith(name):
        rest = rest.removeprefix(name).removeprefix(":").strip()
    # A bare broker error code says little: add what the code means (Kafka's errors carry it).
    if not rest:
        rest = str(getattr(exc, "description", "") or "").strip()
    text = " ".join(part for part in (f"{code}]" if code else "", rest) if part)
    return f"{name}: {text}" if text else name
