"""A Prometheus histogram fed a batch of observations at once (metrics.py's commit-to-ack)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class _Buckets:
    """One series of a BatchHistogram."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe_many(self, values: Iterable[float]) -> None:
        bounds, counts = self.bounds, self.counts
        total = 0.0
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1  # the first bucket with le >= value
            total += value
        self.sum += total


class BatchHistogram(Collector):
    """A histogram fed a batch of observations at once. prometheus_client's Histogram takes a
    lock per observation and walks its buckets in Python, microseconds per row; a settled batch
    observes hundreds of rows at once from one thread. Exposed as a Histogram is; with
    `labelnames`, one series per `labels(...)`, as a Histogram's."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        registry: CollectorRegistry,
        labelnames: Sequence[str] = (),
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = [*buckets, math.inf]
        self._labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], _Buckets] = {}
        if not labelnames:
            self._series[()] = _Buckets(self._bounds)
        registry.register(self)

    @property
    def name(self) -> str:
        return self._name

    def labels(self, *values: str) -> _Buckets:
        return self._series.setdefault(tuple(values), _Buckets(self._bounds))

    def remove_by_labels(self, labels: dict[str, str]) -> None:
        at = {self._labelnames.index(k): v for k, v in labels.items()}
        for key in [k for k in self._series if all(k[i] == v for i, v in at.items())]:
            del self._series[key]

    def observe_many(self, values: Iterable[float]) -> None:
        self._series[()].observe_many(values)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            self._name, self._documentation, labels=self._labelnames or None
        )
        for values, series in self._series.items():
            cumulative = 0
            buckets = []
            for bound, count in zip(self._bounds, series.counts, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))  # type: ignore[no-untyped-call]
            family.add_metric(list(values), buckets, series.sum)
        yield family
