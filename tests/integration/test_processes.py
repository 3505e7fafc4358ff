"""Real `outbox-dispatcher` processes: several at once, kill -9, SIGTERM, the CLI."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest

from outbox_dispatcher.store import migrations

from .helpers import (
    LEASED,
    LIVE_LEASE,
    Services,
    check,
    consume,
    count,
    event_ids,
    insert_sequenced,
    kill9,
    kill9_with_rows_in_flight,
    settings_env,
    spawn,
    stop_all,
    wait_all_settled,
    wait_started,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_three_processes_publish_10k_rows_over_200_keys_in_order(
    conn: asyncpg.Connection,
    services: Services,
    topic: str,
    make_settings: Any,
    tmp_path: Path,
    record_property: Any,
) -> None:
    # A claim takes at most batch_size keys (one owner per key): fewer than the table has, so
    # that there is work for several processes at once.
    settings = make_settings(claim_tasks=2, batch_size=50, log_format="json")
    logs = [tmp_path / f"d{i}.log" for i in range(3)]
    processes = [spawn(settings, log) for log in logs]
    try:
        await wait_started(logs)
        await insert_sequenced(conn, topic, keys=200, per_key=50)  # one transaction
        started = time.monotonic()
        await wait_all_settled(conn, 180)
        elapsed = time.monotonic() - started
    finally:
        codes = stop_all(processes)
    assert codes == [0, 0, 0], [(tmp_path / f"d{i}.log").read_text()[-3000:] for i in range(3)]
    shares = await conn.fetch(
        "SELECT lease_owner, count(*) AS n FROM outbox GROUP BY 1 ORDER BY 2 DESC"
    )
    assert len(shares) >= 2, "the processes shared the work"
    records = await consume(services.kafka_bootstrap_servers, topic, 10_000, timeout=120)
    verdict = check(records, await event_ids(conn))
    for record in records:  # the row's own headers travel with it
        assert dict(record.headers)["seq"] == str(orjson.loads(record.value or b"")["seq"]).encode()
    assert (len(verdict.lost), verdict.reordered, verdict.unexpected) == (0, [], [])
    assert verdict.delivered == 10_000
    assert await count(conn, f"published_at IS NULL OR {LEASED}") == 0
    rate = 10_000 / elapsed
    record_property("rows_per_second", round(rate))
    print(
        f"\n3 processes: 10000 rows in {elapsed:.2f}s = {rate:.0f} rows/s "
        f"(from the insert's commit), duplicates {verdict.duplicates}, rows per process "
        f"{[r['n'] for r in shares]}"
    )


async def test_kill_9_mid_batch_loses_nothing_and_keeps_order(
    conn: asyncpg.Connection,
    services: Services,
    topic: str,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    await insert_sequenced(conn, topic, keys=50, per_key=100)
    # Slow each batch down (linger) so that the kill lands with batches in flight.
    settings = make_settings(
        claim_tasks=2, batch_size=50, lease_seconds=3, kafka_linger_ms=200, log_format="json"
    )
    victim = spawn(settings, tmp_path / "victim.log")
    survivor: subprocess.Popen[bytes] | None = None
    try:

        async def some_published() -> bool:
            return await count(conn, "published_at IS NOT NULL") >= 200

        await wait_until(some_published, 60, "the victim to publish some rows")
        in_flight = await kill9_with_rows_in_flight(conn, victim, LIVE_LEASE, 30)
        orphans = await count(conn, LIVE_LEASE)
        survivor = spawn(settings, tmp_path / "survivor.log")
        await wait_all_settled(conn, 120)
    finally:
        codes = stop_all([p for p in (victim, survivor) if p is not None])
    assert codes[-1] == 0
    assert orphans > 0
    assert await count(conn, "dead_at IS NOT NULL") == 0
    verdict = check(
        await consume(services.kafka_bootstrap_servers, topic, 5000, timeout=120),
        await event_ids(conn),
    )
    assert (len(verdict.lost), verdict.reordered, verdict.unexpected) == (0, [], [])
    # Duplicates only from the killed process's unmarked batches, each with its event id.
    assert verdict.duplicates <= in_flight
    reclaimed = await count(conn, "attempts > 0")
    assert reclaimed >= 1


async def test_sigterm_with_rows_in_flight_exits_0_and_leaves_nothing_leased(
    conn: asyncpg.Connection, topic: str, make_settings: Any, tmp_path: Path
) -> None:
    await insert_sequenced(conn, topic, keys=100, per_key=100)
    settings = make_settings(
        claim_tasks=4,
        batch_size=100,
        kafka_linger_ms=100,
        shutdown_grace_seconds=15,
        log_format="json",
    )
    process = spawn(settings, tmp_path / "d.log")
    try:

        async def busy() -> bool:
            return (
                await count(conn, "published_at IS NOT NULL") > 0
                and await count(conn, LIVE_LEASE) > 0
            )

        await wait_until(busy, 60, "rows in flight")
        process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(process.wait, 45)
    finally:
        if process.poll() is None:
            kill9(process)
    log = (tmp_path / "d.log").read_text()
    assert code == 0, log[-3000:]
    assert '"shutdown_requested"' in log and '"stopped"' in log
    assert await count(conn, LEASED) == 0, "nothing stays leased"
    assert await count(conn, "published_at IS NULL") > 0, "stopped before the end"
    assert "Traceback" not in log


async def test_sigterm_while_the_broker_is_away_still_exits_within_the_grace_period(
    conn: asyncpg.Connection,
    services: Services,
    topic: str,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    """Rows in flight to an unreachable broker: SIGTERM gives them back unmarked and the process
    ends (the producer's flush is bounded), instead of waiting for a broker that is not there."""
    settings = make_settings(shutdown_grace_seconds=3, log_format="json", lease_seconds=30)
    process = spawn(settings, tmp_path / "d.log")
    try:
        await wait_started([tmp_path / "d.log"])
        await services.broker("stop")
        try:
            await insert_sequenced(conn, topic, keys=10, per_key=10)

            async def in_flight() -> bool:
                return await count(conn, LIVE_LEASE) > 0

            await wait_until(in_flight, 30, "rows claimed while the broker is away")
            process.send_signal(signal.SIGTERM)
            started = time.monotonic()
            code = await asyncio.to_thread(process.wait, 60)
            took = time.monotonic() - started
        finally:
            await services.broker("start")
    finally:
        if process.poll() is None:
            kill9(process)
    log = (tmp_path / "d.log").read_text()
    assert code == 0, log[-3000:]
    assert '"stopped"' in log
    assert took < 30, f"took {took:.1f} s to stop"
    assert await count(conn, LEASED) == 0, "in-flight rows were given back"
    assert await count(conn, "published_at IS NOT NULL OR dead_at IS NOT NULL") == 0


async def test_cli_migrate_status_and_run_refusal(
    empty_database_url: str, make_settings: Any, tmp_path: Path
) -> None:
    env = settings_env(make_settings(database_url=empty_database_url, log_format="json"))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "outbox_dispatcher", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    refused = cli("run")
    assert refused.returncode == 1
    assert "run `outbox-dispatcher migrate`" in refused.stderr
    migrated = cli("migrate")
    assert migrated.returncode == 0, migrated.stderr
    every = list(range(1, migrations.latest_version() + 1))
    assert f'"applied":{json.dumps(every, separators=(",", ":"))}' in migrated.stderr
    again = cli("migrate")
    assert '"applied":[]' in again.stderr
    conn = await asyncpg.connect(empty_database_url)
    try:
        await conn.execute(
            "SELECT outbox_enqueue('a', 'k', 'x'); SELECT outbox_enqueue('a', 'k', 'y');"
            "SELECT outbox_enqueue('b', NULL, 'z');"
            "UPDATE outbox SET dead_at = now(), last_error = 'x' WHERE topic = 'b'"
        )
    finally:
        await conn.close()
    status = cli("status", "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["totals"]["pending"] == 2 and report["totals"]["dead"] == 1
    assert [t["topic"] for t in report["topics"]] == ["a", "b"]
    table = cli("status")
    assert table.stdout.splitlines()[0].split()[:4] == ["topic", "waiting", "in_flight", "dead"]
    bad = cli("status", "--table", "x;drop")
    assert bad.returncode == 2
    assert "OUTBOX_TABLE / --table" in bad.stderr
    assert "outbox:outbox" not in refused.stderr + migrated.stderr + status.stderr
