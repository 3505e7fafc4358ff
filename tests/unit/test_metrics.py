"""outbox_dispatcher/metrics.py without a database: the failure counters are decided by the
outcome's class (data), never by its text; the batch histogram exposes what a histogram does."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime

import pytest
from aiokafka import errors as kafka_errors
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.metrics import LAG_BUCKETS, OTHER, BatchHistogram, Metrics
from outbox_dispatcher.models import Failure, OutboxRecord, Outcome, Result
from outbox_dispatcher.retries import RetryPolicy
from outbox_dispatcher.source_metrics import SourceMetrics, forget


def record(attempts: int = 0, topic: str = "t") -> OutboxRecord:
    return OutboxRecord(1, topic, "k", b"x", {}, uuid.uuid4(), datetime.now(UTC), attempts, False)


def counts(m: Metrics) -> dict[tuple[str, str], float]:
    """(metric, reason) -> value of the failure and dead-letter counters, topic t."""
    found: dict[tuple[str, str], float] = {}
    for family in m.registry.collect():
        if family.name not in ("outbox_publish_failures", "outbox_dead_lettered"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.value:
                found[(family.name, sample.labels["reason"])] = sample.value
    return found


def test_a_dead_row_is_counted_by_its_class_whatever_its_text_says() -> None:
    m = Metrics()
    now = 0.0
    # Text that reads like the other class on purpose: the counters must not parse it.
    m.record_batch(
        [record()],
        [Result(Outcome.DEAD, "permanent-looking broker text", failure=Failure.ROW)],
        now,
    )
    assert counts(m) == {
        ("outbox_publish_failures", "row"): 1,
        ("outbox_dead_lettered", "max_attempts"): 1,
    }
    m = Metrics()
    m.record_batch(
        [record()],
        [Result(Outcome.DEAD, "gave up, it says", failure=Failure.PERMANENT)],
        now,
    )
    assert counts(m) == {
        ("outbox_publish_failures", "permanent"): 1,
        ("outbox_dead_lettered", "permanent"): 1,
    }


def test_retries_are_counted_as_row_or_outage_by_class_and_not_attempted_not_at_all() -> None:
    m = Metrics()
    m.record_batch(
        [record(), record(), record()],
        [
            Result(Outcome.RETRY, "x", delay=1, counted=True, failure=Failure.ROW),
            Result(Outcome.RETRY, "y", delay=1, failure=Failure.TRANSIENT),
            Result(Outcome.RETRY),  # not attempted: an earlier row of its key failed
        ],
        0.0,
    )
    assert counts(m) == {
        ("outbox_publish_failures", "row"): 1,
        ("outbox_publish_failures", "outage"): 1,
    }


@pytest.mark.parametrize(
    ("exc", "attempts", "outcome", "failure"),
    [
        (None, 0, Outcome.PUBLISHED, None),
        (errors.NotAttempted(), 0, Outcome.RETRY, None),
        (kafka_errors.MessageSizeTooLargeError(), 0, Outcome.DEAD, Failure.PERMANENT),
        (kafka_errors.KafkaConnectionError(), 5, Outcome.RETRY, Failure.TRANSIENT),
        (errors.TopicMissingError(), 0, Outcome.RETRY, Failure.ROW),
        (RuntimeError("permanent error, not retried"), 2, Outcome.DEAD, Failure.ROW),
    ],
)
def test_the_retry_policy_gives_each_outcome_its_class(
    exc: BaseException | None, attempts: int, outcome: Outcome, failure: Failure | None
) -> None:
    policy = RetryPolicy(Settings(max_attempts=3), random.Random(1))
    result = policy.result(record(attempts), exc)
    assert (result.outcome, result.failure) == (outcome, failure)


def test_a_batch_histogram_exposes_what_a_histogram_of_the_same_observations_does() -> None:
    values = [0.0, 0.005, 0.0051, 0.3, 1.0, 7.5, 3600.0, 5000.0, 0.01, 0.01]
    plain, batched = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("h_seconds", "doc", buckets=LAG_BUCKETS, registry=plain)
    for value in values:
        histogram.observe(value)
    many = BatchHistogram("h_seconds", "doc", LAG_BUCKETS, batched)
    many.observe_many(values[:4])
    many.observe_many([])
    many.observe_many(values[4:])
    expected = [line for line in generate_latest(plain).splitlines() if b"_created" not in line]
    assert generate_latest(batched).splitlines() == expected


def exported(m: Metrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in m.registry.collect()
        for s in family.samples
        if s.name == name
    }


def test_a_fleet_gives_the_first_outboxes_a_source_label_and_the_rest_other() -> None:
    m = Metrics(max_sources=2)
    views = [SourceMetrics(m, label) for label in ("a.outbox", "b.outbox", "c.outbox", "d")]
    assert [v.label for v in views] == ["a.outbox", "b.outbox", "other", "other"]
    for n, view in enumerate(views, 1):
        view.record_batch([record()] * n, [Result(Outcome.PUBLISHED)] * n, 0.0)
        view.claimed.inc(n)
    published = exported(m, "outbox_published_total")
    assert published == {
        (("source", "a.outbox"), ("topic", "t")): 1,
        (("source", "b.outbox"), ("topic", "t")): 2,
        (("source", "other"), ("topic", "t")): 7,
    }
    assert views[1].totals() == (2, 0)
    # Only the outboxes with their own label have table gauges.
    assert {dict(k)["source"] for k in exported(m, "outbox_pending_rows")} == {
        "a.outbox",
        "b.outbox",
    }


def test_an_outbox_let_go_leaves_no_series_and_frees_its_place() -> None:
    m = Metrics(max_sources=1)
    a = SourceMetrics(m, "a.outbox")
    a.claimed.inc(5)
    assert SourceMetrics(m, "b.outbox").label == OTHER
    forget(m, "a.outbox")
    assert not [k for k in exported(m, "outbox_claimed_rows_total") if ("source", "a.outbox") in k]
    assert SourceMetrics(m, "c.outbox").label == "c.outbox"
    forget(m, "b.outbox")  # it was under "other": "other" stays
    assert (("source", "other"),) in exported(m, "outbox_claimed_rows_total")


def test_the_single_table_process_has_no_source_label() -> None:
    m = Metrics()
    m.record_batch([record()], [Result(Outcome.PUBLISHED)], 0.0)
    assert exported(m, "outbox_published_total") == {(("topic", "t"),): 1}
    assert exported(m, "outbox_pending_rows") == {(): 0}
