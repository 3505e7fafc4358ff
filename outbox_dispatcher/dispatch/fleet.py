"""Assembles and supervises a process that serves many outboxes (OUTBOX_SOURCES, issue 36):
the source registry (which outboxes exist now), one pool and one LISTEN connection per database
(dispatch/databases.py), one Kafka publisher (at-least-once; with exactly-once each outbox has
its own, its lanes opened while it is active: dispatch/fleet_delivery.py), the claim slots
shared by every outbox (dispatch/slots.py), and each outbox's upkeep (dispatch/outboxes.py).

As the single-table supervisor: every loop runs in one TaskGroup, a loop that dies stops the
process; shutdown stops claiming, lets the claims and the batches on their way finish within the
grace, then cancels. Outboxes come and go while it runs, as the registry reports them: a new one
is served at once, one let go has its loops cancelled (a claim or batch of it in flight ends as
it would)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Coroutine, Sequence
from typing import Any, NoReturn

import structlog

from outbox_dispatcher import errors, metrics, source_metrics
from outbox_dispatcher.config.outboxes import Outbox, Source
from outbox_dispatcher.config.settings import DeliveryMode, Settings
from outbox_dispatcher.dispatch import fleet_health
from outbox_dispatcher.dispatch.beats import BatchedHeartbeat
from outbox_dispatcher.dispatch.databases import Databases
from outbox_dispatcher.dispatch.every import every
from outbox_dispatcher.dispatch.fleet_delivery import (
    ExactlyOnce,
    OutboxLanes,
    ensure_progress_topic,
)
from outbox_dispatcher.dispatch.outboxes import Key, OutboxRuntime, Shared, channel_of, key_of
from outbox_dispatcher.dispatch.probe import IdleProbe
from outbox_dispatcher.dispatch.slots import ClaimSlots
from outbox_dispatcher.dispatch.supervisor import configs_of, instance_id
from outbox_dispatcher.health import HealthServer, Heartbeats, ReadinessCache
from outbox_dispatcher.kafka.publisher import KafkaPublisher
from outbox_dispatcher.retries import RetryPolicy
from outbox_dispatcher.sources.fleet import FleetMember, FleetView, outbox_key
from outbox_dispatcher.sources.registry import SourceRegistry, State, View
from outbox_dispatcher.store import DispatchStore, Statements, db, listen, migrations
from outbox_dispatcher.store.probe import Session

log = structlog.get_logger(__name__)

# With LISTEN the idle outboxes are probed this often (notifications wake them sooner); without,
# every poll interval (dispatch/probe.py).
IDLE_POLL_SECONDS = 2.0
Loop = Coroutine[Any, Any, None]
# A database away or refusing us (e.g. not accepting connections) when its pool is made.
POOL_FAILURES: tuple[type[BaseException], ...] = (*db.RETRIABLE_ERRORS, db.PostgresError)


class FleetDispatcher:
    """What `run` starts with OUTBOX_SOURCES: the same face as the single-table Dispatcher."""

    def __init__(
        self, settings: Settings, sources: Sequence[Source], *, owner: str | None = None
    ) -> None:
        s = self.settings = settings
        self.sources = tuple(sources)
        self.owner = owner or instance_id()
        self.stopping = asyncio.Event()
        self.metrics = metrics.Metrics(max_sources=s.metrics_max_sources)
        self.metrics.delivery.labels(s.delivery.value).set(1)
        self.heartbeats = Heartbeats(s.liveness_timeout_seconds + s.poll_interval_seconds)
        self.slots = ClaimSlots(
            s.fleet_in_flight_batches,
            s.batch_size,
            self.stopping,
            self.heartbeats,
            claims=s.claim_tasks,
        )
        self.metrics.in_flight.set_function(
            lambda: sum(len(o.in_flight) for o in self.slots.outboxes.values())
        )
        self.idle_poll = max(s.poll_interval_seconds, IDLE_POLL_SECONDS if s.listen else 0.0)
        self._published_let_go = 0
        self._loops: dict[Key, list[asyncio.Task[None]]] = {}
        self._listeners: dict[str, asyncio.Task[None]] = {}
        self._side: list[asyncio.Task[None]] = []
        self._tg: asyncio.TaskGroup | None = None
        self._http: HealthServer | None = None
        self.member: FleetMember | None = None  # made by run
        self.probes: dict[str, IdleProbe] = {}  # the idle probe of each database
        self.beats: dict[str, BatchedHeartbeat] = {}  # and its batched heartbeat
        # Exactly-once: outboxes refused (label, reason) while their schema is older than it
        # needs, and each database's refusal (None: its commits are durable), checked once.
        self.refused: dict[Key, tuple[str, str]] = {}
        self._durable: dict[str, str | None] = {}
        self._lanes: list[OutboxLanes] = []  # every outbox's, closed at the end
        self.first_pass = fleet_health.FirstPass(self.slots)  # /readyz waits for it

    @property
    def published(self) -> int:
        """Rows published since the process started, over every outbox."""
        served = sum(o.published for o in self.slots.outboxes.values())
        return self._published_let_go + served

    @property
    def http_port(self) -> int | None:
        return None if self._http is None else self._http.port

    def live(self) -> dict[str, object]:
        stale = self.heartbeats.stale()
        return {"live": not stale, "stale_loops": stale}

    def stop(self) -> None:
        if not self.stopping.is_set():
            log.info("shutdown_requested", outboxes=len(self.slots.outboxes))
            self.stopping.set()

    async def run(self) -> None:
        s = self.settings
        if s.listen_database_url is not None:
            log.warning(
                "listen_database_url_ignored",
                detail="with OUTBOX_SOURCES each database is listened to through its source's "
                "URL: a source behind a transaction pooler needs OUTBOX_LISTEN=false",
            )
        databases = Databases(s, self.sources)
        registry = SourceRegistry.from_settings(self.sources, s)
        self.member = FleetMember(
            s.database_url.get_secret_value(),
            functools.partial(db.connect, settings=s, setting="OUTBOX_DATABASE_URL"),
            lease_seconds=s.lease_seconds,
            member_id=self.owner,
            backoff_initial=s.backoff_initial_seconds,
        )
        publisher = KafkaPublisher(configs_of(s).publisher)
        await publisher.start()
        shared = Shared(
            s,
            self.owner,
            publisher,
            self.metrics,
            RetryPolicy(s),
            self.idle_poll,
            self._exactly_once(),
        )
        try:
            await registry.refresh()  # the outboxes there are now, served at once
            await self.member.beat()  # and the members: this one serves only its share
            if shared.exactly_once is not None:
                stores = await self._progress_stores(registry.view(), databases)
                await ensure_progress_topic(shared.exactly_once, stores)
            await self._supervise(registry, databases, shared)
        finally:
            for lanes in self._lanes:  # (their keys ended: a graceful stop's farewell)
                await lanes.stop()
            await publisher.stop()
            await registry.close()
            for probe in self.probes.values():
                await probe.session.close()
            await databases.close()
        log.info("stopped", published=self.published)

    def _exactly_once(self) -> ExactlyOnce | None:
        """Exactly-once: what each outbox's publisher is made with (None: at-least-once)."""
        s = self.settings
        if s.delivery is not DeliveryMode.EXACTLY_ONCE:
            return None
        self.metrics.partitions_held.set_function(lambda: sum(lanes.held for lanes in self._lanes))
        configs = configs_of(s)
        return ExactlyOnce(
            configs.publisher,
            configs.progress,
            self.metrics,
            self.owner,
            lane_count=s.claim_tasks,
            idle_seconds=s.lanes_idle_seconds,
            lease_seconds=s.lease_seconds,
        )

    async def _progress_stores(self, view: View, databases: Databases) -> list[DispatchStore]:
        """Exactly-once: the stores of the outboxes ready now at a version it serves (whose
        leases the progress topic's check at start asks about)."""
        stores = []
        for state in view.outboxes:
            o = state.outbox
            refused = migrations.exactly_once_refusal(state.version or 0)
            if state.state is not State.READY or refused:
                continue
            try:
                pool = await databases.pool(o.database)
            except POOL_FAILURES:  # served once it is back; its open checks the topic then
                continue
            statements = Statements.for_table(o.schema, o.table)
            stores.append(DispatchStore(pool, statements, steady=True, replays=True))
        return stores

    async def _supervise(
        self, registry: SourceRegistry, databases: Databases, shared: Shared
    ) -> None:
        s = self.settings
        log.info(
            "started",
            owner=self.owner,
            sources=len(self.sources),
            databases=len(databases.channels),
            claim_tasks=s.claim_tasks,
            in_flight_batches=s.fleet_in_flight_batches,
            batch_size=s.batch_size,
            pool_size_per_database=databases.pool_size,
            delivery=s.delivery.value,
        )
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            claims = [
                tg.create_task(
                    self._guard(self.slots.serve(f"claim-{i}", s.poll_interval_seconds), "claim"),
                    name=f"claim-{i}",
                )
                for i in range(s.claim_tasks)
            ]
            for name, loop in self._side_loops(registry, databases, shared).items():
                self._side.append(tg.create_task(self._guard(loop, name), name=name))
            if self.member is not None:  # leaves the fleet by itself once stopping
                member = self._guard(self.member.run(self.stopping), "fleet-member")
                tg.create_task(member, name="fleet-member")
            tg.create_task(self._shutdown(claims), name="shutdown")

    def _side_loops(
        self, registry: SourceRegistry, databases: Databases, shared: Shared
    ) -> dict[str, Loop]:
        s = self.settings
        readiness = ReadinessCache(lambda: fleet_health.readiness(self, registry, shared))
        side: dict[str, Loop] = {
            "registry": registry.run(self.stopping),
            "outboxes": self._follow(registry, databases, shared),
            "readiness": self._refresh_readiness(readiness),
        }
        assert self._tg is not None  # noqa: S101 (made from inside the task group only)
        # Ends by itself once done (cancelled with the side loops at shutdown if not); /readyz
        # then checks again at once rather than answer its cached "not ready" for a second.
        first_pass = self.first_pass.run(then=readiness.forget)
        self._side.append(self._tg.create_task(first_pass, name="first-pass"))
        for database in databases.channels:
            session = Session(databases.url(database), s)  # both run on its connection
            self.probes[database] = IdleProbe(
                database, session, self.slots, s, self.idle_poll, owner=self.owner
            )
            side[f"idle-probe:{database}"] = self.probes[database].run()
            self.beats[database] = BatchedHeartbeat(database, session, self.slots, s, self.owner)
            side[f"heartbeats:{database}"] = self.beats[database].run()
        if s.http_enabled:
            self._http = HealthServer(
                s.http_host,
                s.http_port,
                live=self.live,
                ready=readiness,
                metrics=self.metrics.exposition,
            )
            side["http"] = self._http.serve()
        return side

    async def _follow(
        self, registry: SourceRegistry, databases: Databases, shared: Shared
    ) -> NoReturn:
        """Serve what the registry reports ready, let go what it no longer does."""
        while True:
            await self._sync(registry.view(), databases, shared)
            self.first_pass.synced.set()
            await asyncio.sleep(min(registry.interval, 1.0))

    async def _sync(self, view: View, databases: Databases, shared: Shared) -> None:
        ready = {key_of(o.outbox): o for o in view.outboxes if o.state is State.READY}
        if self.member is not None:  # this member's share (all of them before its first beat)
            fleet = self.member.view()
            self.member.hot = self._hot(fleet)
            mine = {key_of(o) for o in fleet.mine(o.outbox for o in ready.values())}
            ready = {key: state for key, state in ready.items() if key in mine}
        for key in [k for k in self.slots.outboxes if k not in ready]:
            self._let_go(key)
        for key in [k for k in self.refused if k not in ready]:
            del self.refused[key]
        probed: set[str] = set()  # the databases whose probes look at new outboxes at once
        for key, state in ready.items():
            if key not in self.slots.outboxes:
                if await self._serve(state.outbox, state.version or 0, databases, shared):
                    probed.add(state.outbox.database)
                if self.member is not None and not self.member.view().owns(state.outbox):
                    log.info("outbox_hot_served_too", source=state.outbox.label)
        for database in probed:
            self.probes[database].look_soon()
        self._route_notifications(databases)

    def _hot(self, fleet: FleetView) -> tuple[str, ...]:
        """The outboxes this member owns whose claims have seen a backlog for
        OUTBOX_FLEET_HOT_SECONDS: listed at its next beat, so that the second member in their
        hash order serves them too (sources/fleet.py)."""
        since = time.monotonic() - self.settings.fleet_hot_seconds
        return tuple(
            sorted(
                outbox_key(o.outbox)
                for o in self.slots.outboxes.values()
                if o.backlog_since is not None and o.backlog_since <= since and fleet.owns(o.outbox)
            )
        )

    async def _serve(
        self, outbox: Outbox, version: int, databases: Databases, shared: Shared
    ) -> bool:
        """Serve it; True: its database's probe is to look at it (its first look)."""
        try:
            pool = await databases.pool(outbox.database)
        except POOL_FAILURES as exc:  # the registry's next read says why; tried again
            log.debug("database_pool_unavailable", database=outbox.database, error=repr(exc))
            return False
        if shared.exactly_once is not None and await self._refused(outbox, version, pool):
            return False
        runtime = OutboxRuntime(outbox, pool, version, shared)
        if runtime.lanes is not None:
            self._lanes.append(runtime.lanes)
        probed = runtime.steady and outbox.database in self.probes
        self.slots.add(runtime, probed=probed)
        assert self._tg is not None  # noqa: S101 (served from inside the task group only)
        self._loops[runtime.key] = [
            self._tg.create_task(loop, name=f"{name}:{runtime.label}")
            for name, loop in runtime.loops().items()
        ]
        log.info("outbox_served", source=runtime.label, database=outbox.database, version=version)
        return probed

    async def _refused(self, outbox: Outbox, version: int, pool: db.Pool) -> bool:
        """Exactly-once: an outbox whose schema is older than PROGRESS_ID_VERSION, or whose
        database's sessions run with synchronous_commit off, is refused alone (one line per
        change; named in /readyz), never the process; served once migrated."""
        reason = migrations.exactly_once_refusal(version)
        if reason is None and outbox.database not in self._durable:
            try:
                async with pool.acquire() as conn:
                    await db.require_durable_commits(conn)
            except errors.ConfigurationError as exc:
                self._durable[outbox.database] = f"{exc} (then restart the dispatcher)"
            except POOL_FAILURES:  # the registry's next read says why; tried again
                return True
            else:
                self._durable[outbox.database] = None
        if reason is None:
            reason = self._durable.get(outbox.database)
        key = key_of(outbox)
        if reason is None:
            self.refused.pop(key, None)
            return False
        if self.refused.get(key) != (outbox.label, reason):
            log.warning("outbox_refused", source=outbox.label, reason=reason)
        self.refused[key] = (outbox.label, reason)
        return True

    def _let_go(self, key: Key) -> None:
        runtime = self.slots.outboxes[key]
        self._published_let_go += runtime.published
        self.slots.forget(key)
        for task in self._loops.pop(key, []):
            task.cancel()
        if runtime.lanes is not None and self._tg is not None:  # closed once its rows settle
            self._lanes.remove(runtime.lanes)
            stopping = runtime.lanes.stop(settle_within=self.settings.lease_seconds)
            self._tg.create_task(stopping, name=f"lanes-stop:{runtime.label}")
        source_metrics.forget(self.metrics, runtime.label)
        log.info("outbox_stopped", source=runtime.label, published=runtime.published)

    def _route_notifications(self, databases: Databases) -> None:
        """Each database's LISTEN channels: its served outboxes'. Its LISTEN connection lives
        while it has one (a database whose outboxes were all let go, e.g. unreachable, holds
        none and retries nothing)."""
        if not self.settings.listen:
            return
        for database, channels in databases.channels.items():
            routes = {
                channel_of(o.outbox): functools.partial(self.slots.wake, key)
                for key, o in self.slots.outboxes.items()
                if o.outbox.database == database
            }
            channels.set(routes)
            channels.missed = functools.partial(self.probes[database].look_soon, everything=True)
            listener = self._listeners.get(database)
            if routes and listener is None:
                assert self._tg is not None  # noqa: S101
                loop = listen.listen_channels(databases.url(database), self.settings, channels)
                self._listeners[database] = self._tg.create_task(loop, name="listener")
            elif not routes and listener is not None:
                listener.cancel()
                del self._listeners[database]

    async def _refresh_readiness(self, readiness: ReadinessCache) -> NoReturn:
        was: bool | None = None

        async def refresh() -> None:
            nonlocal was
            state = await readiness.get()
            if state.ready != was:
                (log.info if state.ready else log.warning)(
                    "ready" if state.ready else "not_ready", checks=state.checks
                )
                was = state.ready

        await every(
            min(self.settings.metrics_interval_seconds, 5.0),
            refresh,
            log=log,
            failed="readiness_failed",
            tolerated=(),
            wait_first=False,
        )

    async def _guard(self, loop: Loop, name: str) -> None:
        await loop
        if not self.stopping.is_set():
            raise errors.LoopDiedError(f"the {name} loop returned unexpectedly")

    async def _shutdown(self, claims: list[asyncio.Task[None]]) -> None:
        """Once stopping: the slots end their claims and grant no more; the batches on their way
        (dispatch/slots.py) are settled within what is left of the grace; then whatever is left
        is cancelled (a cancelled batch marks what the broker acknowledged and gives back the
        rest) and the outboxes' loops stop."""
        await self.stopping.wait()
        loop = asyncio.get_running_loop()
        until = loop.time() + self.settings.shutdown_grace_seconds
        _, pending = await asyncio.wait(claims, timeout=self.settings.shutdown_grace_seconds)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        cancelled = len(pending) + await self.slots.finish(until - loop.time())
        if cancelled:
            log.warning("shutdown_grace_expired", cancelling=cancelled)
        loops = (t for tasks in self._loops.values() for t in tasks)
        for task in [*self._side, *self._listeners.values(), *loops]:
            task.cancel()
