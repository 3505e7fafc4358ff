"""Many outboxes (issue 36): tenant schemas `tenant_NNNN` of one database, served by
`outbox-dispatcher run` processes with OUTBOX_SOURCES=[{"schema": "tenant_*"}] (at-least-once).
What they cost the database while idle, how fast a quiet tenant is served beside another's
backlog, how one tenant's backlog drains beside idle ones, and how soon a tenant migrated while
the fleet runs is served. Each tenant is migrated as `outbox-dispatcher migrate` migrates one
(store.migrations), without ANALYZE or VACUUM."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from benchmarks.load import KEYS, PAYLOAD, write_load
from benchmarks.processes import (
    BackendCpuSampler,
    Dispatchers,
    dispatchers,
    machine_cpu,
    tcp_ports,
    wait_ready,
)
from benchmarks.stack import Stack, connection, fresh, settings_for
from benchmarks.steady import write_timeline
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.store import migrations
from outbox_dispatcher.store.fleet import FleetStore

SOURCES = '[{"schema": "tenant_*"}]'
QUIET_RATE = 20.0  # events/s of each quiet tenant (the goal row)


def tenant(i: int) -> str:
    return f"tenant_{i:04d}"


async def add_tenants(url: str, first: int, count: int) -> list[str]:
    """CREATE SCHEMA and migrate `count` tenants from number `first` on."""
    names = [tenant(i) for i in range(first, first + count)]
    conn = await asyncpg.connect(url)
    try:
        for name in names:
            await conn.execute(f'CREATE SCHEMA "{name}"')
            await migrations.migrate(conn, name, "outbox")
    finally:
        await conn.close()
    return names


@contextlib.asynccontextmanager
async def tenants(stack: Stack, count: int) -> AsyncIterator[tuple[str, str]]:
    """A fresh database with `count` migrated tenant schemas and the fleet's membership table
    (as `migrate` with OUTBOX_SOURCES makes them; without it each process knew only itself and
    served every outbox: `fleet_idle`'s two processes each served all 500 until session 6),
    and a topic."""
    async with fresh(stack) as (url, topic):
        await add_tenants(url, 0, count)
        async with connection(url) as conn:
            await FleetStore(conn).create()
        yield url, topic


def fleet_settings(url: str, stack: Stack, **overrides: Any) -> Settings:
    return settings_for(url, stack, sources=SOURCES, **overrides)


async def backlog(url: str, name: str, topic: str, rows: int) -> None:
    """`rows` pending rows over KEYS keys in one tenant, committed at once."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            f'INSERT INTO "{name}".outbox (topic, ordering_key, payload) '
            "SELECT $1, 'key-' || (g % $2), $3 FROM generate_series(1, $4) AS g",
            topic,
            KEYS,
            b"x" * PAYLOAD,
            rows,
        )
    finally:
        await conn.close()


async def pending(conn: asyncpg.Connection, name: str) -> int:
    value: int = await conn.fetchval(
        f'SELECT count(*) FROM "{name}".outbox WHERE published_at IS NULL AND dead_at IS NULL'
    )
    return value


async def connections_per_process(conn: asyncpg.Connection, group: Dispatchers) -> list[int]:
    """Each process's backends, matched by its sockets' local ports (all databases)."""
    ports = [
        r["client_port"]
        for r in await conn.fetch(
            "SELECT client_port FROM pg_stat_activity "
            "WHERE application_name = 'outbox-dispatcher' AND client_port IS NOT NULL"
        )
    ]
    return [sum(1 for p in ports if p in tcp_ports(proc.pid)) for proc in group.processes]


async def idle(stack: Stack, outboxes: int, processes: int, seconds: float) -> dict[str, float]:
    """`outboxes` idle tenants served by `processes` processes: the database's CPU for the
    dispatchers' backends (sampled, so that pooled connections closing meanwhile count) in the
    start-up (5 x `seconds` from ready: each outbox's first upkeep, pools opening and closing;
    2026-12-07, 500 tenants: 66 % of a core in the first 30 s, 3-5 % up to 150 s), then settled
    (the next 7 x `seconds`, what a fleet that runs for hours costs: the idle pace's slow loops
    and the full probe every 15 s fall in it), and each process's connections."""
    async with (
        tenants(stack, outboxes) as (url, _),
        connection(url) as conn,
        dispatchers(fleet_settings(url, stack), processes) as group,
    ):
        await wait_ready(url, group)
        sampler = BackendCpuSampler(conn)
        start_up = await sampler.window(5 * seconds)
        settled = await sampler.window(7 * seconds)
        per_process = await connections_per_process(conn, group)
    return {
        "outboxes": float(outboxes),
        "processes": float(processes),
        "postgres_cpu_percent_of_one_core": 100 * settled / (7 * seconds),
        "postgres_cpu_percent_start_up": 100 * start_up / (5 * seconds),
        "connections_per_process_max": float(max(per_process)),
    }


@contextlib.asynccontextmanager
async def second_topic(stack: Stack, topic: str) -> AsyncIterator[str]:
    """Another topic (6 partitions), deleted afterwards."""
    admin = AIOKafkaAdminClient(bootstrap_servers=stack.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 6, 1)])
        yield topic
        with contextlib.suppress(Exception):
            await admin.delete_topics([topic])
    finally:
        await admin.close()


async def quiet_beside(
    stack: Stack, quiet: int, idle_ones: int, backlog_rows: int, seconds: float, **opts: Any
) -> dict[str, float]:
    """`quiet` tenants written at QUIET_RATE events/s each (one-row transactions) for
    `seconds`, beside a tenant with `backlog_rows` committed before the process starts (none:
    the baseline) and `idle_ones` idle tenants; one process. Latency from each writer's COMMIT
    to the record reaching a consumer: over the whole window (`p*_ms`; the writers start once the
    process is connected, as before), and over the events committed after its /readyz first said
    ready (`p*_ms_steady`: once its first pass over the outboxes is done, what a rollout routes
    load onto; `first_pass_seconds` from the process's start)."""
    busy = tenant(0)
    names = [tenant(i) for i in range(1, quiet + 1)]
    port = free_port()
    opts = {"http_enabled": True, "http_host": "127.0.0.1", "http_port": port, **opts}
    async with (
        tenants(stack, 1 + quiet + idle_ones) as (url, topic),
        second_topic(stack, f"{topic}-backlog") as backlog_topic,
        connection(url) as conn,
    ):
        if backlog_rows:
            await backlog(url, busy, backlog_topic, backlog_rows)
        committed: dict[str, float] = {}
        received: dict[str, float] = {}
        consumer = AIOKafkaConsumer(
            topic, bootstrap_servers=stack.bootstrap, auto_offset_reset="earliest", group_id=None
        )
        await consumer.start()
        stop = asyncio.Event()

        async def consume() -> None:
            quiet_since = time.monotonic()
            while not stop.is_set() or (
                len(received) < len(committed) and time.monotonic() - quiet_since < 30
            ):
                batch = await consumer.getmany(timeout_ms=20, max_records=20_000)
                now = time.monotonic()
                for records in batch.values():
                    for record in records:
                        event_id = dict(record.headers)["event-id"].decode()
                        if received.setdefault(event_id, now) == now:
                            quiet_since = now

        started = time.monotonic()
        async with dispatchers(fleet_settings(url, stack, **opts)) as group:
            ready = asyncio.create_task(ready_at(port))
            await wait_ready(url, group)
            reader = asyncio.create_task(consume())
            busy_at, dispatcher_at = machine_cpu(), group.cpu()
            try:
                written = await asyncio.gather(
                    *(
                        write_load(
                            url, topic, QUIET_RATE, 1, seconds, committed, 1, f'"{n}".outbox'
                        )
                        for n in names
                    )
                )
                busy_end, dispatcher_end = machine_cpu(), group.cpu()
                left = await pending(conn, busy)
                stop.set()
                await reader
            finally:
                ready.cancel()
                await consumer.stop()
            ready_since = ready.result() if ready.done() and not ready.cancelled() else math.inf
    if timeline := os.environ.get("OUTBOX_BENCH_TIMELINE"):  # commit time and latency per row
        write_timeline(Path(timeline), committed, received)
    whole = latencies_of(committed, received)
    steady = latencies_of({e: t for e, t in committed.items() if t >= ready_since}, received)
    return {
        "quiet_tenants": float(quiet),
        "quiet_events": float(sum(written)),
        "p50_ms": percentile(whole, 50),
        "p95_ms": percentile(whole, 95),
        "p99_ms": percentile(whole, 99),
        # Once ready (NaN: not ready within the window).
        "first_pass_seconds": ready_since - started,
        "quiet_events_steady": float(len(steady)),
        "p50_ms_steady": percentile(steady, 50),
        "p99_ms_steady": percentile(steady, 99),
        "backlog_rows": float(backlog_rows),
        "backlog_left_when_writers_stopped": float(left),
        "rows_stranded": float(len(committed) - len(whole)),
        # The writers' window: the machine's busy share of every core (100: saturated, its
        # latencies are the queue for a core), and the dispatcher process's share of one core.
        "machine_busy_percent": 100
        * (busy_end[0] - busy_at[0])
        / max(1e-9, busy_end[1] - busy_at[1]),
        "dispatcher_cpu_percent_of_one_core": 100
        * (dispatcher_end - dispatcher_at)
        / max(1e-9, (busy_end[1] - busy_at[1]) / (os.cpu_count() or 1)),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def ready_at(port: int) -> float:
    """When the process's /readyz first answers 200 (the loop's clock), polled every 20 ms."""
    while True:
        with contextlib.suppress(OSError):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(b"GET /readyz HTTP/1.0\r\nHost: bench\r\n\r\n")
                status = await reader.readline()
            finally:
                writer.close()
            if status.split()[1:2] == [b"200"]:
                return time.monotonic()
        await asyncio.sleep(0.02)


def latencies_of(committed: dict[str, float], received: dict[str, float]) -> list[float]:
    """Commit-to-consume in ms of the events received, sorted."""
    return sorted((received[e] - t) * 1000 for e, t in committed.items() if e in received)


def percentile(latencies: list[float], p: float) -> float:
    if not latencies:
        return math.nan
    return latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))]


async def drain_beside_idle(stack: Stack, rows: int, idle_ones: int) -> dict[str, float]:
    """One tenant's `rows` (over KEYS keys) drained beside `idle_ones` idle tenants, one
    process: events/s by the database clock, first to last mark (as drains.drain)."""
    busy = tenant(0)
    async with tenants(stack, 1 + idle_ones) as (url, topic), connection(url) as conn:
        await backlog(url, busy, topic, rows)
        async with dispatchers(fleet_settings(url, stack)) as group:
            await wait_ready(url, group)
            deadline = time.monotonic() + 600
            while await pending(conn, busy) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            left = await pending(conn, busy)
        span = await conn.fetchval(
            f'SELECT extract(epoch FROM max(published_at) - min(published_at)) FROM "{busy}".outbox'
        )
    return {
        "events_per_second": rows / max(float(span or 0), 1e-3),
        "idle_outboxes": float(idle_ones),
        "rows_stranded": float(left),
    }


async def new_tenant(stack: Stack, outboxes: int, samples: int = 3) -> dict[str, float]:
    """A process serving `outboxes` tenants; a tenant created and migrated while it runs gets
    one row: seconds from that row's commit to the record reaching a consumer (each sample a
    new tenant)."""
    seconds: list[float] = []
    async with (
        tenants(stack, outboxes) as (url, topic),
        dispatchers(fleet_settings(url, stack)) as group,
    ):
        await wait_ready(url, group)
        consumer = AIOKafkaConsumer(
            topic, bootstrap_servers=stack.bootstrap, auto_offset_reset="latest", group_id=None
        )
        await consumer.start()
        try:
            await consumer.getmany(timeout_ms=500)  # assigned, at the end
            for i in range(samples):
                [name] = await add_tenants(url, outboxes + i, 1)
                async with connection(url) as conn:
                    seconds.append(await one_event(conn, consumer, name, topic, 60.0))
        finally:
            await consumer.stop()
    return {
        "first_row_published_s_max": max(seconds),
        "first_row_published_s_median": statistics.median(seconds),
    }


async def one_event(
    conn: asyncpg.Connection, consumer: AIOKafkaConsumer, name: str, topic: str, limit: float
) -> float:
    """One row committed to tenant `name`: seconds until `consumer` has it (`limit` when it
    never comes)."""
    event_id = str(uuid.uuid4())
    await conn.execute(
        f'INSERT INTO "{name}".outbox (topic, ordering_key, payload, event_id) '
        "VALUES ($1, 'k', $2, $3::uuid)",
        topic,
        b"x",
        event_id,
    )
    return await _arrival(consumer, event_id, time.monotonic(), limit)


async def _arrival(consumer: AIOKafkaConsumer, event_id: str, since: float, limit: float) -> float:
    """Seconds from `since` until the record `event_id` arrives (never: `limit`)."""
    while time.monotonic() - since < limit:
        batch = await consumer.getmany(timeout_ms=100)
        for records in batch.values():
            for record in records:
                if dict(record.headers)["event-id"].decode() == event_id:
                    return time.monotonic() - since
    return limit
