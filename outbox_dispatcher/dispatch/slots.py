"""The claim slots of a process serving many outboxes (OUTBOX_SOURCES): `claim_tasks` slots
shared by every outbox through weighted deficit round-robin (sources/fairness.py). An outbox
takes a slot only while it is active: woken by a notification, a poll, or its own full batch;
an idle one costs no slot and no connection. A slot holds one claim from claim to settle."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import structlog

from outbox_dispatcher.dispatch.outboxes import Key, OutboxRuntime
from outbox_dispatcher.dispatch.wakeup import pause
from outbox_dispatcher.health import Heartbeats
from outbox_dispatcher.sources.fairness import DeficitRoundRobin

log = structlog.get_logger(__name__)


class ClaimSlots:
    """The outboxes served, which of them have work, and the slot loops that claim for them."""

    def __init__(
        self, budget: int, batch_size: int, stopping: asyncio.Event, heartbeats: Heartbeats
    ) -> None:
        self.scheduler: DeficitRoundRobin[Key] = DeficitRoundRobin(budget, batch_size)
        self.outboxes: dict[Key, OutboxRuntime] = {}
        self._stopping = stopping
        self._heartbeats = heartbeats
        self._changed = asyncio.Event()
        self._woken_in_flight: set[Key] = set()  # a notification came while it was claiming
        self._retry_at: dict[Key, float] = {}  # backing off until (monotonic)

    def add(self, runtime: OutboxRuntime) -> None:
        """A new outbox: claimed once, in the lane of polls (it may have a backlog, which makes
        it active then): after the outboxes with work, so that hundreds served at once (at
        start) do not hold up a notified outbox (seconds of p99 in `make bench`'s fleet_quiet_*
        while the first pass ran)."""
        self.outboxes[runtime.key] = runtime
        self.scheduler.add(runtime.key, runtime.outbox.source.weight)
        self.poll([runtime.key])

    def forget(self, key: Key) -> None:
        """Let go: no slot is granted to it again (a claim of it in flight ends as it would)."""
        self.outboxes.pop(key, None)
        self.scheduler.forget(key)
        self._retry_at.pop(key, None)
        self._woken_in_flight.discard(key)

    def wake(self, key: Key) -> None:
        """It has work, or may (a notification, a poll): into the ring, unless it backs off or
        is gone. One that comes while its claim runs brings one more claim after it."""
        flow = self.scheduler.flows.get(key)
        if flow is not None and flow.in_flight:
            self._woken_in_flight.add(key)
        self._activate(key)

    def _activate(self, key: Key) -> None:
        if key not in self.scheduler.flows or self._retry_at.get(key, 0.0) > time.monotonic():
            return
        self.scheduler.wake(key)
        self._changed.set()

    def idle(self) -> set[Key]:
        """The outboxes that wait for work: out of the ring, no claim in flight, not backing
        off (what the idle probe looks at, dispatch/probe.py)."""
        now, queued = time.monotonic(), self.scheduler.queued()
        return {
            key
            for key, flow in self.scheduler.flows.items()
            if key in self.outboxes
            and not flow.in_flight
            and key not in queued
            and self._retry_at.get(key, 0.0) <= now
        }

    def poll(self, keys: Iterable[Key]) -> None:
        """Claim each of these idle outboxes once (an outbox the probe cannot read: a schema
        older than the steady claim, a probe that failed), in the scheduler's lane of polls:
        after the outboxes with work, never ahead of them."""
        for key in keys:
            if self._retry_at.get(key, 0.0) <= time.monotonic():
                self.scheduler.probe(key)
        self._changed.set()

    async def serve(self, name: str, poll: float) -> None:
        """One slot, until the process stops: take the next grant, claim and run one batch."""
        try:
            while not self._stopping.is_set():
                self._heartbeats.beat(name)
                key = self.scheduler.grant()
                if key is None:
                    self._changed.clear()
                    await _either(self._changed, self._stopping, poll)
                    continue
                await self._turn(name, key)
        finally:
            self._heartbeats.forget(name)

    async def _turn(self, name: str, key: Key) -> None:
        runtime = self.outboxes.get(key)
        rows = 0
        try:
            if runtime is not None:
                rows = await runtime.turn(lambda: self._heartbeats.beat(name))
        finally:
            self.scheduler.finished(key, rows)
            self._changed.set()
        if runtime is None or key not in self.outboxes:
            return
        if runtime.retry_in is not None:
            self._back_off(key, runtime.retry_in)
        elif (rows and not runtime.drained) or key in self._woken_in_flight:
            self._woken_in_flight.discard(key)
            self._activate(key)  # rows, and the claim saw no end to them; or notified meanwhile
        elif await runtime.idle():
            self._activate(key)  # a fresh announcement: rows committed before it sent none
        if runtime.outage:
            await pause(self._stopping, runtime.outage)  # the broker is away: for every outbox

    def _back_off(self, key: Key, delay: float) -> None:
        self.scheduler.sleep(key)
        self._retry_at[key] = time.monotonic() + delay
        asyncio.get_running_loop().call_later(delay, self._retry, key)

    def _retry(self, key: Key) -> None:
        self._retry_at.pop(key, None)
        self._activate(key)


async def _either(one: asyncio.Event, other: asyncio.Event, seconds: float) -> None:
    """Until either event is set, or `seconds` have passed."""
    waits = {asyncio.ensure_future(one.wait()), asyncio.ensure_future(other.wait())}
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
