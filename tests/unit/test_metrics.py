"""outbox_dispatcher/metrics.py without a database."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from outbox_dispatcher.metrics import LAG_BUCKETS, BatchHistogram


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
