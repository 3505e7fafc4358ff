"""Issue 34's scenarios of things going wrong under load, each bounded in time and on loopback:
new keys arriving faster than one process drains (`scaling_new_keys_*`), the orphans of a
process killed under a backlog of new keys (`orphans_killed`), and the other topics' delay while
a pause waits for an open transaction that read the pauses (`pause_readers`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time

from aiokafka import AIOKafkaConsumer
from asyncpg.transaction import Transaction

from benchmarks.drains import wait_drained
from benchmarks.load import PAYLOAD, prefill, write_load
from benchmarks.processes import dispatchers, slow_broker, wait_ready
from benchmarks.stack import RESULTS, Stack, connection, fresh, settings_for

ORPHAN_LEASE = 5.0  # lease_seconds of orphans_killed's dispatchers
ORPHAN_GRACE = 5.0  # the goal: each orphaned key's first row republished within lease + this
ORPHAN_WAIT = 40.0  # seconds after the kill before the scenario stops waiting (a bound)
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


async def orphans_killed(stack: Stack, rows: int) -> dict[str, float]:
    """Review P3: two dispatchers (lease ORPHAN_LEASE s) drain a backlog of `rows` rows of new
    keys (two rows a key) while a writer adds rows of new keys as fast as it can; one is killed
    (SIGKILL) holding leases. For each key it held, the time from the kill to its first held
    row's republication by the other, by the database clock; the worst, and how many keys
    took longer than lease + ORPHAN_GRACE s. Keys still waiting ORPHAN_WAIT s after the kill
    count at that bound (`orphan_keys_unpublished`)."""
    async with fresh(stack) as (url, topic), connection(url) as conn:
        await prefill(url, topic, rows, max(rows // 2, 1), prefix="new-")
        settings = settings_for(url, stack, lease_seconds=ORPHAN_LEASE)
        stop = asyncio.Event()
        async with dispatchers(settings, 2) as group:
            await wait_ready(url, group)
            writer = asyncio.create_task(new_key_writer(url, topic, None, 50, stop, "live-"))
            try:
                victim = group.processes[0]
                deadline = time.monotonic() + 30
                held = 0
                while not held and time.monotonic() < deadline:
                    owners = await conn.fetch(
                        "SELECT lease_owner, count(*) FROM outbox_leases GROUP BY lease_owner"
                    )
                    held = sum(r["count"] for r in owners if _owner_pid(r[0]) == victim.pid)
                    await asyncio.sleep(0.05)
                killed_at = await conn.fetchval("SELECT clock_timestamp()")
                victim.send_signal(signal.SIGKILL)
                # Its rows as its claims left them: the first held row of each key.
                firsts = await conn.fetch(
                    "SELECT ordering_key, min(id) AS id, min(lease_owner) AS owner "
                    "FROM outbox_leases GROUP BY ordering_key"
                )
                orphans = [r["id"] for r in firsts if _owner_pid(r["owner"]) == victim.pid]
                until = time.monotonic() + ORPHAN_WAIT
                while time.monotonic() < until and await conn.fetchval(
                    "SELECT count(*) FROM outbox WHERE id = ANY ($1) AND published_at IS NULL "
                    "AND dead_at IS NULL",
                    orphans,
                ):
                    await asyncio.sleep(0.1)
                waited = await conn.fetchval(
                    "SELECT extract(epoch FROM clock_timestamp() - $1::timestamptz)", killed_at
                )
                after = await conn.fetch(
                    "SELECT extract(epoch FROM published_at - $1::timestamptz) AS s FROM outbox "
                    "WHERE id = ANY ($2)",
                    killed_at,
                    orphans,
                )
            finally:
                stop.set()
                await writer
    # A row its own last settle marked (in flight at the kill) was published before: no orphan.
    delays = [float(r["s"]) if r["s"] is not None else float(waited) for r in after]
    delays = [d for d in delays if d > 0]
    unpublished = sum(r["s"] is None for r in after)
    limit = ORPHAN_LEASE + ORPHAN_GRACE
    if unpublished:
        print(f"orphans_killed: {unpublished} orphaned keys not republished {waited:.0f} s on")
    return {
        "lease_seconds": ORPHAN_LEASE,
        "orphan_keys": float(len(delays)),
        "worst_first_republished_s": max(delays, default=0.0),
        "worst_beyond_lease_s": max(delays, default=ORPHAN_LEASE) - ORPHAN_LEASE,
        "orphan_keys_late": float(sum(d > limit for d in delays)),
        "orphan_keys_unpublished": float(unpublished),
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
