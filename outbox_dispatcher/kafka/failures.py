"""How a failed publish of one row is handled, read from the exception (aiokafka's model: its
errors carry `retriable`, as ours do).

`classify` reads what the exception says of itself first: our errors declare their `failure`
(outbox_dispatcher/errors.py), aiokafka's say whether they are `retriable`. The tuples below
override that where the answer is another: a producer whose sequence state the broker no longer
accepts is no row's fault, a refused size or topic never gets better, and a timeout or a
dropped connection is an outage whatever the class says. This module knows no other module of
ours but models.py: errors.py reads the Kafka part of its messages here (`explain`).
"""

from __future__ import annotations

from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher.models import Failure

# The broker or the producer refuses this row as it is: it is dead-lettered now.
PERMANENT: tuple[type[BaseException], ...] = (
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

# The broker or the network is away: back off, never count the attempt.
TRANSIENT: tuple[type[BaseException], ...] = (
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
    TimeoutError,
    ConnectionError,
)

# The idempotent producer's own state is broken (typically after a broker restart lost or
# reset its producer state): no record's fault; the publisher starts a new producer.
PRODUCER_STATE: tuple[type[BaseException], ...] = (
    kafka_errors.OutOfOrderSequenceNumber,
    kafka_errors.UnknownProducerId,
    kafka_errors.InvalidProducerEpoch,
    kafka_errors.InvalidProducerIdMapping,
    kafka_errors.ProducerFenced,
)

# Refusals that concern a whole topic, not one record of a batch: every record of the topic gets
# them, so sending a batch's records one at a time would only repeat the refusal.
TOPIC: tuple[type[BaseException], ...] = (
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.InvalidTopicError,
    kafka_errors.UnsupportedForMessageFormatError,
)

# In the order they win over what the exception says of itself.
_OVERRIDES = (
    (PRODUCER_STATE, Failure.TRANSIENT),
    (PERMANENT, Failure.PERMANENT),
    (TRANSIENT, Failure.TRANSIENT),
)

TOO_LARGE: tuple[type[BaseException], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordTooLargeError,
    kafka_errors.RecordListTooLargeError,
)
TOO_LARGE_HINT = (
    "a record larger than OUTBOX_KAFKA_MAX_REQUEST_BYTES is refused by the producer, one larger "
    "than the topic's max.message.bytes (broker default 1 MiB) by the broker: raise both, or "
    "make the payload smaller, then requeue the row"
)


def classify(exc: BaseException) -> Failure:
    """Map a publish exception to the way the row is handled."""
    declared = getattr(exc, "failure", None)
    if isinstance(declared, Failure):
        return declared
    retriable = isinstance(exc, kafka_errors.KafkaError) and exc.retriable
    if is_sender_death(exc):
        return Failure.TRANSIENT
    for kinds, failure in _OVERRIDES:
        if isinstance(exc, kinds):
            return failure
    return Failure.TRANSIENT if retriable else Failure.ROW


def is_producer_state(exc: BaseException | None) -> bool:
    """The producer's sequence state is lost, or its sender died: replace it (a fresh
    producer id)."""
    return isinstance(exc, PRODUCER_STATE) or is_sender_death(exc)


def is_sender_death(exc: BaseException | None) -> bool:
    """aiokafka's sender task died on an error it did not expect and failed every batch it held
    with a bare KafkaError whose cause is that error (internals.sender_failure): no record's
    fault, and the producer never sends again. aiokafka's other bare KafkaError of a producer
    (no broker gave metadata) has no cause."""
    return exc is not None and type(exc) is kafka_errors.KafkaError and exc.__cause__ is not None


def is_rejection(exc: BaseException | None) -> bool:
    """The broker refused a record's batch with an error that is neither an outage, nor the
    producer's own state, nor about the whole topic: the refusal may be another record's
    fault (each is sent again alone)."""
    return (
        isinstance(exc, kafka_errors.KafkaError)
        and not isinstance(exc, PRODUCER_STATE + TOPIC)
        and classify(exc) is not Failure.TRANSIENT
    )


def describe(exc: BaseException) -> str:
    """errors.describe, and for a record too large what to do about it: the reason a failed
    publish leaves in last_error."""
    text = errors.describe(exc)
    if not isinstance(exc, TOO_LARGE):
        return text
    # aiokafka names its own max_request_size; ours is OUTBOX_KAFKA_MAX_REQUEST_BYTES.
    text = text.replace("the max_request_size configuration", "OUTBOX_KAFKA_MAX_REQUEST_BYTES")
    return f"{text} ({TOO_LARGE_HINT})"
