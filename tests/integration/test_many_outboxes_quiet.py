"""What a quiet tenant's event costs one `outbox-dispatcher run` process serving many outboxes
(issue 36), counted by pg_stat_statements against real PostgreSQL and Kafka: one claim and one
settle statement (the steady path), the wait announced not per event, nothing withdrawn; the
claims that notifications during a batch on its way bring (one at once, one after its settle:
dispatch/slots.py) stay below one more per event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from outbox_dispatcher.store.fleet import FleetStore

from .helpers import Services, spawn, stop_all, wait_started
from .sources_helpers import fresh_database, migrate
from .test_many_outboxes import MakeTopic, Tenant, fleet_settings
from .test_many_outboxes_idle import TENANTS, calls, reset_counts, since

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EVENTS = 60
RATE = 20.0  # one-row transactions a second (issue 36's quiet tenant)


@pytest.fixture
async def database(services: Services) -> AsyncIterator[str]:
    async with fresh_database(services.database_url) as url:
        conn = await asyncpg.connect(url)
        try:
            await FleetStore(conn).create()
        finally:
            await conn.close()
        yield url


async def test_a_quiet_event_costs_one_claim_and_one_settle(
    services: Services,
    database: str,
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    await migrate(database, *TENANTS)
    quiet = Tenant(database, "tenant_a", await make_topic())
    settings = fleet_settings(make_settings, database, [{"schema": "tenant_*"}])
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:
        await wait_started([log])
        await asyncio.sleep(2)  # each outbox's first claim, when it is served
        await reset_counts(services.database_url)
        before = await calls(services.database_url, database)
        async with quiet.connect() as conn:
            for n in range(EVENTS):
                await conn.execute(
                    "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, $2, $3)",
                    quiet.topic,
                    f"key-{n}",
                    b"{}",
                )
                await asyncio.sleep(1 / RATE)
        await quiet.all_published(timeout=30)
        await asyncio.sleep(0.5)
        after = await calls(services.database_url, database)
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    counted = {
        q: n
        for q, n in since(after, before).items()
        if n and '"tenant_a".' in q and not q.lstrip().startswith("EXISTS")  # (the writers')
    }
    claims = sum(  # dispatch.sql claim_steady, and the claim function
        n
        for q, n in counted.items()
        if ("probe AS" in q and "AS more" in q) or '"outbox_claim_work"(' in q
    )
    settles = sum(n for q, n in counted.items() if "decide AS" in q)  # dispatch.sql settle_steady
    announced = sum(n for q, n in counted.items() if "_waiting" in q and "ON CONFLICT" in q)
    withdrawn = sum(
        n for q, n in counted.items() if q.lstrip().startswith("DELETE") and "_waiting" in q
    )
    report = "\n".join(f"{n:5d} {' '.join(q.split())[:140]}" for q, n in counted.items())
    assert EVENTS / 2 <= settles <= EVENTS, report  # one per batch (two events may share one)
    # one per event, and one after a batch for a notification that came while it was on its
    # way (two slots claiming a notified outbox at once: two per event)
    assert settles <= claims <= 1.5 * EVENTS, report
    assert announced <= 3, report  # kept fresh every few seconds, not per event
    assert withdrawn == 0, report  # only a full batch withdraws it
    assert sum(counted.values()) < 3 * EVENTS, report  # the upkeep's besides
