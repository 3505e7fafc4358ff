"""The mark (settle) at its edges, against real PostgreSQL: a reply lost after the commit
(review F13)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from outbox_dispatcher import db, marker
from outbox_dispatcher.claimer import Claimer
from outbox_dispatcher.marker import Marker
from outbox_dispatcher.models import Batch, Outcome, Result
from outbox_dispatcher.sql import Queries
from tests.faultproxy import FaultProxy

from .helpers import count, wait_until
from .test_network_faults import _via

pytestmark = pytest.mark.integration

QUERIES = Queries.for_table("public", "outbox")
OK = Result(Outcome.PUBLISHED)


class Events:
    """The marker's log calls, recorded (event name, fields)."""

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
    monkeypatch.setattr(marker, "log", recorded)
    return recorded


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(database_url, min_size=1, max_size=4, init=db.init_connection)
    try:
        yield p
    finally:
        await p.close()


async def insert(conn: asyncpg.Connection, keys: list[str]) -> list[int]:
    rows = await conn.fetch(
        "INSERT INTO outbox (topic, ordering_key, payload) "
        "SELECT 't', k, 'x' FROM unnest($1::text[]) WITH ORDINALITY AS u(k, n) ORDER BY n "
        "RETURNING id",
        keys,
    )
    return [r["id"] for r in rows]


async def claim(pool: asyncpg.Pool, settings: Any, owner: str) -> Batch:
    batch = await Claimer(pool, QUERIES, settings, owner).claim()
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
    restore the connection is reset, the marker retries, and the retry changes 0 rows because
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
            mark = Marker(via, QUERIES, retry_for=30.0, owner="owner-a")
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
            mark = Marker(via, QUERIES, retry_for=30.0, owner="owner-a")
            task = asyncio.create_task(mark.settle(batch, [OK] * 3))
            await asyncio.wait_for(proxy.tripped.wait(), 10)
            await asyncio.sleep(1.0)  # A's lease expires
            taken = await claim(pool, make_settings(batch_size=10), "owner-b")
            assert [r.reclaimed for r in taken.records] == [True] * 3
            assert (
                await Marker(pool, QUERIES, retry_for=5.0, owner="owner-b").settle(taken, [OK] * 3)
                == 3
            )
            await proxy.restore()
            settled = await asyncio.wait_for(task, 30)
        finally:
            await via.close()
    assert settled == 0
    assert events.rows("settle_reply_lost") == []
    assert events.rows("lease_lost") == [3]
