"""Issue 34's scenarios of things going wrong under load, each bounded in time and on loopback:
new keys arriving faster than one process drains (`scaling_new_keys_*`), the orphans of a
process killed under a backlog of new keys (`orphans_killed`), and the other topics' delay while
a pause waits for an open transaction that read the pauses (`pause_readers`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime

import asyncpg
from aiokafka import AIOKafkaConsumer
from asyncpg.transaction import Transaction

from benchmarks.drains import wait_drained
from benchmarks.load import PAYLOAD, prefill, write_load
from benchmarks.processes import dispatchers, slow_broker, tcp_ports, wait_ready
from benchmarks.stack import RESULTS, Stack, connection, fresh, settings_for

ORPHAN_LEASE = 5.0  # lease_seconds of orphans_killed's dispatchers
ORPHAN_GRACE = 5.0  # the goal: each orphaned key's first row republished within lease + this
ORPHAN_WAIT = 40.0  # seconds after the kill before the scenario stops waiting (a bound)
ORPHAN_STREAM = 3.0  # seconds of the stream of new keys before the kill
ORPHAN_PER_TX = 200  # the writer's rows a transaction: it offers more than two processes drain
ORPHAN_BROKER_DELAY = 0.02  # latency each way (as scaling_new_keys_*): the broker sets the pace
PAUSE_HELD = 5.0  # how long pause_readers' reader keeps its transaction open
LIVE_KEYS = (
    "INSERT INTO outbox (topic, ordering_key, payload) "
    "SELECT $1, $2 || g, $3 FROM generate_series($4::bigint, $5::bigint) g"
)


async def new_key_writer(
    url: str, topic: str, rate: float | None, per_tx: int, stop: asyncio.Event, prefix: str
) -> int:
    """Rows of keys never seen before (one each), `per_tx` a transaction, paced to `rate` rows/s
    (None: as fast as one connection commits), until `stop`; returns how many it wrote."""
    payload = b"x" * PAYLOAD
    written = 0
    async with connection(url) as conn:
        started = time.monotonic()
        while not stop.is_set():
            await conn.execute(LIVE_KEYS, topic, prefix, payload, written, written + per_tx - 1)
            written += per_tx
            if rate and (ahead := started + written / rate - time.monotonic()) > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), ahead)
    return written


async def scaling_new_keys(
    stack: Stack, rows: int, processes: int, *, broker_delay: float, rate: float
) -> dict[str, float]:
    """Issue 34 point 3: a backlog of `rows` rows, each on a key of its own, and a writer adding
    rows of new keys at `rate` while `processes` dispatchers drain through the fault proxy
    (`broker_delay` each way); events/s over every row (backlog and stream) by the database
    clock, first to last mark. The backlog is what one process cannot keep up with: all of it
    passes through discovery, as new keys do."""
    async with fresh(stack) as (url, topic), contextlib.AsyncExitStack() as exits:
        _, first = await prefill(url, topic, rows, rows, prefix="new-")
        bootstrap = await exits.enter_async_context(slow_broker(stack, broker_delay))
        settings = settings_for(url, stack, kafka_bootstrap_servers=bootstrap)
        conn = await exits.enter_async_context(connection(url))
        last = first + rows - 1
        stop = asyncio.Event()
        async with dispatchers(settings, processes):
            writer = asyncio.create_task(new_key_writer(url, topic, rate, 10, stop, "live-"))
            try:
                stranded = await wait_drained(conn, first, last, interval=0.05)
            finally:
                stop.set()
                written = await writer
            stranded += await wait_drained(conn, first, interval=0.05)
        span = await conn.fetchval(
            "SELECT extract(epoch FROM max(published_at) - min(published_at)) FROM outbox "
            "WHERE id >= $1",
            first,
        )
    return {
        "events_per_second": (rows + written) / max(float(span or 0), 1e-3),
        "written_meanwhile": float(written),
        "rows_stranded": float(stranded),
    }


def _owner_pid(owner: str) -> int:
    """A lease owner is host:pid:suffix (dispatch/supervisor.py's instance_id)."""
    return int(owner.rsplit(":", 2)[1])


@dataclass
class Frozen:
    """The victim stopped while it held leases, as the database saw it then."""

    at: datetime  # the database clock just before the stop
    rows: list[int]  # the first unpublished row of each key it held
    pending: int  # the table's pending rows
    top: int  # the table's highest id


async def _table_state(conn: asyncpg.Connection) -> tuple[int, int]:
    """(pending rows, highest id): once before the stream and once at the stop, to show that the
    writer offered more than the dispatchers drained."""
    row = await conn.fetchrow(
        "SELECT count(*) FILTER (WHERE published_at IS NULL AND dead_at IS NULL) AS pending, "
        "coalesce(max(id), 0) AS top FROM outbox"
    )
    assert row is not None
    return int(row["pending"]), int(row["top"])


async def _quiesce(conn: asyncpg.Connection, ports: set[int]) -> None:
    """Until no backend of the stopped process is running a statement that can still finish: what
    it sent before the stop commits (or waits to send its result, ClientWrite, and is rolled back
    by the kill), so that the database shows what it holds."""
    until = time.monotonic() + 5
    while time.monotonic() < until and await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE client_port = ANY ($1::int[]) "
        "AND state = 'active' AND wait_event IS DISTINCT FROM 'ClientWrite'",
        list(ports),
    ):
        await asyncio.sleep(0.02)


async def _held_rows(conn: asyncpg.Connection, pid: int) -> list[int]:
    """The first unpublished row of each key whose lease `pid` holds (`outbox_leases`)."""
    firsts = await conn.fetch(
        "SELECT min(id) AS id, min(lease_owner) AS owner FROM outbox_leases "
        "GROUP BY coalesce(ordering_key, id::text)"
    )
    return [r["id"] for r in firsts if _owner_pid(r["owner"]) == pid]


async def _freeze_holding(conn: asyncpg.Connection, victim: subprocess.Popen[bytes]) -> Frozen:
    """SIGSTOP the victim and read what it holds from the database; a stop that finds it between
    batches is undone (SIGCONT) and tried again. Stopping first makes the held leases exact: a
    running process settles what it holds between any read and its kill (the scenario once
    found 0 orphans that way)."""
    for _ in range(100):
        at = await conn.fetchval("SELECT clock_timestamp()")
        victim.send_signal(signal.SIGSTOP)
        try:
            await _quiesce(conn, tcp_ports(victim.pid))
            if rows := await _held_rows(conn, victim.pid):
                return Frozen(at, rows, *await _table_state(conn))
        except BaseException:
            victim.send_signal(signal.SIGCONT)  # so that the group's SIGTERM can stop it
            raise
        victim.send_signal(signal.SIGCONT)
        await asyncio.sleep(0.05)
    msg = "the victim held no lease at any of 100 stops"
    raise RuntimeError(msg)


async def _republished(conn: asyncpg.Connection, frozen: Frozen) -> list[float | None]:
    """Seconds from the stop to each orphaned row's publication by the survivor; None for a row
    still unpublished ORPHAN_WAIT s after it."""
    until = time.monotonic() + ORPHAN_WAIT
    while time.monotonic() < until and await conn.fetchval(
        "SELECT count(*) FROM outbox WHERE id = ANY ($1) AND published_at IS NULL "
        "AND dead_at IS NULL",
        frozen.rows,
    ):
        await asyncio.sleep(0.1)
    after = await conn.fetch(
        "SELECT extract(epoch FROM published_at - $1::timestamptz) AS s FROM outbox "
        "WHERE id = ANY ($2)",
        frozen.at,
        frozen.rows,
    )
    return [float(r["s"]) if r["s"] is not None else None for r in after]


async def orphans_killed(stack: Stack, rows: int) -> dict[str, float]:
    """Review P3: two dispatchers (lease ORPHAN_LEASE s, a broker ORPHAN_BROKER_DELAY s away each
    way) drain a backlog of `rows` rows of new keys (two a key) while a writer offers rows of new
    keys faster than they drain. After ORPHAN_STREAM s one is stopped at a moment it holds leases
    (`_freeze_holding`) and killed (SIGKILL). For each key it held, the time from the stop to its
    first held row's publication by the survivor, by the database clock: the worst and the p99,
    and how many keys took longer than lease + ORPHAN_GRACE s. Rows still unpublished
    ORPHAN_WAIT s on count at that bound (`orphan_keys_unpublished`)."""
    async with fresh(stack) as (url, topic), contextlib.AsyncExitStack() as exits:
        conn = await exits.enter_async_context(connection(url))
        await prefill(url, topic, rows, max(rows // 2, 1), prefix="new-")
        bootstrap = await exits.enter_async_context(slow_broker(stack, ORPHAN_BROKER_DELAY))
        settings = settings_for(
            url, stack, lease_seconds=ORPHAN_LEASE, kafka_bootstrap_servers=bootstrap
        )
        stop = asyncio.Event()
        async with dispatchers(settings, 2) as group:
            await wait_ready(url, group)
            before = await _table_state(conn)
            started = time.monotonic()
            writer = asyncio.create_task(
                new_key_writer(url, topic, None, ORPHAN_PER_TX, stop, "live-")
            )
            try:
                await asyncio.sleep(ORPHAN_STREAM)
                victim = group.processes[0]
                frozen = await _freeze_holding(conn, victim)
                streamed = time.monotonic() - started
                victim.send_signal(signal.SIGKILL)
                victim.wait()
                delays = await _republished(conn, frozen)
            finally:
                stop.set()
                await writer
    return _orphan_figures(frozen, delays, before, streamed)


def _orphan_figures(
    frozen: Frozen, delays: list[float | None], before: tuple[int, int], streamed: float
) -> dict[str, float]:
    """The scenario's figures; a row never republished counts at the wait's bound."""
    unpublished = sum(d is None for d in delays)
    if unpublished:
        print(f"orphans_killed: {unpublished} orphaned keys not republished {ORPHAN_WAIT:g} s on")
    bounded = sorted(ORPHAN_WAIT if d is None else d for d in delays)
    pending, top = before
    written = frozen.top - top
    drained = written - (frozen.pending - pending)
    if drained >= written:
        print(f"orphans_killed: the writer offered {written} rows, they drained {drained}")
    return {
        "lease_seconds": ORPHAN_LEASE,
        "orphan_keys": float(len(bounded)),
        "worst_first_republished_s": bounded[-1],
        "p99_first_republished_s": bounded[min(len(bounded) - 1, int(0.99 * len(bounded)))],
        "worst_beyond_lease_s": bounded[-1] - ORPHAN_LEASE,
        "orphan_keys_late": float(sum(d > ORPHAN_LEASE + ORPHAN_GRACE for d in bounded)),
        "orphan_keys_unpublished": float(unpublished),
        "pending_at_kill": float(frozen.pending),
        "offered_per_s": written / streamed,
        "drained_per_s": drained / streamed,
    }


async def _consume(
    consumer: AIOKafkaConsumer,
    received: dict[str, float],
    committed: dict[str, float],
    stop: asyncio.Event,
) -> None:
    quiet = time.monotonic()
    while not stop.is_set() or len(received) < len(committed):
        batch = await consumer.getmany(timeout_ms=20, max_records=20_000)
        now = time.monotonic()
        for records in batch.values():
            for record in records:
                received.setdefault(dict(record.headers)["event-id"].decode(), now)
                quiet = now
        if stop.is_set() and now - quiet > 30:
            return


async def pause_readers(stack: Stack, rate: float, seconds: float) -> dict[str, float]:
    """Review P5: writers commit one-row transactions of one topic at `rate` for `seconds`
    around this: an open transaction reads the pauses (a report, pg_dump), `outbox-dispatcher
    pause` of another topic runs (and waits for that reader, as a pause does), and the reader
    commits PAUSE_HELD s later. The worst commit-to-consume delay of the first topic's records
    (and their p99)."""
    async with fresh(stack) as (url, topic), connection(url) as reader:
        committed: dict[str, float] = {}
        received: dict[str, float] = {}
        async with dispatchers(settings_for(url, stack)) as group:
            await wait_ready(url, group)
            consumer = AIOKafkaConsumer(
                topic,
                bootstrap_servers=stack.bootstrap,
                auto_offset_reset="earliest",
                group_id=None,
                fetch_max_wait_ms=5,
            )
            await consumer.start()
            stop = asyncio.Event()
            consuming = asyncio.create_task(_consume(consumer, received, committed, stop))
            try:
                load = asyncio.create_task(
                    write_load(url, topic, rate, 1, seconds + PAUSE_HELD, committed)
                )
                await asyncio.sleep(seconds / 2)
                tx = reader.transaction()
                await tx.start()
                await reader.fetch("SELECT * FROM outbox_paused")
                pause_took = await _pause(url, f"{topic}-paused", tx)
                await load
                stop.set()
                await consuming
            finally:
                consuming.cancel()
                await consumer.stop()
    delays = sorted(received[e] - t for e, t in committed.items() if e in received)
    stranded = len(committed) - len(delays)
    if stranded:
        print(f"STRANDED: {stranded} committed events not consumed (nothing new for 30 s)")
    return {
        "worst_delay_s": delays[-1] if delays else 0.0,
        "p99_ms": 1000 * delays[min(len(delays) - 1, int(0.99 * len(delays)))] if delays else 0,
        "pause_seconds": pause_took,
        "rows_stranded": float(stranded),
    }


async def _pause(url: str, topic: str, reader: Transaction) -> float:
    """`outbox-dispatcher pause --topic` as an operator runs it, while `reader`'s transaction
    stays open PAUSE_HELD s; the seconds the command took."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env |= {"OUTBOX_DATABASE_URL": url, "OUTBOX_LOG_LEVEL": "WARNING"}
    started = time.monotonic()
    with (RESULTS / "dispatcher.log").open("ab") as log:
        command = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "outbox_dispatcher",
            "pause",
            "--topic",
            topic,
            "--reason",
            "benchmark",
            "--yes",
            env=env,
            stdout=log,
            stderr=log,
        )
        try:
            await asyncio.sleep(PAUSE_HELD)
            await reader.commit()
            await asyncio.wait_for(command.wait(), 60)
        finally:
            if command.returncode is None:
                command.kill()
                await command.wait()
    assert command.returncode == 0, f"pause failed ({command.returncode}); see dispatcher.log"
    return time.monotonic() - started
