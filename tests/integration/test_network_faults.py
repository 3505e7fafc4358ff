"""Network faults between the dispatcher and its services, through tests/faultproxy.py.

Kafka: the broker advertises its own address in metadata, so a proxy in front of the bootstrap
address alone would only see the first request. deploy/local/services.sh gives the broker a
second listener (PROXIED) that advertises the proxy's fixed port; a client bootstrapped at the
proxy therefore reaches the broker only through it (the test proves it: a cut stops every ack).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from tests.faultproxy import FaultProxy

from .helpers import (
    EXPIRED_LEASE,
    LEASED,
    Services,
    check,
    consume,
    count,
    event_ids,
    insert_sequenced,
    kafka_proxy,
    log_events,
    running,
    spawn,
    stop_all,
    wait_all_settled,
    wait_started,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LEASE = 3.0
CUT = 8.0


def _via(url: str, port: int) -> str:
    """`url` with its host:port replaced by the proxy's, without TLS: the proxy recognises the
    mark statement by its text (the local PostgreSQL offers TLS, which asyncpg would prefer)."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    query = "&".join(q for q in parts.query.split("&") if q and not q.startswith("sslmode="))
    query = f"{query}&sslmode=disable" if query else "sslmode=disable"
    return urlunsplit(parts._replace(netloc=f"{userinfo}@127.0.0.1:{port}", query=query))


async def test_kafka_cut_longer_than_a_lease_under_load_loses_and_reorders_nothing(
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    make_settings: Any,
) -> None:
    async with kafka_proxy(services) as proxy:
        settings = make_settings(
            kafka_bootstrap_servers=proxy.address,
            lease_seconds=LEASE,
            claim_tasks=2,
            batch_size=50,
            http_port=0,
        )
        writer = await asyncpg.connect(database_url)
        writing = asyncio.Event()
        writing.set()
        written = 0

        async def write() -> None:
            """10 keys, one row each every 50 ms, until told to stop."""
            nonlocal written
            seq = 0
            while writing.is_set():
                await insert_sequenced(writer, topic, keys=10, per_key=1, first_seq=seq)
                seq += 1
                written += 10
                await asyncio.sleep(0.05)

        try:
            async with running(settings):
                load = asyncio.create_task(write())

                async def some_published() -> bool:
                    return await count(conn, "published_at IS NOT NULL") >= 200

                await wait_until(some_published, 60, "rows published through the proxy")
                assert proxy.accepted > 0 and proxy.forwarded_bytes > 0
                await proxy.cut()
                cut_at = time.monotonic()
                await asyncio.sleep(1.0)  # what was acknowledged before the cut is marked
                published_early = await count(conn, "published_at IS NOT NULL")
                await asyncio.sleep(CUT - 1.0)
                published_late = await count(conn, "published_at IS NOT NULL")
                pending_late = await count(conn, "published_at IS NULL")
                expired = await count(conn, EXPIRED_LEASE)
                await proxy.restore()
                restored_at = time.monotonic()
                first_after = published_late

                async def resumed() -> bool:
                    return await count(conn, "published_at IS NOT NULL") > first_after

                await wait_until(resumed, 60, "publishing to resume after the cut")
                recovery = time.monotonic() - restored_at
                await asyncio.sleep(2.0)  # more load after the restore
                writing.clear()
                await load
                await wait_all_settled(conn, 90)
        finally:
            writing.clear()
            await writer.close()
    total = await count(conn)
    assert total == written
    # The proxy carried all producer traffic: while it was cut, not one row was acknowledged.
    assert published_late == published_early, (published_early, published_late)
    assert pending_late > 0
    assert await count(conn, "dead_at IS NOT NULL") == 0
    # A broker outage is nobody's fault: the leases were kept, no row was taken over or charged.
    reclaimed = await count(conn, "attempts > 0")
    assert reclaimed == 0
    verdict = check(
        await consume(services.kafka_bootstrap_servers, topic, total, timeout=120),
        await event_ids(conn),
    )
    assert (len(verdict.lost), verdict.reordered, verdict.unexpected) == (0, [], [])
    assert verdict.delivered == total
    print(
        f"\nkafka cut {CUT:.0f}s (lease {LEASE:.0f}s): {total} rows, {pending_late} pending at the "
        f"end of the cut, expired leases during the cut {expired}, rows reclaimed {reclaimed}, "
        f"dead 0, duplicates {verdict.duplicates}, first publish {recovery:.2f}s after restore "
        f"(cut lasted {restored_at - cut_at:.1f}s)"
    )


@pytest.mark.parametrize("fault", ["stall", "blackhole"])
async def test_database_cut_while_marking_lets_another_dispatcher_take_over_fenced(
    fault: str,
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    """Dispatcher A reaches PostgreSQL through the proxy, which hangs the moment A sends its
    first mark (after the broker acknowledged the batch): the mark cannot land, A's leases
    cannot be extended and expire, dispatcher B (direct) takes the rows over and publishes them
    again. Then the proxy is restored.

    stall: the held mark reaches the server late, with A's old lease token, and must change
    nothing. blackhole: the mark's bytes were dropped; on restore A's connections are reset, A
    gives the mark up (its lease is long gone) and changes nothing either."""
    await insert_sequenced(conn, topic, keys=10, per_key=20)
    a_port = urlsplit(database_url).port
    assert a_port is not None
    async with FaultProxy("127.0.0.1", a_port) as proxy:
        # The mark: the settle function, or the steady path's one statement (its batch unnest)
        mark = (b'"outbox_settle_work"(', b"AS u(id, k, counted)")
        proxy.fault_on(mark, drop=fault == "blackhole")
        common: dict[str, Any] = {
            "lease_seconds": LEASE,
            "batch_size": 500,
            "log_format": "json",
            "http_port": 0,
        }
        settings_a = make_settings(
            database_url=_via(database_url, proxy.port), claim_tasks=1, listen=False, **common
        )
        settings_b = make_settings(claim_tasks=1, **common)
        log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
        processes = [spawn(settings_a, log_a)]
        try:
            try:
                await asyncio.wait_for(proxy.tripped.wait(), 60)
            except TimeoutError:
                pytest.fail("A's mark never went through the proxy as plain text")
            faulted_at = time.monotonic()
            # A published every row (its batch took them all) and is stuck marking.
            assert await count(conn, "published_at IS NOT NULL") == 0
            batch_a = await count(conn, LEASED)
            assert batch_a == 200
            owner_a = await conn.fetchval("SELECT DISTINCT lease_owner FROM outbox")
            processes.append(spawn(settings_b, log_b))
            await wait_started([log_b])
            await wait_all_settled(conn, 60)
            takeover = time.monotonic() - faulted_at
            before = await conn.fetch(
                "SELECT id, published_at, lease_owner, lease_token, attempts FROM outbox "
                "ORDER BY id"
            )
            assert {r["lease_owner"] for r in before} != {owner_a}
            assert all(r["attempts"] == 1 for r in before), "B reclaimed A's expired leases"

            await proxy.restore()

            async def a_settled() -> bool:
                return bool(log_events(log_a, "lease_lost") or log_events(log_a, "settle_failed"))

            await wait_until(a_settled, 60, "A's late mark to come back")
            after = await conn.fetch(
                "SELECT id, published_at, lease_owner, lease_token, attempts FROM outbox "
                "ORDER BY id"
            )
            # Both keep running after the restore; later rows go out as usual.
            await insert_sequenced(conn, topic, keys=10, per_key=5, first_seq=20)
            await wait_all_settled(conn, 60)
        finally:
            # Off the event loop: A's shutdown needs the proxy, which runs on this loop.
            codes = await asyncio.to_thread(stop_all, processes)
    assert codes == [0, 0], (log_a.read_text()[-3000:], log_b.read_text()[-3000:])
    if fault == "stall":
        assert not log_events(log_a, "settle_failed"), "the late mark must reach the server"
        lost = log_events(log_a, "lease_lost")
        assert [e["rows"] for e in lost] == [batch_a], "the stale mark changed 0 of its rows"
    else:
        assert [e["rows"] for e in log_events(log_a, "settle_failed")] == [batch_a]
    assert [dict(r) for r in after] == [dict(r) for r in before], "nothing changed by A's mark"
    assert await count(conn, "dead_at IS NOT NULL") == 0
    verdict = check(
        await consume(services.kafka_bootstrap_servers, topic, 250, timeout=120),
        await event_ids(conn),
    )
    assert (len(verdict.lost), verdict.reordered, verdict.unexpected) == (0, [], [])
    assert verdict.delivered == 250
    assert 0 < verdict.duplicates <= batch_a
    print(
        f"\npostgres {fault} while marking: A's batch {batch_a} rows, B took over "
        f"{takeover:.1f}s after the fault (lease {LEASE:.0f}s), A's mark settled 0 rows, "
        f"duplicates {verdict.duplicates} (all with their event id), lost 0, reordered 0"
    )
