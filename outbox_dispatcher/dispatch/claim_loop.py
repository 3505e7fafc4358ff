"""A claim loop: claim a batch, back off while the database fails, wait for rows (LISTEN
announced, or polling), and run each batch (dispatch/batch.py). A batch that waits for a
partition that does not acknowledge, once its other keys are settled, runs on while the loop
claims again: the loop keeps up to MAX_STALLED_BATCHES such batches.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog

from outbox_dispatcher.dispatch.batch import BatchRun, Publishing, Settling
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.leases import InFlight
from outbox_dispatcher.dispatch.wakeup import Waiting, Wakeup, pause
from outbox_dispatcher.health import Heartbeats
from outbox_dispatcher.metrics import Metrics
from outbox_dispatcher.models import Batch
from outbox_dispatcher.store import db

log = structlog.get_logger(__name__)

# Batches one claim loop may have waiting for partitions that do not acknowledge while it claims
# on (each holds only the keys of those partitions once its other keys are settled). Parked
# batches do not count: past publish_timeout they wait only for requests in flight that the
# broker keeps refusing (BatchRun.parked), at most one per partition and producer, and nothing the
# loop could do would help them; a loop at the cap looks again every PARKED_CHECK_SECONDS.
MAX_STALLED_BATCHES = 8
PARKED_CHECK_SECONDS = 1.0


@dataclass(frozen=True)
class ClaimLoopConfig:
    batch_size: int  # a full batch means a backlog
    backoff_initial_seconds: float
    backoff_max_seconds: float
    poll_interval_seconds: float
    linger_seconds: float
    linger_poll_seconds: float


@dataclass
class Shared:
    """What the claim loops of one dispatcher share."""

    stopping: asyncio.Event
    wakeup: Wakeup
    heartbeats: Heartbeats
    # When any loop last claimed a batch: without LISTEN the loops poll fast for a while after.
    last_batch: float = float("-inf")


class ClaimLoop:
    def __init__(
        self,
        name: str,
        config: ClaimLoopConfig,
        *,
        claimer: Claimer,
        publisher: Publishing,
        settling: Settling,
        in_flight: InFlight,
        metrics: Metrics,
        shared: Shared,
        waiting: Waiting | None = None,
    ) -> None:
        self.name = name
        self._config = config
        self._claimer = claimer
        self._publisher = publisher
        self._settling = settling
        self._in_flight = in_flight
        self._metrics = metrics
        self._shared = shared
        self._waiting = waiting
        self._backoff = config.backoff_initial_seconds
        self._runs: dict[asyncio.Future[float], BatchRun] = {}  # this loop's batches being run
        # The last batch was partial and its claim saw nothing left after it: the next turn
        # waits for a notification (one that came meanwhile is kept by Wakeup) instead of
        # claiming at once, which would almost always be empty.
        self._drained = False

    async def run(self) -> None:
        shared = self._shared
        try:
            while not shared.stopping.is_set():
                shared.heartbeats.beat(self.name)
                await self._turn()
            if self._runs:  # graceful shutdown: let stalled batches finish (within the grace)
                await asyncio.wait(self._runs)
                self._reap()
        except BaseException:
            for unfinished in self._runs:
                unfinished.cancel()
            if self._runs:
                await asyncio.wait(self._runs)
            raise
        finally:
            shared.heartbeats.forget(self.name)

    async def _turn(self) -> None:
        """Claim once, then wait for rows, or run the batch."""
        c = self._config
        if self._drained:
            self._drained = False
            await self._wait_for_rows()
            if self._shared.stopping.is_set():
                return
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            batch = await self._claimer.claim()
        except db.RETRIABLE_ERRORS as exc:
            log.warning("claim_failed", error=repr(exc), retry_in=self._backoff)
            await pause(self._shared.stopping, self._backoff)
            self._backoff = min(self._backoff * 2, c.backoff_max_seconds)
            return
        self._metrics.claim_duration.observe(loop.time() - started)
        self._backoff = c.backoff_initial_seconds
        if batch is None:
            await self._wait_for_rows()
        else:
            await self._run(batch, started)

    async def _wait_for_rows(self) -> None:
        c, shared = self._config, self._shared
        if self._waiting is not None:
            # Writers notify while the wait is announced, so nothing needs polling fast: wait
            # for the notification (poll_interval is the fallback).
            if await self._waiting.announce():
                return  # claim once more before waiting: see Waiting.announce
            poll = c.poll_interval_seconds
        else:
            # Without LISTEN nobody hears a notification: poll fast after a batch.
            lingering = asyncio.get_running_loop().time() - shared.last_batch < c.linger_seconds
            poll = c.linger_poll_seconds if lingering else c.poll_interval_seconds
        await shared.wakeup.wait(shared.stopping, poll)

    async def _run(self, batch: Batch, claimed_at: float) -> None:
        """Run the batch until it ends, or until it waits only for partitions that do not
        acknowledge (its other keys settled): then claim on, up to MAX_STALLED_BATCHES."""
        c, shared, m = self._config, self._shared, self._metrics
        shared.last_batch = asyncio.get_running_loop().time()
        full = len(batch.records) >= c.batch_size
        # (only while writers notify: the wait announced, see Waiting)
        self._drained = batch.drained and not full and self._waiting is not None
        if self._waiting is not None and full:
            # A full batch: a backlog, so the loops will not wait soon; writers can stop
            # notifying. After a partial batch the announcement stays: the loop is about to
            # wait again, and withdrawing and announcing every batch costs two writes.
            await self._waiting.withdraw()
        m.claimed.inc(len(batch.records))
        if reclaimed := sum(r.reclaimed for r in batch.records):
            m.reclaims.inc(reclaimed)
        if full:
            shared.wakeup.notify()  # a full batch: there is probably more for another loop
        stalled = asyncio.Event()
        run = BatchRun(
            batch,
            self._publisher,
            self._settling,
            self._in_flight,
            lambda: shared.heartbeats.beat(self.name),
            stalled,
            claimed_at,
        )
        task = asyncio.ensure_future(run.run())
        self._runs[task] = run
        stall = asyncio.ensure_future(stalled.wait())
        try:
            await asyncio.wait({task, stall}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stall.cancel()
        if task.done():
            del self._runs[task]
            self._reap()
            if outage := task.result():
                await pause(shared.stopping, outage)
            return
        log.debug("batch_stalled", rows=len(batch.records), stalled_batches=len(self._runs))
        self._reap()
        while self._stalled() >= MAX_STALLED_BATCHES:
            await asyncio.wait(
                self._runs, timeout=PARKED_CHECK_SECONDS, return_when=asyncio.FIRST_COMPLETED
            )
            self._reap()

    def _reap(self) -> None:
        """Drop finished batches, raising what one raised (a dead batch stops the loop)."""
        for task in [t for t in self._runs if t.done()]:
            del self._runs[task]
            task.result()

    def _stalled(self) -> int:
        """The batches that count against MAX_STALLED_BATCHES: all but the parked ones."""
        return sum(1 for run in self._runs.values() if not run.parked)
