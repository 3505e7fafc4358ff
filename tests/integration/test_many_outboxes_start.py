"""A process serving many outboxes at its start (issue 36), against real PostgreSQL and Kafka:
its first look at every outbox is its database's idle probe, not a claim each (an idle outbox
is not claimed at all, one with rows is claimed at once), and /readyz says ready only once that
first pass is done (dispatch/fleet_health.py). Counted with pg_stat_statements and /readyz's
answers, never timed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from .helpers import Services, spawn, stop_all, wait_started, wait_until
from .sources_helpers import migrate
from .test_chaos import http_port, readyz
from .test_many_outboxes import MakeTopic, Tenant, fleet_settings
from .test_many_outboxes_idle import calls, database, reset_counts  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IDLE = tuple(f"tenant_{i:02d}" for i in range(12))
BUSY = "tenant_busy"


def claims_by_tenant(counted: dict[str, int], tenants: tuple[str, ...]) -> dict[str, int]:
    """Each tenant's claims: the steady claim (its `more`) and the claim function's."""
    return {
        t: sum(
            n
            for q, n in counted.items()
            if (f'"{t}"."outbox_cursor"' in q and "AS more" in q)
            or f'"{t}"."outbox_claim_work"(' in q
        )
        for t in tenants
    }


def announcements(counted: dict[str, int], tenants: tuple[str, ...]) -> int:
    """Each tenant's own announcements (dispatch.sql `waiting_announce`), not the probe's batch."""
    return sum(
        n
        for q, n in counted.items()
        for t in tenants
        if q.lstrip().startswith(f'INSERT INTO "{t}"."outbox_waiting"')
    )


@pytest.mark.parametrize("listen", [False, True], ids=["polling", "listen"])
async def test_at_start_idle_outboxes_are_probed_not_claimed_and_one_with_rows_is_claimed(
    services: Services,
    database: str,  # noqa: F811 (the fixture)
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
    listen: bool,
) -> None:
    """12 idle tenants and one with rows committed before the start: the rows are published,
    and no idle tenant is claimed; with LISTEN their waits are announced by one statement (before:
    each was claimed once when served, its wait announced by a statement of its own and claimed
    again, and the LISTEN connection's first connect woke every one for a claim more, all in the
    ring ahead of notified tenants)."""
    await migrate(database, *IDLE, BUSY)
    busy = Tenant(database, BUSY, await make_topic())
    await busy.insert(keys=3, per_key=4)
    settings = fleet_settings(make_settings, database, [{"schema": "tenant_*"}], listen=listen)
    await reset_counts(services.database_url)
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:
        await wait_started([log])
        await busy.all_published(timeout=60)

        async def probed() -> bool:
            counted = await calls(services.database_url, database)
            return sum(n for q, n in counted.items() if "AS outbox" in q) >= 1

        await wait_until(probed, 30, "the idle probe's first look")
        await asyncio.sleep(1)  # (a claim woken by that look would have run by now)
        counted = await calls(services.database_url, database)
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    assert claims_by_tenant(counted, IDLE) == dict.fromkeys(IDLE, 0), "idle: probed, not claimed"
    assert announcements(counted, IDLE) == 0, "no idle outbox announces its wait by itself"
    batches = sum(n for q, n in counted.items() if q.lstrip().startswith("WITH a0 AS (INSERT"))
    assert batches == (1 if listen else 0), "with LISTEN, announced by the probe's batch"
    assert claims_by_tenant(counted, (BUSY,))[BUSY] >= 1
    assert sum(n for q, n in counted.items() if "AS outbox" in q) >= 1, "the probe looked"
    verdict = await busy.verdict(services)
    assert (verdict.delivered, verdict.lost, verdict.reordered) == (12, [], [])


async def test_readyz_says_ready_only_once_the_first_pass_over_the_outboxes_is_done(
    services: Services,
    database: str,  # noqa: F811 (the fixture)
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    """The first look is held up (a lock on one tenant's cursor, which the probe reads): every
    outbox is served, the broker answers, and /readyz still says 503 with the pass's progress;
    once the lock goes, 200 and "done" (before: 200 as soon as an outbox was served)."""
    tenants = IDLE[:3]
    await migrate(database, *tenants)
    settings = fleet_settings(
        make_settings, database, [{"schema": "tenant_*"}], listen=False, http_port=0
    )
    holder = await asyncpg.connect(database)
    log = tmp_path / "fleet.log"
    process = None
    try:
        transaction = holder.transaction()
        await transaction.start()
        await holder.execute(f'LOCK TABLE "{tenants[1]}".outbox_cursor IN ACCESS EXCLUSIVE MODE')
        process = spawn(settings, log)
        await wait_started([log])
        await wait_until(lambda: _true(http_port(log)), 30, "its HTTP port")
        port = http_port(log)
        assert port is not None

        async def all_served() -> bool:
            return log.read_text().count('"outbox_served"') == len(tenants)

        await wait_until(all_served, 30, "every outbox served")
        await asyncio.sleep(1)  # readiness is cached for a second
        status, body = await asyncio.to_thread(readyz, port)
        assert status == 503, body
        assert body["checks"]["broker"] == "ok", body
        assert body["checks"]["first pass"] == f"0 of {len(tenants)} outboxes looked at", body
        await transaction.rollback()

        async def ready() -> bool:
            return (await asyncio.to_thread(readyz, port))[0] == 200

        await wait_until(ready, 30, "/readyz to say ready once the first pass is done")
        assert (await asyncio.to_thread(readyz, port))[1]["checks"]["first pass"] == "done"
    finally:
        await holder.close()
        codes = stop_all([process]) if process is not None else [0]
    assert codes == [0], log.read_text()[-3000:]


async def _true(value: object) -> bool:
    return bool(value)
