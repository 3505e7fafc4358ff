"""The last hour of the backlog, the lag and the dispatchers' rates, sampled by the console
process and kept in its memory only (a restart starts an empty chart; nothing is written for it,
so a read-only role will do). Rates come from the counters each dispatcher reports with its
heartbeat (every 10 s): rows published and dead-lettered since it started."""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import NoReturn

import structlog

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.every import Warn, every
from outbox_dispatcher.operate import jobs, reads
from outbox_dispatcher.operate.session import (
    RETRIABLE_ERRORS,
    DatabaseError,
    PrivilegeError,
    connected,
)

log = structlog.get_logger(__name__)

WINDOW_SECONDS = 3600.0


@dataclass(frozen=True)
class Sample:
    at: float  # Unix time
    pending: int
    dead: int
    oldest_pending_age_seconds: float | None
    parked: int = 0
    # Each live dispatcher's counters since it started: owner -> (published, dead-lettered, Unix
    # time of the heartbeat that reported them).
    counters: dict[str, tuple[int, int, float]] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        found = asdict(self)
        found.pop("counters")
        return found


@dataclass(frozen=True)
class Rate:
    """Rows per second at a sample: each live dispatcher's rate between its last two heartbeats
    (its counters change only then), summed."""

    at: float
    published_per_second: float
    dead_per_second: float

    def as_json(self) -> dict[str, object]:
        return asdict(self)


def rates(samples: list[Sample]) -> list[Rate]:
    """A rate at every sample once some dispatcher reported twice; a counter that went down (a
    restart under the same owner) counts as no rows."""
    beats: dict[str, tuple[int, int, float]] = {}
    current: dict[str, tuple[float, float]] = {}
    found = []
    for sample in samples:
        for owner, (published, dead, beat) in sample.counters.items():
            last = beats.get(owner)
            if last is not None and beat > last[2]:
                span = beat - last[2]
                current[owner] = (
                    max(0, published - last[0]) / span,
                    max(0, dead - last[1]) / span,
                )
            if last is None or beat > last[2]:
                beats[owner] = (published, dead, beat)
        live = [current[o] for o in sample.counters if o in current]
        if live:
            found.append(Rate(sample.at, sum(p for p, _ in live), sum(d for _, d in live)))
    return found


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
        return rates(self.samples())


_TOLERATED: tuple[type[BaseException], ...] = (
    *RETRIABLE_ERRORS,
    errors.OutboxDispatcherError,
    DatabaseError,
)


async def sample_once(settings: Settings, history: History) -> None:
    """One sample into `history`; and records of actions whose process died are closed as
    interrupted (a role that may not is fine: they read as interrupted anyway)."""
    async with connected(settings) as session:
        now = await reads.gauges(session)
        try:
            await jobs.sweep(session)
        except PrivilegeError:
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


async def sample_forever(settings: Settings, history: History) -> NoReturn:
    """Every console_sample_seconds, a sample. A failure is logged once per outage, never
    fatal: the chart only informs."""
    await every(
        settings.console_sample_seconds,
        functools.partial(sample_once, settings, history),
        log=log,
        failed="console_sample_failed",
        tolerated=_TOLERATED,
        wait_first=False,
        warn=Warn.PER_OUTAGE,
        describe=errors.describe,
    )
