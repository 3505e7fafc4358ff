"""The single-table dispatcher's periodic loops (issue 35): the lease keeper, the reclaimer, the
heartbeat, the gauges, readiness and retention each keep their interval, and no two of them
ever start a step together. They all fired at each 10 s tick: their statements queued behind
each other and the claims, and exactly-once's p99 at 1k/s rose there.

An hour of the real loops (Dispatcher._side_loops) on a virtual clock, over a store that
records when each loop's statement came and takes a while to answer."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any

from outbox_dispatcher import registry
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.supervisor import Dispatcher
from outbox_dispatcher.health import Readiness, ReadinessCache
from outbox_dispatcher.store import migrations
from tests.unit.virtual_time import run_virtual

HOUR = 3600.0


class TimedStore:
    """The statements the side loops run, each answered after `seconds[loop]` of the virtual
    clock; `starts[loop]` the times each loop's step began."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds
        self.starts: dict[str, list[float]] = {}

    async def _step(self, loop: str) -> None:
        self.starts.setdefault(loop, []).append(asyncio.get_running_loop().time())
        await asyncio.sleep(self.seconds.get(loop, 0.0))

    async def extend_leases(self, *, ids: list[int], tokens: list[Any], seconds: float) -> int:
        await self._step("lease-keeper")
        return len(ids)

    async def dead_letter_crash_loops(self, **_: Any) -> list[Any]:
        await self._step("reclaimer")
        return []

    async def count_expired_leases(self) -> int:
        return 0

    async def sweep(self, **_: Any) -> tuple[int, bool]:
        return 0, False

    async def schema_version(self) -> int:
        return migrations.latest_version()

    async def dispatcher_beat(self, **_: Any) -> None:
        await self._step("heartbeat")

    async def clock_tick(self) -> None:
        await self._step("metrics")

    async def gauges(self, **_: Any) -> dict[str, Any]:
        return {
            "first_pending_id": None,
            "pending": 0,
            "oldest_pending_age_seconds": None,
            "paused_rows": 0,
            "oldest_paused_age_seconds": None,
            "held_rows": 0,
            "oldest_held_age_seconds": None,
            "dead": 0,
            "backoff_keys": 0,
            "held_keys": 0,
            "dead_blocked_keys": 0,
            "table_paused": False,
            "paused_topics": 0,
        }

    async def clock_prune(self, **_: Any) -> None:
        return None

    async def cleanup_window(self, **_: Any) -> dict[str, Any]:
        await self._step("retention")
        return {"last_id": None}


def side_loops_for_an_hour(settings: Settings, store: TimedStore) -> None:
    """The dispatcher's side loops (rows in flight all along) for an hour of the virtual clock."""

    async def main() -> None:
        dispatcher = Dispatcher(settings, owner="me")
        dispatcher.in_flight.add(uuid.uuid4(), [1, 2, 3])

        async def ready() -> Readiness:
            await store._step("readiness")
            return Readiness(True, {})

        side = dispatcher._side_loops(store, ReadinessCache(ready, ttl=-1.0))  # type: ignore[arg-type]
        tasks = [asyncio.ensure_future(loop) for loop in side.values()]
        await asyncio.sleep(HOUR)
        for task in tasks:
            task.cancel()
        ended = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(e, asyncio.CancelledError) for e in ended), ended

    run_virtual(main())


def settings(**overrides: Any) -> Settings:
    return Settings(listen=False, http_enabled=False, **overrides)


def closest_starts_of_two_loops(starts: dict[str, list[float]]) -> float:
    ordered = sorted((t, loop) for loop, times in starts.items() for t in times)
    return min(b[0] - a[0] for a, b in itertools.pairwise(ordered) if a[1] != b[1])


def longest_gap(times: list[float]) -> float:
    return max(b - a for a, b in itertools.pairwise(times))


def test_the_side_loops_never_start_a_step_together_and_keep_their_intervals() -> None:
    """The defaults (a 30 s lease, 10 s reclaim and heartbeat, 15 s gauges, 5 s readiness, 60 s
    retention), each step taking a while (the reclaimer 0.4 s, as exactly-once's under load):
    an hour on, their steps still start at least 0.8 s apart (their phases 5/6 s apart modulo
    5 s: a step's length does not move the next), and each interval holds: the leases extended
    every 10 s from the first 10 s on, the heartbeat every 10 s."""
    store = TimedStore({"reclaimer": 0.4, "lease-keeper": 0.05, "heartbeat": 0.05, "metrics": 0.2})
    s = settings()
    side_loops_for_an_hour(s, store)
    starts = store.starts
    assert set(starts) == {
        "lease-keeper",
        "reclaimer",
        "heartbeat",
        "metrics",
        "readiness",
        "retention",
    }
    assert closest_starts_of_two_loops(starts) >= 0.8, "two loops started a step together"
    leases = starts["lease-keeper"]
    assert leases[0] < s.lease_seconds / 3
    assert longest_gap(leases) <= s.lease_seconds / 3 + 1e-6
    assert longest_gap(starts["heartbeat"]) <= registry.HEARTBEAT_SECONDS + 1e-6
    assert starts["heartbeat"][0] == 0, "the heartbeat beats at the start"
    for loop, seconds in (("reclaimer", 10), ("metrics", 15), ("readiness", 5), ("retention", 60)):
        assert len(starts[loop]) >= HOUR / seconds - 1, loop
        assert longest_gap(starts[loop]) <= seconds + 1e-6, loop


def test_a_short_lease_and_reclaim_interval_are_spread_too() -> None:
    """The integration tests' settings (a 5 s lease: extended every 5/3 s; a 1 s reclaim):
    the steps still never start together."""
    store = TimedStore({"reclaimer": 0.01})
    side_loops_for_an_hour(settings(lease_seconds=5.0, reclaim_interval_seconds=1.0), store)
    assert closest_starts_of_two_loops(store.starts) >= 0.05
    assert longest_gap(store.starts["lease-keeper"]) <= 5 / 3 + 1e-6
