"""every(): the one loop of all upkeep.

The lease keeper, the reclaimer, retention, the heartbeat, the readiness refresh and the metrics
and console samples are each a step run forever at an interval. A failure the step tolerates
(the database away, a grant missing) is logged and the next step comes; any other error ends the
task, and with it the supervisor's task group, as a bug should.

Loops that run side by side in one process (the single-table dispatcher's) are given distinct
phases (`spread`) on fixed grids of the event loop's clock, so that no two of them ever start a
step together: at a shared tick their statements queued behind each other and behind the
claims, and the claims' latency rose every 10 s (issue 35).
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Awaitable, Callable, Mapping
from enum import Enum
from fractions import Fraction
from typing import Any, NoReturn


class Warn(Enum):
    """How often a tolerated failure is logged."""

    EACH = "each"  # every failed step
    PER_OUTAGE = "per_outage"  # the first failure after a success
    ONCE = "once"  # the first failure of the process's life


class Grid:
    """The points origin + k * seconds of a clock: where a phased loop starts its steps."""

    def __init__(self, seconds: float, origin: float) -> None:
        self.seconds = seconds
        self.origin = origin
        self._k = -1  # the point last waited for

    def wait(self, now: float) -> float:
        """The wait from `now` until the first point at or after it that comes after the one
        last waited for (a step that overran its interval: the points it passed are skipped and
        the loop keeps its place; a sleep that woke within the clock's resolution before its
        point: that point is not run twice)."""
        if self.seconds <= 0:
            return 0.0
        self._k = max(self._k + 1, math.ceil((now - self.origin) / self.seconds))
        return max(0.0, self.origin + self._k * self.seconds - now)


def spread(intervals: Mapping[str, float]) -> dict[str, float]:
    """A phase for each loop (by name, with its interval) so that, each on its grid, no two of
    them ever start a step together. A loop's steps fall at its phase modulo the intervals'
    greatest common measure (5 s for 5, 10 and 15 s; a lease's third is a fraction of it), and
    the phases share that measure out evenly, in the mapping's order (the first at 0).
    Intervals are taken to the nearest fraction with a denominator up to 1,000: others drift
    past each other, which no phase can prevent."""
    if not intervals:
        return {}
    measures = [Fraction(s).limit_denominator(1000) for s in intervals.values()]
    slot = float(functools.reduce(_common_measure, measures)) / len(intervals)
    return {name: i * slot for i, name in enumerate(intervals)}


def _common_measure(a: Fraction, b: Fraction) -> Fraction:
    """The greatest x of which both are whole multiples."""
    return Fraction(
        math.gcd(a.numerator * b.denominator, b.numerator * a.denominator),
        a.denominator * b.denominator,
    )


async def every(
    seconds: float,
    step: Callable[[], Awaitable[object]],
    *,
    log: Any,
    failed: str,
    tolerated: tuple[type[BaseException], ...],
    wait_first: bool = True,
    warn: Warn = Warn.EACH,
    describe: Callable[[BaseException], str] = repr,
    context: Callable[[], Mapping[str, object]] = dict,
    due: Callable[[], bool] | None = None,
    phase: float | None = None,
) -> NoReturn:
    """Run `step` every `seconds` (after a first wait unless `wait_first` is false); log a
    tolerated failure as `failed` on the caller's logger, with `context()`'s fields. With `due`,
    a tick whose `due()` is false is skipped (an idle outbox's upkeep, dispatch/idle.py).
    Without `phase`, each wait is `seconds` from the end of the last step. With it, the steps
    start on a Grid of the event loop's clock: `phase` seconds after the call (plus `seconds`
    with `wait_first`), then every `seconds` from there, whatever each step took (never more
    than `seconds` between two starts unless a step overran)."""
    warned = False
    pause = _pauses(seconds, phase, wait_first)
    if phase is not None or wait_first:
        await asyncio.sleep(pause())
    while True:
        if due is not None and not due():
            await asyncio.sleep(pause())
            continue
        try:
            await step()
        except tolerated as exc:
            if warn is Warn.EACH or not warned:
                log.warning(failed, error=describe(exc), **context())
            warned = True
        else:
            if warn is Warn.PER_OUTAGE:
                warned = False
        await asyncio.sleep(pause())


def _pauses(seconds: float, phase: float | None, wait_first: bool) -> Callable[[], float]:
    """The waits of every(): `seconds` each, or to the next point of the loop's Grid."""
    if phase is None:
        return lambda: seconds
    loop = asyncio.get_running_loop()
    grid = Grid(seconds, loop.time() + phase + (seconds if wait_first else 0.0))
    return lambda: grid.wait(loop.time())
