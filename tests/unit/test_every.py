"""every(): the one loop of all upkeep. A tolerated failure is logged (as often as asked) and the
next step comes; any other error ends the loop."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from outbox_dispatcher.dispatch.every import Grid, Warn, every, spread
from tests.unit.virtual_time import run_virtual


class Recorded:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append((event, fields))


class AwayError(Exception):
    pass


class BugError(Exception):
    pass


def steps(outcomes: list[BaseException | None]) -> tuple[list[int], Any]:
    """A step that fails or succeeds as `outcomes` say, then raises BugError (ending the loop)."""
    ran: list[int] = []

    async def step() -> None:
        ran.append(len(ran))
        if len(ran) > len(outcomes):
            raise BugError
        outcome = outcomes[len(ran) - 1]
        if outcome is not None:
            raise outcome

    return ran, step


@pytest.mark.parametrize(
    ("warn", "logged"),
    [(Warn.EACH, 4), (Warn.PER_OUTAGE, 2), (Warn.ONCE, 1)],
)
async def test_tolerated_failures_are_logged_as_asked_and_the_loop_goes_on(
    warn: Warn, logged: int
) -> None:
    # Two outages of two failed steps each, with a success between them.
    ran, step = steps([AwayError(), AwayError(), None, AwayError(), AwayError(), None])
    log = Recorded()
    with pytest.raises(BugError):
        await every(
            0,
            step,
            log=log,
            failed="thing_failed",
            tolerated=(AwayError,),
            warn=warn,
            context=lambda: {"rows": 3},
        )
    assert len(ran) == 7, "every step ran; the untolerated error ended the loop"
    assert len(log.warnings) == logged
    assert all(event == "thing_failed" and f["rows"] == 3 for event, f in log.warnings)
    assert log.warnings[0][1]["error"] == "AwayError()"


async def test_the_first_step_waits_for_the_interval_unless_asked_not_to() -> None:
    for wait_first, ran_at_once in ((True, 0), (False, 1)):
        ran, step = steps([None] * 10)
        task = asyncio.ensure_future(
            every(60, step, log=Recorded(), failed="x", tolerated=(), wait_first=wait_first)
        )
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(ran) == ran_at_once


# --- phases (issue 35: the 10 s tick) ------------------------------------------------------------


def test_a_phased_loop_keeps_to_its_grid_whatever_its_steps_take() -> None:
    """Steps of 0.3 s, one of 25 s: each starts on the grid (phase, then every 10 s), the
    overrun's missed points skipped; without the grid each wait was 10 s after the step's end
    and the loop drifted by what its steps took."""
    started: list[float] = []

    async def step() -> None:
        loop = asyncio.get_running_loop()
        started.append(loop.time())
        await asyncio.sleep(25 if len(started) == 3 else 0.3)

    async def main() -> None:
        task = asyncio.ensure_future(
            every(10, step, log=Recorded(), failed="x", tolerated=(), wait_first=False, phase=2.5)
        )
        await asyncio.sleep(70)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_virtual(main())
    assert [round(t, 6) for t in started] == [2.5, 12.5, 22.5, 52.5, 62.5]


def test_a_grid_point_is_never_run_twice_by_an_early_wake() -> None:
    assert Grid(10, 0).wait(0) == 0, "a point the loop is at is not skipped"
    grid = Grid(10, 5)
    assert grid.wait(0) == 5
    # asyncio runs a timer within its clock's resolution before its time
    assert grid.wait(5 - 1e-9) == pytest.approx(10 + 1e-9)
    assert grid.wait(15.2) == pytest.approx(9.8)


def ticks(phases: dict[str, float], intervals: dict[str, float], until: float) -> list[tuple]:
    """Every step's start (time, loop) of loops on their grids."""
    return sorted(
        (phases[name] + k * seconds, name)
        for name, seconds in intervals.items()
        for k in range(int(until / seconds) + 1)
    )


@pytest.mark.parametrize(
    ("intervals", "common"),
    [
        # the single-table dispatcher's defaults: heartbeat, readiness, gauges, leases, reclaim,
        # retention
        ({"h": 10, "r": 5, "m": 15, "l": 10, "c": 10, "t": 60}, 5.0),
        # the tests' settings: a 5 s lease (its third), a 1 s reclaim
        ({"h": 10, "r": 5, "m": 15, "l": 5 / 3, "c": 1.0, "t": 60}, 1 / 3),
        ({"a": 0.2, "b": 7.5, "c": 20 / 3}, 1 / 30),
    ],
)
def test_spread_loops_never_start_a_step_together(
    intervals: dict[str, float], common: float
) -> None:
    """Over an hour on their grids, the closest two starts of different loops are the common
    measure of their intervals shared out among them (at one phase for all: 0 s)."""
    phases = spread(intervals)
    starts = ticks(phases, intervals, 3600)
    closest = min(b[0] - a[0] for a, b in itertools.pairwise(starts) if a[1] != b[1])
    assert closest == pytest.approx(common / len(intervals))
    assert phases[next(iter(intervals))] == 0
    assert max(phases.values()) < common
