"""The claim slots of a process serving many outboxes (OUTBOX_SOURCES): `claims` slots that
claim, and a budget of batches in flight, both shared by every outbox through weighted deficit
round-robin (sources/fairness.py). An outbox takes a slot only while it is active: woken by a
notification, a poll, or its own full batch; an idle one costs no slot and no connection.

A slot holds one claim statement; the batch it claimed is then published and settled by a run
of its own (OutboxRuntime.run) while the slot grants on, as a single-table claim loop keeps
claiming while its earlier batches are on their way (dispatch/claim_loop.py). A slot that held
its batch to the settle held up every other outbox for a broker round trip and a mark: 20 quiet
tenants at 20 events/s through two slots had p99 of 1.3-1.6 s. What bounds the work in flight
is the scheduler's budget of grants: a grant is held from the claim to the settle."""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Iterable

import structlog

from outbox_dispatcher.dispatch.outboxes import Claim, Key, OutboxRuntime
from outbox_dispatcher.dispatch.wakeup import pause
from outbox_dispatcher.health import Heartbeats
from outbox_dispatcher.sources.fairness import DeficitRoundRobin

log = structlog.get_logger(__name__)


class ClaimSlots:
    """The outboxes served, which of them have work, the slot loops that claim for them and
    the runs of the batches claimed."""

    def __init__(
        self,
        budget: int,
        batch_size: int,
        stopping: asyncio.Event,
        heartbeats: Heartbeats,
        *,
        claims: int = 1,
    ) -> None:
        """`budget` batches in flight, `claims` slot loops (the caller runs that many `serve`):
        the last `claims` grants of the budget are kept for outboxes with nothing in flight
        (the scheduler's reserve, sources/fairness.py), so that a backlog cannot hold the whole
        budget while a notified quiet outbox waits."""
        reserve = max(0, min(claims, budget - 1))
        self.scheduler: DeficitRoundRobin[Key] = DeficitRoundRobin(budget, batch_size, reserve)
        self.outboxes: dict[Key, OutboxRuntime] = {}
        self._stopping = stopping
        self._heartbeats = heartbeats
        self._changed = asyncio.Event()
        # Notifications (and probes' finds) counted per outbox: one that came after a claim
        # began brings one more claim after that claim's batch (see _ended).
        self._notices: dict[Key, int] = {}
        self._retry_at: dict[Key, float] = {}  # backing off until (monotonic)
        self._backlogged: set[Key] = set()  # its last claim saw more rows than it took
        self._paused_until = 0.0  # a broker outage pauses every grant until then (monotonic)
        self._runs: set[asyncio.Task[None]] = set()
        self._run_names = itertools.count(1)
        self._crashed: BaseException | None = None  # a run's bug: the slots raise it
        # Served, not looked at yet (neither probed nor claimed): the first pass's progress.
        self.unlooked: set[Key] = set()
        self.all_looked = asyncio.Event()
        self.all_looked.set()

    def add(self, runtime: OutboxRuntime, *, probed: bool = False) -> None:
        """A new outbox, looked at once: `probed`, by its database's idle probe, which the caller
        runs next (dispatch/probe.py `IdleProbe.look_soon`: one statement per 100 outboxes, and
        only those with work, or an expired lease, are claimed); otherwise claimed once, in the
        lane of polls (it may have a backlog, which makes it active then): after the outboxes
        with work, so that hundreds served at once (at start) do not hold up a notified outbox
        (seconds of p99 in `make bench`'s fleet_quiet_* while the first pass ran). A claim
        each at start was most of a 500-outbox process's first seconds (each outbox's
        statements prepared on the pool's connections, its wait announced, claimed again)."""
        self.outboxes[runtime.key] = runtime
        self.scheduler.add(runtime.key, runtime.outbox.source.weight)
        self.unlooked.add(runtime.key)
        self.all_looked.clear()
        if not probed:
            self.poll([runtime.key])

    def looked(self, keys: Iterable[Key]) -> None:
        """These outboxes were looked at (a probe answered, or a claim ended)."""
        self.unlooked.difference_update(keys)
        if not self.unlooked:
            self.all_looked.set()

    def forget(self, key: Key) -> None:
        """Let go: no slot is granted to it again (a claim or batch of it in flight ends as it
        would)."""
        self.outboxes.pop(key, None)
        self.looked([key])
        self.scheduler.forget(key)
        self._retry_at.pop(key, None)
        self._notices.pop(key, None)
        self._backlogged.discard(key)

    def wake(self, key: Key) -> None:
        """It has work, or may (a notification, a poll): into the ring, unless it backs off or
        is gone. One that comes while a claim or batch of it is in flight also brings one more
        claim once that batch is settled (its row may be of a key the batch holds)."""
        if key in self.scheduler.flows:
            self._notices[key] = self._notices.get(key, 0) + 1
        self._activate(key)

    def _activate(self, key: Key) -> None:
        if key not in self.scheduler.flows or self._retry_at.get(key, 0.0) > time.monotonic():
            return
        self.scheduler.wake(key)
        self._changed.set()

    def idle(self) -> set[Key]:
        """The outboxes that wait for work: out of the ring, nothing in flight, not backing
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

    @property
    def runs(self) -> int:
        """Batches on their way (claimed, being published and settled)."""
        return len(self._runs)

    async def serve(self, name: str, poll: float) -> None:
        """One slot, until the process stops: take the next grant and claim; the batch claimed
        runs on its own. Paused for every outbox while the broker is away."""
        try:
            while not self._stopping.is_set():
                self._heartbeats.beat(name)
                self._raise_crash()
                paused = self._paused_until - time.monotonic()
                if paused > 0:
                    await pause(self._stopping, paused)
                    continue
                key = self.scheduler.grant()
                if key is None:
                    self._changed.clear()
                    await _either(self._changed, self._stopping, poll)
                    continue
                await self._claim(key)
        except BaseException:
            await self._cancel_runs()  # the process fails: no run outlives its slots
            raise
        finally:
            self._heartbeats.forget(name)

    async def _claim(self, key: Key) -> None:
        """Claim for `key` (its grant held); a batch goes on as a run of its own."""
        runtime = self.outboxes.get(key)
        if runtime is None:  # let go since its grant
            self._release(key)
            return
        seen = self._notices.get(key, 0)
        if key not in self._backlogged:
            # Out of the ring while it claims: the other slots would claim it at once too (the
            # ring grants an outbox every free slot while its credit lasts), and for a quiet
            # outbox's one row that second claim finds nothing (two claims per event). A
            # notification meanwhile puts it back.
            self.scheduler.sleep(key)
        try:
            claim = await runtime.claim()
        except BaseException:
            self._release(key)
            raise
        self.looked([key])
        notified = self._notices.get(key, 0) != seen
        if claim.batch is not None and (claim.full or not claim.drained):
            self._backlogged.add(key)
            self._activate(key)  # more rows: in the ring, claimed by every free slot
        else:
            self._backlogged.discard(key)
            if claim.retry_in is None and not notified:
                self.scheduler.sleep(key)  # drained: until a notification or a poll
        if claim.batch is None:
            await self._ended(key, runtime, seen, claim.retry_in)
            return
        run_name = f"run-{next(self._run_names)}"
        task = asyncio.create_task(self._run(run_name, key, runtime, claim, seen), name=run_name)
        self._runs.add(task)
        task.add_done_callback(self._run_done)

    async def _run(
        self, name: str, key: Key, runtime: OutboxRuntime, claim: Claim, seen: int
    ) -> None:
        """Publish and settle one claimed batch; its liveness is its own heartbeat (the broker
        waited for beats it)."""
        beat = functools.partial(self._heartbeats.beat, name)
        beat()
        try:
            try:
                ran = await runtime.run(claim, beat)
            except BaseException:  # cancelled at shutdown (the run gave its rows back) or a bug
                self._release(key)
                raise
            await self._ended(key, runtime, seen, ran.retry_in, ran.outage)
        finally:
            self._heartbeats.forget(name)

    def _raise_crash(self) -> None:
        """A run's bug stops the process, as it stopped the slot that ran it before."""
        if self._crashed is not None:
            raise self._crashed

    def _run_done(self, task: asyncio.Task[None]) -> None:
        self._runs.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if self._crashed is None:  # a bug: the slots stop the process with it
            self._crashed = task.exception()
        self._changed.set()

    def _release(self, key: Key, outage: float = 0.0) -> None:
        self.scheduler.release(key)
        if outage:  # the broker is away: no grant for any outbox meanwhile
            self._paused_until = max(self._paused_until, time.monotonic() + outage)
        self._changed.set()

    async def _ended(
        self,
        key: Key,
        runtime: OutboxRuntime,
        seen: int,
        retry_in: float | None,
        outage: float = 0.0,
    ) -> None:
        """A grant's end (an empty or failed claim, or its batch settled): given back; then a
        failure backs the outbox off alone, a notification since the claim began brings one more
        claim, and an outbox left with nothing to do announces its wait."""
        self._release(key, outage)
        if self.outboxes.get(key) is not runtime:  # let go meanwhile (maybe served again)
            return
        idle = not self.scheduler.waiting(key) and not self.scheduler.flows[key].in_flight
        if retry_in is not None:
            self._back_off(key, retry_in)
        elif self._notices.get(key, 0) != seen:
            self._activate(key)
        elif idle and await runtime.idle():
            self._activate(key)  # a fresh announcement: rows committed before it sent none

    def _back_off(self, key: Key, delay: float) -> None:
        self.scheduler.sleep(key)
        self._retry_at[key] = time.monotonic() + delay
        asyncio.get_running_loop().call_later(delay, self._retry, key)

    def _retry(self, key: Key) -> None:
        self._retry_at.pop(key, None)
        self._activate(key)

    async def finish(self, seconds: float) -> int:
        """Shutdown, once the slots stopped claiming: the batches on their way get `seconds` to
        be settled; the rest are cancelled (each marks what the broker acknowledged and gives
        back the rest, dispatch/batch.py) and waited for. Returns how many were cancelled."""
        late: set[asyncio.Task[None]] = set()
        try:
            if self._runs:
                _, late = await asyncio.wait(set(self._runs), timeout=max(0.0, seconds))
        finally:
            await self._cancel_runs()
        self._raise_crash()
        return len(late)

    async def _cancel_runs(self) -> None:
        while runs := {task for task in self._runs if not task.done()}:
            for task in runs:
                task.cancel()
            await asyncio.wait(runs)


async def _either(one: asyncio.Event, other: asyncio.Event, seconds: float) -> None:
    """Until either event is set, or `seconds` have passed."""
    waits = {asyncio.ensure_future(one.wait()), asyncio.ensure_future(other.wait())}
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
