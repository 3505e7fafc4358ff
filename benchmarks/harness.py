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
from outbox_dispatcher import migrations
from outbox_dispatcher.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAYLOAD = 512
KEYS = 1000
TICKS = os.sysconf("SC_CLK_TCK")


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


FULL = Sizes(200_000, 50_000, 10_000, 200_000, 10.0, 30.0, 5.0, 3)
QUICK = Sizes(3_000, 1_000, 300, 3_000, 1.5, 2.0, 1.0, 1)


@dataclass
class Stack:
    admin_url: str
    bootstrap: str
    template: str = ""

    def url(self, database: str) -> str:
        base, _, _ = self.admin_url.rpartition("/")
        return f"{base}/{database}"


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


async def prefill(url: str, topic: str, rows: int, keys: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            "INSERT INTO outbox (topic, ordering_key, payload, headers) "
            "SELECT $1, 'key-' || (i % $2), convert_to(lpad(i::text, $3, 'x'), 'UTF8'), "
            "jsonb_build_object('seq', (i / $2)::text) FROM generate_series(0, $4 - 1) i",
            topic,
            keys,
            PAYLOAD,
            rows,
        )
        await conn.execute("VACUUM ANALYZE outbox")
    finally:
        await conn.close()


def settings_for(url: str, stack: Stack, **overrides: Any) -> Settings:
    overrides.setdefault("http_port", 0)
    return Settings(database_url=url, kafka_bootstrap_servers=stack.bootstrap, **overrides)


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


async def backend_cpu(conn: asyncpg.Connection) -> float:
    pids = await conn.fetch(
        "SELECT pid FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name = 'outbox-dispatcher'"
    )
    total = 0.0
    for row in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(row["pid"])
    return total


# -- scenarios --


async def drain(
    stack: Stack, rows: int, keys: int, processes: int = 1, **opts: Any
) -> dict[str, float]:
    """Rows already in the table; events/s from the first to the last row marked published."""
    async with fresh(stack) as (url, topic):
        await prefill(url, topic, rows, keys)
        settings = settings_for(url, stack, **opts)
        conn = await asyncpg.connect(url)
        try:
            first = await conn.fetchval("SELECT min(id) FROM outbox")
            async with dispatchers(settings, processes) as group:
                # The clock starts when the oldest row is gone or published (as the database
                # clock does with the first published_at), not at process start-up.
                while await conn.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM outbox WHERE id = $1 AND published_at IS NULL)",
                    first,
                ):
                    await asyncio.sleep(0.005)
                started = time.monotonic()
                cpu0 = group.cpu()
                pg0 = await backend_cpu(conn)
                wal0 = await conn.fetchval("SELECT pg_current_wal_lsn()")
                while await conn.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM outbox "
                    "WHERE published_at IS NULL AND dead_at IS NULL)"
                ):
                    await asyncio.sleep(0.02)
                wall = time.monotonic() - started
                cpu = group.cpu() - cpu0
                pg = await backend_cpu(conn) - pg0
                wal = await conn.fetchval("SELECT pg_current_wal_lsn() - $1::pg_lsn", wal0)
            span = await conn.fetchval(
                "SELECT extract(epoch FROM max(published_at) - min(published_at)) FROM outbox"
            )
            dead = await conn.fetchval("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
        finally:
            await conn.close()
    assert dead == 0, f"{dead} rows dead-lettered in a benchmark"
    return {
        # By the database clock, first to last mark; with delete_on_publish (no marks) by this
        # process's clock from the dispatcher's connection to the last row gone.
        "events_per_second": rows / max(float(span) if span is not None else wall, 1e-3),
        "events_per_second_wall": rows / max(wall, 1e-3),
        "dispatcher_cpu_ms_per_1k": cpu * 1000 / (rows / 1000),
        "postgres_cpu_ms_per_1k": pg * 1000 / (rows / 1000),
        "wal_bytes_per_event": float(wal) / rows,
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
                while await conn.fetchval(
                    "SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_at IS NULL"
                ):
                    await asyncio.sleep(0.05)
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
    stack: Stack, rate: float | None, rows_per_tx: int, seconds: float
) -> dict[str, float]:
    """Writers commit at a fixed offered rate (None: as fast as they can) while the dispatcher
    runs; latency from each writer's COMMIT returning to the record reaching a consumer, both
    taken with this process's monotonic clock (an upper bound of commit-to-ack by one fetch)."""
    async with fresh(stack) as (url, topic):
        settings = settings_for(url, stack)
        async with dispatchers(settings) as group:
            await wait_ready(url, group)
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

            async def consume() -> None:
                while not stop.is_set() or len(received) < len(committed):
                    batch = await consumer.getmany(timeout_ms=20, max_records=20_000)
                    now = time.monotonic()
                    for records in batch.values():
                        for record in records:
                            event_id = dict(record.headers)["event-id"].decode()
                            received.setdefault(event_id, now)
                    if stop.is_set() and time.monotonic() > stop_deadline:
                        return

            stop_deadline = float("inf")
            reader = asyncio.create_task(consume())
            try:
                written = await write_load(url, topic, rate, rows_per_tx, seconds, committed)
                stop_deadline = time.monotonic() + 30
                stop.set()
                await reader
            finally:
                await consumer.stop()
    latencies = sorted((received[e] - t) * 1000 for e, t in committed.items() if e in received)
    lost = len(committed) - len(latencies)
    assert lost == 0, f"{lost} committed events not consumed within 30 s"

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))]

    return {
        "offered_per_second": rate or 0.0,
        "achieved_per_second": written / seconds,
        "p50_ms": pct(50),
        "p95_ms": pct(95),
        "p99_ms": pct(99),
    }


async def write_load(
    url: str,
    topic: str,
    rate: float | None,
    rows_per_tx: int,
    seconds: float,
    committed: dict[str, float],
    connections: int = 8,
) -> int:
    """Writer transactions of `rows_per_tx` rows, paced to `rate` rows/s over `connections`."""
    pool = await asyncpg.create_pool(url, min_size=connections, max_size=connections)
    assert pool is not None
    payload = b"x" * PAYLOAD
    start = time.monotonic()
    end = start + seconds
    tx_interval = (rows_per_tx / rate) * connections if rate else 0.0
    sql = (
        "INSERT INTO outbox (topic, ordering_key, payload) "
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
    """Writer throughput (10-row transactions, as fast as possible) with and without the NOTIFY
    trigger, no dispatcher running."""
    results = {}
    for trigger in (True, False):
        async with fresh(stack) as (url, topic):
            if not trigger:
                conn = await asyncpg.connect(url)
                await conn.execute("ALTER TABLE outbox DISABLE TRIGGER outbox_notify")
                await conn.close()
            written = await write_load(url, topic, None, 10, seconds, {})
            results["with_notify" if trigger else "without_notify"] = written / seconds
    results["notify_cost_percent"] = 100 * (1 - results["with_notify"] / results["without_notify"])
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
        "writer_notify_cost": lambda: writer_cost(stack, s.writer_seconds),
    }
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
    def eps(name: str) -> float:
        return results.get(name, {}).get("events_per_second", float("nan"))

    return {
        "drain_vs_kafka_only": eps("drain") / eps("baseline_kafka_only"),
        "drain_vs_postgres_only": eps("drain") / eps("baseline_postgres_only"),
        "drain_vs_handwritten": eps("drain") / eps("baseline_handwritten"),
        "two_processes_vs_one": eps("scaling_2_processes") / eps("scaling_4_tasks"),
    }


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


def table(results: dict[str, dict[str, float]], derived: dict[str, float]) -> str:
    lines = ["| scenario | figures |", "|---|---|"]
    for name, figures in results.items():
        shown = ", ".join(f"{k} {v:,.1f}" for k, v in figures.items())
        lines.append(f"| {name} | {shown} |")
    for name, value in derived.items():
        lines.append(f"| ratio {name} | {value:.2f} |")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    sizes = QUICK if args.quick else FULL
    runs = args.runs or sizes.runs
    stack = Stack(
        admin_url=os.environ.get(
            "OUTBOX_BENCH_DATABASE_URL", "postgresql://outbox:outbox@127.0.0.1:5432/outbox"
        ),
        bootstrap=os.environ.get("OUTBOX_BENCH_KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    await make_template(stack)
    scenarios = plan(stack, sizes)
    chosen = args.only.split(",") if args.only else list(scenarios)
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
    report = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "runs": runs,
        "quick": args.quick,
        "results": results,
        "ratios": derived,
    }
    out = Path(args.out) if args.out else RESULTS / "latest.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    m = report["machine"]
    markdown = (
        f"Run {report['when']} on {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, "
        f"Python {m['python']} ({m['note']}); median of {runs} runs.\n\n" + table(results, derived)
    )
    out.with_suffix(".md").write_text(markdown + "\n")
    print(table(results, derived))
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
