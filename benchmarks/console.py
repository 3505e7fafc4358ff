"""The operator console at scale (issue 22): every page against 100,000 dead rows (beside 100,000
published rows of history), a bulk requeue of all of them through the API (its progress, an
abort, the record's count against the rows it changed, then the rest), and what the console's
schema costs writers (the two partial indexes of dead rows, the `replays` column).

    python -m benchmarks.console [--dead 100000] [--writer-seconds 5]

Against the local stack (deploy/local/services.sh, the same variables as `make bench`), with the
real `outbox-dispatcher console` process over HTTP. Prints the figures and writes them to
benchmarks/results/console-latest.json. Not part of `make bench`: it fills its own database.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from benchmarks.harness import machine
from benchmarks.load import write_load as writer_load
from benchmarks.stack import RESULTS, Stack, drop_database, fresh, make_template

TOKEN = "console-benchmark-token-0123456789"  # noqa: S105 - a test token
AUTH = {"authorization": f"Bearer {TOKEN}"}
ERRORS = (
    "UnknownTopicOrPartitionError: topic 'orders-v%s' does not exist: create the topic",
    "the record is %s bytes serialized, larger than OUTBOX_KAFKA_MAX_REQUEST_BYTES=1048576",
    "dead-lettered: the lease expired 10 times (last owner host-%s:1:ab12cd); last error: none",
    "KafkaTimeoutError: no acknowledgement within 20 s (attempt %s)",
)


async def fill(url: str, dead: int) -> None:
    """`dead` dead rows over 5 topics, 70 % of them keyed (5,000 keys), four causes, deaths over
    two days; as many published rows before them, and a few pending ones."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            "INSERT INTO outbox (topic, ordering_key, payload, headers, published_at, created_at)"
            " SELECT 'orders-' || (g % 5), 'k-' || (g % 5000), convert_to('{\"n\": ' || g || '}',"
            " 'UTF8'), jsonb_build_object('traceparent', '00-' || md5(g::text) || '-01'),"
            " now() - interval '3 days', now() - interval '3 days' FROM generate_series(1, $1) g",
            dead,
        )
        await conn.execute(
            "INSERT INTO outbox (topic, ordering_key, payload, headers, dead_at, attempts,"
            "                    last_error)"
            " SELECT 'orders-' || (g % 5), CASE WHEN g % 10 < 7 THEN 'k-' || (g % 5000) END,"
            "        convert_to('{\"n\": ' || g || '}', 'UTF8'),"
            "        jsonb_build_object('traceparent', '00-' || md5(g::text) || '-01'),"
            "        now() - (g % 2880) * interval '1 minute', 10,"
            "        format(($2::text[])[1 + g % 4], g % 97)"
            "   FROM generate_series(1, $1) g",
            dead,
            list(ERRORS),
        )
        await conn.execute(
            "INSERT INTO outbox (topic, ordering_key, payload)"
            " SELECT 'orders-0', 'live-' || g, 'x' FROM generate_series(1, 100) g"
        )
    finally:
        await conn.close()


def start_console(url: str, port: int, batch_size: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        OUTBOX_DATABASE_URL=url,
        OUTBOX_CONSOLE_PORT=str(port),
        OUTBOX_CONSOLE_TOKEN=TOKEN,
        OUTBOX_CONSOLE_SHOW_PAYLOAD="true",
        OUTBOX_CLEANUP_BATCH_SIZE=str(batch_size),
        OUTBOX_LOG_LEVEL="WARNING",
    )
    return subprocess.Popen(
        [sys.executable, "-m", "outbox_dispatcher", "console"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def timed(c: httpx.AsyncClient, path: str, times: int = 5) -> dict[str, float]:
    seconds = []
    for _ in range(times):
        started = time.monotonic()
        answer = await c.get(path)
        seconds.append(time.monotonic() - started)
        assert answer.status_code == 200, (path, answer.status_code, answer.text[:300])
    return {"median_s": statistics.median(seconds), "max_s": max(seconds)}


async def pages(
    c: httpx.AsyncClient, conn: asyncpg.Connection, dead: int
) -> dict[str, dict[str, float]]:
    """Every page (and its API), five times each; a page near the end by its cursor."""
    deep = await conn.fetchval(
        "SELECT id FROM outbox WHERE dead_at IS NOT NULL ORDER BY id OFFSET $1 LIMIT 1",
        dead * 99 // 100,
    )
    row = await conn.fetchval("SELECT max(id) FROM outbox WHERE dead_at IS NOT NULL")
    event = await conn.fetchval("SELECT event_id FROM outbox WHERE id = $1", row)
    paths = {
        "overview": "/?refresh=off",
        "api status": "/api/v1/status",
        "dead, first page": "/dead",
        "dead, 1000 per page": "/dead?limit=1000",
        "dead, a page at 99 % by cursor": f"/dead?after={deep}",
        "dead, newest deaths first": "/dead?sort=-dead_at",
        "dead, one topic": "/dead?topic=orders-3",
        "dead, error text": "/dead?error=timeout",
        "dead, one key": "/dead?key=k-42",
        "api dead": "/api/v1/dead?limit=1000",
        "dead by cause": "/dead/groups",
        "rows, newest": "/rows",
        "rows, published of a key": "/rows?state=published&key=k-42",
        "rows, header text": "/rows?header=traceparent%3D00-abc",
        "rows, payload text": "/rows?payload=%22n%22%3A%2042%7D",
        "rows, by event id": f"/rows?event_id={event}",
        "row": f"/rows/{row}",
        "blocked keys": "/blocked",
        "routed": "/routed",
        "audit": "/audit",
    }
    return {name: await timed(c, path) for name, path in paths.items()}


async def _running_record(c: httpx.AsyncClient) -> dict[str, Any]:
    while True:
        found = (await c.get("/api/v1/audit", params={"status": "running", "limit": 1})).json()
        if found["actions"]:
            return dict(found["actions"][0])
        await asyncio.sleep(0.05)


async def bulk_requeue(
    c: httpx.AsyncClient, conn: asyncpg.Connection, total: int
) -> dict[str, Any]:
    """Requeue every dead row through the API: follow its record's progress from other requests
    while it runs, abort it past 40 %, compare the record with the table; then requeue the rest
    to the end and time it."""
    started = time.monotonic()
    request = asyncio.create_task(
        c.post("/api/v1/dead/requeue", json={"all": True}, headers={"idempotency-key": "bench-1"})
    )
    record = await _running_record(c)
    job = f"/api/v1/jobs/{record['id']}"
    progress: list[tuple[float, int]] = []
    during: list[float] = []
    while record["status"] == "running":
        progress.append((round(time.monotonic() - started, 2), record["rows"]))
        if record["rows"] >= 0.4 * total and not record["abort_requested_at"]:
            await c.post(f"{job}/abort")
        during.append((await timed(c, "/dead", 1))["median_s"])
        await asyncio.sleep(0.2)
        record = (await c.get(job)).json()
    first = await request
    changed = await conn.fetchval(
        "SELECT count(*) FROM outbox WHERE last_error LIKE 'requeued by operator%'"
    )
    aborted = {
        "api_status": first.status_code,
        "status": record["status"],
        "detail": record["detail"],
        "expected": record["expected"],
        "record_rows": record["rows"],
        "rows_changed_in_table": changed,
        "record_equals_table": record["rows"] == changed,
        "seconds_to_abort": round(time.monotonic() - started, 1),
        "progress_samples": progress,
        "dead_page_while_running_max_s": max(during, default=0.0),
    }
    rest_started = time.monotonic()
    second = await c.post(
        "/api/v1/dead/requeue", json={"all": True}, headers={"idempotency-key": "bench-2"}
    )
    job = second.json()["job"]
    while (record := (await c.get(job)).json())["status"] == "running":
        await asyncio.sleep(0.5)
    elapsed = time.monotonic() - rest_started
    left = await conn.fetchval("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL")
    return {
        "aborted_run": aborted,
        "rest": {
            "status": record["status"],
            "rows": record["rows"],
            "seconds": round(elapsed, 1),
            "rows_per_second": round(record["rows"] / elapsed),
            "dead_rows_left": left,
        },
    }


async def writer_cost(stack: Stack, seconds: float, rounds: int) -> dict[str, float]:
    """Writers' rows/s (10-row transactions, 4 connections) into the outbox as migrated and
    without what version 12 (the console) added to it, alternating, `rounds` times each."""
    cases = {
        "outbox": "",
        "without_console": "DROP INDEX outbox_dead_id_idx, outbox_dead_at_idx; "
        "ALTER TABLE outbox DROP COLUMN replays",
    }
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, ddl in cases.items():
            async with fresh(stack) as (url, topic):
                conn = await asyncpg.connect(url)
                try:
                    if ddl:
                        await conn.execute(ddl)
                finally:
                    await conn.close()
                written = await writer_load(url, topic, None, 10, seconds, {}, 4, "outbox")
                rates[name].append(written / seconds)
    result = {f"rows_per_second_{n}": statistics.median(r) for n, r in rates.items()}
    base = result["rows_per_second_without_console"]
    result["cost_percent"] = 100 * (1 - result["rows_per_second_outbox"] / base)
    return result


async def main_async(args: argparse.Namespace) -> int:
    stack = Stack.from_env()
    await make_template(stack)
    report: dict[str, Any] = {"when": datetime.now(UTC).isoformat(timespec="seconds")}
    report["machine"] = machine()
    try:
        async with fresh(stack) as (url, _topic):
            started = time.monotonic()
            await fill(url, args.dead)
            report["fill_seconds"] = round(time.monotonic() - started, 1)
            port = 19000 + os.getpid() % 1000
            console = start_console(url, port, args.batch_size)
            conn = await asyncpg.connect(url)
            try:
                base = f"http://127.0.0.1:{port}"
                async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=60) as c:
                    for _ in range(100):
                        try:
                            await c.get("/api/v1/status")
                            break
                        except httpx.TransportError:
                            await asyncio.sleep(0.2)
                    report["pages_before_analyze"] = await pages(c, conn, args.dead)
                    await conn.execute("ANALYZE outbox")
                    report["pages"] = await pages(c, conn, args.dead)
                    report["bulk_requeue"] = await bulk_requeue(c, conn, args.dead)
            finally:
                await conn.close()
                console.terminate()
                console.wait(30)
        report["writer_cost"] = await writer_cost(stack, args.writer_seconds, args.rounds)
    finally:
        admin = await asyncpg.connect(stack.admin_url)
        await drop_database(admin, stack.template)
        await admin.close()
    out = Path(args.out) if args.out else RESULTS / "console-latest.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"written: {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.console", description=__doc__)
    parser.add_argument("--dead", type=int, default=100_000, help="dead rows (100,000)")
    parser.add_argument(
        "--batch-size", type=int, default=200, help="OUTBOX_CLEANUP_BATCH_SIZE (200)"
    )
    parser.add_argument("--writer-seconds", type=float, default=5.0, help="per writer case")
    parser.add_argument("--rounds", type=int, default=5, help="writer cases, alternating")
    parser.add_argument("--out", default="", help="JSON result file")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
