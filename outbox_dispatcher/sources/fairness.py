"""Weighted deficit round-robin over one in-flight budget per process (issue 36): which outbox
the next free claim slot claims for. Pure: a slot calls `grant` when it is free; the grant is
held while its batch is in flight (claimed, not yet settled) and given back with `release` (or
`finished`, which also puts a drained outbox to sleep); `wake` and `sleep` say which outboxes
have work.

The budget is of batches in flight, not of claims at once: a claim slot (dispatch/slots.py) holds
a grant only for its claim statement, then the batch's publish and settle run on their own while
the slot grants on, so that a broker round trip and a mark no longer hold up every other outbox
(the quiet tenants' p99 of 1.3-1.6 s with two slots that held each batch to its settle). An outbox
may hold several grants at once (a backlog's batches on their way, as a single-table claim loop
keeps claiming while earlier batches are published); per-key order is the leases' (a key's rows
are leased to one batch at a time).

Why deficit round-robin: a fixed visit order (or "the first with work") gives the head of the
list every free slot while it has a backlog; plain round-robin has no weights. Here each active
outbox, when the pointer reaches it, is credited `weight` claims of `batch_size` rows and spends
them before the pointer moves on, so over every round the grants follow the weights exactly,
whatever the budget. An outbox that is idle or backing off is out of the ring: it is never
visited, holds no grant and gathers no credit to burst with later. Each decision is O(1)
outside the reserve, O(budget) within it (below).

Polls (an outbox looked at without knowing it has work: a newly served one, or one the idle
probe of dispatch/probe.py cannot read) are not work: they wait in a lane of their own and take
a slot only when no outbox in the ring wants one, or every PROBE_EVERY-th grant while the ring
stays busy (so that they are still looked at under a backlog). Without that lane, 500 idle
tenants polled every 2 s filled the ring, and a notified quiet tenant waited behind hundreds of
empty claims (p99 7 s in `make bench`'s fleet_quiet_*).

**The reserve.** With batches in flight decoupled from the claims, a backlog could take the whole
budget (its batches of 500 rows each waiting for the broker), and a notified quiet outbox would
wait for one of them to settle before its one-row claim. So the last `reserve` grants of the
budget (as many as the process's claim slots, dispatch/slots.py) go only to outboxes with
nothing in flight: the first such outbox in ring order, granted out of the round (its credit and
the ring's pointer untouched). Decided against a per-outbox cap of budget - slots: a cap
protects the quiet outboxes from one backlog only (two backlogs capped at budget - slots each
still fill the budget), and with a small budget it overrides the weights (two grants, one each,
is 1:1 whatever the weights); the reserve leaves the rest of the budget to the weights, among
however many outboxes with batches in flight. The bound it gives: an outbox that wakes with
nothing in flight is granted at the next free slot once every outbox ahead of it in the ring
has spent one quantum, and, if the budget outside the reserve is spent, at once while a reserved
grant is free (held only by outboxes that had nothing in flight when they took it: mostly quiet
ones' short batches); it never waits for a backlog's batch to settle unless the whole reserve is
held.
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
    in_flight: int = 0  # grants held: batches being claimed or on their way
    granted: int = 0  # claims granted since it was added (for status and tests)


class DeficitRoundRobin(Generic[K]):
    """The scheduler of one process: `budget` batches in flight, each a claim of `batch_size`
    rows; the last `reserve` of them only for outboxes with none in flight."""

    def __init__(self, budget: int, batch_size: int, reserve: int = 0) -> None:
        if budget < 1 or batch_size < 1:
            msg = f"budget and batch_size must be at least 1, got {budget} and {batch_size}"
            raise ValueError(msg)
        if not 0 <= reserve < budget:
            msg = f"reserve must be at least 0 and below the budget {budget}, got {reserve}"
            raise ValueError(msg)
        self.budget = budget
        self.batch_size = batch_size
        self.reserve = reserve
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
        """An outbox let go (dropped, or now another member's). Its grants in flight still end
        with `release` (or `finished`), which then only gives them back."""
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

    def waiting(self, key: K) -> bool:
        """Whether it is in the ring or waiting in the lane of polls."""
        return key in self._ring or key in self._probes

    @property
    def active(self) -> list[K]:
        """The outboxes in the ring, the next to be visited first."""
        return list(self._ring)

    def grant(self) -> K | None:
        """The outbox the next free slot claims for, or None (the budget is spent, nobody has
        work, or within the reserve only outboxes with batches in flight have). The grant is
        held until `release`."""
        if self.in_flight >= self.budget or not (self._ring or self._probes):
            return None
        key: K | None = None
        if self._probes and (not self._ring or (self._grants + 1) % PROBE_EVERY == 0):
            key = self._next_poll()
        if key is None:
            reserved = self.in_flight >= self.budget - self.reserve
            key = self._fresh_in_ring() if reserved else self._next_in_ring()
        if key is None:  # nobody in the ring may have it now: a poll may
            key = self._next_poll()
        if key is None:
            return None
        self._grants += 1
        return self._hold(key)

    def _next_poll(self) -> K | None:
        """The next poll waiting, if it may have a grant now (within the reserve: an outbox
        with nothing in flight, which a poll's always is)."""
        if not self._probes:
            return None
        reserved = self.in_flight >= self.budget - self.reserve
        if reserved and self.flows[self._probes[0]].in_flight:
            return None
        return self._probes.popleft()

    def _next_in_ring(self) -> K | None:
        """The ring's next outbox with credit left, crediting it at its visit: at most two steps
        (a fresh credit is always at least one claim)."""
        while self._ring:
            self.visits += 1
            key = self._ring[0]
            flow = self.flows[key]
            if not self._credited:
                flow.deficit += flow.weight * self.batch_size
                self._credited = True
            if flow.deficit >= self.batch_size:
                flow.deficit -= self.batch_size
                return key
            self._ring.rotate(-1)
            self._credited = False
        return None

    def _fresh_in_ring(self) -> K | None:
        """Within the reserve: the first outbox in ring order with nothing in flight, granted
        out of the round (its credit and the pointer untouched, so the weights among the
        outboxes with batches in flight stay as they were). Each outbox passed over holds a
        grant: at most `budget` steps."""
        for key in self._ring:
            self.visits += 1
            if not self.flows[key].in_flight:
                return key
        return None

    def _hold(self, key: K) -> K:
        flow = self.flows[key]
        flow.in_flight += 1
        flow.granted += 1
        self.in_flight += 1
        return key

    def release(self, key: K) -> None:
        """A grant of `key` ended (its claim found nothing, or its batch was settled): the
        budget has it back."""
        self.in_flight -= 1
        flow = self.flows.get(key)
        if flow is not None and flow.in_flight > 0:  # else forgotten (maybe added again) meanwhile
            flow.in_flight -= 1

    def finished(self, key: K, rows: int) -> None:
        """A grant of `key` ended with `rows` rows claimed: given back, and an outbox with fewer
        rows than a batch is drained: it sleeps until something wakes it."""
        self.release(key)
        if key in self.flows and rows < self.batch_size:
            self.sleep(key)
