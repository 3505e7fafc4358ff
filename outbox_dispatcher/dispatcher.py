"""Assembles the dispatcher and supervises its loops.

Every loop runs in one TaskGroup: a loop that dies stops the process (non-zero exit), never a
half-alive zombie. Shutdown has two phases: stop claiming and let in-flight batches finish within
the grace period; then cancel, giving unacknowledged rows back and marking acknowledged ones.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import asyncpg
import structlog

from outbox_dispatcher import (
    cleanup,
    db,
    errors,
    listener,
    metrics,
    migrations,
    reclaimer,
    registry,
)
from outbox_dispatcher.claimer import Claimer, Wakeup, pause
from outbox_dispatcher.health import HealthServer, Heartbeats, Readiness, ReadinessCache
from outbox_dispatcher.marker import Marker
from outbox_dispatcher.models import Batch, OutboxRecord, Outcome, Result
from outbox_dispatcher.publisher import KafkaPublisher, NotAttempted, Sent
from outbox_dispatcher.retries import RetryPolicy
from outbox_dispatcher.settings import Settings
from outbox_dispatcher.sql import Queries
from outbox_dispatcher.store import Store

log = structlog.get_logger(__name__)

READINESS_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError,
    asyncpg.PostgresError,
    *db.RETRIABLE_ERRORS,
)


# Batches one claim loop may have waiting for partitions that do not acknowledge while it claims
# on (each holds only the keys of those partitions once its other keys are settled). Parked
# batches do not count: past publish_timeout they wait only for requests in flight that the
# broker keeps refusing (Sent.parked), at most one per partition and producer, and nothing the
# loop could do would help them; a loop at the cap looks again every PARKED_CHECK_SECONDS.
MAX_STALLED_BATCHES = 8
PARKED_CHECK_SECONDS = 1.0


def _reap(
    batches: set[asyncio.Future[float]], deliveries: dict[asyncio.Future[float], Sent]
) -> None:
    """Drop finished batches, raising what one raised (a dead batch stops the loop, as
    before)."""
    for task in [t for t in batches if t.done()]:
        batches.discard(task)
        deliveries.pop(task, None)
        task.result()


def _stalled(
    batches: set[asyncio.Future[float]], deliveries: dict[asyncio.Future[float], Sent]
) -> int:
    """The batches that count against MAX_STALLED_BATCHES: all but the parked ones."""
    return sum(1 for t in batches if not (t in deliveries and deliveries[t].parked))


def instance_id() -> str:
    """Who holds a lease, for operators: host, pid and a random suffix (pids repeat)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Dispatcher:
    def __init__(self, settings: Settings, *, owner: str | None = None) -> None:
        self.settings = settings
        self.owner = owner or instance_id()
        self.queries = Queries.for_table(settings.db_schema, settings.table)
        self.stopping = asyncio.Event()
        self.in_flight = reclaimer.InFlight()
        self.retry_policy = RetryPolicy(settings)
        self.published = 0
        self.wakeup = Wakeup()
        self._last_batch = float("-inf")
        self.metrics = metrics.Metrics()
        self.metrics.in_flight.set_function(lambda: len(self.in_flight))
        # A claim loop beats at least once per poll interval (also while it waits out a broker
        # outage), the lease keeper once per lease/3.
        self.heartbeats = Heartbeats(
            settings.liveness_timeout_seconds
            + max(settings.poll_interval_seconds, settings.lease_seconds / 3)
        )
        self._http: HealthServer | None = None

    @property
    def http_port(self) -> int | None:
        """The port /metrics, /livez and /readyz listen on, once started (OUTBOX_HTTP_PORT=0
        picks a free one)."""
        return None if self._http is None else self._http.port

    def live(self) -> dict[str, object]:
        stale = self.heartbeats.stale()
        return {"live": not stale, "stale_loops": stale}

    def stop(self) -> None:
        """Begin a graceful shutdown (phase one: stop claiming)."""
        if not self.stopping.is_set():
            log.info("shutdown_requested", in_flight=len(self.in_flight))
            self.stopping.set()

    async def run(self) -> None:
        s = self.settings
        pool = await db.create_pool(s)
        try:
            async with pool.acquire() as conn:
                await migrations.check_version(conn, s.db_schema, s.table)
            publisher = KafkaPublisher(s)
            await publisher.start()
            try:
                await self._supervise(pool, publisher)
            finally:
                await publisher.stop()
        finally:
            await pool.close()
        log.info("stopped", published=self.published)

    async def _supervise(self, pool: asyncpg.Pool, publisher: KafkaPublisher) -> None:
        s = self.settings
        claimer = Claimer(pool, self.queries, s, self.owner)
        marker = Marker(
            pool,
            self.queries,
            retry_for=s.lease_seconds,
            delete_on_publish=s.delete_on_publish,
            owner=self.owner,
        )
        readiness = ReadinessCache(lambda: self._readiness(pool, publisher))
        # Without LISTEN nobody hears a notification: writers are never asked to send one.
        waiting = (
            listener.Waiting(pool, self.queries, self.owner, ttl=2 * s.poll_interval_seconds + 5)
            if s.listen
            else None
        )
        log.info(
            "started",
            owner=self.owner,
            table=f"{s.db_schema}.{s.table}",
            claim_tasks=s.claim_tasks,
            batch_size=s.batch_size,
            bootstrap_servers=s.kafka_bootstrap_servers,
        )
        async with asyncio.TaskGroup() as tg:
            claim_tasks = [
                tg.create_task(
                    self._guard(
                        self._claim_loop(f"claim-{i}", claimer, publisher, marker, waiting),
                        f"claim-{i}",
                    ),
                    name=f"claim-{i}",
                )
                for i in range(s.claim_tasks)
            ]
            side: dict[str, Coroutine[Any, Any, None]] = {
                "lease-keeper": reclaimer.keep_leases(
                    pool, self.queries, s, self.in_flight, self.heartbeats
                ),
                "reclaimer": reclaimer.reclaim(pool, self.queries, s, self.metrics),
                "metrics": metrics.sample(pool, self.queries, s, self.metrics),
                "readiness": self._refresh_readiness(readiness),
                "heartbeat": registry.heartbeat(
                    pool, self.queries, s, self.owner, self.metrics.totals
                ),
            }
            if s.listen:
                side["listener"] = listener.listen(s, self.wakeup)
            if s.http_enabled:
                self._http = HealthServer(
                    s.http_host,
                    s.http_port,
                    live=self.live,
                    ready=readiness,
                    metrics=self.metrics.exposition,
                )
                side["http"] = self._http.serve()
            if s.retention_seconds > 0 and not s.delete_on_publish:
                side["retention"] = cleanup.retention(pool, self.queries, s)
            side_tasks = [
                tg.create_task(self._guard(coro, name), name=name) for name, coro in side.items()
            ]
            tg.create_task(self._shutdown(claim_tasks, side_tasks), name="shutdown")

    async def _readiness(self, pool: asyncpg.Pool, publisher: KafkaPublisher) -> Readiness:
        checks: dict[str, str] = {}
        if self.stopping.is_set():
            checks["dispatcher"] = "shutting down"
        try:
            async with asyncio.timeout(3):
                version = await Store(pool, self.queries).schema_version()
        except READINESS_ERRORS as exc:
            checks["database"] = f"unreachable: {errors.describe(exc)}"
        else:
            checks["database"] = "ok"
            expected = migrations.latest_version()
            checks["schema"] = (
                "ok"
                if version == expected
                else f"version {version}, this dispatcher needs {expected}"
            )
        reachable = await publisher.broker_reachable(3.0)
        checks["broker"] = "ok" if reachable else "unreachable"
        ready = all(value == "ok" for value in checks.values())
        self.metrics.ready.set(int(ready))
        return Readiness(ready, checks)

    async def _refresh_readiness(self, readiness: ReadinessCache) -> None:
        """Keep outbox_ready current even when nothing probes /readyz; log changes."""
        was: bool | None = None
        while True:
            state = await readiness.get()
            if state.ready != was:
                if state.ready:
                    log.info("ready", checks=state.checks)
                else:
                    log.warning("not_ready", checks=state.checks)
                was = state.ready
            await asyncio.sleep(min(self.settings.metrics_interval_seconds, 5.0))

    async def _guard(self, loop: Coroutine[Any, Any, None], name: str) -> None:
        """A loop that returns while the dispatcher is not stopping is a dead loop."""
        await loop
        if not self.stopping.is_set():
            raise errors.LoopDiedError(f"the {name} loop returned unexpectedly")

    async def _shutdown(
        self, claim_tasks: list[asyncio.Task[None]], side_tasks: list[asyncio.Task[None]]
    ) -> None:
        await self.stopping.wait()
        _, pending = await asyncio.wait(claim_tasks, timeout=self.settings.shutdown_grace_seconds)
        if pending:
            log.warning("shutdown_grace_expired", cancelling=len(pending))
            for task in pending:
                task.cancel()
            await asyncio.wait(pending)
        for task in side_tasks:
            task.cancel()

    async def _claim_loop(
        self,
        name: str,
        claimer: Claimer,
        publisher: KafkaPublisher,
        marker: Marker,
        waiting: listener.Waiting | None = None,
    ) -> None:
        s = self.settings
        m = self.metrics
        backoff = s.backoff_initial_seconds
        loop = asyncio.get_running_loop()
        batches: set[asyncio.Future[float]] = set()  # this loop's batches being published
        deliveries: dict[asyncio.Future[float], Sent] = {}  # what each of them has sent
        try:
            while not self.stopping.is_set():
                self.heartbeats.beat(name)
                started = loop.time()
                try:
                    batch = await claimer.claim()
                except db.RETRIABLE_ERRORS as exc:
                    log.warning("claim_failed", error=repr(exc), retry_in=backoff)
                    await pause(self.stopping, backoff)
                    backoff = min(backoff * 2, s.backoff_max_seconds)
                    continue
                m.claim_duration.observe(loop.time() - started)
                backoff = s.backoff_initial_seconds
                if batch is None:
                    if waiting is not None:
                        # Writers notify while the wait is announced, so nothing needs polling
                        # fast: wait for the notification (poll_interval is the fallback).
                        if await waiting.announce():
                            continue  # claim once more before waiting: see Waiting.announce
                        poll = s.poll_interval_seconds
                    else:
                        # Without LISTEN nobody hears a notification: poll fast after a batch.
                        lingering = loop.time() - self._last_batch < s.linger_seconds
                        poll = s.linger_poll_seconds if lingering else s.poll_interval_seconds
                    await self.wakeup.wait(self.stopping, poll)
                    continue
                self._last_batch = loop.time()
                if waiting is not None and len(batch.records) >= s.batch_size:
                    # A full batch: a backlog, so the loops will not wait soon; writers can stop
                    # notifying. After a partial batch the announcement stays: the loop is about
                    # to wait again, and withdrawing and announcing every batch costs two writes.
                    await waiting.withdraw()
                m.claimed.inc(len(batch.records))
                if reclaimed := sum(r.reclaimed for r in batch.records):
                    m.reclaims.inc(reclaimed)
                if len(batch.records) >= s.batch_size:
                    self.wakeup.notify()  # a full batch: there is probably more for another loop
                stalled = asyncio.Event()
                sent = Sent()
                task = asyncio.ensure_future(
                    self._process(
                        batch, publisher, marker, lambda: self.heartbeats.beat(name), stalled, sent
                    )
                )
                batches.add(task)
                deliveries[task] = sent
                stall = asyncio.ensure_future(stalled.wait())
                try:
                    await asyncio.wait({task, stall}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    stall.cancel()
                if task.done():
                    batches.discard(task)
                    deliveries.pop(task, None)
                    _reap(batches, deliveries)
                    outage = task.result()
                    if outage:
                        await pause(self.stopping, outage)
                    continue
                # The batch waits for a partition that does not acknowledge; its other keys are
                # settled. Claim on (its waiting keys stay leased), up to MAX_STALLED_BATCHES.
                log.debug("batch_stalled", rows=len(batch.records), stalled_batches=len(batches))
                _reap(batches, deliveries)
                while _stalled(batches, deliveries) >= MAX_STALLED_BATCHES:
                    await asyncio.wait(
                        batches, timeout=PARKED_CHECK_SECONDS, return_when=asyncio.FIRST_COMPLETED
                    )
                    _reap(batches, deliveries)
            if batches:  # graceful shutdown: let stalled batches finish (within the grace period)
                await asyncio.wait(batches)
                _reap(batches, deliveries)
        except BaseException:
            for unfinished in batches:
                unfinished.cancel()
            if batches:
                await asyncio.wait(batches)
            raise
        finally:
            self.heartbeats.forget(name)

    async def _process(
        self,
        batch: Batch,
        publisher: KafkaPublisher,
        marker: Marker,
        heartbeat: Callable[[], None] = lambda: None,
        stalled: asyncio.Event | None = None,
        sent: Sent | None = None,
    ) -> float:
        """Publish one batch and settle it; returns how long to pause for a broker outage.

        If acks are still missing after EARLY_SETTLE_SECONDS (sooner once other partitions
        answered: see publisher.EARLY_SETTLE_FACTOR), the keys whose rows are all
        acknowledged are settled at once (their keys released), then those of later answers
        (every EARLY_SETTLE_SECONDS), and `stalled` is set when other partitions answer, so that
        the claim loop goes on while this batch waits for a partition that does not acknowledge
        (review F10): only the keys that map to it wait."""
        records = batch.records
        loop = asyncio.get_running_loop()
        self.in_flight.add(batch.token, [r.id for r in records])
        claimed_at = loop.time()
        sent = Sent() if sent is None else sent
        settled_early: set[int] = set()
        transient = False  # an early part met an outage: pause before the next claim

        async def early() -> None:
            nonlocal transient
            done = acknowledged_keys(records, sent, settled_early)
            if done:
                part = Batch(batch.token, [records[i] for i in done])
                outcomes = publisher.outcomes(Sent([sent.futures[i] for i in done]), NotAttempted())
                # Before the settle: a cancel during it lets the shielded settle finish, and the
                # cancel path must not settle these rows a second time (review N12).
                settled_early.update(done)
                results = await self._settle(
                    part, outcomes, marker, claimed_at, time.time(), early=True
                )
                transient = transient or any(
                    res.failure is errors.Failure.TRANSIENT for res in results
                )
                self.in_flight.add(
                    batch.token, [r.id for i, r in enumerate(records) if i not in settled_early]
                )
            if (
                stalled is not None
                and not stalled.is_set()
                and (done or await publisher.broker_reachable(1.0))
            ):
                stalled.set()

        try:
            try:
                outcomes = await publisher.publish(records, sent, heartbeat, early)
            except asyncio.CancelledError:
                # Shutdown past the grace period: close the producer first (bounded), so that no
                # copy of a row given back can still be delivered by it after another dispatcher
                # re-claimed the row; then mark what was acknowledged, give back the rest.
                await publisher.abandon(sent, "the dispatcher stopped")
                stopped = NotAttempted("dispatcher shut down")
                outcomes = [
                    stopped
                    if o is not None and errors.classify(o) is errors.Failure.TRANSIENT
                    else o
                    for o in publisher.outcomes(sent, stopped, total=len(records))
                ]
                rest = [i for i in range(len(records)) if i not in settled_early]
                part = Batch(batch.token, [records[i] for i in rest])
                if part.records:
                    await marker.settle_shielded(
                        part, self.retry_policy.results(part.records, [outcomes[i] for i in rest])
                    )
                raise
            rest = [i for i in range(len(records)) if i not in settled_early]
            part = Batch(batch.token, [records[i] for i in rest])
            results = (
                await self._settle(
                    part, [outcomes[i] for i in rest], marker, claimed_at, time.time()
                )
                if part.records
                else []
            )
        finally:
            self.in_flight.discard(batch.token)
        if transient or any(res.failure is errors.Failure.TRANSIENT for res in results):
            return self.retry_policy.outage_delay()
        return 0.0

    async def _settle(
        self,
        batch: Batch,
        outcomes: Sequence[BaseException | None],
        marker: Marker,
        claimed_at: float,
        acked_at: float,
        *,
        early: bool = False,
    ) -> list[Result]:
        """Settle (part of) a batch, then its metrics and logs."""
        m = self.metrics
        records = batch.records
        loop = asyncio.get_running_loop()
        m.publish_duration.observe(loop.time() - claimed_at)
        results = self.retry_policy.results(records, outcomes)
        started = loop.time()
        settled = await marker.settle_shielded(batch, results)
        m.mark_duration.observe(loop.time() - started)
        published = sum(1 for o in outcomes if o is None)
        self.published += published
        if settled:
            m.record_batch(records, results, acked_at)
        self._log_failures(records, results)
        log.debug(
            "batch_settled",
            rows=len(records),
            published=published,
            settled=settled,
            early=early,
            reclaimed=sum(r.reclaimed for r in records),
            duration_ms=round((loop.time() - claimed_at) * 1000, 1),
            first_id=records[0].id,
            last_id=records[-1].id,
        )
        return results

    @staticmethod
    def _log_failures(records: list[OutboxRecord], results: list[Result]) -> None:
        """One line per dead-lettered row (each needs an operator's eye); one line per reason
        for rows that will be retried, so that an outage does not flood the log."""
        retried: dict[str, list[OutboxRecord]] = defaultdict(list)
        for record, result in zip(records, results, strict=True):
            if result.outcome is Outcome.DEAD:
                log.error(
                    "dead_lettered",
                    id=record.id,
                    event_id=str(record.event_id),
                    topic=record.topic,
                    ordering_key=record.ordering_key,
                    attempts=record.attempts + int(result.counted),
                    reason=result.error,
                )
            elif result.error:
                retried[result.error].append(record)
        for reason, failed in retried.items():
            log.warning(
                "publish_failed_will_retry",
                rows=len(failed),
                reason=reason,
                topics=sorted({r.topic or "(routed)" for r in failed}),
                first_event_ids=[str(r.event_id) for r in failed[:3]],
            )


def acknowledged_keys(records: Sequence[OutboxRecord], sent: Sent, already: set[int]) -> list[int]:
    """Indices of rows not yet settled whose key has every row of the batch acknowledged
    (keyless rows: the row itself). A key with any row pending, failed or not yet sent waits
    for the whole batch: its rows are settled together, in one statement. Once nothing more is
    sent for the claim (sent.final), a key whose rows all have their answer, failures included,
    is settled too: only rows still in flight wait."""

    def answered(i: int) -> bool:
        item = sent.futures[i] if i < len(sent.futures) else None
        if isinstance(item, asyncio.Future):
            return item.done() and (sent.final or (not item.cancelled() and not item.exception()))
        return sent.final and item is not None

    key_done: dict[str, bool] = {}
    for i, record in enumerate(records):
        key = record.ordering_key
        if key is not None:
            key_done[key] = key_done.get(key, True) and answered(i)
    return [
        i
        for i, record in enumerate(records)
        if i not in already
        and answered(i)
        and (record.ordering_key is None or key_done[record.ordering_key])
    ]
