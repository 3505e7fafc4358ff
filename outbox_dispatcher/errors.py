"""One root exception; each subclass says whether retrying can help and what the operator does.

A class's docstring is its default message, as in procrastinate.
"""

from __future__ import annotations

import enum

from aiokafka import errors as kafka_errors


class OutboxDispatcherError(Exception):
    """The outbox dispatcher failed."""

    retriable: bool = False

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


class RoutingError(OutboxDispatcherError):
    """The row has no topic the dispatcher can use: give it a topic, or set the topic template or
    default topic, then requeue it."""


class UnpublishableRowError(OutboxDispatcherError):
    """The row can never become a Kafka record as it is: fix it, then requeue it."""


class TopicMissingError(OutboxDispatcherError):
    """The topic does not exist and the broker did not create it: create it or fix the row."""


class NotAttempted(OutboxDispatcherError):  # noqa: N818 - an outcome, not an error
    """The record was not sent: an earlier record of its key failed or is not acknowledged, or
    the dispatcher stopped; it keeps its place and is retried, not counted."""

    retriable = True


class LoopDiedError(OutboxDispatcherError):
    """A dispatcher loop stopped unexpectedly; the process exits so that it is restarted."""


class Failure(enum.Enum):
    """How a failed publish of one row is handled."""

    # The row itself cannot ever be published (too large, invalid topic, not authorized):
    # dead-letter it now.
    PERMANENT = "permanent"
    # Something about this row failed and may succeed later: count the attempt, back off,
    # dead-letter after max_attempts.
    ROW = "row"
    # The broker or the network is down: back off, but do not count the attempt; an outage must
    # not dead-letter anything.
    TRANSIENT = "transient"


_PERMANENT = (
    RoutingError,
    UnpublishableRowError,
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordTooLargeError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.InvalidTopicError,
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.CorruptRecordException,
    kafka_errors.PolicyViolationError,
    kafka_errors.InvalidTimestampError,
    kafka_errors.UnsupportedForMessageFormatError,
)

_TRANSIENT = (
    kafka_errors.KafkaConnectionError,
    kafka_errors.NodeNotReadyError,
    kafka_errors.NoBrokersAvailable,
    kafka_errors.RequestTimedOutError,
    kafka_errors.NotEnoughReplicasError,
    kafka_errors.NotEnoughReplicasAfterAppendError,
    kafka_errors.LeaderNotAvailableError,
    kafka_errors.NotLeaderForPartitionError,
    kafka_errors.KafkaTimeoutError,
    kafka_errors.ProducerClosed,
    BrokerUnavailableError,
    TimeoutError,
    ConnectionError,
)


# The idempotent producer's own state is broken (typically after a broker restart lost or
# reset its producer state): no record's fault; the publisher starts a new producer.
PRODUCER_STATE_ERRORS = (
    kafka_errors.OutOfOrderSequenceNumber,
    kafka_errors.UnknownProducerId,
    kafka_errors.InvalidProducerEpoch,
    kafka_errors.InvalidProducerIdMapping,
    kafka_errors.ProducerFenced,
)

# Refusals that concern a whole topic, not one record of a batch: every record of the topic gets
# them, so sending a batch's records one at a time would only repeat the refusal.
TOPIC_ERRORS = (
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.InvalidTopicError,
    kafka_errors.UnsupportedForMessageFormatError,
)


def classify(exc: BaseException) -> Failure:
    """Map a publish exception to the way the row is handled."""
    if isinstance(exc, PRODUCER_STATE_ERRORS):
        return Failure.TRANSIENT
    if isinstance(exc, _PERMANENT):
        return Failure.PERMANENT
    if isinstance(exc, _TRANSIENT):
        return Failure.TRANSIENT
    if isinstance(exc, kafka_errors.KafkaError) and exc.retriable:
        return Failure.TRANSIENT
    return Failure.ROW


_TOO_LARGE = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordTooLargeError,
    kafka_errors.RecordListTooLargeError,
)
TOO_LARGE_HINT = (
    "a record larger than OUTBOX_KAFKA_MAX_REQUEST_BYTES is refused by the producer, one larger "
    "than the topic's max.message.bytes (broker default 1 MiB) by the broker: raise both, or "
    "make the payload smaller, then requeue the row"
)


def describe(exc: BaseException) -> str:
    """A one-line reason for last_error and the logs: the class name once, then the message."""
    name = type(exc).__name__
    text = str(exc).strip()
    # aiokafka repeats the class name ("[Error 10] MessageSizeTooLargeError: The message ...",
    # "KafkaConnectionError: KafkaConnectionError: ..."): keep the code, drop the repeats.
    code, _, rest = text.partition("] ") if text.startswith("[Error ") else ("", "", text)
    while rest.startswith(name):
        rest = rest.removeprefix(name).removeprefix(":").strip()
    if isinstance(exc, kafka_errors.BrokerResponseError) and not rest:
        # A bare broker error code says little: add what the code means.
        rest = str(getattr(exc, "description", "")).strip()
    if isinstance(exc, _TOO_LARGE):
        # aiokafka names its own max_request_size; ours is OUTBOX_KAFKA_MAX_REQUEST_BYTES.
        rest = rest.replace("the max_request_size configuration", "OUTBOX_KAFKA_MAX_REQUEST_BYTES")
        rest = f"{rest} ({TOO_LARGE_HINT})" if rest else TOO_LARGE_HINT
    text = " ".join(part for part in (f"{code}]" if code else "", rest) if part)
    return f"{name}: {text}" if text else name
