"""What an idle fleet asks its database (issue 36, "Idle cost"), against real PostgreSQL: the
idle probe's loop (dispatch/probe.py) asks every outbox within its full interval, a slice at a
time, each slice's statement prepared once on its own connection, and in between only the
outboxes whose tables were written (PostgreSQL's statistics) or whose live lease expires; the
registry heartbeat of a database's outboxes is one statement (dispatch/beats.py), and `status`
still counts each outbox's dispatcher live."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

import asyncpg
import pytest
from pydantic import SecretStr

from outbox_dispatcher import registry
from outbox_dispatcher.config.outboxes import Outbox, Source
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch import probe as probe_module
from outbox_dispatcher.dispatch.beats import BatchedHeartbeat
from outbox_dispatcher.dispatch.outboxes import OutboxRuntime, Shared
from outbox_dispatcher.dispatch.probe import IdleProbe
from outbox_dispatcher.dispatch.slots import ClaimSlots
from outbox_dispatcher.health import Heartbeats
from outbox_dispatcher.metrics import Metrics
from outbox_dispatcher.retries import RetryPolicy
from outbox_dispatcher.store import DispatchStore, Statements, db
from outbox_dispatcher.store import probe as probe_statements
from outbox_dispatcher.store.probe import Session

from .helpers import Services, wait_until
from .sources_helpers import fresh_database, migrate
from .test_many_outboxes_idle import calls, reset_counts, since

pytestmark = pytest.mark.integration

# More than a statement asyncpg caches (15 KiB): the full probe of these is about 20 KiB.
TENANTS = tuple(f"t_{i:02d}" for i in range(14))


@pytest.fixture
async def database(services: Services) -> AsyncIterator[str]:
    async with fresh_database(services.database_url) as url:
        await migrate(url, *TENANTS)
        yield url


@dataclass
class Fleet:
    """The served outboxes of one database as a fleet process holds them, no claim running."""

    slots: ClaimSlots
    session: Session
    pool: db.Pool
    settings: Settings

    @property
    def database(self) -> str:
        """Its name as the fleet names it (hosts, ports and name)."""
        return next(iter(self.slots.outboxes))[0]

    def woken(self) -> set[str]:
        return {key[1] for key in self.slots.scheduler.queued()}

    def asleep(self) -> None:
        """Every outbox idle again (as if its claim had found nothing)."""
        for key in self.slots.outboxes:
            self.slots.scheduler.sleep(key)


@pytest.fixture
async def fleet(database: str) -> AsyncIterator[Fleet]:
    settings = Settings(database_url=database, statement_cache_size=100)
    pool = await db.create_pool(settings, url=database, max_size=2, setting="OUTBOX_SOURCES")
    slots = ClaimSlots(2, 100, asyncio.Event(), Heartbeats(60))
    shared = Shared(settings, "me", cast(Any, None), Metrics(), RetryPolicy(settings), 0.2)
    for tenant in TENANTS:
        outbox = Outbox(Source(SecretStr(database), "t_*", "outbox"), tenant)
        slots.add(OutboxRuntime(outbox, pool, 16, shared))
    session = Session(database, settings)
    fleet = Fleet(slots, session, pool, settings)
    fleet.asleep()
    await settled(session)
    try:
        yield fleet
    finally:
        await session.close()
        await pool.close()


async def settled(session: Session) -> None:
    """Until the migrations' statistics have all been reported (a backend reports its own as
    it exits, after its client has gone)."""
    oids = await probe_statements.relations(session, [(t, "outbox") for t in TENANTS])
    last: list[int] | None = None

    async def still() -> bool:
        nonlocal last
        now, last = last, await probe_statements.changes(session, oids)
        await asyncio.sleep(0.3)
        return now == last

    await wait_until(still, 10, "the statistics settled")


async def insert(url: str, schema: str) -> None:
    """A row from a writer of its own, which reports its statistics when it ends."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            f"INSERT INTO {schema}.outbox (topic, ordering_key, payload) VALUES ('t', 'k', 'x')"
        )
    finally:
        await conn.close()


async def full_probes(session: Session) -> dict[str, str]:
    """The full probe's statements prepared on the session's connection: {statement: name}."""
    rows = await session.fetch("SELECT name, statement FROM pg_prepared_statements")
    every = [f'"{tenant}"."outbox"' for tenant in TENANTS]
    return {r["statement"]: r["name"] for r in rows if all(t in r["statement"] for t in every)}


async def test_between_full_probes_only_the_outboxes_written_to_are_asked(
    database: str, fleet: Fleet
) -> None:
    probe = IdleProbe(fleet.database, fleet.session, fleet.slots, fleet.settings, 0.2)
    await probe.once()  # the first: every outbox
    assert (probe.full_probes, probe.probes, probe.looked) == (1, 1, len(TENANTS))
    chunk = await full_probes(fleet.session)
    assert len(chunk) == 1, "the full probe's statement is prepared on the probe's connection"
    for _ in range(3):  # nothing written: no outbox asked
        await probe.once()
    assert (probe.full_probes, probe.probes, probe.looked) == (1, 1, len(TENANTS))
    assert fleet.woken() == set()

    await insert(database, "t_05")

    async def asked() -> bool:
        await probe.once()
        return probe.looked > len(TENANTS)

    await wait_until(asked, 10, "the written outbox asked (its statistics reported)")
    assert probe.looked == len(TENANTS) + 1, "only the outbox written to"
    assert fleet.woken() == {"t_05"}

    probe._full_due = True  # the next full probe: the same statement, still prepared
    await probe.once()
    assert probe.full_probes == 2
    again = await full_probes(fleet.session)
    assert again == chunk, "prepared once, not again at each full probe"


async def test_a_live_lease_is_asked_about_when_it_expires_without_any_write(
    database: str, fleet: Fleet
) -> None:
    conn = await asyncpg.connect(database)
    try:
        await conn.execute(
            "INSERT INTO t_03.outbox (topic, ordering_key, payload) VALUES ('t', 'k', 'x')"
        )
        rows = await conn.fetch(
            "SELECT id FROM t_03.outbox_claim_work(100, 100, 'dead', 1.5, $1, false, 5, 1000)",
            uuid.uuid4(),
        )
        assert rows
    finally:
        await conn.close()
    probe = IdleProbe(fleet.database, fleet.session, fleet.slots, fleet.settings, 0.2)
    await probe.once()  # the full probe: a live lease, due in 1.5 s
    assert fleet.woken() == set()

    async def taken_over() -> bool:
        await probe.once()
        return "t_03" in fleet.woken()

    await wait_until(taken_over, 10, "the expired lease's outbox woken before the next full probe")
    assert probe.full_probes == 1
    assert fleet.woken() == {"t_03"}


async def test_the_heartbeat_of_every_outbox_of_a_database_is_one_statement(
    services: Services, database: str, fleet: Fleet
) -> None:
    beats = BatchedHeartbeat(fleet.database, fleet.session, fleet.slots, fleet.settings, "me")
    await reset_counts(services.database_url)
    before = await calls(services.database_url, database)
    await beats.once()
    await beats.once()
    after = since(await calls(services.database_url, database), before)
    upserts = {q: n for q, n in after.items() if n and "outbox_dispatchers" in q and "INSERT" in q}
    assert list(upserts.values()) == [2], "one statement a beat for every outbox"
    for tenant in TENANTS:
        assert await live(fleet, tenant) == ["me"]


async def test_a_batch_that_fails_beats_each_outbox_alone(database: str, fleet: Fleet) -> None:
    conn = await asyncpg.connect(database)
    try:
        await conn.execute("ALTER TABLE t_07.outbox_dispatchers RENAME TO gone")
    finally:
        await conn.close()
    beats = BatchedHeartbeat(fleet.database, fleet.session, fleet.slots, fleet.settings, "me")
    await beats.once()
    assert beats.beats == 0
    for tenant in TENANTS:
        if tenant != "t_07":
            assert await live(fleet, tenant) == ["me"], tenant


async def live(fleet: Fleet, tenant: str) -> list[str]:
    """The dispatchers `status` counts live in a tenant's outbox."""
    store = DispatchStore(fleet.pool, Statements.for_table(tenant, "outbox"))
    rows = await store.dispatchers_live(live_seconds=registry.LIVE_SECONDS)
    return [r["owner"] for r in rows]


async def test_an_idle_outbox_sweeps_again_only_once_its_tables_were_written(
    database: str, fleet: Fleet
) -> None:
    probe = IdleProbe(fleet.database, fleet.session, fleet.slots, fleet.settings, 0.2)
    await probe.once()  # the statistics: each outbox's writes so far
    runtime = next(o for o in fleet.slots.outboxes.values() if o.outbox.schema == "t_02")
    assert await runtime.sweep(), "its first pass"
    assert not await runtime.sweep(), "nothing written since: nothing new to find"
    await insert(database, "t_02")

    async def written() -> bool:
        before = runtime.writes
        await probe.once()
        return runtime.writes != before

    await wait_until(written, 10, "the write counted")
    assert await runtime.sweep(), "written since its last pass"


async def test_every_outbox_is_asked_within_the_full_interval_one_slice_at_a_time(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the first probe no statement asks every outbox at once (five such statements back
    to back took a core for 100-250 ms each under load, spikes in the quiet tenants' latency):
    a slice a step, each slice's statement prepared once, every outbox within FULL_SECONDS."""
    monkeypatch.setattr(probe_module, "MIN_SLICE", 5)  # 14 tenants: slices of 5, 5 and 4
    now = [1000.0]
    probe = IdleProbe(
        fleet.database, fleet.session, fleet.slots, fleet.settings, 2.0, clock=lambda: now[0]
    )
    await probe.once()  # the first: every outbox, a statement a slice
    assert (probe.full_probes, probe.probes, probe.looked) == (1, 3, len(TENANTS))
    prepared = await kept(fleet.session)
    assert sorted(prepared.values()) == [4, 5, 5], "a statement a slice, prepared"
    asked: list[int] = []
    for _ in range(int(probe_module.FULL_SECONDS)):  # one probe a second, nothing written
        now[0] += 1.0
        before = probe.looked
        await probe.once()
        asked.append(probe.looked - before)
    assert sorted(n for n in asked if n) == [4, 5, 5], asked
    assert asked.index(5) == 4, "the first slice due a third of FULL_SECONDS after the first probe"
    assert probe.full_probes == 1
    assert await kept(fleet.session) == prepared, "the slices' statements prepared once"
    assert fleet.woken() == set()


async def kept(session: Session) -> dict[str, int]:
    """The rotation's statements prepared on the session's connection: {statement: outboxes}."""
    rows = await session.fetch("SELECT statement FROM pg_prepared_statements")
    counts = {r["statement"]: r["statement"].count("AS outbox,") for r in rows}
    return {sql: n for sql, n in counts.items() if n}
