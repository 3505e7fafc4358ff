"""Prometheus metrics: what an operator alerts on (lag, dead rows, no progress, not ready).

Every name has the `outbox_` prefix; labels are limited to topic, reason and step, which stay few.
Each Dispatcher owns a registry (several dispatchers in one test process do not mix); the table
gauges are sampled from the database every metrics_interval_seconds by `sample`.
"""

from __future__ import annotations

import bisect
import math
import platform
import time
from collections.abc import Iterable, Iterator, Sequence

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from outbox_dispatcher import __version__
from outbox_dispatcher.models import Failure, OutboxRecord, Outcome, Result
from outbox_dispatcher.store import DispatchStore, db

log = structlog.get_logger(__name__)

# The *_created series double the output and no dashboard or alert of ours uses them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Claims and marks take milliseconds; a publish waits for acks=all; commit-to-ack spans polling.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)

# The names exported (without the _total/_bucket/... suffixes the client adds); deploy/ manifests
# and alerts are tested against this list.
NAMES = (
    "outbox_build_info",
    "outbox_delivery_mode",
    "outbox_ready",
    "outbox_pending_rows",
    "outbox_oldest_pending_age_seconds",
    "outbox_parked_rows",
    "outbox_oldest_parked_age_seconds",
    "outbox_dead_rows",
    "outbox_blocked_keys",
    "outbox_in_flight_rows",
    "outbox_claimed_rows_total",
    "outbox_published_total",
    "outbox_publish_failures_total",
    "outbox_dead_lettered_total",
    "outbox_lease_reclaims_total",
    "outbox_sweep_repaired_total",
    "outbox_sweep_passes_total",
    "outbox_claim_duration_seconds",
    "outbox_publish_duration_seconds",
    "outbox_mark_duration_seconds",
    "outbox_commit_to_ack_seconds",
    "outbox_table_sampled_timestamp_seconds",
    "outbox_paused",
    "outbox_lanes_renewed_total",
    "outbox_takeovers_waiting_total",
    "outbox_fences_failed_total",
    "outbox_partitions_held",
)


class BatchHistogram(Collector):
    """A histogram fed a batch of observations at once. prometheus_client's Histogram takes a
    lock per observation and walks its buckets in Python, microseconds per row; a settled batch
    observes hundreds of rows at once from one thread. Exposed as a Histogram is."""

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = [*buckets, math.inf]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        registry.register(self)

    @property
    def name(self) -> str:
        return self._name

    def observe_many(self, values: Iterable[float]) -> None:
        bounds, counts = self._bounds, self._counts
        total = 0.0
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1  # the first bucket with le >= value
            total += value
        self._sum += total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative = 0
        buckets = []
        for bound, count in zip(self._bounds, self._counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))  # type: ignore[no-untyped-call]
        yield HistogramMetricFamily(
            self._name, self._documentation, buckets=buckets, sum_value=self._sum
        )


class Metrics:
    """The process's Prometheus registry: the table's gauges (sampled), this dispatcher's
    counters, and the durations of a batch's steps."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._register_gauges(self.registry)
        self._register_table_gauges(self.registry)
        self._register_counters(self.registry)
        self._register_durations(self.registry)

    def _register_gauges(self, r: CollectorRegistry) -> None:
        self.build_info = Gauge(
            "outbox_build_info",
            "Always 1; the labels say which outbox-dispatcher runs.",
            ["version", "python"],
            registry=r,
        )
        self.build_info.labels(__version__, platform.python_version()).set(1)
        self.delivery = Gauge(
            "outbox_delivery_mode",
            "1 for the delivery mode in force (OUTBOX_DELIVERY): at-least-once or exactly-once.",
            ["mode"],
            registry=r,
        )
        self.ready = Gauge(
            "outbox_ready",
            "1 when the database, the schema version and the broker are all fine (as /readyz).",
            registry=r,
        )
        self.in_flight = Gauge(
            "outbox_in_flight_rows",
            "Rows this dispatcher has claimed and not yet settled.",
            registry=r,
        )
        self.partitions_held = Gauge(
            "outbox_partitions_held",
            "Exactly-once: partitions whose rows wait because a transaction stalled on them "
            "(not acknowledged in time: short of in-sync replicas, leader unreachable).",
            registry=r,
        )

    def _register_table_gauges(self, r: CollectorRegistry) -> None:
        """What the sampler reads from the table every metrics interval."""
        self.pending = Gauge(
            "outbox_pending_rows", "Rows neither published nor dead-lettered.", registry=r
        )
        self.oldest_pending_age = Gauge(
            "outbox_oldest_pending_age_seconds",
            "The lag to alert on: how long the oldest pending row that nothing holds on purpose "
            "has waited, since it was committed or an operator made it pending again, by the "
            "database's clock (0 when there is none). Rows of paused topics and held rows are "
            "outbox_parked_rows instead.",
            registry=r,
        )
        self.parked_rows = Gauge(
            "outbox_parked_rows",
            "Pending rows waiting on purpose, not counted in the lag: reason=paused (their topic "
            "or the whole table is paused), reason=held (not due and never failed, or of a key "
            "whose head is: `replay --release-held`).",
            ["reason"],
            registry=r,
        )
        self.oldest_parked_age = Gauge(
            "outbox_oldest_parked_age_seconds",
            "How long the oldest parked row of each reason has waited, measured as the lag is "
            "(0 when there is none).",
            ["reason"],
            registry=r,
        )
        self.dead = Gauge("outbox_dead_rows", "Dead-lettered rows in the table.", registry=r)
        self.blocked_keys = Gauge(
            "outbox_blocked_keys",
            "Ordering keys whose next row cannot go now: waiting out a retry backoff, held "
            "without a failure (`replay --release-held`), or behind a dead row under "
            "dead_letter_policy=block.",
            ["reason"],
            registry=r,
        )
        self.paused = Gauge(
            "outbox_paused",
            "Pauses set by `outbox-dispatcher pause`: scope=table is 1 while the whole table is "
            "paused; scope=topic counts paused topics.",
            ["scope"],
            registry=r,
        )
        self.sampled = Gauge(
            "outbox_table_sampled_timestamp_seconds",
            "When the table gauges were last read from the database (Unix time).",
            registry=r,
        )

    def _register_counters(self, r: CollectorRegistry) -> None:
        self.claimed = Counter(
            "outbox_claimed_rows", "Rows claimed by this dispatcher.", registry=r
        )
        self.published = Counter(
            "outbox_published",
            "Rows acknowledged by the broker and marked published.",
            ["topic"],
            registry=r,
        )
        self.failures = Counter(
            "outbox_publish_failures",
            "Failed publish attempts by class: permanent (dead at once), row (counted retry), "
            "outage (broker unavailable; never counts towards max_attempts).",
            ["topic", "reason"],
            registry=r,
        )
        self.dead_lettered = Counter(
            "outbox_dead_lettered",
            "Rows dead-lettered by this dispatcher, by why: permanent, max_attempts, crash_loop.",
            ["topic", "reason"],
            registry=r,
        )
        self.sweep_repaired = Counter(
            "outbox_sweep_repaired",
            "Pending rows the anti-entropy sweep found that no claim knew of (written below the "
            "claim cursor or with triggers off); each was handed to the claims.",
            registry=r,
        )
        self.sweep_passes = Counter(
            "outbox_sweep_passes",
            "Passes of the anti-entropy sweep over the whole table this dispatcher finished.",
            registry=r,
        )
        self.reclaims = Counter(
            "outbox_lease_reclaims",
            "Rows taken over after their previous owner's lease expired.",
            registry=r,
        )
        self.lanes_renewed = Counter(
            "outbox_lanes_renewed",
            "Exactly-once: transactional ids a lane gave up for a new one, by why: stalled (a "
            "partition short of in-sync replicas did not acknowledge its transaction in time), "
            "coordinator (partitions with enough in-sync replicas did not: most likely the "
            "transaction coordinator), fenced (a takeover or the broker's transaction timeout), "
            "abort_unanswered.",
            ["reason"],
            registry=r,
        )
        for reason in (
            "stalled",
            "coordinator",
            "fenced",
            "abort_unanswered",
        ):  # exported at 0 from the start
            self.lanes_renewed.labels(reason)
        self.takeovers_waiting = Counter(
            "outbox_takeovers_waiting",
            "Exactly-once: takeovers that decided nothing because the progress could not be read "
            "(unread: the broker or the database; end_unreached: a transaction open on the "
            "progress partition did not end in time, a hanging one if it keeps rising; "
            "unfenced: an id of the owner it stands in for could not be fenced): their rows wait, "
            "uncounted, and their keys keep the reconcile duty.",
            ["reason"],
            registry=r,
        )
        for reason in ("unread", "end_unreached", "unfenced"):
            self.takeovers_waiting.labels(reason)
        self.fences_failed = Counter(
            "outbox_fences_failed",
            "Exactly-once: another dispatcher's transactional id a takeover could not fence (its "
            "last transaction's markers cannot be written yet); the takeover went on.",
            registry=r,
        )

    def _register_durations(self, r: CollectorRegistry) -> None:
        self.claim_duration = Histogram(
            "outbox_claim_duration_seconds",
            "One claim round trip.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.publish_duration = Histogram(
            "outbox_publish_duration_seconds",
            "Publishing one batch: send to the last acknowledgement.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.mark_duration = Histogram(
            "outbox_mark_duration_seconds",
            "Settling one batch (marking published, scheduling retries, dead-lettering).",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.commit_to_ack = BatchHistogram(
            "outbox_commit_to_ack_seconds",
            "From a row's created_at (its writer's transaction, by the database clock) to the "
            "broker's acknowledgement (by this host's clock).",
            LAG_BUCKETS,
            r,
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def totals(self) -> tuple[int, int]:
        """Rows published and dead-lettered since this process started (every topic and
        reason), which each heartbeat reports for the console's rates."""
        return _total(self.published), _total(self.dead_lettered)

    def record_batch(
        self, records: Sequence[OutboxRecord], results: Sequence[Result], acked_at: float
    ) -> None:
        """Counters and the commit-to-ack histogram for one settled batch."""
        published: dict[str, int] = {}
        delays: list[float] = []
        for record, result in zip(records, results, strict=True):
            topic = record.topic or "(routed)"
            if result.outcome is Outcome.PUBLISHED:
                published[topic] = published.get(topic, 0) + 1
                delays.append(max(0.0, acked_at - record.created_at.timestamp()))
                continue
            if result.failure is None:
                continue  # not attempted: an earlier row of its key failed
            if result.outcome is Outcome.DEAD:
                permanent = result.failure is Failure.PERMANENT
                self.failures.labels(topic, "permanent" if permanent else "row").inc()
                self.dead_lettered.labels(topic, "permanent" if permanent else "max_attempts").inc()
            else:
                outage = result.failure is Failure.TRANSIENT
                self.failures.labels(topic, "outage" if outage else "row").inc()
        self.commit_to_ack.observe_many(delays)
        for topic, n in published.items():
            self.published.labels(topic).inc(n)


def _total(counter: Counter) -> int:
    return int(
        sum(
            sample.value
            for metric in counter.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
        )
    )


# A role not granted what a newer migration added (schema/roles.sql is rerun after each): the
# gauges go stale (OutboxTableMetricsStale fires), publishing goes on.
SAMPLE_ERRORS: tuple[type[BaseException], ...] = (
    *db.RETRIABLE_ERRORS,
    db.InsufficientPrivilegeError,
)


async def sample(store: DispatchStore, m: Metrics, *, block_on_dead: bool) -> None:
    """Read the table gauges (pending, lag, parked, dead, blocked keys) once; the supervisor
    samples every metrics interval.

    Each sample first notes the highest committed id in the database's clock table, the time
    the lag is measured from (a writer's created_at is believed only within those notes), and
    afterwards forgets the notes no pending row needs.
    """
    await store.clock_tick()
    row = await store.gauges(block_on_dead=block_on_dead)
    await store.clock_prune(first_pending_id=row["first_pending_id"])
    m.pending.set(row["pending"])
    m.oldest_pending_age.set(row["oldest_pending_age_seconds"] or 0.0)
    for reason in ("paused", "held"):
        m.parked_rows.labels(reason).set(row[f"{reason}_rows"])
        m.oldest_parked_age.labels(reason).set(row[f"oldest_{reason}_age_seconds"] or 0.0)
    m.dead.set(row["dead"])
    m.blocked_keys.labels("backoff").set(row["backoff_keys"])
    m.blocked_keys.labels("held").set(row["held_keys"])
    m.blocked_keys.labels("dead").set(row["dead_blocked_keys"])
    m.paused.labels("table").set(int(row["table_paused"]))
    m.paused.labels("topic").set(row["paused_topics"])
    m.sampled.set(time.time())
