"""Property-based: any interleaving of claims, acknowledgements, failures, lease expiries and
lease extensions (the lease keeper, also with a token that expired) by several claimers keeps the
per-key invariants, and a final drain loses nothing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox_dispatcher import db
from outbox_dispatcher.claimer import Claimer
from outbox_dispatcher.marker import Marker
from outbox_dispatcher.models import Batch, Outcome, Result
from outbox_dispatcher.settings import Settings
from outbox_dispatcher.sql import Queries

pytestmark = pytest.mark.integration

QUERIES = Queries.for_table("public", "outbox")
KEYS = st.sampled_from(["a", "b", "c", None])


@dataclass(frozen=True)
class Op:
    claimer: int
    action: str  # claim | ack | fail | dead | expire | extend
    limit: int
    cut: int  # where in the batch the failure happens


OPS = st.builds(
    Op,
    claimer=st.integers(0, 2),
    action=st.sampled_from(["claim", "claim", "ack", "fail", "dead", "expire", "extend"]),
    limit=st.integers(1, 6),
    cut=st.integers(0, 5),
)

INVARIANTS = """
-- A key's live leases belong to one claim ...
SELECT 'two owners of a key' AS broken, min(id) FROM outbox
 WHERE ordering_key IS NOT NULL AND published_at IS NULL AND dead_at IS NULL
   AND lease_expires_at > now()
 GROUP BY ordering_key HAVING count(DISTINCT lease_token) > 1
UNION ALL
-- ... and form a prefix of its pending rows.
SELECT 'leased row after an unleased one', l.id FROM outbox l
 WHERE l.ordering_key IS NOT NULL AND l.published_at IS NULL AND l.dead_at IS NULL
   AND l.lease_expires_at > now() AND EXISTS (
       SELECT 1 FROM outbox e WHERE e.ordering_key = l.ordering_key AND e.id < l.id
          AND e.published_at IS NULL AND e.dead_at IS NULL
          AND (e.lease_expires_at IS NULL OR e.lease_expires_at <= now()))
UNION ALL
-- Every key with a pending row is in the registry (else no claim would ever find it).
SELECT 'key missing from the registry', min(o.id) FROM outbox o
 WHERE o.ordering_key IS NOT NULL AND o.published_at IS NULL AND o.dead_at IS NULL
   AND NOT EXISTS (SELECT 1 FROM outbox_key k WHERE k.ordering_key = o.ordering_key)
 GROUP BY o.ordering_key
"""


PENDING = """
SELECT id, ordering_key, lease_expires_at > now() AS leased, next_attempt_at > now() AS waiting
  FROM outbox WHERE published_at IS NULL AND dead_at IS NULL ORDER BY id
"""


def check_claim(before: list[Any], batch: Batch) -> None:
    """A claim takes no row leased by someone else, and nothing of a key whose head waits."""
    heads: dict[str, Any] = {}
    for row in before:
        if row["ordering_key"] is not None:
            heads.setdefault(row["ordering_key"], row)
    state = {row["id"]: row for row in before}
    for record in batch.records:
        assert not state[record.id]["leased"], f"row {record.id} was leased by another claim"
        if record.ordering_key is not None:
            head = heads[record.ordering_key]
            assert not head["waiting"], f"key {record.ordering_key} taken while its head waits"
            assert not head["leased"], f"key {record.ordering_key} taken while its head is leased"


def out_of_order(deliveries: list[tuple[str | None, int]]) -> list[str]:
    """Per key, the first delivery of each row must follow id order (what a consumer sees)."""
    last: dict[str, int] = {}
    seen: set[int] = set()
    broken = []
    for key, row_id in deliveries:
        if key is None or row_id in seen:
            continue
        seen.add(row_id)
        if row_id < last.get(key, 0):
            broken.append(f"key {key}: row {row_id} first delivered after row {last[key]}")
        last[key] = row_id
    return broken


def delivered(batch: Batch, results: list[Result]) -> list[tuple[str | None, int]]:
    """What reached the broker: a publisher's acknowledged records, whether or not its lease
    still held when it marked them (a stale owner's records are in Kafka all the same)."""
    return [
        (r.ordering_key, r.id)
        for r, res in zip(batch.records, results, strict=True)
        if res.outcome is Outcome.PUBLISHED
    ]


def results_for(batch: Batch, op: Op) -> list[Result]:
    """ack: all published; fail/dead: the row at `cut` fails, later rows are not attempted."""
    n = len(batch.records)
    if op.action == "ack":
        return [Result(Outcome.PUBLISHED)] * n
    cut = min(op.cut, n - 1)
    failed = (
        Result(Outcome.RETRY, "boom", delay=3600, counted=True)
        if op.action == "fail"
        else Result(Outcome.DEAD, "poison", counted=True)
    )
    not_attempted = Result(Outcome.RETRY)
    return [Result(Outcome.PUBLISHED)] * cut + [failed] + [not_attempted] * (n - cut - 1)


async def scenario(url: str, keys: list[str | None], ops: list[Op]) -> None:
    pool = await asyncpg.create_pool(url, min_size=1, max_size=3, init=db.init_connection)
    assert pool is not None
    try:
        async with pool.acquire() as conn:
            await conn.execute("TRUNCATE outbox, outbox_key RESTART IDENTITY")
            await conn.executemany(
                "INSERT INTO outbox (topic, ordering_key, payload) VALUES ('t', $1, 'x')",
                [(k,) for k in keys],
            )
        marker = Marker(pool, QUERIES, retry_for=1.0)
        batches: dict[int, Batch] = {}
        deliveries: list[tuple[str | None, int]] = []
        for op in ops:
            if op.action == "claim":
                if op.claimer not in batches:
                    claimer = Claimer(
                        pool,
                        QUERIES,
                        Settings(batch_size=op.limit),
                        f"c{op.claimer}",
                    )
                    before = await pool.fetch(PENDING)
                    batch = await claimer.claim()
                    if batch is not None:
                        check_claim(before, batch)
                        batches[op.claimer] = batch
            elif op.action == "expire":
                # The claimer hangs past its lease; it keeps its batch and may settle it late.
                batch = batches.get(op.claimer)
                if batch is not None:
                    for table in ("outbox", "outbox_key"):
                        await pool.execute(
                            f"UPDATE {table} SET lease_expires_at = now() - interval '1 second' "
                            "WHERE lease_token = $1",
                            batch.token,
                        )
            elif op.action == "extend":
                # The lease keeper of a claimer that may have lost its lease: it must only ever
                # extend a lease that is still live and still its own.
                batch = batches.get(op.claimer)
                if batch is not None:
                    ids = [r.id for r in batch.records]
                    await pool.fetch(QUERIES.extend_leases, ids, [batch.token] * len(ids), 60.0)
            elif op.claimer in batches:
                batch = batches.pop(op.claimer)
                results = results_for(batch, op)
                deliveries.extend(delivered(batch, results))
                await marker.settle(batch, results)
            broken = await pool.fetch(INVARIANTS)
            assert not broken, [tuple(r) for r in broken]
        # Drain: whatever happened, every row ends published or dead-lettered.
        await pool.execute(
            "UPDATE outbox SET next_attempt_at = now(), lease_expires_at = now() - interval '1s' "
            "WHERE published_at IS NULL AND dead_at IS NULL"
        )
        await pool.execute(
            "UPDATE outbox_key SET not_before = '-infinity', "
            "lease_expires_at = now() - interval '1s' WHERE lease_token IS NOT NULL"
        )
        drainer = Claimer(pool, QUERIES, Settings(batch_size=50, max_attempts=100), "drain")
        for _ in range(len(keys) + 1):
            batch = await drainer.claim()
            if batch is None:
                break
            results = [Result(Outcome.PUBLISHED)] * len(batch.records)
            deliveries.extend(delivered(batch, results))
            await marker.settle(batch, results)
        left = await pool.fetchval(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_at IS NULL"
        )
        assert left == 0
        assert not await pool.fetch(INVARIANTS)
        assert out_of_order(deliveries) == []
    finally:
        await pool.close()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(keys=st.lists(KEYS, min_size=1, max_size=14), ops=st.lists(OPS, min_size=1, max_size=30))
def test_claim_and_settle_keep_per_key_invariants(
    database_url: str, keys: list[str | None], ops: list[Op]
) -> None:
    asyncio.run(scenario(database_url, keys, ops))


def test_the_checks_catch_violations(database_url: str) -> None:
    assert out_of_order([("a", 1), ("a", 3), ("a", 1), ("b", 2)]) == []
    assert out_of_order([("a", 3), ("a", 1)]) == ["key a: row 1 first delivered after row 3"]

    async def run() -> Any:
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute(
                "INSERT INTO outbox (topic, ordering_key, payload) "
                "VALUES ('t', 'a', 'x'), ('t', 'a', 'y');"
                "UPDATE outbox SET lease_token = gen_random_uuid(), "
                "lease_expires_at = now() + interval '1 minute'"
            )
            return await conn.fetch(INVARIANTS)
        finally:
            await conn.close()

    assert [r["broken"] for r in asyncio.run(run())] == ["two owners of a key"]
