"""The last hour of the backlog, the lag and the dispatchers' rates, sampled by the console
process and kept in its memory only (a restart starts an empty chart; nothing is written for it,
so a read-only role will do). Rates come from the counters each dispatcher reports with its
heartbeat (every 10 s): rows published and dead-lettered since it started."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import asyncpg
import structlog

from outbox_dispatcher import db, errors
from outbox_dispatcher.operate import jobs, reads
from outbox_dispatcher.operate.session import connected
from outbox_dispatcher.settings import Settings

log = structlog.get_logger(__name__)

WINDOW_SECONDS = 3600.0


@dataclass(frozen=True)
class Sample:
    at: float  # Unix time
    pending: int
    dead: int
    oldest_pending_age_seconds: float | None
    parked: int = 0
    # Each live dispatcher's counters: owner -> (published, dead-lettered) since it started.
    counters: dict[str, tuple[int, int]] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        found = asdict(self)
        found.pop("counters")
        return found


@dataclass(frozen=True)
class Rate:
    """Rows per second between two samples, summed over the dispatchers alive at both (None:
    none reported counters at both)."""

    at: float
    published_per_second: float | None
    dead_per_second: float | None

    def as_json(self) -> dict[str, object]:
        return asdict(self)


def rate_between(a: Sample, b: Sample) -> Rate:
    span = b.at - a.at
    both = [owner for owner in b.counters if owner in a.counters]
    if span <= 0 or not both:
        return Rate(b.at, None, None)
    published = sum(max(0, b.counters[o][0] - a.counters[o][0]) for o in both)
    dead = sum(max(0, b.counters[o][1] - a.counters[o][1]) for o in both)
    return Rate(b.at, published / span, dead / span)


class History:
    """Samples of the last WINDOW_SECONDS, oldest first."""

    def __init__(self, window_seconds: float = WINDOW_SECONDS) -> None:
        self.window_seconds = window_seconds
        self._samples: deque[Sample] = deque()

    def add(self, sample: Sample) -> None:
        self._samples.append(sample)
        while self._samples and self._samples[0].at < sample.at - self.window_seconds:
            self._samples.popleft()

    def samples(self) -> list[Sample]:
        return list(self._samples)

    def rates(self) -> list[Rate]:
        kept = self.samples()
        return [rate_between(a, b) for a, b in itertools.pairwise(kept)]


_TOLERATED: tuple[type[BaseException], ...] = (
    *db.RETRIABLE_ERRORS,
    errors.OutboxDispatcherError,
    asyncpg.PostgresError,
)


async def sample_once(settings: Settings, history: History) -> None:
    """One sample into `history`; and records of actions whose process died are closed as
    interrupted (a role that may not is fine: they read as interrupted anyway)."""
    async with connected(settings) as session:
        now = await reads.gauges(session)
        try:
            await jobs.sweep(session)
        except asyncpg.InsufficientPrivilegeError:
            pass
    history.add(
        Sample(
            at=time.time(),
            pending=now.pending,
            dead=now.dead,
            oldest_pending_age_seconds=now.oldest_pending_age_seconds,
            parked=now.parked,
            counters=now.counters,
        )
    )


async def sample_forever(settings: Settings, history: History) -> None:
    """Every console_sample_seconds, a sample. A failure is logged once per outage, never
    fatal: the chart only informs."""
    failing = False
    while True:
        try:
            await sample_once(settings, history)
        except _TOLERATED as exc:
            if not failing:
                log.warning("console_sample_failed", error=errors.describe(exc))
            failing = True
        else:
            failing = False
        await asyncio.sleep(settings.console_sample_seconds)
