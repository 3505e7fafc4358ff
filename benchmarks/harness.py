"""The benchmark harness: `make bench` (or `python -m benchmarks`).

Runs against the local stack (`make services`): each measurement gets a fresh database cloned from a
migrated template and its own topic; the dispatcher under test is a real `outbox-dispatcher run`
process, so its CPU is its own. Every figure is the median of `--runs` runs, and every headline is
also given as a ratio to a baseline measured in the same run, because these machines are shared
and noisy. Results: a table on stdout and a JSON file (benchmarks/results/latest.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from benchmarks import baselines, handwritten
from benchmarks.goals import STUCK_KINDS, goals, goals_table
from outbox_dispatcher import migrations
from outbox_dispatcher.settings import Settings
from outbox_dispatcher.sql import Queries
from tests.faultproxy import CHUNK, FaultProxy, _Link

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAYLOAD = 512
KEYS = 1000
TICKS = os.sysconf("SC_CLK_TCK")
STUCK_KEY = "stuck-key"  # the prefill's keys are key-<n>: no collision
BROKER_DELAY = 0.02  # latency the proxy adds each way (40 ms a round trip): scaling_processes_*
QUERIES = Queries.for_table("public", "outbox")
WAIT_LIMIT = 900.0  # seconds a drain may take before the scenario fails
REPLAY_BATCH = 250  # rows per hold batch of the stuck key's replay (as version 0.1 held)


@dataclass
class Sizes:
    drain: int
    hot_key: int
    handwritten: int
    kafka_only: int
    sustained_seconds: float
    idle_seconds: float
    writer_seconds: float
    runs: int
    scaling_latency: int  # the drain of scaling_processes_latency_*
    stuck_rows: int  # pending rows of the stuck key
    stuck_drain: int  # the other keys' drain behind it


FULL = Sizes(200_000, 50_000, 10_000, 200_000, 10.0, 30.0, 5.0, 3, 50_000, 100_000, 20_000)
QUICK = Sizes(3_000, 1_000, 300, 3_000, 1.5, 2.0, 1.0, 1, 1_000, 2_000, 1_000)


@dataclass
class Stack:
    admin_url: str
    bootstrap: str
    proxied_port: int  # the broker listener that advertises proxy_port
    proxy_port: int
    template: str = ""

    def url(self, database: str) -> str:
        base, _, _ = self.admin_url.rpartition("/")
        return f"{base}/{database}"

    @classmethod
    def from_env(cls) -> Stack:
        """The stack of `deploy/local/services.sh` on the ports its variables choose (those of
        `services.sh env` and the tests' variables too, so a second clone's stack is found)."""
        env = os.environ
        pg_port = env.get("OUTBOX_SERVICES_PG_PORT", "5432")
        bootstrap = (
            env.get("OUTBOX_BENCH_KAFKA_BOOTSTRAP_SERVERS")
            or env.get("OUTBOX_TEST_KAFKA_BOOTSTRAP_SERVERS")
            or f"127.0.0.1:{env.get('OUTBOX_SERVICES_KAFKA_PORT', '9092')}"
        )
        # The proxied listener's ports, derived from the broker's as services.sh does.
        kafka_port = int(bootstrap.split(",")[0].rpartition(":")[2])
        proxied = env.get("OUTBOX_TEST_KAFKA_PROXIED_PORT") or env.get(
            "OUTBOX_SERVICES_KAFKA_PROXIED_PORT", str(kafka_port + 10002)
        )
        proxy = env.get("OUTBOX_TEST_KAFKA_PROXY_PORT") or env.get(
            "OUTBOX_SERVICES_KAFKA_PROXY_PORT", str(kafka_port + 10003)
        )
        return cls(
            admin_url=env.get("OUTBOX_BENCH_DATABASE_URL")
            or env.get("OUTBOX_TEST_DATABASE_URL")
            or f"postgresql://outbox:outbox@127.0.0.1:{pg_port}/outbox",
            bootstrap=bootstrap,
            proxied_port=int(proxied),
            proxy_port=int(proxy),
        )


# -- set-up --


async def make_template(stack: Stack) -> None:
    stack.template = f"bench_template_{os.getpid()}"
    admin = await asyncpg.connect(stack.admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{stack.template}"')
        await admin.execute(f'CREATE DATABASE "{stack.template}"')
    finally:
        await admin.close()
    conn = await asyncpg.connect(stack.url(stack.template))
    try:
        await migrations.migrate(conn, "public", "outbox")
        # CHECKPOINT before each WAL measurement (so that the writer's insert and the drain both
        # pay their full-page images alike) needs pg_checkpoint; the local stack's role may
        # grant it to itself (CREATEROLE).
        if not await conn.fetchval("SELECT pg_has_role(current_user, 'pg_checkpoint', 'MEMBER')"):
            await conn.execute("GRANT pg_checkpoint TO CURRENT_USER")
            print("granted pg_checkpoint to the benchmark's role (CHECKPOINT)", flush=True)
    finally:
        await conn.close()


async def drop_database(admin: asyncpg.Connection, name: str) -> None:
    """Drop, waiting out an autovacuum worker that FORCE may not terminate for this role."""
    for _ in range(30):
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        except asyncpg.InsufficientPrivilegeError:
            await asyncio.sleep(1)
        else:
            return


@contextlib.asynccontextmanager
async def fresh(stack: Stack, partitions: int = 6) -> AsyncIterator[tuple[str, str]]:
    """A database cloned from the migrated template and a topic, both removed afterwards."""
    name = f"bench_{uuid.uuid4().hex[:10]}"
    topic = f"bench-{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(stack.admin_url)
    kafka = AIOKafkaAdminClient(bootstrap_servers=stack.bootstrap)
    await kafka.start()
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{stack.template}"')
        await kafka.create_topics([NewTopic(topic, partitions, 1)])
        yield stack.url(name), topic
    finally:
        with contextlib.suppress(Exception):
            await kafka.delete_topics([topic])
        await kafka.close()
        await drop_database(admin, name)
        await admin.close()


async def prefill(url: str, topic: str, rows: int, keys: int, key: str | None = None) -> float:
    """One INSERT of `rows` rows over `keys` keys (or all on `key`); returns its WAL bytes per
    row, measured after a CHECKPOINT so that it pays its full-page images as the drain does."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("CHECKPOINT")
        wal0 = await conn.fetchval("SELECT pg_current_wal_lsn()")
        await conn.execute(
            "INSERT INTO outbox (topic, ordering_key, payload, headers) "
            "SELECT $1, coalesce($5, 'key-' || (i % $2)), "
            "convert_to(lpad(i::text, $3, 'x'), 'UTF8'), "
            "jsonb_build_object('seq', (i / $2)::text) FROM generate_series(0, $4 - 1) i",
            topic,
            keys,
            PAYLOAD,
            rows,
            key,
        )
        wal = await conn.fetchval("SELECT pg_current_wal_lsn() - $1::pg_lsn", wal0)
        await conn.execute("VACUUM ANALYZE outbox")
    finally:
        await conn.close()
    return float(wal) / rows


async def make_stuck(url: str, topic: str, kind: str, rows: int) -> dict[str, Any]:
    """`rows` pending rows of STUCK_KEY that cannot move: `block` (its head dead; the dispatcher
    runs with dead_letter_policy=block), `backoff` (its head waits an hour), `paused` (its rows
    in a topic of their own, paused), `replay` (published, then held by an unfinished replay).
    Returns the settings the dispatcher needs for it."""
    stuck_topic = f"{topic}-paused" if kind == "paused" else topic
    await prefill(url, stuck_topic, rows, 1, key=STUCK_KEY)
    conn = await asyncpg.connect(url)
    try:
        head = await conn.fetchval("SELECT min(id) FROM outbox WHERE ordering_key = $1", STUCK_KEY)
        if kind == "block":
            await conn.execute(
                "UPDATE outbox SET dead_at = now(), attempts = 10, last_error = 'benchmark' "
                "WHERE id = $1",
                head,
            )
            return {"dead_letter_policy": "block"}
        if kind == "backoff":
            await conn.execute(
                "UPDATE outbox SET attempts = 1, next_attempt_at = now() + interval '1 hour', "
                "last_error = 'benchmark' WHERE id = $1",
                head,
            )
        elif kind == "paused":
            await conn.fetchrow(QUERIES.pause, stuck_topic, "a stuck key")
        elif kind == "replay":
            await conn.execute(
                "UPDATE outbox SET published_at = now() WHERE ordering_key = $1", STUCK_KEY
            )
            last = await conn.fetchval(
                "SELECT max(id) FROM outbox WHERE ordering_key = $1", STUCK_KEY
            )
            # A replay of version 0.1 whose command died between hold and release (replay is
            # one transaction now): held for an hour, in batches, as that version held them.
            after = 0
            while True:
                after = await conn.fetchval(
                    "WITH batch AS (SELECT id FROM outbox WHERE ordering_key = $1 "
                    "AND published_at IS NOT NULL AND id > $2 AND id <= $3 ORDER BY id LIMIT $4), "
                    "held AS (UPDATE outbox o SET published_at = NULL, attempts = 0, "
                    "next_attempt_at = now() + interval '1 hour', "
                    "last_error = 'replayed by operator at (held)' "
                    "FROM batch b WHERE o.id = b.id RETURNING o.id) SELECT max(id) FROM held",
                    STUCK_KEY,
                    after,
                    last,
                    REPLAY_BATCH,
                )
                if after is None:
                    break
        else:
            msg = f"unknown stuck kind {kind!r}"
            raise ValueError(msg)
    finally:
        await conn.close()
    return {}


def settings_for(url: str, stack: Stack, **overrides: Any) -> Settings:
    overrides.setdefault("http_port", 0)
    overrides.setdefault("kafka_bootstrap_servers", stack.bootstrap)
    return Settings(database_url=url, **overrides)


# -- the dispatcher under test --


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


@dataclass
class Dispatchers:
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.processes)


@contextlib.asynccontextmanager
async def dispatchers(settings: Settings, count: int = 1) -> AsyncIterator[Dispatchers]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    for name in settings.model_fields_set:  # what the scenario chose; defaults for the rest
        value = getattr(settings, name)
        if hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        elif isinstance(value, bool):
            value = "true" if value else "false"
        env[f"OUTBOX_{name.upper()}"] = str(getattr(value, "value", value))
    env["OUTBOX_LOG_LEVEL"] = "WARNING"
    group = Dispatchers()
    log = (RESULTS / "dispatcher.log").open("ab")
    try:
        for _ in range(count):
            group.processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "outbox_dispatcher", "run"],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        yield group
    finally:
        for p in group.processes:
            p.send_signal(signal.SIGTERM)
        for p in group.processes:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()


async def wait_ready(url: str, group: Dispatchers) -> None:
    """Until every dispatcher process has its pool open (it connects after start-up)."""
    conn = await asyncpg.connect(url)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            connected = await conn.fetchval(
                "SELECT count(DISTINCT client_port) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = 'outbox-dispatcher'"
            )
            if connected >= 2 * len(group.processes):  # pool + LISTEN
                await asyncio.sleep(0.3)
                return
            await asyncio.sleep(0.05)
        msg = f"dispatchers did not connect; see {RESULTS / 'dispatcher.log'}"
        raise RuntimeError(msg)
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def connection(url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(url)
    try:
        yield conn
    finally:
        await conn.close()


async def wait_while(
    conn: asyncpg.Connection, query: str, *args: Any, interval: float, what: str
) -> None:
    """Poll `query` until it returns false: a scenario that stops moving fails, never hangs."""
    deadline = time.monotonic() + WAIT_LIMIT
    while await conn.fetchval(query, *args):
        if time.monotonic() > deadline:
            msg = (
                f"{what}: still waiting after {WAIT_LIMIT:.0f} s; see {RESULTS / 'dispatcher.log'}"
            )
            raise RuntimeError(msg)
        await asyncio.sleep(interval)


async def backend_cpu_by_pid(conn: asyncpg.Connection) -> dict[int, float]:
    """CPU seconds of each PostgreSQL backend serving a dispatcher (its application_name)."""
    pids = await conn.fetch(
        "SELECT pid FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name = 'outbox-dispatcher'"
    )
    cpu = {}
    for row in pids:
        with contextlib.suppress(OSError):
            cpu[row["pid"]] = cpu_seconds(row["pid"])
    return cpu


async def backend_cpu(conn: asyncpg.Connection) -> float:
    return sum((await backend_cpu_by_pid(conn)).values())


def backend_cpu_since(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU between two samples; a backend that connected meanwhile counts from zero (one that
    disconnected meanwhile is lost: the dispatcher's pool keeps its connections)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


class LatencyProxy(FaultProxy):
    """The project's fault proxy with latency only: each chunk is forwarded `delay` seconds after
    it arrived while later chunks keep arriving. (FaultProxy.delay sleeps before forwarding each
    chunk in turn, which also caps a connection at one chunk per delay: a bandwidth limit that
    depends on how the kernel happens to split the stream.)"""

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        *,
        from_client: bool = False,
    ) -> None:
        if not self._delay:
            await super()._pump(reader, writer, link, from_client=from_client)
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def forward() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                self.forwarded_bytes += len(data)
            if writer.can_write_eof():
                writer.write_eof()

        sender = asyncio.ensure_future(forward())
        try:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await reader.read(CHUNK):
                    queue.put_nowait((loop.time() + self._delay, data))
            queue.put_nowait(None)
            with contextlib.suppress(OSError, ConnectionError):
                await sender
        finally:
            sender.cancel()


@contextlib.asynccontextmanager
async def slow_broker(stack: Stack, delay: float) -> AsyncIterator[str]:
    """The fault proxy in front of the broker's proxied listener, adding `delay` seconds of
    latency each way. Yields the bootstrap address: the listener advertises the proxy's port,
    so every connection of a client bootstrapped here crosses the proxy."""
    proxy = LatencyProxy("127.0.0.1", stack.proxied_port, listen_port=stack.proxy_port)
    proxy.delay(delay)
    async with proxy:
        yield proxy.address
        assert proxy.forwarded_bytes > 0, "the dispatchers did not reach the broker via the proxy"


# -- scenarios --


async def drain(
    stack: Stack,
    rows: int,
    keys: int,
    processes: int = 1,
    *,
    stuck: str | None = None,
    stuck_rows: int = 0,
    broker_delay: float = 0.0,
    **opts: Any,
) -> dict[str, float]:
    """Rows already in the table; events/s from the first to the last row marked published.
    With `stuck`, STUCK_KEY's `stuck_rows` rows that cannot move are written first and the
    figures are those of the other keys' rows; with `broker_delay`, the dispatchers reach the
    broker through the fault proxy."""
    async with fresh(stack) as (url, topic), contextlib.AsyncExitStack() as exits:
        if stuck:
            opts.update(await make_stuck(url, topic, stuck, stuck_rows))
        writer_wal = await prefill(url, topic, rows, keys)
        if broker_delay:
            bootstrap = await exits.enter_async_context(slow_broker(stack, broker_delay))
            opts["kafka_bootstrap_servers"] = bootstrap
        settings = settings_for(url, stack, **opts)
        conn = await asyncpg.connect(url)
        try:
            first = await conn.fetchval(
                "SELECT min(id) FROM outbox WHERE ordering_key IS DISTINCT FROM $1", STUCK_KEY
            )
            # No CHECKPOINT here: the prefill's and the drain's changes fall in the checkpoint
            # cycle that began just before the prefill, as a writer's insert and our claim and
            # mark of its row do in steady operation (one after a CHECKPOINT would charge the
            # drain a full-page image of every heap page, which new pages spare the insert).
            wal0 = await conn.fetchval("SELECT pg_current_wal_lsn()")
            fpi0 = await conn.fetchval("SELECT wal_fpi FROM pg_stat_wal")
            async with dispatchers(settings, processes) as group:
                # The clock starts when the oldest row is gone or published (as the database
                # clock does with the first published_at), not at process start-up.
                await wait_while(
                    conn,
                    "SELECT EXISTS (SELECT 1 FROM outbox WHERE id = $1 AND published_at IS NULL)",
                    first,
                    interval=0.005,
                    what="the drain's first row",
                )
                started = time.monotonic()
                cpu0 = group.cpu()
                pg0 = await backend_cpu_by_pid(conn)
                # The stuck key's rows are older than `first`: the pending index's range scan
                # from `first` never reads them.
                await wait_while(
                    conn,
                    "SELECT EXISTS (SELECT 1 FROM outbox "
                    "WHERE published_at IS NULL AND dead_at IS NULL AND id >= $1)",
                    first,
                    interval=0.02,
                    what="the drain",
                )
                wall = time.monotonic() - started
                cpu = group.cpu() - cpu0
                pg = backend_cpu_since(pg0, await backend_cpu_by_pid(conn))
                wal = await conn.fetchval("SELECT pg_current_wal_lsn() - $1::pg_lsn", wal0)
            # Backends report their WAL counters when they exit (the dispatchers' are gone now).
            await asyncio.sleep(0.5)
            fpi = await conn.fetchval("SELECT wal_fpi FROM pg_stat_wal") - fpi0
            span = await conn.fetchval(
                "SELECT extract(epoch FROM max(published_at) - min(published_at)) FROM outbox "
                "WHERE id >= $1",
                first,
            )
            dead = await conn.fetchval(
                "SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL AND id >= $1", first
            )
            left = await conn.fetchval(
                "SELECT count(*) FROM outbox WHERE ordering_key = $1 AND published_at IS NULL",
                STUCK_KEY,
            )
        finally:
            await conn.close()
    assert dead == 0, f"{dead} rows dead-lettered in a benchmark"
    assert left == (stuck_rows if stuck else 0), f"the stuck key moved: {left} rows pending"
    dispatcher_wal = float(wal) / rows
    return {
        # By the database clock, first to last mark; with delete_on_publish (no marks) by this
        # process's clock from the dispatcher's connection to the last row gone.
        "events_per_second": rows / max(float(span) if span is not None else wall, 1e-3),
        "events_per_second_wall": rows / max(wall, 1e-3),
        "dispatcher_cpu_ms_per_1k": cpu * 1000 / (rows / 1000),
        "postgres_cpu_ms_per_1k": pg * 1000 / (rows / 1000),
        # The writer's share (its INSERT, right after a CHECKPOINT) and ours (everything from
        # the dispatcher's start to the last mark: claims, marks, the registry, autovacuum).
        "wal_bytes_per_event_writer": writer_wal,
        "wal_bytes_per_event_dispatcher": dispatcher_wal,
        "wal_bytes_per_event_total": writer_wal + dispatcher_wal,
        # Full-page images in ours, cluster-wide (pg_stat_wal): near 0 unless a checkpoint fell
        # inside the drain.
        "wal_full_page_images_per_1k_events": fpi * 1000 / rows,
    }


async def hot_key(stack: Stack, rows: int) -> dict[str, float]:
    """All rows on one ordering key; the order is checked on the consumer side."""
    async with fresh(stack) as (url, topic):
        await prefill(url, topic, rows, 1)
        settings = settings_for(url, stack)
        conn = await asyncpg.connect(url)
        try:
            async with dispatchers(settings) as group:
                await wait_ready(url, group)
                await wait_while(
                    conn,
                    "SELECT EXISTS (SELECT 1 FROM outbox "
                    "WHERE published_at IS NULL AND dead_at IS NULL)",
                    interval=0.05,
                    what="the hot key's drain",
                )
            span = await conn.fetchval(
                "SELECT extract(epoch FROM max(published_at) - min(published_at)) FROM outbox"
            )
        finally:
            await conn.close()
        in_order = await consumed_in_order(stack.bootstrap, topic, rows)
    assert in_order, "hot key: records out of order"
    return {"events_per_second": rows / max(float(span), 1e-6)}


async def consumed_in_order(bootstrap: str, topic: str, rows: int) -> bool:
    """Payloads were numbered in id order: first deliveries must come back ascending."""
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None
    )
    await consumer.start()
    seen: set[int] = set()
    last = -1
    ordered = True
    try:
        deadline = time.monotonic() + 120
        while len(seen) < rows and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500, max_records=20_000)
            for records in batch.values():
                for record in records:
                    n = int((record.value or b"").lstrip(b"x"))
                    if n in seen:
                        continue
                    seen.add(n)
                    ordered = ordered and n > last
                    last = n
    finally:
        await consumer.stop()
    return ordered and len(seen) == rows


async def sustained(
    stack: Stack,
    rate: float | None,
    rows_per_tx: int,
    seconds: float,
    *,
    stuck: str | None = None,
    stuck_rows: int = 0,
) -> dict[str, float]:
    """Writers commit at a fixed offered rate (None: as fast as they can) while the dispatcher
    runs; latency from each writer's COMMIT returning to the record reaching a consumer, both
    taken with this process's monotonic clock (an upper bound of commit-to-ack by one fetch).
    CPU of the dispatcher and of its backends from its start-up to the last record consumed.
    With `stuck`, STUCK_KEY's rows that cannot move are in the table first."""
    async with fresh(stack) as (url, topic):
        opts = await make_stuck(url, topic, stuck, stuck_rows) if stuck else {}
        settings = settings_for(url, stack, **opts)
        async with connection(url) as conn, dispatchers(settings) as group:
            await wait_ready(url, group)
            cpu0 = group.cpu()
            pg0 = await backend_cpu_by_pid(conn)
            committed: dict[str, float] = {}
            received: dict[str, float] = {}
            consumer = AIOKafkaConsumer(
                topic,
                bootstrap_servers=stack.bootstrap,
                auto_offset_reset="earliest",
                group_id=None,
                fetch_max_wait_ms=5,
            )
            await consumer.start()
            stop = asyncio.Event()

            # After the writers stop, the reader waits for the rest while records keep coming:
            # a backlog (writers faster than the relay) drains at its own pace; 30 s with nothing
            # new is a loss.
            quiet_limit = 30.0
            last_new = [time.monotonic()]

            async def consume() -> None:
                while not stop.is_set() or len(received) < len(committed):
                    batch = await consumer.getmany(timeout_ms=20, max_records=20_000)
                    now = time.monotonic()
                    for records in batch.values():
                        for record in records:
                            event_id = dict(record.headers)["event-id"].decode()
                            if received.setdefault(event_id, now) == now:
                                last_new[0] = now
                    if stop.is_set() and now - last_new[0] > quiet_limit:
                        return

            reader = asyncio.create_task(consume())
            try:
                written = await write_load(url, topic, rate, rows_per_tx, seconds, committed)
                last_new[0] = max(last_new[0], time.monotonic())
                stop.set()
                await reader
                cpu = group.cpu() - cpu0
                pg = backend_cpu_since(pg0, await backend_cpu_by_pid(conn))
            finally:
                await consumer.stop()
    latencies = sorted((received[e] - t) * 1000 for e, t in committed.items() if e in received)
    lost = len(committed) - len(latencies)
    assert lost == 0, f"{lost} committed events not consumed (nothing new arrived for 30 s)"

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))]

    return {
        "offered_per_second": rate or 0.0,
        "achieved_per_second": written / seconds,
        "p50_ms": pct(50),
        "p95_ms": pct(95),
        "p99_ms": pct(99),
        "dispatcher_cpu_ms_per_1k": cpu * 1000 / (max(written, 1) / 1000),
        "postgres_cpu_ms_per_1k": pg * 1000 / (max(written, 1) / 1000),
    }


async def write_load(
    url: str,
    topic: str,
    rate: float | None,
    rows_per_tx: int,
    seconds: float,
    committed: dict[str, float],
    connections: int = 8,
    table: str = "outbox",
) -> int:
    """Writer transactions of `rows_per_tx` rows, paced to `rate` rows/s over `connections`."""
    pool = await asyncpg.create_pool(url, min_size=connections, max_size=connections)
    assert pool is not None
    payload = b"x" * PAYLOAD
    start = time.monotonic()
    end = start + seconds
    tx_interval = (rows_per_tx / rate) * connections if rate else 0.0
    sql = (
        f"INSERT INTO {table} (topic, ordering_key, payload) "
        "SELECT $1, k, $3 FROM unnest($2::text[]) AS k RETURNING event_id"
    )

    async def writer(n: int) -> int:
        count = 0
        next_at = start + n * tx_interval / connections
        i = n
        while True:
            now = time.monotonic()
            if now >= end:
                return count
            if tx_interval and next_at > now:
                await asyncio.sleep(next_at - now)
            keys = [f"key-{(i + j) % KEYS}" for j in range(rows_per_tx)]
            i += rows_per_tx * connections
            async with pool.acquire() as conn, conn.transaction():
                rows = await conn.fetch(sql, topic, keys, payload)
            done = time.monotonic()
            for row in rows:
                committed[str(row["event_id"])] = done
            count += len(rows)
            next_at += tx_interval

    try:
        return sum(await asyncio.gather(*(writer(n) for n in range(connections))))
    finally:
        await pool.close()


async def idle(stack: Stack, seconds: float) -> dict[str, float]:
    """CPU of a dispatcher with nothing to do, as a percentage of one core."""
    async with fresh(stack) as (url, _), dispatchers(settings_for(url, stack)) as group:
        await wait_ready(url, group)
        await asyncio.sleep(1)
        cpu0 = group.cpu()
        await asyncio.sleep(seconds)
        cpu = group.cpu() - cpu0
    return {"cpu_percent_of_one_core": 100 * cpu / seconds}


async def writer_cost(stack: Stack, seconds: float) -> dict[str, float]:
    """Writer throughput, 10-row transactions from 4 connections as fast as they can, no
    dispatcher running, into (a) the outbox as migrated (indexes, the registry trigger, the
    wake-up check) with no dispatcher waiting, (b) the same while a dispatcher says it waits
    (every statement notifies), (c) a table with the same columns and only its primary key.
    Costs in % of (c)."""
    results = {}
    for case in ("outbox", "outbox_dispatcher_waiting", "primary_key_only"):
        async with fresh(stack) as (url, topic), connection(url) as conn:
            if case == "outbox_dispatcher_waiting":
                await conn.execute(
                    "INSERT INTO outbox_waiting (owner, until) "
                    "VALUES ('benchmark', now() + interval '1 hour')"
                )
            if case == "primary_key_only":
                await conn.execute(
                    "CREATE TABLE plain (LIKE outbox INCLUDING DEFAULTS INCLUDING IDENTITY); "
                    "ALTER TABLE plain ADD PRIMARY KEY (id)"
                )
            table = "plain" if case == "primary_key_only" else "outbox"
            await conn.execute("CHECKPOINT")
            wal0 = await conn.fetchval("SELECT pg_current_wal_lsn()")
            written = await write_load(url, topic, None, 10, seconds, {}, 4, table)
            wal = await conn.fetchval("SELECT pg_current_wal_lsn() - $1::pg_lsn", wal0)
            results[f"rows_per_second_{case}"] = written / seconds
            # The writers' WAL in 10-row transactions (the drain's writer share is one INSERT).
            results[f"wal_bytes_per_row_{case}"] = float(wal) / max(written, 1)
    plain = results["rows_per_second_primary_key_only"]
    results["cost_percent"] = 100 * (1 - results["rows_per_second_outbox"] / plain)
    results["cost_percent_dispatcher_waiting"] = 100 * (
        1 - results["rows_per_second_outbox_dispatcher_waiting"] / plain
    )
    return results


# What each part of the relay's schema costs writers: the outbox as migrated with one part taken
# away at a time (and everything taken away: the primary key only), in the same run.
WRITER_PARTS = {
    "outbox": "",
    "without_registry_trigger": "DROP TRIGGER outbox_key_track ON outbox",
    "without_checks": (
        "ALTER TABLE outbox DROP CONSTRAINT outbox_topic_valid, "
        "DROP CONSTRAINT outbox_topic_not_internal, DROP CONSTRAINT outbox_headers_valid, "
        "DROP CONSTRAINT outbox_ordering_key_length"
    ),
    "without_headers_check": "ALTER TABLE outbox DROP CONSTRAINT outbox_headers_valid",
    "without_topic_checks": (
        "ALTER TABLE outbox DROP CONSTRAINT outbox_topic_valid, "
        "DROP CONSTRAINT outbox_topic_not_internal"
    ),
    "without_event_id_unique": "ALTER TABLE outbox DROP CONSTRAINT outbox_event_id_key",
    "without_pending_index": "DROP INDEX outbox_pending_key_idx, outbox_pending_keyless_idx",
    "primary_key_only": (
        "DROP TRIGGER outbox_key_track ON outbox; "
        "DROP TRIGGER outbox_key_rearm ON outbox; DROP TRIGGER outbox_key_rearm_dead ON outbox; "
        "ALTER TABLE outbox DROP CONSTRAINT outbox_topic_valid, "
        "DROP CONSTRAINT outbox_topic_not_internal, DROP CONSTRAINT outbox_headers_valid, "
        "DROP CONSTRAINT outbox_ordering_key_length, DROP CONSTRAINT outbox_event_id_key, "
        "DROP CONSTRAINT outbox_not_published_and_dead; "
        "DROP INDEX outbox_pending_key_idx, outbox_pending_keyless_idx, outbox_dead_key_idx"
    ),
}


async def writer_cost_parts(stack: Stack, seconds: float) -> dict[str, float]:
    """Where the writers' cost goes: `writer_cost`'s load (10-row transactions, 4 connections,
    no dispatcher) into the outbox with one part of the schema dropped at a time. Each part's
    share is the throughput it gives back, in % of the primary-key-only table."""
    results = {}
    for case, ddl in WRITER_PARTS.items():
        async with fresh(stack) as (url, topic), connection(url) as conn:
            if ddl:
                await conn.execute(ddl)
            await conn.execute("CHECKPOINT")
            written = await write_load(url, topic, None, 10, seconds, {}, 4, "outbox")
            results[f"rows_per_second_{case}"] = written / seconds
    plain = results["rows_per_second_primary_key_only"]
    full = results["rows_per_second_outbox"]
    results["cost_percent"] = 100 * (1 - full / plain)
    for case in WRITER_PARTS:
        if case.startswith("without_"):
            gained = results[f"rows_per_second_{case}"] - full
            results[f"share_percent_{case.removeprefix('without_')}"] = 100 * gained / plain
    return results


async def kafka_ceiling(stack: Stack, count: int) -> dict[str, float]:
    async with fresh(stack) as (url, topic):
        elapsed = await baselines.kafka_only(
            stack.bootstrap, topic, count, PAYLOAD, KEYS, settings_for(url, stack)
        )
    return {"events_per_second": count / elapsed}


async def kafka_batch_api_ceiling(stack: Stack, count: int) -> dict[str, float]:
    async with fresh(stack) as (url, topic):
        elapsed = await baselines.kafka_only_batch_api(
            stack.bootstrap, topic, count, PAYLOAD, KEYS, settings_for(url, stack)
        )
    return {"events_per_second": count / elapsed}


async def pg_ceiling(stack: Stack, rows: int) -> dict[str, float]:
    async with fresh(stack) as (url, topic):
        await prefill(url, topic, rows, KEYS)
        marked, elapsed = await baselines.pg_only(url, settings_for(url, stack))
    return {"events_per_second": marked / elapsed}


async def handwritten_pattern(stack: Stack, rows: int) -> dict[str, float]:
    async with fresh(stack) as (url, topic):
        await prefill(url, topic, rows, KEYS)
        marked, elapsed = await handwritten.run(url, stack.bootstrap)
    return {"events_per_second": marked / elapsed}


# -- runner --


Scenario = Callable[[], Awaitable[dict[str, float]]]


async def median_of(runs: int, scenario: Scenario) -> dict[str, float]:
    samples = [await scenario() for _ in range(runs)]
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def plan(stack: Stack, sizes: Sizes) -> dict[str, Scenario]:
    s = sizes
    scenarios: dict[str, Scenario] = {
        "baseline_kafka_only": lambda: kafka_ceiling(stack, s.kafka_only),
        "baseline_kafka_batch_api": lambda: kafka_batch_api_ceiling(stack, s.kafka_only),
        "baseline_postgres_only": lambda: pg_ceiling(stack, s.drain),
        "baseline_handwritten": lambda: handwritten_pattern(stack, s.handwritten),
        "drain": lambda: drain(stack, s.drain, KEYS),
        "hot_key": lambda: hot_key(stack, s.hot_key),
        "scaling_1_task": lambda: drain(stack, s.drain // 2, KEYS, claim_tasks=1),
        "scaling_2_tasks": lambda: drain(stack, s.drain // 2, KEYS, claim_tasks=2),
        "scaling_4_tasks": lambda: drain(stack, s.drain // 2, KEYS, claim_tasks=4),
        "scaling_2_processes": lambda: drain(stack, s.drain // 2, KEYS, processes=2),
        "idle": lambda: idle(stack, s.idle_seconds),
        "writer_cost": lambda: writer_cost(stack, s.writer_seconds),
        "writer_cost_parts": lambda: writer_cost_parts(stack, s.writer_seconds),
    }
    # Processes against a slow broker (the fault proxy), so the database is not the limit.
    for n in (1, 2, 4):
        scenarios[f"scaling_processes_latency_{n}"] = lambda n=n: drain(
            stack, s.scaling_latency, KEYS, processes=n, broker_delay=BROKER_DELAY
        )
    # A key that cannot move, with many pending rows written first; the other keys' drain and
    # their latency at a steady 1k/s, each also measured without it ("none").
    for kind in ("none", *STUCK_KINDS):
        stuck = None if kind == "none" else kind
        scenarios[f"stuck_key_{kind}"] = lambda stuck=stuck: drain(
            stack, s.stuck_drain, KEYS, stuck=stuck, stuck_rows=s.stuck_rows
        )
        scenarios[f"stuck_key_latency_{kind}"] = lambda stuck=stuck: sustained(
            stack, 1_000, 10, s.sustained_seconds, stuck=stuck, stuck_rows=s.stuck_rows
        )
    # Techniques: the drain with one setting changed from the defaults, to see what each is worth.
    techniques: dict[str, dict[str, Any]] = {
        "synchronous_commit_on": {"synchronous_commit": "on"},
        "linger_0ms": {"kafka_linger_ms": 0},
        "linger_10ms": {"kafka_linger_ms": 10},
        "batch_16k": {"kafka_max_batch_bytes": 16_384},
        "batch_1m": {"kafka_max_batch_bytes": 1_048_576},
        "lz4": {"kafka_compression": "lz4"},
        "zstd": {"kafka_compression": "zstd"},
        "asyncio_loop": {"uvloop": False},
        "no_prepared_statements": {"statement_cache_size": 0},
        "delete_on_publish": {"delete_on_publish": True},
        "claim_batch_100": {"batch_size": 100},
        "claim_batch_1000": {"batch_size": 1000},
        "claim_tasks_2": {"claim_tasks": 2},
    }
    scenarios["technique_defaults"] = lambda: drain(stack, s.drain // 4, KEYS)
    for name, opts in techniques.items():
        scenarios[f"technique_{name}"] = lambda opts=opts: drain(stack, s.drain // 4, KEYS, **opts)
    for rate in (1_000, 2_000, 5_000, 15_000, None):
        for per_tx in (10, 1):
            name = f"sustained_{rate or 'max'}_per_s_{per_tx}_per_tx"
            scenarios[name] = lambda rate=rate, per_tx=per_tx: sustained(
                stack, rate, per_tx, s.sustained_seconds
            )
    return scenarios


def ratios(results: dict[str, dict[str, float]]) -> dict[str, float]:
    """Ratios (and differences) between scenarios of the same run; NaN where one is missing."""

    def fig(name: str, figure: str = "events_per_second") -> float:
        return results.get(name, {}).get(figure, float("nan"))

    derived = {
        "drain_vs_kafka_only": fig("drain") / fig("baseline_kafka_only"),
        "kafka_batch_api_vs_send": fig("baseline_kafka_batch_api") / fig("baseline_kafka_only"),
        "drain_vs_postgres_only": fig("drain") / fig("baseline_postgres_only"),
        "drain_vs_handwritten": fig("drain") / fig("baseline_handwritten"),
        "two_processes_vs_one": fig("scaling_2_processes") / fig("scaling_4_tasks"),
        "processes_latency_2_vs_1": fig("scaling_processes_latency_2")
        / fig("scaling_processes_latency_1"),
        "processes_latency_4_vs_1": fig("scaling_processes_latency_4")
        / fig("scaling_processes_latency_1"),
    }
    for kind in STUCK_KINDS:
        derived[f"stuck_key_{kind}_vs_none"] = fig(f"stuck_key_{kind}") / fig("stuck_key_none")
        # A difference in ms, not a ratio: how much p99 commit-to-consume rises.
        derived[f"stuck_key_{kind}_p99_rise_ms"] = fig(f"stuck_key_latency_{kind}", "p99_ms") - fig(
            "stuck_key_latency_none", "p99_ms"
        )
    return derived


def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "note": "PostgreSQL, the Kafka broker, the dispatcher and the load all on this machine",
    }


def table(
    results: dict[str, dict[str, float]],
    derived: dict[str, float],
    verdicts: list[dict[str, Any]],
) -> str:
    lines = ["| scenario | figures |", "|---|---|"]
    for name, figures in results.items():
        shown = ", ".join(f"{k} {v:,.1f}" for k, v in figures.items())
        lines.append(f"| {name} | {shown} |")
    for name, value in derived.items():
        lines.append(f"| ratio {name} | {value:.2f} |")
    return "\n".join(lines) + "\n\n### Goals (issues 14 and 10)\n\n" + goals_table(verdicts)


async def main_async(args: argparse.Namespace) -> int:
    sizes = QUICK if args.quick else FULL
    runs = args.runs or sizes.runs
    stack = Stack.from_env()
    scenarios = plan(stack, sizes)
    chosen = args.only.split(",") if args.only else list(scenarios)
    unknown = [name for name in chosen if name not in scenarios]
    if unknown:
        print(f"unknown scenarios: {', '.join(unknown)}; known: {', '.join(scenarios)}")
        return 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    await make_template(stack)
    results: dict[str, dict[str, float]] = {}
    try:
        for name in chosen:
            started = time.monotonic()
            results[name] = await median_of(runs, scenarios[name])
            print(f"{name}: {results[name]} ({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        admin = await asyncpg.connect(stack.admin_url)
        await drop_database(admin, stack.template)
        await admin.close()
    derived = ratios(results)
    verdicts = goals(results, derived)
    report = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "runs": runs,
        "quick": args.quick,
        "results": results,
        "ratios": derived,
        "goals": verdicts,
    }
    out = Path(args.out) if args.out else RESULTS / "latest.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    m = report["machine"]
    markdown = (
        f"Run {report['when']} on {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, "
        f"Python {m['python']} ({m['note']}); median of {runs} runs.\n\n"
        + table(results, derived, verdicts)
    )
    out.with_suffix(".md").write_text(markdown + "\n")
    print(table(results, derived, verdicts))
    print(f"written: {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--runs", type=int, default=0, help="runs per scenario (median)")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--out", default="", help="JSON result file")
    import uvloop

    return uvloop.run(main_async(parser.parse_args()))
