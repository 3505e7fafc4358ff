"""The last hour of backlog and lag, sampled by the console process and kept in its memory only
(a restart starts an empty chart; nothing is written to the database, so a read-only role will
do). Drawn as inline SVG on the server: no chart library, no script."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import asdict, dataclass

import asyncpg
import structlog

from outbox_dispatcher import db, display, errors
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

    def as_json(self) -> dict[str, object]:
        return asdict(self)


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


_TOLERATED: tuple[type[BaseException], ...] = (
    *db.RETRIABLE_ERRORS,
    errors.OutboxDispatcherError,
    asyncpg.PostgresError,
)


async def sample_forever(settings: Settings, history: History) -> None:
    """Every console_sample_seconds: the table's gauges into `history`. A failure is logged once
    per outage, never fatal: the chart only informs."""
    failing = False
    while True:
        try:
            async with connected(settings) as session:
                row = await session.store.gauges(block_on_dead=False)
        except _TOLERATED as exc:
            if not failing:
                log.warning("console_sample_failed", error=errors.describe(exc))
            failing = True
        else:
            failing = False
            history.add(
                Sample(
                    at=time.time(),
                    pending=row["pending"],
                    dead=row["dead"],
                    oldest_pending_age_seconds=row["oldest_pending_age_seconds"],
                )
            )
        await asyncio.sleep(settings.console_sample_seconds)


WIDTH, HEIGHT, PAD = 720, 180, 36


def svg(samples: list[Sample], now: float, window_seconds: float = WINDOW_SECONDS) -> str:
    """Backlog (pending rows) and lag (oldest pending age) over the window, or since the first
    sample when that is younger, each on its own scale. Only numbers and fixed words go into the
    markup, so nothing needs escaping."""
    start = max(now - window_seconds, samples[0].at if samples else now - window_seconds)
    span = max(now - start, 1.0)
    inner_w, inner_h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD

    def x(at: float) -> float:
        return PAD + max(0.0, at - start) / span * inner_w

    def line(values: list[tuple[float, float]], top: float, colour: str) -> str:
        if not values:
            return ""
        scale = top or 1.0
        points = " ".join(
            f"{x(at):.1f},{PAD + inner_h - value / scale * inner_h:.1f}" for at, value in values
        )
        return f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{points}"/>'

    backlog = [(s.at, float(s.pending)) for s in samples]
    lag = [(s.at, s.oldest_pending_age_seconds or 0.0) for s in samples]
    top_backlog = max((v for _, v in backlog), default=0.0)
    top_lag = max((v for _, v in lag), default=0.0)
    bottom = PAD + inner_h
    return "".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
            f'width="{WIDTH}" height="{HEIGHT}" role="img" '
            'aria-label="backlog and lag over the last hour">',
            f'<rect x="{PAD}" y="{PAD}" width="{inner_w}" height="{inner_h}" fill="#fafafa" '
            'stroke="#ccc"></rect>',
            line(backlog, top_backlog, "#1f77b4"),
            line(lag, top_lag, "#d62728"),
            f'<text x="{PAD}" y="{PAD - 8}" font-size="12" fill="#1f77b4">'
            f"pending rows (max {top_backlog:.0f})</text>",
            f'<text x="{WIDTH - PAD}" y="{PAD - 8}" font-size="12" fill="#d62728" '
            f'text-anchor="end">oldest pending age (max {top_lag:.1f}s)</text>',
            f'<text x="{PAD}" y="{bottom + 16}" font-size="11" fill="#666">'
            f"{display.age_text(span)} ago</text>",
            f'<text x="{WIDTH - PAD}" y="{bottom + 16}" font-size="11" fill="#666" '
            'text-anchor="end">now</text>',
            "</svg>",
        ]
    )
