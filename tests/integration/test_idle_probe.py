"""The batched idle probe's statement (store/probe.py, issue 36) against real PostgreSQL and the
claim engine: it names exactly the outboxes a claim would find work in (new rows, an expired
lease, a due retry) and no other (nothing, a live lease, a retry not yet due, the whole table
paused), and a row committed between two probes is found by the second: above the cursor, or
in a hole of the cursor once its transaction ends."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from outbox_dispatcher.store import probe

from .helpers import Services
from .sources_helpers import fresh_database, migrate

pytestmark = pytest.mark.integration

TENANTS = ("t_rows", "t_expired", "t_due", "t_later", "t_empty", "t_live", "t_paused")


@pytest.fixture
async def database(services: Services) -> AsyncIterator[str]:
    async with fresh_database(services.database_url) as url:
        yield url


async def insert(conn: asyncpg.Connection, schema: str, key: str) -> None:
    await conn.execute(
        f"INSERT INTO {schema}.outbox (topic, ordering_key, payload) VALUES ('t', $1, 'x')", key
    )


async def claim(conn: asyncpg.Connection, schema: str, lease: float) -> list[int]:
    """The engine's claim, as a dispatcher calls it: the ids it leased."""
    rows = await conn.fetch(
        f"SELECT id FROM {schema}.outbox_claim_work(100, 100, 'test', $1, $2, false, 5, 1000)",
        lease,
        uuid.uuid4(),
    )
    return [int(r["id"]) for r in rows]


async def named(conn: asyncpg.Connection, schemas: tuple[str, ...]) -> dict[str, str]:
    """The probe's answer: each outbox it names, with what it found."""
    found = await probe.probe(conn, [(s, "outbox") for s in schemas], takes_blocked=True)
    return {
        schemas[f.index]: ("expired" if f.expired else "") + ("work" if f.work else "")
        for f in found
        if f.found
    }


async def later(conn: asyncpg.Connection, schemas: tuple[str, ...]) -> dict[str, object]:
    """What the probe says to look at again without any write: a hole whose transactions run,
    or the seconds until a live lease expires or a retry falls due (rounded)."""
    found = await probe.probe(conn, [(s, "outbox") for s in schemas], takes_blocked=True)
    return {
        schemas[f.index]: "hole" if f.hole else round(f.due_in or 0, -1)
        for f in found
        if f.hole or (f.due_in or 0) > 0
    }


async def test_the_probe_names_exactly_the_outboxes_with_work(database: str) -> None:
    await migrate(database, *TENANTS)
    conn = await asyncpg.connect(database)
    try:
        for schema in TENANTS:
            if schema != "t_empty":
                await insert(conn, schema, "k")
        assert await named(conn, TENANTS) == dict.fromkeys(set(TENANTS) - {"t_empty"}, "work")
        # a live lease (its owner works on it), one about to expire, and retries: a failed
        # publish leaves its key waiting until not_before
        assert await claim(conn, "t_live", 60)
        assert await claim(conn, "t_expired", 0.2)
        for schema, due in (("t_due", "- interval '1 second'"), ("t_later", "+ interval '1 h'")):
            assert await claim(conn, schema, 60)
            await conn.execute(
                f"UPDATE {schema}.outbox_work SET claim_token = NULL, claim_owner = NULL,"
                " claim_expires_at = NULL, claim_first = NULL, claim_last = NULL,"
                f" head_id = claim_first, state = 'w', not_before = now() {due}"
            )
        await conn.execute("INSERT INTO t_paused.outbox_paused (topic) VALUES ('*')")
        await asyncio.sleep(0.3)  # t_expired's lease ends
        assert await named(conn, TENANTS) == {
            "t_rows": "work",
            "t_expired": "expired",
            "t_due": "work",
        }
        # looked at again when the live lease expires, when the retry falls due
        assert await later(conn, TENANTS) == {"t_live": 60.0, "t_later": 3600.0}
        # many outboxes: several chunks, each numbered on from the last
        many = TENANTS * (probe.CHUNK // len(TENANTS) + 2)
        found = await probe.probe(conn, [(s, "outbox") for s in many], takes_blocked=True)
        assert sorted(f.index for f in found if f.found) == [
            i for i, s in enumerate(many) if s in ("t_rows", "t_expired", "t_due")
        ]
    finally:
        await conn.close()


async def test_a_row_committed_between_two_probes_is_found_by_the_second(database: str) -> None:
    await migrate(database, "t_a", "t_b")
    conn = await asyncpg.connect(database)
    writer = await asyncpg.connect(database)
    try:
        assert await named(conn, ("t_a", "t_b")) == {}
        await insert(writer, "t_a", "k1")  # committed after the first probe: above the cursor
        assert await named(conn, ("t_a", "t_b")) == {"t_a": "work"}
        assert await claim(conn, "t_a", 60)
        assert await named(conn, ("t_a", "t_b")) == {}

        # A row whose id is drawn before and committed after a claim's discovery passed it: a
        # hole of the cursor, which the probe names once the writer's transaction has ended.
        late = writer.transaction()
        await late.start()
        await insert(writer, "t_b", "late")
        await insert(conn, "t_b", "early")
        assert await claim(conn, "t_b", 60)  # takes "early", leaves a hole below it
        # A new hole is read once more by the next discovery (the engine's rule), so the probe
        # names it once; then not while its writer runs.
        assert await named(conn, ("t_a", "t_b")) == {"t_b": "work"}
        assert await claim(conn, "t_b", 60) == []
        assert await named(conn, ("t_a", "t_b")) == {}
        # (and t_a's live lease: looked at again when it expires)
        assert await later(conn, ("t_a", "t_b")) == {"t_a": 60.0, "t_b": "hole"}
        await late.commit()
        assert await named(conn, ("t_a", "t_b")) == {"t_b": "work"}
        assert await claim(conn, "t_b", 60)  # the late row, as the probe said
    finally:
        await writer.close()
        await conn.close()
