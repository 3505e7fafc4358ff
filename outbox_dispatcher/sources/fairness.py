"""Weighted deficit round-robin over one in-flight budget per process (issue 36): which outbox
the next free claim slot goes to. Pure: the claim loop calls `grant` when a slot is free and
`finished` when a claim is settled; `wake` and `sleep` say which outboxes have work.

Why deficit round-robin: a fixed visit order (or "the first with work") gives the head of the
list every free slot while it has a backlog; plain round-robin has no weights. Here each active
outbox, when the pointer reaches it, is credited `weight` claims of `batch_size` rows and spends
them before the pointer moves on, so over every round the grants follow the weights exactly,
whatever the budget. An outbox that is idle or backing off is out of the ring: it is never
visited, holds no slot and gathers no credit to burst with later. Each decision is O(1).

Polls (an outbox looked at without knowing it has work: a newly served one, or one the idle
probe of dispatch/probe.py cannot read) are not work: they wait in a lane of their own and take
a slot only when no outbox in the ring wants one, or every PROBE_EVERY-th grant while the ring
stays busy (so that they are still looked at under a backlog). Without that lane, 500 idle
tenants polled every 2 s filled the ring, and a notified quiet tenant waited behind hundreds of
empty claims (p99 7 s in `make bench`'s fleet_quiet_*).

There is no per-outbox cap of slots: with a small budget a cap would override the weights (two
slots, one each, is 1:1 whatever the weights). The latency bound comes from the ring instead: an
outbox that wakes is granted once every outbox ahead of it in the ring has spent one quantum.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

# While outboxes with work hold the ring, one grant in this many goes to a waiting poll.
PROBE_EVERY = 4


@dataclasses.dataclass
class Flow:
    """One outbox's share: its weight, the rows it may still be granted this round (`deficit`)
    and the claims it holds."""

    weight: int
    deficit: int = 0
    in_flight: int = 0
    granted: int = 0  # claims granted since it was added (for status and tests)


class DeficitRoundRobin(Generic[K]):
    """The scheduler of one process: `budget` claim slots, each a claim of `batch_size` rows."""

    def __init__(self, budget: int, batch_size: int) -> None:
        if budget < 1 or batch_size < 1:
            msg = f"budget and batch_size must be at least 1, got {budget} and {batch_size}"
            raise ValueError(msg)
        self.budget = budget
        self.batch_size = batch_size
        self.flows: dict[K, Flow] = {}
        self._ring: collections.deque[K] = collections.deque()
        self._probes: collections.deque[K] = collections.deque()  # polls waiting for a slot
        self._grants = 0
        self._credited = False  # whether the ring's head has had its quantum for this visit
        self.in_flight = 0
        self.visits = 0  # ring positions looked at by `grant` (its cost, for tests)

    def add(self, key: K, weight: int = 1) -> None:
        """A new outbox (or a new weight for a known one); it starts asleep."""
        if weight < 1:
            msg = f"weight must be at least 1, got {weight}"
            raise ValueError(msg)
        if key in self.flows:
            self.flows[key].weight = weight
        else:
            self.flows[key] = Flow(weight)

    def forget(self, key: K) -> None:
        """An outbox let go (dropped, or now another member's). Its claims in flight still end
        with `finished`, which then only frees their slots."""
        self.sleep(key)
        self.flows.pop(key, None)

    def wake(self, key: K) -> None:
        """The outbox has work (a notification, a probe, or a full claim): it joins the ring
        behind every outbox already in it."""
        if key not in self.flows:
            msg = f"unknown outbox {key!r}: add it first"
            raise KeyError(msg)
        if key not in self._ring:
            self._ring.append(key)
        if key in self._probes:
            self._probes.remove(key)

    def probe(self, key: K) -> None:
        """Look at an idle outbox once, when no outbox with work wants the slot (see the module
        docstring); nothing if it is in the ring or already waiting."""
        if key in self.flows and key not in self._ring and key not in self._probes:
            self._probes.append(key)

    def sleep(self, key: K) -> None:
        """The outbox is idle or backing off: out of the ring, no credit kept."""
        if key in self._probes:
            self._probes.remove(key)
        if key not in self._ring:
            return
        if self._ring[0] == key:
            self._credited = False
        self._ring.remove(key)
        self.flows[key].deficit = 0

    def queued(self) -> set[K]:
        """The outboxes in the ring or waiting in the lane of polls."""
        return {*self._ring, *self._probes}

    @property
    def active(self) -> list[K]:
        """The outboxes in the ring, the next to be visited first."""
        return list(self._ring)

    def grant(self) -> K | None:
        """The outbox the next free slot claims for, or None (no slot free, or nobody has work).
        The slot is held until `finished`."""
        if self.in_flight >= self.budget or not (self._ring or self._probes):
            return None
        self._grants += 1
        if self._probes and (not self._ring or self._grants % PROBE_EVERY == 0):
            return self._hold(self._probes.popleft())
        while True:  # at most two steps: a fresh credit is always at least one claim
            self.visits += 1
            key = self._ring[0]
            flow = self.flows[key]
            if not self._credited:
                flow.deficit += flow.weight * self.batch_size
                self._credited = True
            if flow.deficit >= self.batch_size:
                flow.deficit -= self.batch_size
                return self._hold(key)
            self._ring.rotate(-1)
            self._credited = False

    def _hold(self, key: K) -> K:
        flow = self.flows[key]
        flow.in_flight += 1
        flow.granted += 1
        self.in_flight += 1
        return key

    def finished(self, key: K, rows: int) -> None:
        """A claim of `key` ended with `rows` rows: its slot is free again. Fewer rows than a
        batch means the outbox is drained: it sleeps until something wakes it."""
        self.in_flight -= 1
        flow = self.flows.get(key)
        if flow is None:  # forgotten while its claim ran
            return
        flow.in_flight -= 1
        if rows < self.batch_size:
            self.sleep(key)
