"""Prometheus metrics: what an operator alerts on (lag, dead rows, no progress, not ready).

Every name has the `outbox_` prefix; labels are limited to topic, reason and step, which stay few.
Each Dispatcher owns a registry (several dispatchers in one test process do not mix); the table
gauges are sampled from the database every metrics_interval_seconds by `sample`.

A process serving many outboxes (OUTBOX_SOURCES) registers the per-outbox families (listed in
source_metrics.PER_SOURCE) with a first label `source`, bounded by `SourceLabels`
(source_metrics.py binds one outbox's view); the single-table process keeps its series
unlabelled, as its dashboards know them.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeVar

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from outbox_dispatcher import __version__
from outbox_dispatcher.batch_histogram import BatchHistogram
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


# The `source` of every outbox beyond OUTBOX_METRICS_MAX_SOURCES (never a source's own label: the
# name "other" is reserved, and an unnamed source's label has a dot).
OTHER = "other"


class SourceLabels:
    """Which outboxes have a `source` label of their own: the first `most` to ask, each until
    it is let go (its series removed, its place free for the next); the rest share OTHER."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.own: set[str] = set()

    def take(self, label: str) -> str:
        if label in self.own or len(self.own) < self.most:
            self.own.add(label)
            return label
        return OTHER

    def release(self, label: str) -> bool:
        """Whether `label` had a place of its own (its series are to be removed)."""
        if label in self.own:
            self.own.remove(label)
            return True
        return False


M = TypeVar("M", covariant=True)


class Labelled(Protocol[M]):
    """A family with labels (a source's view of one binds its `source`)."""

    def labels(self, *labelvalues: Any) -> M: ...


class ObservesMany(Protocol):
    def observe_many(self, values: Iterable[float]) -> None: ...


class OutboxMetrics(Protocol):
    """What one outbox's work and sample record into: the single-table process's Metrics, or one
    outbox's view of a fleet's (source_metrics.SourceMetrics)."""

    @property
    def pending(self) -> Gauge: ...
    @property
    def oldest_pending_age(self) -> Gauge: ...
    @property
    def parked_rows(self) -> Labelled[Gauge]: ...
    @property
    def oldest_parked_age(self) -> Labelled[Gauge]: ...
    @property
    def dead(self) -> Gauge: ...
    @property
    def blocked_keys(self) -> Labelled[Gauge]: ...
    @property
    def paused(self) -> Labelled[Gauge]: ...
    @property
    def sampled(self) -> Gauge: ...
    @property
    def claimed(self) -> Counter: ...
    @property
    def published(self) -> Labelled[Counter]: ...
    @property
    def failures(self) -> Labelled[Counter]: ...
    @property
    def dead_lettered(self) -> Labelled[Counter]: ...
    @property
    def sweep_repaired(self) -> Counter: ...
    @property
    def sweep_passes(self) -> Counter: ...
    @property
    def claim_duration(self) -> Histogram: ...
    @property
    def publish_duration(self) -> Histogram: ...
    @property
    def mark_duration(self) -> Histogram: ...
    @property
    def commit_to_ack(self) -> ObservesMany: ...
    def record_batch(
        self, records: Sequence[OutboxRecord], results: Sequence[Result], acked_at: float
    ) -> None: ...
    def totals(self) -> tuple[int, int]: ...


class Metrics:
    """The process's Prometheus registry: the table's gauges (sampled), this dispatcher's
    counters, and the durations of a batch's steps."""

    def __init__(self, *, max_sources: int | None = None) -> None:
        """`max_sources`: a process of many outboxes (OUTBOX_METRICS_MAX_SOURCES), whose
        per-outbox families have the `source` label; None: the single-table process."""
        self.sources = None if max_sources is None else SourceLabels(max_sources)
        self._by = [] if max_sources is None else ["source"]
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
        by = self._by
        self.pending = Gauge(
            "outbox_pending_rows", "Rows neither published nor dead-lettered.", by, registry=r
        )
        self.oldest_pending_age = Gauge(
            "outbox_oldest_pending_age_seconds",
            "The lag to alert on: how long the oldest pending row that nothing holds on purpose "
            "has waited, since it was committed or an operator made it pending again, by the "
            "database's clock (0 when there is none). Rows of paused topics and held rows are "
            "outbox_parked_rows instead.",
            by,
            registry=r,
        )
        self.parked_rows = Gauge(
            "outbox_parked_rows",
            "Pending rows waiting on purpose, not counted in the lag: reason=paused (their topic "
            "or the whole table is paused), reason=held (not due and never failed, or of a key "
            "whose head is: `replay --release-held`).",
            [*by, "reason"],
            registry=r,
        )
        self.oldest_parked_age = Gauge(
            "outbox_oldest_parked_age_seconds",
            "How long the oldest parked row of each reason has waited, measured as the lag is "
            "(0 when there is none).",
            [*by, "reason"],
            registry=r,
        )
        self.dead = Gauge("outbox_dead_rows", "Dead-lettered rows in the table.", by, registry=r)
        self.blocked_keys = Gauge(
            "outbox_blocked_keys",
            "Ordering keys whose next row cannot go now: waiting out a retry backoff, held "
            "without a failure (`replay --release-held`), or behind a dead row under "
            "dead_letter_policy=block.",
            [*by, "reason"],
            registry=r,
        )
        self.paused = Gauge(
            "outbox_paused",
            "Pauses set by `outbox-dispatcher pause`: scope=table is 1 while the whole table is "
            "paused; scope=topic counts paused topics.",
            [*by, "scope"],
            registry=r,
        )
        self.sampled = Gauge(
            "outbox_table_sampled_timestamp_seconds",
            "When the table gauges were last read from the database (Unix time).",
            by,
            registry=r,
        )

    def _register_counters(self, r: CollectorRegistry) -> None:
        by = self._by
        self.claimed = Counter(
            "outbox_claimed_rows", "Rows claimed by this dispatcher.", by, registry=r
        )
        self.published = Counter(
            "outbox_published",
            "Rows acknowledged by the broker and marked published.",
            [*by, "topic"],
            registry=r,
        )
        self.failures = Counter(
            "outbox_publish_failures",
            "Failed publish attempts by class: permanent (dead at once), row (counted retry), "
            "outage (broker unavailable; never counts towards max_attempts).",
            [*by, "topic", "reason"],
            registry=r,
        )
        self.dead_lettered = Counter(
            "outbox_dead_lettered",
            "Rows dead-lettered by this dispatcher, by why: permanent, max_attempts, crash_loop.",
            [*by, "topic", "reason"],
            registry=r,
        )
        self.sweep_repaired = Counter(
            "outbox_sweep_repaired",
            "Pending rows the anti-entropy sweep found that no claim knew of (written below the "
            "claim cursor or with triggers off); each was handed to the claims.",
            by,
            registry=r,
        )
        self.sweep_passes = Counter(
            "outbox_sweep_passes",
            "Passes of the anti-entropy sweep over the whole table this dispatcher finished.",
            by,
            registry=r,
        )
        self.reclaims = Counter(
            "outbox_lease_reclaims",
            "Rows taken over after their previous owner's lease expired.",
            by,
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
        by = self._by
        self.claim_duration = Histogram(
            "outbox_claim_duration_seconds",
            "One claim round trip.",
            by,
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.publish_duration = Histogram(
            "outbox_publish_duration_seconds",
            "Publishing one batch: send to the last acknowledgement.",
            by,
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.mark_duration = Histogram(
            "outbox_mark_duration_seconds",
            "Settling one batch (marking published, scheduling retries, dead-lettering).",
            by,
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.commit_to_ack = BatchHistogram(
            "outbox_commit_to_ack_seconds",
            "From a row's created_at (its writer's transaction, by the database clock) to the "
            "broker's acknowledgement (by this host's clock).",
            LAG_BUCKETS,
            r,
            by,
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def totals(self) -> tuple[int, int]:
        """Rows published and dead-lettered since this process started (every topic and
        reason), which each heartbeat reports for the console's rates."""
        return total_of(self.published), total_of(self.dead_lettered)

    def record_batch(
        self, records: Sequence[OutboxRecord], results: Sequence[Result], acked_at: float
    ) -> None:
        """Counters and the commit-to-ack histogram for one settled batch."""
        record_batch(self, records, results, acked_at)


def record_batch(
    m: OutboxMetrics, records: Sequence[OutboxRecord], results: Sequence[Result], acked_at: float
) -> None:
    """Counters and the commit-to-ack histogram for one settled batch of an outbox."""
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
            m.failures.labels(topic, "permanent" if permanent else "row").inc()
            m.dead_lettered.labels(topic, "permanent" if permanent else "max_attempts").inc()
        else:
            outage = result.failure is Failure.TRANSIENT
            m.failures.labels(topic, "outage" if outage else "row").inc()
    m.commit_to_ack.observe_many(delays)
    for topic, n in published.items():
        m.published.labels(topic).inc(n)


def total_of(counter: Counter, source: str | None = None) -> int:
    """The counter's sum over every series (of one `source`'s when given)."""
    return int(
        sum(
            sample.value
            for metric in counter.collect()
            for sample in metric.samples
            if sample.name.endswith("_total")
            and (source is None or sample.labels.get("source") == source)
        )
    )


# A role not granted what a newer migration added (schema/roles.sql is rerun after each): the
# gauges go stale (OutboxTableMetricsStale fires), publishing goes on.
SAMPLE_ERRORS: tuple[type[BaseException], ...] = (
    *db.RETRIABLE_ERRORS,
    db.InsufficientPrivilegeError,
)


async def sample(store: DispatchStore, m: OutboxMetrics, *, block_on_dead: bool) -> None:
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
