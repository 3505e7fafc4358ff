"""How a failed publish is handled (outbox_dispatcher/kafka/failures.py): what the exception
says of itself first, the override tuples after."""

from __future__ import annotations

import pytest
from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher.kafka import failures
from outbox_dispatcher.models import Failure


class SaysRetriable(kafka_errors.BrokerResponseError):
    errno = 9999
    message = "SAYS_RETRIABLE"
    description = "a broker error no tuple names"
    retriable = True


class SaysNotRetriable(SaysRetriable):
    retriable = False


@pytest.mark.parametrize(
    ("exc", "failure"),
    [
        (SaysRetriable(), Failure.TRANSIENT),  # read from the exception
        (SaysNotRetriable(), Failure.ROW),
        (kafka_errors.OutOfOrderSequenceNumber(), Failure.TRANSIENT),  # producer state
        (kafka_errors.MessageSizeTooLargeError(), Failure.PERMANENT),  # override
        (kafka_errors.KafkaTimeoutError(), Failure.TRANSIENT),
        (TimeoutError(), Failure.TRANSIENT),
        (RuntimeError("bug"), Failure.ROW),
        (errors.RoutingError(), Failure.PERMANENT),  # ours declare theirs
        (errors.UnpublishableRowError(), Failure.PERMANENT),
        (errors.BrokerUnavailableError(), Failure.TRANSIENT),
        # retriable, but no publish outage: as a row error, as before the move.
        (errors.DatabaseUnavailableError(), Failure.ROW),
        (errors.NotAttempted(), Failure.ROW),
        (errors.TopicMissingError(), Failure.ROW),
    ],
)
def test_classify_reads_the_exception_then_the_overrides(
    exc: BaseException, failure: Failure
) -> None:
    assert failures.classify(exc) is failure


def test_a_rejection_is_neither_an_outage_nor_the_producers_state_nor_the_topics() -> None:
    assert failures.is_rejection(kafka_errors.CorruptRecordException())
    assert not failures.is_rejection(kafka_errors.NotEnoughReplicasError())
    assert not failures.is_rejection(kafka_errors.OutOfOrderSequenceNumber())
    assert not failures.is_rejection(kafka_errors.TopicAuthorizationFailedError())
    assert not failures.is_rejection(errors.BrokerUnavailableError())
    assert not failures.is_rejection(None)


def test_describe_adds_what_a_bare_code_means_and_the_too_large_hint() -> None:
    assert errors.describe(SaysRetriable()) == (
        "SaysRetriable: [Error 9999] a broker error no tuple names"
    )
    assert failures.TOO_LARGE_HINT in failures.describe(kafka_errors.RecordTooLargeError())
