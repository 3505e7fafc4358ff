"""The mark (settle) at its edges, against real PostgreSQL: a reply lost after the commit
(review F13) and a stale owner's late mark of a row the reclaimer dead-lettered (review F14)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from outbox_dispatcher.dispatch import settler as settler_module
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.models import Batch, Outcome, Result
from outbox_dispatcher.store import DispatchStore, Statements, db
from tests.faultproxy import FaultProxy

from .helpers import count, wait_until
from .test_network_faults import _via

pytestmark = pytest.mark.integration

STATEMENTS = Statements.for_table("public", "outbox")
OK = Result(Outcome.PUBLISHED)


class Events:
    """The settler's log calls, recorded (event name, fields)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def _record(self, event: str, **fields: Any) -> None:
        self.seen.append((event, fields))

    debug = info = warning = error = _record

    def rows(self, event: str) -> list[int]:
        return [int(f["rows"]) for e, f in self.seen if e == event]


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Events:
    recorded = Events()
    monkeypatch.setattr(settler_module, "log", recorded)
    return recorded


async def insert(conn: asyncpg.Connection, keys: list[str]) -> list[int]:
    rows = await conn.fetch(
        "INSERT INTO outbox (topic, ordering_key, payload) "
        "SELECT 't', k, 'x' FROM unnest($1::text[]) WITH ORDINALITY AS u(k, n) ORDER BY n "
        "RETURNING id",
        keys,
    )
    return [r["id"] for r in rows]


async def claim(pool: asyncpg.Pool, settings: Any, owner: str) -> Batch:
    batch = await Claimer(DispatchStore(pool, STATEMENTS), settings, owner).claim()
    assert batch is not None
    return batch


# --- F13: a mark whose reply was lost ----------------------------------------------------------


async def test_a_mark_whose_reply_was_lost_is_not_reported_as_a_lost_lease(
    pool: asyncpg.Pool,
    conn: asyncpg.Connection,
    database_url: str,
    make_settings: Any,
    events: Events,
) -> None:
    """The mark reaches PostgreSQL through the fault proxy and commits; the proxy drops its
    reply (the blackhole starts right behind the statement's bytes: its key is in them). On
    restore the connection is reset, the settler retries, and the retry changes 0 rows because
    the first attempt already cleared the token. Before: `lease_lost` ("published again") for
    every row and settle() returned 0, so the dispatcher skipped the batch's metrics."""
    key = f"lost-reply-{uuid.uuid4().hex}"
    await insert(conn, [key] * 3)
    batch = await claim(pool, make_settings(batch_size=10), "owner-a")
    port = urlsplit(database_url).port
    assert port is not None
    async with FaultProxy("127.0.0.1", port) as proxy:
        proxy.fault_on(key.encode(), after=True)
        via = await asyncpg.create_pool(
            _via(database_url, proxy.port), min_size=1, max_size=1, init=db.init_connection
        )
        try:
            mark = Settler(DispatchStore(via, STATEMENTS), retry_for=30.0, owner="owner-a")
            task = asyncio.create_task(mark.settle(batch, [OK] * 3))
            await asyncio.wait_for(proxy.tripped.wait(), 10)

            async def committed() -> bool:
                return await count(conn, "published_at IS NOT NULL") == 3

            await wait_until(committed, 10, "the mark to commit behind the proxy")
            assert not task.done(), "the reply must be lost, not delivered"
            await proxy.restore()
            settled = await asyncio.wait_for(task, 30)
        finally:
            await via.close()
    assert events.rows("settle_retrying"), "the first attempt failed with its reply lost"
    assert events.rows("lease_lost") == []
    assert events.rows("settle_reply_lost") == [3]
    assert settled == 3


async def test_a_lease_really_lost_after_an_unanswered_mark_is_still_reported(
    pool: asyncpg.Pool,
    conn: asyncpg.Connection,
    database_url: str,
    make_settings: Any,
    events: Events,
) -> None:
    """A's mark never reaches the server (the proxy drops it); A's lease expires, B takes the
    rows over and publishes them; then A's retry changes 0 rows. These rows were taken over (B
    is their owner, one attempt more): lease_lost is the truth here."""
    key = f"lost-lease-{uuid.uuid4().hex}"
    await insert(conn, [key] * 3)
    batch = await claim(pool, make_settings(batch_size=10, lease_seconds=0.5), "owner-a")
    port = urlsplit(database_url).port
    assert port is not None
    async with FaultProxy("127.0.0.1", port) as proxy:
        proxy.fault_on(key.encode(), drop=True)
        via = await asyncpg.create_pool(
            _via(database_url, proxy.port), min_size=1, max_size=1, init=db.init_connection
        )
        try:
            mark = Settler(DispatchStore(via, STATEMENTS), retry_for=30.0, owner="owner-a")
            task = asyncio.create_task(mark.settle(batch, [OK] * 3))
            await asyncio.wait_for(proxy.tripped.wait(), 10)
            await asyncio.sleep(1.0)  # A's lease expires
            taken = await claim(pool, make_settings(batch_size=10), "owner-b")
            assert [r.reclaimed for r in taken.records] == [True] * 3
            assert (
                await Settler(
                    DispatchStore(pool, STATEMENTS), retry_for=5.0, owner="owner-b"
                ).settle(taken, [OK] * 3)
                == 3
            )
            await proxy.restore()
            settled = await asyncio.wait_for(task, 30)
        finally:
            await via.close()
    assert settled == 0
    assert events.rows("settle_reply_lost") == []
    assert events.rows("lease_lost") == [3]


# --- F14: a stale owner delivers a row the reclaimer dead-lettered -----------------------------


async def test_a_stale_owners_late_mark_records_a_crash_loop_row_it_published(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any, events: Events
) -> None:
    """The interleaving, with max_attempts=1 (every lease expiry is a crash loop) and
    dead_letter_policy=block:

    1. dispatcher A claims row r1 of key K (a short lease) and sends it to Kafka;
    2. A stalls past its lease (a GC pause, a slow broker): the lease expires;
    3. the reclaimer's sweep sees r1's expired lease with attempts+1 >= max_attempts and
       dead-letters it as a crash loop (A "crashed or hung while publishing");
    4. dispatcher B claims K: nothing (K's head is dead; under block K waits);
    5. the broker acknowledges A's send: r1 is in Kafka;
    6. A marks r1 published with its lease token.

    Before: the sweep had cleared r1's token, so A's mark was fenced: r1 stayed dead although it
    is in Kafka, blocked K's later row r2 for good, and a requeue would have published it again.
    Now the sweep keeps the token of the lease it ended, a late mark of that token may record a
    publication (nothing else), and K's dead flag is refreshed: r1 is published, r2 goes."""
    key = f"stale-{uuid.uuid4().hex}"
    [r1] = await insert(conn, [key])
    settings = make_settings(
        batch_size=10, lease_seconds=0.5, max_attempts=1, dead_letter_policy="block"
    )
    stale = await claim(pool, settings, "owner-a")  # 1.
    assert [r.id for r in stale.records] == [r1]
    [r2] = await insert(conn, [key])
    await asyncio.sleep(1.0)  # 2.
    swept = await DispatchStore(pool, STATEMENTS).dead_letter_crash_loops(
        max_attempts=1, block_on_dead=True
    )
    # 3.
    assert [row["id"] for row in swept] == [r1]
    assert await count(conn, f"id = {r1} AND dead_at IS NOT NULL") == 1
    b = Claimer(
        DispatchStore(pool, STATEMENTS),
        make_settings(batch_size=10, dead_letter_policy="block"),
        "owner-b",
    )
    assert await b.claim() is None  # 4.
    settler = Settler(
        DispatchStore(pool, STATEMENTS), retry_for=5.0, owner="owner-a", block_on_dead=True
    )
    settled = await settler.settle(stale, [OK])  # 6.
    assert settled == 1
    assert events.rows("lease_lost") == []
    row = await conn.fetchrow("SELECT published_at, dead_at FROM outbox WHERE id = $1", r1)
    assert row is not None
    assert (row["published_at"] is not None, row["dead_at"]) == (True, None)
    after = await b.claim()
    assert after is not None
    assert [r.id for r in after.records] == [r2], "K is no longer held by a dead row"


async def test_a_stale_owners_late_failure_leaves_the_crash_loop_row_dead(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any, events: Events
) -> None:
    """As above, but A's send failed: the sweep's verdict stands (only a publication, a fact the
    broker acknowledged, overrides it)."""
    key = f"stale-{uuid.uuid4().hex}"
    [r1] = await insert(conn, [key])
    settings = make_settings(batch_size=10, lease_seconds=0.5, max_attempts=1)
    stale = await claim(pool, settings, "owner-a")
    await asyncio.sleep(1.0)
    swept = await DispatchStore(pool, STATEMENTS).dead_letter_crash_loops(
        max_attempts=1, block_on_dead=False
    )
    assert [row["id"] for row in swept] == [r1]
    failed = Result(Outcome.RETRY, "broker down", delay=1.0, counted=False)
    assert (
        await Settler(DispatchStore(pool, STATEMENTS), retry_for=5.0, owner="owner-a").settle(
            stale, [failed]
        )
        == 0
    )
    assert events.rows("lease_lost") == [1]
    row = await conn.fetchrow(
        "SELECT published_at, dead_at, last_error FROM outbox WHERE id = $1", r1
    )
    assert row is not None
    assert row["published_at"] is None
    assert row["dead_at"] is not None
    assert row["last_error"].startswith("dead-lettered: the lease expired")
