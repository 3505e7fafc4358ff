from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime

import pytest
from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.errors import NotAttempted, TopicMissingError
from outbox_dispatcher.kafka import failures
from outbox_dispatcher.models import Failure, OutboxRecord, Outcome
from outbox_dispatcher.retries import MAX_OUTAGE_STREAK, RetryPolicy


def record(attempts: int = 0) -> OutboxRecord:
    return OutboxRecord(1, "t", "k", b"x", {}, uuid.uuid4(), datetime.now(UTC), attempts, False)


@pytest.fixture
def policy() -> RetryPolicy:
    settings = Settings(max_attempts=3, backoff_initial_seconds=1, backoff_max_seconds=8)
    return RetryPolicy(settings, random.Random(1))


def test_backoff_doubles_with_jitter_and_is_capped(policy: RetryPolicy) -> None:
    for attempt, full in [(1, 1), (2, 2), (3, 4), (4, 8), (10, 8)]:
        for _ in range(50):
            assert full / 2 <= policy.backoff(attempt) <= full


@pytest.mark.parametrize("attempt", [62, 63, 64, 1024, 1025, 1026, 10**6, 2**70])
def test_backoff_never_overflows_however_many_failures(policy: RetryPolicy, attempt: int) -> None:
    # float(2 ** 1024) raised OverflowError at the 1025th failure (finding F8).
    for _ in range(20):
        assert 4 <= policy.backoff(attempt) <= 8


def test_a_huge_initial_backoff_is_still_capped() -> None:
    settings = Settings(backoff_initial_seconds=3600, backoff_max_seconds=3600)
    assert 1800 <= RetryPolicy(settings).backoff(5000) <= 3600


def test_the_outage_streak_is_bounded_and_its_delay_stays_capped(policy: RetryPolicy) -> None:
    outage = [errors.BrokerUnavailableError("away")]
    for _ in range(2_000):
        policy.results([record()], outage)
    assert policy.outage_streak == MAX_OUTAGE_STREAK
    assert 4 <= policy.outage_delay() <= 8
    policy.results([record()], [None])
    assert policy.outage_streak == 0, "a batch with a success and no outage ends the streak"


def test_acknowledged_records_are_published(policy: RetryPolicy) -> None:
    assert policy.result(record(), None).outcome is Outcome.PUBLISHED


@pytest.mark.parametrize(
    "exc",
    [
        kafka_errors.MessageSizeTooLargeError("too big"),
        kafka_errors.InvalidTopicError(),
        kafka_errors.TopicAuthorizationFailedError(),
    ],
)
def test_permanent_errors_dead_letter_at_once(policy: RetryPolicy, exc: Exception) -> None:
    result = policy.result(record(), exc)
    assert result.outcome is Outcome.DEAD
    assert result.error and result.error.startswith("permanent error, not retried:")
    assert type(exc).__name__ in result.error


def test_row_errors_count_and_dead_letter_after_max_attempts(policy: RetryPolicy) -> None:
    exc = TopicMissingError("topic 'x' does not exist")
    first = policy.result(record(attempts=0), exc)
    assert (first.outcome, first.counted) == (Outcome.RETRY, True)
    assert 0.5 <= first.delay <= 1
    last = policy.result(record(attempts=2), exc)
    assert last.outcome is Outcome.DEAD
    assert last.error and "gave up after 3 failed attempts" in last.error


@pytest.mark.parametrize(
    "exc",
    [
        kafka_errors.KafkaConnectionError(),
        kafka_errors.KafkaTimeoutError(),
        kafka_errors.NotEnoughReplicasError(),
        errors.BrokerUnavailableError(),
    ],
)
def test_outages_never_dead_letter_and_do_not_count(policy: RetryPolicy, exc: Exception) -> None:
    result = policy.result(record(attempts=99), exc)
    assert (result.outcome, result.counted) == (Outcome.RETRY, False)


def test_rows_not_attempted_keep_their_place(policy: RetryPolicy) -> None:
    result = policy.result(record(), NotAttempted())
    assert (result.outcome, result.counted, result.delay, result.error) == (
        Outcome.RETRY,
        False,
        0.0,
        None,
    )


def test_outage_pause_grows_while_outages_last_and_resets(policy: RetryPolicy) -> None:
    outage = kafka_errors.KafkaConnectionError()
    recs = [record()]
    delays = []
    for _ in range(4):
        policy.results(recs, [outage])
        delays.append(policy.outage_delay())
    assert delays[-1] > delays[0]
    policy.results(recs, [None])
    assert policy.outage_delay() <= 1


def test_classify_unknown_errors_as_row_errors() -> None:
    assert failures.classify(RuntimeError("bug")) is Failure.ROW
    assert errors.describe(RuntimeError("bug")) == "RuntimeError: bug"
    assert errors.describe(kafka_errors.KafkaConnectionError()) == "KafkaConnectionError"


def test_oversize_errors_name_our_setting_and_the_topic_limit_once() -> None:
    client_side = kafka_errors.MessageSizeTooLargeError(
        "The message is 2097355 bytes when serialized which is larger than the maximum request "
        "size you have configured with the max_request_size configuration"
    )
    for exc in (client_side, kafka_errors.MessageSizeTooLargeError()):
        text = failures.describe(exc)
        assert "OUTBOX_KAFKA_MAX_REQUEST_BYTES" in text and "max.message.bytes" in text
        assert "max_request_size" not in text
        assert text.count("MessageSizeTooLargeError") == 1
    doubled = kafka_errors.KafkaConnectionError("KafkaConnectionError: Unable to bootstrap")
    assert errors.describe(doubled) == "KafkaConnectionError: Unable to bootstrap"
