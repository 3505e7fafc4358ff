"""Steady load: writers commit at a fixed offered rate while the dispatcher runs; and a dispatcher
with nothing to do."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer

from benchmarks import statements
from benchmarks.load import make_stuck, write_load
from benchmarks.processes import backend_cpu_by_pid, backend_cpu_since, dispatchers, wait_ready
from benchmarks.stack import Stack, connection, fresh, settings_for


async def sustained(
    stack: Stack,
    rate: float | None,
    rows_per_tx: int,
    seconds: float,
    *,
    stuck: str | None = None,
    stuck_rows: int = 0,
    count_statements: str = "",
    **opts: Any,
) -> dict[str, float]:
    """Writers commit at a fixed offered rate (None: as fast as they can) while the dispatcher
    runs; latency from each writer's COMMIT returning to the record reaching a consumer, both
    taken with this process's monotonic clock (an upper bound of commit-to-ack by one fetch).
    CPU of the dispatcher and of its backends from its start-up to the last record consumed.
    With `stuck`, STUCK_KEY's rows that cannot move are in the table first; `opts` are settings
    (in exactly-once the consumer reads read_committed, as such a consumer must). With
    `count_statements` (the scenario's name), the dispatcher's statements per cycle
    (benchmarks/statements.py) from the writers' start to the last record consumed."""
    async with contextlib.AsyncExitStack() as exits:
        url, topic = await exits.enter_async_context(fresh(stack))
        if stuck:
            opts |= await make_stuck(url, topic, stuck, stuck_rows)
        counter = None
        if count_statements:
            own, counter = await exits.enter_async_context(statements.counting(url))
            opts |= own
        settings = settings_for(opts.pop("database_url", url), stack, **opts)
        conn = await exits.enter_async_context(connection(url))
        group = await exits.enter_async_context(dispatchers(settings))
        await wait_ready(url, group)
        if counter is not None:
            await counter.read()
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
            isolation_level="read_committed",
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
            if counter is not None:
                await counter.read()
        finally:
            await consumer.stop()
    if timeline := os.environ.get("OUTBOX_BENCH_TIMELINE"):  # commit time and latency per row
        write_timeline(Path(timeline), committed, received)
    latencies = sorted((received[e] - t) * 1000 for e, t in committed.items() if e in received)
    # Committed and never consumed: nothing new arrived for 30 s after the writers stopped.
    stranded = len(committed) - len(latencies)
    if stranded:
        print(f"STRANDED: {stranded} committed events not consumed (nothing new for 30 s)")

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))] if latencies else 0

    counted: dict[str, float] = {}
    if counter is not None:
        counted, top = counter.figures()
        statements.record(count_statements, top)
    elif count_statements:
        statements.WHY_NOT[count_statements] = statements.COUNTING.why_not
    return counted | {
        "offered_per_second": rate or 0.0,
        "achieved_per_second": written / seconds,
        "p50_ms": pct(50),
        "p95_ms": pct(95),
        "p99_ms": pct(99),
        "dispatcher_cpu_ms_per_1k": cpu * 1000 / (max(written, 1) / 1000),
        "postgres_cpu_ms_per_1k": pg * 1000 / (max(written, 1) / 1000),
        "rows_stranded": float(stranded),
    }


def write_timeline(path: Path, committed: dict[str, float], received: dict[str, float]) -> None:
    """Each consumed row's commit time and latency (ms), in commit order, appended to `path`."""
    rows = sorted((t, (received[e] - t) * 1000) for e, t in committed.items() if e in received)
    with path.open("a") as out:
        out.writelines(f"{t:.6f} {latency:.3f}\n" for t, latency in rows)


async def idle(stack: Stack, seconds: float) -> dict[str, float]:
    """CPU of a dispatcher with nothing to do, as a percentage of one core."""
    async with fresh(stack) as (url, _), dispatchers(settings_for(url, stack)) as group:
        await wait_ready(url, group)
        await asyncio.sleep(1)
        cpu0 = group.cpu()
        await asyncio.sleep(seconds)
        cpu = group.cpu() - cpu0
    return {"cpu_percent_of_one_core": 100 * cpu / seconds}
