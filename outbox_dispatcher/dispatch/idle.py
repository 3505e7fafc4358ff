"""What an idle outbox of many (OUTBOX_SOURCES) costs: the batched idle probe and the pace of its
upkeep (issue 36, docs/design/many-outboxes.md "Idle cost").

An outbox whose last claim found less than a batch leaves the ring: no slot, no connection. It
is woken by a notification (while its wait is announced) or by the probe: one statement per
database every idle interval (store/probe.py) that asks each served outbox, with the claim
function's own tests for work, whether a claim would find rows or a lease expired. Only the idle
outboxes it names are claimed: 500 idle outboxes cost one statement per interval instead of 500
empty claims.

A row is never left behind: a row committed after the probe's snapshot either has an id above
the cursor (the cursor moves only by a claim, and only outboxes with work are claimed) or, if a
claim's discovery passed its id before the commit, is a hole of the cursor whose transactions
have ended by then; both are what the next probe looks for, as the claim does. Whatever the
probe decides, a notification still wakes the outbox at once.

Its upkeep (reclaimer, sweep, registry heartbeat, retention) runs at the normal intervals while
the outbox is active (rows claimed within ACTIVE_SECONDS), at once when the probe finds an
expired lease, and otherwise SLOW times less often, jittered (the reclaimer RECLAIM_SLOW times,
the sweep SWEEP_SLOW times); the heartbeat no slower than `status` still counts the dispatcher
live (registry.LIVE_SECONDS)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Final

from outbox_dispatcher import registry

# An outbox that claimed rows within this long keeps its normal upkeep and its announcement.
ACTIVE_SECONDS: Final = 60.0
# An idle outbox's upkeep runs this many times less often (jittered down to SLOW_JITTER of it).
SLOW: Final = 10.0
SLOW_JITTER: Final = 0.75
# The anti-entropy sweep of an idle outbox (a step of its reclaimer): rows written around the
# claim engine's bookkeeping are rare, and an idle outbox's sweep re-walks its whole table.
SWEEP_SLOW: Final = 30.0
# The reclaimer of an idle outbox: its duties (crash loops, expired leases awaiting takeover)
# are leases that expired, which the probe names at once (UpkeepPace.want); the slow round is a
# safety net only (its function costs about 2.5 ms a call on an empty table).
RECLAIM_SLOW: Final = 30.0
# The registry heartbeat of an idle outbox: as slow as `status` allows (a beat within
# registry.LIVE_SECONDS, with a tick of margin).
HEARTBEAT_SLOW: Final = (registry.LIVE_SECONDS - registry.HEARTBEAT_SECONDS / 2) / (
    registry.HEARTBEAT_SECONDS
)


class UpkeepPace:
    """When each upkeep loop of one outbox runs: a `due` gate per loop (dispatch/every.py)."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None
    ) -> None:
        self._clock = clock
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        # Idle until its first rows (a backlog makes it busy at its first claim); each loop's
        # first tick runs, unless its gate says otherwise.
        self._active_until = clock()
        self._wanted: set[str] = set()
        self._next: dict[str, float] = {}

    def busy(self) -> None:
        """Rows were claimed: normal upkeep for a while."""
        self._active_until = self._clock() + ACTIVE_SECONDS

    @property
    def active(self) -> bool:
        return self._clock() < self._active_until

    def want(self) -> None:
        """The probe found an expired lease: every loop runs at its next tick."""
        self._wanted.update(self._next)

    def gate(
        self, name: str, interval: float, slow: float = SLOW, *, first: bool = True
    ) -> Callable[[], bool]:
        """The `due` of the loop `name` that ticks every `interval`: every tick while the
        outbox is active or wanted; otherwise once `slow` intervals (jittered) have passed.
        Without `first`, an idle outbox's first tick waits like the later ones: a loop whose
        every duty the probe names (the steady reclaimer: an expired lease makes it wanted) need
        not run for each of 500 outboxes served at once (500 reclaim functions, 2 s of the
        database's time in the first seconds of a fleet, beside its busy outboxes' claims)."""
        self._next[name] = 0.0 if first else self._clock() + interval * slow

        def due() -> bool:
            now = self._clock()
            if not (now < self._active_until or name in self._wanted or now >= self._next[name]):
                return False
            self._wanted.discard(name)
            self._next[name] = now + interval * slow * self._rng.uniform(SLOW_JITTER, 1.0)
            return True

        return due
