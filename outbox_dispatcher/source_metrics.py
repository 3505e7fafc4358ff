"""One outbox's view of a many-outbox process's metrics (OUTBOX_SOURCES): every per-outbox family
(`PER_SOURCE`) with its `source` label bound, so that the code one outbox runs (claims, settling,
sweep, the table sample) records as the single-table process's does, into its own series.

The label is bounded: the first OUTBOX_METRICS_MAX_SOURCES outboxes served get their own
(metrics.SourceLabels), the others share `source="other"`, whose table gauges are not sampled (a
sum of lags means nothing, and sampling costs statements per outbox). An outbox let go
(`forget`) has its series removed and its place freed: a fleet that moves it to another member
does not leave a stale gauge here beside the new owner's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from outbox_dispatcher import metrics
from outbox_dispatcher.metrics import (
    OTHER,
    Labelled,
    Metrics,
    ObservesMany,
    OutboxMetrics,
    total_of,
)
from outbox_dispatcher.models import OutboxRecord, Result

# The families of one outbox's work and table: with OUTBOX_SOURCES each has the `source` label
# first. The others are the process's (build, mode, readiness, in-flight rows, exactly-once).
PER_SOURCE = (
    "pending",
    "oldest_pending_age",
    "parked_rows",
    "oldest_parked_age",
    "dead",
    "blocked_keys",
    "paused",
    "sampled",
    "claimed",
    "published",
    "failures",
    "dead_lettered",
    "sweep_repaired",
    "sweep_passes",
    "reclaims",
    "claim_duration",
    "publish_duration",
    "mark_duration",
    "commit_to_ack",
)


class _Bound:
    """A family with labels after `source`: `labels(...)` gives the series of this source."""

    def __init__(self, family: Any, source: str) -> None:
        self._family = family
        self._source = source

    def labels(self, *labelvalues: Any) -> Any:
        return self._family.labels(self._source, *labelvalues)


class SourceMetrics:
    """metrics.OutboxMetrics for one outbox of a many-outbox process: `label` is the outbox's
    `source` label (its own, or OTHER beyond the bound); `own` says whether it is its own."""

    def __init__(self, process: Metrics, label: str) -> None:
        assert process.sources is not None  # noqa: S101 - made with max_sources
        self.label = process.sources.take(label)
        self.own = self.label != OTHER
        one = self.label
        m = process

        def gauge(family: Gauge) -> Gauge:
            """OTHER's table gauges are never sampled, nor exported (unregistered)."""
            return family.labels(one) if self.own else Gauge("unsampled", "", registry=None)

        self.pending: Gauge = gauge(m.pending)
        self.oldest_pending_age: Gauge = gauge(m.oldest_pending_age)
        self.parked_rows: Labelled[Gauge] = _Bound(m.parked_rows, one)
        self.oldest_parked_age: Labelled[Gauge] = _Bound(m.oldest_parked_age, one)
        self.dead: Gauge = gauge(m.dead)
        self.blocked_keys: Labelled[Gauge] = _Bound(m.blocked_keys, one)
        self.paused: Labelled[Gauge] = _Bound(m.paused, one)
        self.sampled: Gauge = gauge(m.sampled)
        self.claimed: Counter = m.claimed.labels(one)
        self.published: Labelled[Counter] = _Bound(m.published, one)
        self.failures: Labelled[Counter] = _Bound(m.failures, one)
        self.dead_lettered: Labelled[Counter] = _Bound(m.dead_lettered, one)
        self.sweep_repaired: Counter = m.sweep_repaired.labels(one)
        self.sweep_passes: Counter = m.sweep_passes.labels(one)
        self.reclaims: Counter = m.reclaims.labels(one)
        self.claim_duration: Histogram = m.claim_duration.labels(one)
        self.publish_duration: Histogram = m.publish_duration.labels(one)
        self.mark_duration: Histogram = m.mark_duration.labels(one)
        self.commit_to_ack: ObservesMany = m.commit_to_ack.labels(one)
        self._process = m

    def record_batch(
        self, records: Sequence[OutboxRecord], results: Sequence[Result], acked_at: float
    ) -> None:
        metrics.record_batch(self, records, results, acked_at)

    def totals(self) -> tuple[int, int]:
        """Rows published and dead-lettered under this label since the process started (what
        the outbox's heartbeat row reports for the console's rates; OTHER's are shared)."""
        m = self._process
        return total_of(m.published, self.label), total_of(m.dead_lettered, self.label)


def of(process: Metrics, label: str) -> OutboxMetrics:
    """The metrics one outbox records into: its `source`'s view of a many-outbox process's, or
    the process's own when they have no `source` label (a Metrics() made for one table)."""
    return process if process.sources is None else SourceMetrics(process, label)


def sampled(m: OutboxMetrics) -> bool:
    """Whether an outbox samples its table gauges into `m` (not under OTHER)."""
    return not isinstance(m, SourceMetrics) or m.own


def forget(process: Metrics, label: str) -> None:
    """The outbox of `label` is let go: its series removed and its place freed (an outbox under
    OTHER leaves OTHER's series as they are)."""
    if process.sources is None or not process.sources.release(label):
        return
    for name in PER_SOURCE:
        getattr(process, name).remove_by_labels({"source": label})
