"""Assembles the dispatcher and supervises its loops.

Every loop runs in one TaskGroup: a loop that dies stops the process (non-zero exit), never a
half-alive zombie. Shutdown has two phases: stop claiming and let in-flight batches finish within
the grace period; then cancel, giving unacknowledged rows back and marking acknowledged ones.
This is where the settings are read: each component takes a config of its own (configs_of).
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, NoReturn

import structlog

from outbox_dispatcher import errors, metrics, registry
from outbox_dispatcher.config.settings import DeadLetterPolicy, DeliveryMode, Settings
from outbox_dispatcher.dispatch import leases, upkeep
from outbox_dispatcher.dispatch.batch import SettleConfig, Settling
from outbox_dispatcher.dispatch.claim_loop import ClaimLoop, ClaimLoopConfig, Shared
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.every import every, spread
from outbox_dispatcher.dispatch.progress_store import transactional_publisher
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.dispatch.wakeup import Waiting, Wakeup
from outbox_dispatcher.health import HealthServer, Heartbeats, Readiness, ReadinessCache
from outbox_dispatcher.kafka.delivery import DeliveryConfig
from outbox_dispatcher.kafka.exactly_once import orphans
from outbox_dispatcher.kafka.exactly_once.progress import ProgressConfig
from outbox_dispatcher.kafka.exactly_once.publisher import TransactionalPublisher
from outbox_dispatcher.kafka.producers import ProducerConfig
from outbox_dispatcher.kafka.publisher import KafkaPublisher, PublisherConfig
from outbox_dispatcher.kafka.records import RecordConfig
from outbox_dispatcher.kafka.tls import ConnectionConfig
from outbox_dispatcher.kafka.topics import TopicConfig
from outbox_dispatcher.models import picked
from outbox_dispatcher.retries import RetryPolicy
from outbox_dispatcher.store import DispatchStore, Statements, db, listen, migrations

log = structlog.get_logger(__name__)

# exactly-once: a takeover fences as it can the dispatchers with a heartbeat this recent; those
# whose claims it stands in for, whatever their heartbeat's age (registry.py).
FENCE_WINDOW_SECONDS = registry.FENCE_WINDOW_SECONDS
Publisher = KafkaPublisher | TransactionalPublisher

READINESS_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError,
    db.PostgresError,
    *db.RETRIABLE_ERRORS,
)


def instance_id() -> str:
    """Who holds a lease, for operators: host, pid and a random suffix (pids repeat)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Dispatcher:
    def __init__(self, settings: Settings, *, owner: str | None = None) -> None:
        self.settings = settings
        self.configs = configs_of(settings)
        self.owner = owner or instance_id()
        self.statements = Statements.for_table(settings.db_schema, settings.table)
        self.stopping = asyncio.Event()
        self.in_flight = leases.InFlight()
        self.retry_policy = RetryPolicy(settings)
        self._settling: Settling | None = None  # made with the pool (see _supervise)
        # Exactly-once: which crash-loop rows a lost claim committed (leases.settle_crash_loops).
        self._committed_of: leases.CommittedOf | None = None
        # Exactly-once: the sweep of the progress keys dead dispatchers left.
        self._orphans: orphans.Orphans | None = None
        self.wakeup = Wakeup()
        self.metrics = metrics.Metrics()
        self.metrics.delivery.labels(settings.delivery.value).set(1)
        self.metrics.in_flight.set_function(lambda: len(self.in_flight))
        # A claim loop beats at least once per poll interval (also while it waits out a broker
        # outage), the lease keeper once per lease/3.
        self.heartbeats = Heartbeats(
            settings.liveness_timeout_seconds
            + max(settings.poll_interval_seconds, settings.lease_seconds / 3)
        )
        self._http: HealthServer | None = None
        self._shared = Shared(self.stopping, self.wakeup, self.heartbeats)

    @property
    def published(self) -> int:
        """Rows published since the dispatcher started."""
        return 0 if self._settling is None else self._settling.published

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
                if s.delivery is DeliveryMode.EXACTLY_ONCE:
                    version = await migrations.check_version(
                        conn,
                        s.db_schema,
                        s.table,
                        oldest=migrations.PROGRESS_ID_VERSION,
                        who_needs="exactly-once delivery (OUTBOX_DELIVERY) needs",
                    )
                else:
                    version = await migrations.check_version(conn, s.db_schema, s.table)
                await db.require_read_committed(conn)
                if s.delivery is DeliveryMode.EXACTLY_ONCE:
                    await db.require_durable_commits(conn)
            # The one store every component is handed; the steady path from version 16 on.
            store = DispatchStore(
                pool,
                self.statements,
                steady=version >= migrations.STEADY_VERSION,
                replays=version >= migrations.STEADY_VERSION,  # the claim returns it from 16
            )
            if (cache := await store.id_cache()) > 1:
                # Runs anyway (nothing is lost: the sweep finds such rows), but out of order.
                log.warning(
                    "identity_cache_above_one",
                    cache=cache,
                    detail="rows with cached ids are found only by the sweep, after their key's "
                    "later rows: ALTER TABLE ... ALTER COLUMN id SET CACHE 1 (docs/writers.md)",
                )
            publisher = await self._publisher(store)
            await publisher.start()
            try:
                await self._supervise(store, publisher)
            finally:
                await publisher.stop()
        finally:
            await pool.close()
        log.info("stopped", published=self.published)

    async def _publisher(self, store: DispatchStore) -> Publisher:
        """The delivery mode's publisher; exactly-once's fences, before a takeover publishes,
        the owners it stands in for (strictly) and the table's other dispatchers with a
        heartbeat within FENCE_WINDOW_SECONDS (as it can)."""
        s = self.settings
        if s.delivery is DeliveryMode.AT_LEAST_ONCE:
            return KafkaPublisher(self.configs.publisher)
        made = await transactional_publisher(
            store,
            registry.Heartbeat(store, s, self.owner),
            self.configs.publisher,
            self.configs.progress,
            owner=self.owner,
            lane_count=s.claim_tasks,
            counted=self.metrics,
        )
        self.metrics.partitions_held.set_function(lambda: len(made.holds.held))
        return made

    async def _supervise(self, store: DispatchStore, publisher: Publisher) -> None:
        s = self.settings
        configs = self.configs
        claimer = Claimer(store, s, self.owner)
        settler = Settler(
            store,
            retry_for=configs.settle.retry_for_seconds,
            delete_on_publish=configs.settle.delete_on_publish,
            owner=self.owner,
            block_on_dead=configs.settle.block_on_dead,
        )
        settling = self._settling = Settling(settler, self.retry_policy, self.metrics)
        if isinstance(publisher, TransactionalPublisher):
            self._committed_of = publisher.committed_of
            self._orphans = publisher.orphans
        readiness = ReadinessCache(lambda: self._readiness(store, publisher))
        # Without LISTEN nobody hears a notification: writers are never asked to send one.
        waiting = (
            Waiting(store, self.owner, ttl=2 * s.poll_interval_seconds + 5) if s.listen else None
        )
        log.info(
            "started",
            owner=self.owner,
            table=f"{s.db_schema}.{s.table}",
            claim_tasks=s.claim_tasks,
            batch_size=s.batch_size,
            bootstrap_servers=s.kafka_bootstrap_servers,
            delivery=s.delivery.value,
        )
        async with asyncio.TaskGroup() as tg:
            claim_tasks = []
            for i in range(s.claim_tasks):
                loop = ClaimLoop(
                    f"claim-{i}",
                    configs.claim_loop,
                    claimer=claimer,
                    publisher=publisher,
                    settling=settling,
                    in_flight=self.in_flight,
                    metrics=self.metrics,
                    shared=self._shared,
                    waiting=waiting,
                )
                guarded = self._guard(loop.run(), loop.name)
                claim_tasks.append(tg.create_task(guarded, name=loop.name))
            side = self._side_loops(store, readiness)
            side_tasks = [
                tg.create_task(self._guard(coro, name), name=name) for name, coro in side.items()
            ]
            tg.create_task(self._shutdown(claim_tasks, side_tasks), name="shutdown")

    def _side_loops(
        self, store: DispatchStore, readiness: ReadinessCache
    ) -> dict[str, Coroutine[Any, Any, None]]:
        """The loops beside the claim loops, by name: leases, reclaims, gauges, readiness, the
        dispatcher's heartbeat, and as configured LISTEN, HTTP and retention. The periodic ones
        each at a phase of their own (tick_phases): never two of them at once."""
        s = self.settings
        phase = tick_phases(s)
        side: dict[str, Coroutine[Any, Any, None]] = {
            "lease-keeper": leases.keep_leases(
                store, s, self.in_flight, self.heartbeats, phase=phase["lease-keeper"]
            ),
            "reclaimer": leases.reclaim(
                store, s, self.metrics, self._committed_of, phase=phase["reclaimer"]
            ),
            "metrics": self._sample_gauges(store, phase["metrics"]),
            "readiness": self._refresh_readiness(readiness, phase["readiness"]),
            "heartbeat": self._beat(store, phase["heartbeat"]),
        }
        if self._orphans is not None:
            side["progress-sweep"] = orphans.sweep_every(self._orphans, s.progress_sweep_seconds)
        if s.listen:
            side["listener"] = listen.listen(s, self.wakeup.notify)
        if s.http_enabled:
            self._http = HealthServer(
                s.http_host,
                s.http_port,
                live=self.live,
                ready=readiness,
                metrics=self.metrics.exposition,
            )
            side["http"] = self._http.serve()
        if upkeep.wants_retention(s):
            side["retention"] = upkeep.retention(store, s, phase=phase["retention"])
        return side

    async def _sample_gauges(self, store: DispatchStore, phase: float) -> NoReturn:
        """The table gauges, every metrics interval (a role without a newer grant: they go
        stale and OutboxTableMetricsStale fires; publishing goes on)."""
        block = self.settings.dead_letter_policy is DeadLetterPolicy.BLOCK
        await every(
            self.settings.metrics_interval_seconds,
            functools.partial(metrics.sample, store, self.metrics, block_on_dead=block),
            log=metrics.log,
            failed="metrics_sample_failed",
            tolerated=metrics.SAMPLE_ERRORS,
            wait_first=False,
            phase=phase,
        )

    async def _beat(self, store: DispatchStore, phase: float) -> NoReturn:
        heartbeat = registry.Heartbeat(store, self.settings, self.owner, self.metrics.totals)
        await upkeep.heartbeat(heartbeat, phase=phase)

    async def _readiness(self, store: DispatchStore, publisher: Publisher) -> Readiness:
        checks: dict[str, str] = {}
        if self.stopping.is_set():
            checks["dispatcher"] = "shutting down"
        try:
            async with asyncio.timeout(3):
                version = await store.schema_version()
        except READINESS_ERRORS as exc:
            checks["database"] = f"unreachable: {errors.describe(exc)}"
        else:
            checks["database"] = "ok"
            # A range, not one version: a rolling upgrade's expand step keeps older dispatchers
            # ready beside it (review N8).
            checks["schema"] = (
                "ok"
                if migrations.supported(version)
                else f"version {version}, this dispatcher needs version "
                f"{migrations.OLDEST_SUPPORTED} to {migrations.latest_version()}"
            )
        reachable = await publisher.reachable(3.0)
        checks["broker"] = "ok" if reachable else "unreachable"
        ready = all(value == "ok" for value in checks.values())
        self.metrics.ready.set(int(ready))
        return Readiness(ready, checks)

    async def _refresh_readiness(self, readiness: ReadinessCache, phase: float) -> NoReturn:
        """Keep outbox_ready current even when nothing probes /readyz; log changes. (A check
        that fails is a not-ready answer, not an error: nothing is tolerated.)"""
        was: bool | None = None

        async def refresh() -> None:
            nonlocal was
            state = await readiness.get()
            if state.ready != was:
                if state.ready:
                    log.info("ready", checks=state.checks)
                else:
                    log.warning("not_ready", checks=state.checks)
                was = state.ready

        await every(
            readiness_seconds(self.settings),
            refresh,
            log=log,
            failed="readiness_failed",
            tolerated=(),
            wait_first=False,
            phase=phase,
        )

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


def readiness_seconds(settings: Settings) -> float:
    """How often outbox_ready is refreshed when nothing probes /readyz."""
    return min(settings.metrics_interval_seconds, 5.0)


def tick_phases(settings: Settings) -> dict[str, float]:
    """The phases of the dispatcher's periodic loops (every.spread): with the defaults (10 s
    for the heartbeat, the lease keeper and the reclaimer, 5 s readiness, 15 s gauges, 60 s
    retention) their steps fall 5/6 s apart modulo 5 s, where at one shared tick every 10 s
    they queued behind each other and the claims (issue 35). Those that run at once come
    first: the heartbeat at the start, then readiness and the gauges."""
    intervals = {
        "heartbeat": registry.HEARTBEAT_SECONDS,
        "readiness": readiness_seconds(settings),
        "metrics": settings.metrics_interval_seconds,
        "lease-keeper": settings.lease_seconds / 3,
        "reclaimer": settings.reclaim_interval_seconds,
        "retention": settings.cleanup_interval_seconds,
    }
    if not upkeep.wants_retention(settings):
        del intervals["retention"]
    return spread(intervals)


@dataclass(frozen=True)
class Configs:
    """Each moved component's own config, built from the settings here and nowhere else."""

    publisher: PublisherConfig
    claim_loop: ClaimLoopConfig
    settle: SettleConfig
    progress: ProgressConfig  # exactly-once's


def configs_of(settings: Settings) -> Configs:
    s = settings
    return Configs(
        publisher=_publisher_config(s),
        claim_loop=picked(ClaimLoopConfig, s),
        # A settle retries as long as a lease lasts: past it, the rows may be another's.
        settle=picked(
            SettleConfig,
            s,
            retry_for_seconds=s.lease_seconds,
            block_on_dead=s.dead_letter_policy is DeadLetterPolicy.BLOCK,
        ),
        progress=ProgressConfig(
            topic=s.progress_topic,
            outbox=f"{s.db_schema}.{s.table}",
            transactional_id_prefix=s.transactional_id_prefix,
            timeout_seconds=s.transaction_timeout_seconds,
        ),
    )


def _publisher_config(s: Settings) -> PublisherConfig:
    """The Kafka side's configs: the connection's and the producer's settings are the kafka_*
    ones of the same names."""
    connection = picked(
        ConnectionConfig, s, prefix="kafka_", request_timeout_seconds=s.publish_timeout_seconds
    )
    return PublisherConfig(
        producer=picked(
            ProducerConfig,
            s,
            prefix="kafka_",
            connection=connection,
            transaction_timeout_seconds=s.transaction_timeout_seconds,
        ),
        records=picked(RecordConfig, s, max_request_bytes=s.kafka_max_request_bytes),
        topics=picked(TopicConfig, s, allow_auto_create_topics=s.kafka_allow_auto_create_topics),
        delivery=picked(DeliveryConfig, s, max_batch_bytes=s.kafka_max_batch_bytes),
        tracing=s.tracing,
    )
