"""The dispatcher through PgBouncer in transaction pooling mode (deploy/local/services.sh starts
one on OUTBOX_TEST_PGBOUNCER_PORT, default 6432, with a wildcard database entry, so the per-test
databases are reachable through it).

What it takes: statement_cache_size=0 (PgBouncer 1.18, Debian 12's, has no prepared-statement
support; asyncpg then re-parses its unnamed statement inside each Bind/Execute, which a
transaction pooler keeps on one server connection), no session state (PgBouncer drops the
dispatcher's session settings, see ignore_startup_parameters in services.sh; nothing the
dispatcher does depends on them), and LISTEN over a direct DSN (listen_database_url) or polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from .helpers import (
    LIVE_LEASE,
    check,
    consume,
    count,
    event_ids,
    insert_sequenced,
    kill9_with_rows_in_flight,
    spawn,
    stop_all,
    wait_all_settled,
    wait_started,
    wait_until,
)
from .test_visibility import late_lower_id

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _pgbouncer_port() -> int:
    """OUTBOX_TEST_PGBOUNCER_PORT, else services.sh's (a second clone's services run on their
    own ports: OUTBOX_SERVICES_PGBOUNCER_PORT)."""
    return int(
        os.environ.get("OUTBOX_TEST_PGBOUNCER_PORT")
        or os.environ.get("OUTBOX_SERVICES_PGBOUNCER_PORT", "6432")
    )


def _through_pgbouncer(url: str) -> str:
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{userinfo}@127.0.0.1:{_pgbouncer_port()}"))


@pytest.fixture
async def pgbouncer_url(database_url: str) -> str:
    """The test database, through PgBouncer; skips where no PgBouncer runs."""
    url = _through_pgbouncer(database_url)
    try:
        conn = await asyncpg.connect(url, statement_cache_size=0, timeout=5)
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        pytest.skip(f"no PgBouncer on port {_pgbouncer_port()} ({exc!r}): services.sh start")
    try:
        assert await conn.fetchval("SELECT current_database()") == urlsplit(database_url).path[1:]
    finally:
        await conn.close()
    return url


async def test_concurrency_three_processes_through_pgbouncer(
    conn: asyncpg.Connection,
    database_url: str,
    pgbouncer_url: str,
    topic: str,
    make_settings: Any,
    services: Any,
    tmp_path: Path,
) -> None:
    common: dict[str, Any] = {
        "database_url": pgbouncer_url,
        "statement_cache_size": 0,
        "claim_tasks": 2,
        # Fewer keys per claim than the 100 keys written: work for several processes at once.
        "batch_size": 25,
        "log_format": "json",
        "http_port": 0,
    }
    listening = make_settings(listen_database_url=database_url, **common)
    polling = make_settings(listen=False, **common)
    logs = [tmp_path / f"d{i}.log" for i in range(3)]
    which = (listening, listening, polling)
    processes = [spawn(s, log) for s, log in zip(which, logs, strict=True)]
    try:
        await wait_started(logs)
        for first in range(0, 30, 10):  # three transactions, while the dispatchers run
            await insert_sequenced(conn, topic, keys=100, per_key=10, first_seq=first)
        await wait_all_settled(conn, 120)
    finally:
        codes = await asyncio.to_thread(stop_all, processes)
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0, 0], [t[-3000:] for t in texts]
    assert all("Traceback" not in t for t in texts)
    assert all('"listening"' in t for t in texts[:2]), "LISTEN over the direct DSN"
    assert '"listening"' not in texts[2]
    shares = await conn.fetch("SELECT lease_owner, count(*) AS n FROM outbox GROUP BY 1")
    assert len(shares) >= 2, "the processes shared the work"
    verdict = check(
        await consume(services.kafka_bootstrap_servers, topic, 3000, timeout=120),
        await event_ids(conn),
    )
    assert (len(verdict.lost), verdict.duplicates, verdict.reordered, verdict.unexpected) == (
        0,
        0,
        [],
        [],
    )
    assert verdict.delivered == 3000
    print(
        f"\npgbouncer concurrency: 3000 rows, 100 keys, 3 processes "
        f"(rows each {sorted(r['n'] for r in shares)}): lost 0, duplicates 0, reordered 0"
    )


async def test_crashes_kill_9_and_restart_under_write_load_through_pgbouncer(
    conn: asyncpg.Connection,
    database_url: str,
    pgbouncer_url: str,
    topic: str,
    make_settings: Any,
    services: Any,
    tmp_path: Path,
) -> None:
    settings = make_settings(
        database_url=pgbouncer_url,
        listen_database_url=database_url,
        statement_cache_size=0,
        claim_tasks=2,
        batch_size=50,
        lease_seconds=3,
        kafka_linger_ms=100,  # batches stay in flight long enough for a kill to land in one
        log_format="json",
        http_port=0,
    )
    writer = await asyncpg.connect(database_url)
    writing = True
    written = 0

    async def write() -> None:
        nonlocal written
        seq = 0
        while writing:
            await insert_sequenced(writer, topic, keys=20, per_key=2, first_seq=seq)
            seq += 2
            written += 40
            await asyncio.sleep(0.05)

    processes: list[subprocess.Popen[bytes]] = []
    in_flight_at_kills: list[int] = []
    load = asyncio.create_task(write())
    try:
        steady = spawn(settings, tmp_path / "steady.log")
        processes.append(steady)
        victim = spawn(settings, tmp_path / "victim-0.log")
        processes.append(victim)
        await wait_started([tmp_path / "steady.log", tmp_path / "victim-0.log"])
        for kill in range(3):

            async def victim_in_flight(pid: int = victim.pid) -> bool:
                n: int = await conn.fetchval(
                    "SELECT count(*) FROM outbox_leases WHERE lease_expires_at > now()"
                    " AND lease_owner LIKE '%:' || $1::text || ':%'",
                    str(pid),
                )
                return n > 0

            await wait_until(victim_in_flight, 60, "the victim to hold leased rows")
            in_flight_at_kills.append(await kill9_with_rows_in_flight(conn, victim, LIVE_LEASE, 30))
            victim = spawn(settings, tmp_path / f"victim-{kill + 1}.log")
            processes.append(victim)
            await asyncio.sleep(1.0)
        writing = False
        await load
        await wait_all_settled(conn, 120)
    finally:
        writing = False
        with contextlib.suppress(Exception):
            await load
        await writer.close()
        codes = await asyncio.to_thread(stop_all, processes)
    # The killed ones report -9; the steady one and the last restart stop cleanly.
    assert codes[0] == 0 and codes[-1] == 0, codes
    assert await count(conn) == written
    assert await count(conn, "dead_at IS NOT NULL") == 0
    reclaimed = await count(conn, "attempts > 0")
    verdict = check(
        await consume(services.kafka_bootstrap_servers, topic, written, timeout=120),
        await event_ids(conn),
    )
    assert (len(verdict.lost), verdict.reordered, verdict.unexpected) == (0, [], [])
    assert verdict.delivered == written
    # Duplicates only from the killed processes' unmarked batches.
    assert verdict.duplicates <= sum(in_flight_at_kills)
    print(
        f"\npgbouncer crashes: {written} rows under write load, 3 x kill -9 + restart, rows in "
        f"flight at the kills {in_flight_at_kills}, reclaimed {reclaimed}, duplicates "
        f"{verdict.duplicates}, lost 0, reordered 0"
    )


async def test_visibility_gap_through_pgbouncer(
    conn: asyncpg.Connection,
    database_url: str,
    pgbouncer_url: str,
    topic: str,
    make_settings: Any,
    services: Any,
) -> None:
    """T1 (id n) open while T2 (n+1) commits and is published, then T1 commits: the documented
    order (n+1, n, n+2), nothing lost, no prepared-statement or advisory-lock errors."""
    settings = make_settings(
        database_url=pgbouncer_url,
        listen_database_url=database_url,
        statement_cache_size=0,
        http_port=0,
    )
    await late_lower_id(conn, database_url, services, topic, settings)
