"""The pace of an outbox's upkeep (dispatch/idle.py): every tick while it is active, at once
when the probe found an expired lease, otherwise SLOW intervals apart (jittered), and the
registry heartbeat never slower than `status` counts a dispatcher live."""

from __future__ import annotations

import itertools
import random

from outbox_dispatcher import registry
from outbox_dispatcher.dispatch.idle import (
    ACTIVE_SECONDS,
    HEARTBEAT_SLOW,
    SLOW,
    SLOW_JITTER,
    UpkeepPace,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ticks(due: object, clock: Clock, interval: float, count: int) -> list[float]:
    """The times of the ticks (one every `interval`) that `due` lets run."""
    ran = []
    for _ in range(count):
        if due():  # type: ignore[operator]
            ran.append(clock.now)
        clock.now += interval
    return ran


def test_an_idle_outbox_runs_its_first_tick_then_every_slow_interval_jittered() -> None:
    clock = Clock()
    pace = UpkeepPace(clock, random.Random(7))
    ran = ticks(pace.gate("reclaimer", 10.0), clock, 10.0, 1000)
    assert ran[0] == 1000.0
    gaps = {b - a for a, b in itertools.pairwise(ran)}
    assert gaps <= {10.0 * n for n in range(int(SLOW * SLOW_JITTER), int(SLOW) + 1)}, gaps
    assert len(gaps) > 1, "jittered"
    assert len(ran) <= 1000 / (SLOW * SLOW_JITTER) + 1


def test_an_active_outbox_runs_every_tick_until_it_has_been_idle_a_while() -> None:
    clock = Clock()
    pace = UpkeepPace(clock)
    due = pace.gate("retention", 1.0)
    pace.busy()
    ran = ticks(due, clock, 1.0, int(ACTIVE_SECONDS) + 100)
    assert ran[: int(ACTIVE_SECONDS)] == [1000.0 + i for i in range(int(ACTIVE_SECONDS))]
    assert len(ran) < ACTIVE_SECONDS + 100 / (SLOW * SLOW_JITTER) + 1


def test_an_expired_lease_runs_every_loop_at_its_next_tick() -> None:
    clock = Clock()
    pace = UpkeepPace(clock)
    reclaimer, heartbeat = pace.gate("reclaimer", 10.0), pace.gate("heartbeat", 10.0)
    assert reclaimer() and heartbeat()  # first ticks
    clock.now += 10
    assert not reclaimer() and not heartbeat()
    pace.want()
    assert reclaimer() and heartbeat()
    assert not reclaimer() and not heartbeat(), "once"


def test_the_heartbeat_of_an_idle_outbox_keeps_it_live_for_status() -> None:
    clock = Clock()
    pace = UpkeepPace(clock, random.Random(3))
    ran = ticks(
        pace.gate("heartbeat", registry.HEARTBEAT_SECONDS, HEARTBEAT_SLOW), clock, 10.0, 500
    )
    gaps = [b - a for a, b in itertools.pairwise(ran)]
    assert max(gaps) < registry.LIVE_SECONDS
    assert min(gaps) > registry.HEARTBEAT_SECONDS, "slower than an active outbox's"


def test_a_loop_without_a_first_tick_runs_only_when_wanted_or_active() -> None:
    """The steady reclaimer (slow = inf, first = False): nothing for an idle outbox, served or
    not, until the probe finds an expired lease or rows are claimed."""
    clock = Clock()
    pace = UpkeepPace(clock)
    due = pace.gate("reclaimer", 10.0, float("inf"), first=False)
    assert ticks(due, clock, 10.0, 100) == []
    pace.want()
    assert due()
    assert not due(), "once"
    pace.busy()
    assert due(), "active: every tick"
