"""What idle outboxes cost one `outbox-dispatcher run` process serving many (issue 36), counted
by pg_stat_statements, against real PostgreSQL and Kafka: an idle outbox costs no claim per
interval (the batched idle probe asks for all of them in one statement) and its upkeep runs at a
slow pace; rows written to an idle outbox are published, with LISTEN and without; a lease left
by a dead dispatcher in an idle outbox is taken over."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from outbox_dispatcher.store.fleet import FleetStore

from .helpers import Services, spawn, stop_all, wait_started, wait_until
from .sources_helpers import fresh_database, migrate
from .test_many_outboxes import MakeTopic, Tenant, fleet_settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TENANTS = ("tenant_a", "tenant_b", "tenant_c", "tenant_d")
READ = """
SELECT s.query, s.calls FROM pg_stat_statements s
 WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = $1)
"""


@pytest.fixture
async def database(services: Services) -> AsyncIterator[str]:
    async with fresh_database(services.database_url) as url:
        conn = await asyncpg.connect(url)
        try:
            await FleetStore(conn).create()
        finally:
            await conn.close()
        yield url


async def calls(admin_url: str, url: str) -> dict[str, int]:
    """Calls by statement text in the database of `url` (pg_stat_statements, track = all)."""
    conn = await asyncpg.connect(admin_url)
    try:
        if not await conn.fetchval(
            "SELECT count(*) FROM pg_extension WHERE extname = 'pg_stat_statements'"
        ):
            pytest.skip("pg_stat_statements is not installed (make services installs it)")
        rows = await conn.fetch(READ, url.rpartition("/")[2])
        evicted = await conn.fetchval("SELECT dealloc FROM pg_stat_statements_info")
    finally:
        await conn.close()
    # An evicted entry makes a count seem to fall: counts are only read after `reset_counts`.
    assert evicted == 0, "pg_stat_statements evicted entries: raise pg_stat_statements.max"
    return {r["query"]: int(r["calls"]) for r in rows}


async def reset_counts(admin_url: str) -> None:
    """Empties pg_stat_statements (and its eviction count) before a test counts: over a whole
    `make test` its entries fill, and the least-called (an idle outbox's) go first."""
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute("SELECT pg_stat_statements_reset()")
    finally:
        await conn.close()


def per_tenant(counted: dict[str, int], function: str) -> dict[str, int]:
    """Calls of each tenant's engine function `function` (the dispatcher's statement)."""
    return {
        t: sum(n for q, n in counted.items() if f'"{t}"."outbox_{function}"(' in q) for t in TENANTS
    }


def claims_of(counted: dict[str, int]) -> dict[str, int]:
    """Each tenant's claims: the steady claim (dispatch.sql `claim_steady`, its `more`) and
    the claim function's."""
    steady = {
        t: sum(n for q, n in counted.items() if f'"{t}"."outbox_cursor"' in q and "AS more" in q)
        for t in TENANTS
    }
    function = per_tenant(counted, "claim_work")
    return {t: steady[t] + function[t] for t in TENANTS}


def since(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


async def lease_as_a_dead_dispatcher(tenant: Tenant, seconds: float) -> None:
    """A claim of a dispatcher that dies at once: its lease expires `seconds` later."""
    async with tenant.connect() as conn:
        rows = await conn.fetch(
            "SELECT id FROM outbox_claim_work(100, 100, 'dead', $1, $2, false, 5, 1000)",
            seconds,
            uuid.uuid4(),
        )
    assert rows


@pytest.mark.parametrize("listen", [False, True], ids=["polling", "listen"])
async def test_idle_outboxes_cost_no_claims_and_slow_upkeep_and_their_rows_are_published(
    services: Services,
    database: str,
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
    listen: bool,
) -> None:
    await migrate(database, *TENANTS)
    tenants = {t: Tenant(database, t, await make_topic()) for t in TENANTS}
    await tenants["tenant_d"].insert(keys=1, per_key=1)
    await lease_as_a_dead_dispatcher(tenants["tenant_d"], 6)
    settings = fleet_settings(
        make_settings,
        database,
        [{"schema": "tenant_*"}],
        listen=listen,
        poll_interval_seconds=0.2,  # without LISTEN: the probe's interval (with it, 2 s)
        reclaim_interval_seconds=0.2,  # an idle outbox's reclaimer and sweep: every 2 s or so
    )
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:
        await wait_started([log])
        await asyncio.sleep(2)  # each outbox's first claim, when it is served
        await reset_counts(services.database_url)
        before = await calls(services.database_url, database)
        await asyncio.sleep(4)
        after = await calls(services.database_url, database)
        claims = since(claims_of(after), claims_of(before))
        sweeps = since(per_tenant(after, "sweep"), per_tenant(before, "sweep"))
        reclaims = since(per_tenant(after, "reclaim_work"), per_tenant(before, "reclaim_work"))
        probes = sum(n for q, n in since(after, before).items() if "AS outbox" in q)
        # The dead dispatcher's lease (expired after 6 s) is found by the probe and taken over.
        await tenants["tenant_d"].all_published(timeout=30)
        for rounds in range(2):  # rows written to an idle outbox: published
            await tenants["tenant_b"].insert(keys=2, per_key=5, first_seq=5 * rounds)
            await tenants["tenant_b"].all_published(timeout=30)
            await asyncio.sleep(3)  # idle again
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    # (tenant_d is claimed once its dead dispatcher's lease expires, maybe meanwhile: then it
    # is active, with its normal upkeep)
    del claims["tenant_d"], sweeps["tenant_d"], reclaims["tenant_d"]
    assert claims == dict.fromkeys(TENANTS[:3], 0), "an idle outbox is claimed only when probed"
    assert probes >= 1, "the probe looked at them"
    # every 0.2 s while active: 20 in 4 s; idle: every 10 intervals, jittered (1.5-2 s)
    assert all(n <= 4 for n in sweeps.values()), sweeps
    # an idle outbox's reclaimer runs only when the probe finds an expired lease (its slow
    # round, every 30 intervals, ran 4.5-6 s after the first tick)
    assert reclaims == dict.fromkeys(TENANTS[:3], 0), reclaims
    verdict = await tenants["tenant_b"].verdict(services)
    assert (verdict.delivered, verdict.lost, verdict.reordered) == (20, [], [])


async def test_idle_outboxes_served_at_start_run_no_reclaimer_until_a_lease_expires(
    services: Services,
    database: str,
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    """At the steady version an idle outbox's reclaimer has no first round when it is served
    (500 outboxes served at once ran 500 reclaim functions beside a busy outbox's drain): the
    probe names an expired lease, and then it runs (tenant_d's dead dispatcher's lease)."""
    await migrate(database, *TENANTS)
    tenants = {t: Tenant(database, t, await make_topic()) for t in TENANTS}
    await tenants["tenant_d"].insert(keys=1, per_key=1)
    await lease_as_a_dead_dispatcher(tenants["tenant_d"], 8)  # expires after the 3 s counted
    settings = fleet_settings(
        make_settings,
        database,
        [{"schema": "tenant_*"}],
        poll_interval_seconds=0.2,
        reclaim_interval_seconds=0.2,  # a first round would come within 0.2 s of serving
    )
    await reset_counts(services.database_url)
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:
        await wait_started([log])
        await asyncio.sleep(3)  # served, their first claims and upkeep rounds done
        early = per_tenant(await calls(services.database_url, database), "reclaim_work")
        await tenants["tenant_d"].all_published(timeout=30)  # its lease expired, taken over
        # (wanted by the probe once the lease expired: the reclaimer's round comes next)
        await wait_until(
            lambda: _reclaimed(services, database, "tenant_d"), 10, "tenant_d's reclaimer ran"
        )
        late = per_tenant(await calls(services.database_url, database), "reclaim_work")
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    assert early == dict.fromkeys(TENANTS, 0), early
    assert {t: late[t] for t in TENANTS[:3]} == dict.fromkeys(TENANTS[:3], 0), late


async def _reclaimed(services: Services, database: str, tenant: str) -> bool:
    counted = await calls(services.database_url, database)
    return per_tenant(counted, "reclaim_work")[tenant] > 0


async def test_with_listen_a_row_of_a_long_idle_outbox_whose_wait_lapsed_is_found_by_the_probe(
    services: Services,
    database: str,
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    """An outbox idle since it was served keeps no announcement: once it lapses, writers send
    no notification, and its next row is found by the probe."""
    await migrate(database, "tenant_a")
    tenant = Tenant(database, "tenant_a", await make_topic())
    settings = fleet_settings(make_settings, database, [{"schema": "tenant_*"}], listen=True)
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:
        await wait_started([log])

        async def lapsed() -> bool:
            async with tenant.connect() as conn:
                live = await conn.fetchval(
                    "SELECT count(*) FROM outbox_waiting WHERE until > now()"
                )
                announced = await conn.fetchval("SELECT count(*) FROM outbox_waiting")
            return bool(announced) and not live

        await wait_until(lapsed, 30, "its announcement made, then lapsed")
        await tenant.insert(keys=1, per_key=3)  # no notification: nobody is announced
        await tenant.all_published(timeout=30)
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    verdict = await tenant.verdict(services)
    assert (verdict.delivered, verdict.lost, verdict.reordered) == (3, [], [])
