"""The review of claim engine v2 (../shared/research/registry-review.md, findings N1-N7, N9;
and point 11 of issue 21),
each as the interleaving that broke schema version 9, against real PostgreSQL. The tests use only
what any version of the engine offers (writers' SQL on the outbox table, the claim, the settle),
so that they run against version 9 too: there, each of them fails."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.models import Batch, Outcome, Result
from outbox_dispatcher.store import DispatchStore, Statements, migrations

pytestmark = pytest.mark.integration

STATEMENTS = Statements.for_table("public", "outbox")
PUBLISHED = Result(Outcome.PUBLISHED)


async def insert(conn: asyncpg.Connection, keys: list[str | None], topic: str = "t") -> list[int]:
    rows = await conn.fetch(
        "INSERT INTO outbox (topic, ordering_key, payload) "
        "SELECT $2, k, 'x' FROM unnest($1::text[]) WITH ORDINALITY AS u(k, n) ORDER BY n "
        "RETURNING id",
        keys,
        topic,
    )
    return [r["id"] for r in rows]


def claimer(pool: Any, batch_size: int = 100, owner: str = "c") -> Claimer:
    return Claimer(DispatchStore(pool, STATEMENTS), Settings(batch_size=batch_size), owner)


async def settle(pool: asyncpg.Pool, batch: Batch) -> None:
    await Settler(DispatchStore(pool, STATEMENTS), retry_for=1.0).settle(
        batch, [PUBLISHED] * len(batch.records)
    )


async def drain(pool: asyncpg.Pool, claims: int, batch_size: int = 500) -> list[int]:
    """Claim and publish up to `claims` times; the ids published."""
    published: list[int] = []
    for _ in range(claims):
        batch = await claimer(pool, batch_size).claim()
        if batch is None:
            break
        published.extend(r.id for r in batch.records)
        await settle(pool, batch)
    return published


# --- N1: one open writer transaction must not halt other keys ----------------------------------


async def test_an_open_writer_transaction_does_not_halt_the_other_keys(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str
) -> None:
    """Version 9: a writer holding one row of key w open kept 1,000 emptied keys of w's lock
    bucket (hashtext & 511) from being forgotten; they sorted first in every claim and filled
    its key slots: every claim moved 0 rows while a brand-new key's rows waited."""
    bucket_keys = [
        r["k"]
        for r in await conn.fetch(
            "SELECT 'k' || g AS k FROM generate_series(1, 2000000) g"
            " WHERE hashtext('k' || g) & 511 = hashtext('w') & 511 LIMIT 1000"
        )
    ]
    await insert(conn, bucket_keys)
    writer = await asyncpg.connect(database_url)
    try:
        tx = writer.transaction()
        await tx.start()
        await insert(writer, ["w"])
        assert len(await drain(pool, 10)) == 1000, "the bucket's keys were published (emptied)"
        fresh = await insert(conn, ["fresh"] * 100 + [f"other-{i}" for i in range(100)])
        published = await drain(pool, 5)
        assert sorted(published) == fresh, "other keys flow while the writer stays open"
        await tx.commit()
    finally:
        await writer.close()
    assert len(await drain(pool, 2)) == 1, "and the writer's row after its commit"


# --- N2: writers at REPEATABLE READ and SERIALIZABLE --------------------------------------------


@pytest.mark.parametrize("isolation", ["repeatable_read", "serializable"])
async def test_a_row_of_a_writer_whose_snapshot_predates_its_keys_settle_is_claimed(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str, isolation: str
) -> None:
    """Version 9: the registry trigger asked "is k registered?" in the writer's transaction
    snapshot. k was registered when the snapshot began, forgotten by a settle before the insert,
    and never registered again: the row stayed pending for ever."""
    await insert(conn, ["k"])
    held = await claimer(pool).claim()
    assert held is not None
    writer = await asyncpg.connect(database_url)
    try:
        tx = writer.transaction(isolation=isolation)
        await tx.start()
        await writer.fetchval("SELECT count(*) FROM outbox")  # the snapshot starts here
        await settle(pool, held)  # k is emptied
        [late] = await insert(writer, ["k"])
        await tx.commit()
    finally:
        await writer.close()
    assert await drain(pool, 3) == [late]


# --- N3 and N4: rows that reach the table without the insert trigger, key updates ---------------


async def test_rows_restored_with_triggers_off_are_claimed(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    """Version 9: keyed rows inserted under session_replication_role = replica (pg_restore
    --disable-triggers, logical replication's apply, ETL tools) were never registered."""
    await conn.execute("SET session_replication_role = replica")
    try:
        restored = await insert(conn, ["a", "b", None, "a"])
    finally:
        await conn.execute("SET session_replication_role = origin")
    assert sorted(await drain(pool, 3)) == restored


async def test_a_pending_rows_key_updated_by_a_writer_is_claimed_under_the_new_key(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    """Version 9: UPDATE of a pending row's ordering_key (an ORM that inserts, then sets fields)
    never registered the new key: NULL -> k and k -> k2 both stranded the row."""
    keyed, keyless = await insert(conn, ["before", None])
    await conn.execute("UPDATE outbox SET ordering_key = 'after' WHERE id = $1", keyed)
    await conn.execute("UPDATE outbox SET ordering_key = 'given' WHERE id = $1", keyless)
    batch = await claimer(pool).claim()
    assert batch is not None
    assert sorted((r.ordering_key, r.id) for r in batch.records) == [
        ("after", keyed),
        ("given", keyless),
    ]


# --- N5: one owner per key with concurrent first writers and a late commit -----------------------


async def test_two_first_writers_of_a_key_and_a_late_commit_leave_one_owner(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str
) -> None:
    """Version 9: two concurrent first writers of k left two registry rows; with the lower id
    committing late, claim A leased the newer row through one and claim B the late row through
    the other, both live: two owners of k."""
    early = await asyncpg.connect(database_url)
    try:
        tx = early.transaction()
        await tx.start()
        [low] = await insert(early, ["k"])
        [high] = await insert(conn, ["k"])
        a = await claimer(pool, owner="a").claim()
        assert a is not None
        assert [r.id for r in a.records] == [high]
        await tx.commit()
    finally:
        await early.close()
    b = await claimer(pool, owner="b").claim()
    assert b is None or "k" not in {r.ordering_key for r in b.records}, "k is a's"
    await settle(pool, a)
    c = await claimer(pool, owner="c").claim()
    assert c is not None
    assert [r.id for r in c.records] == [low], "the late row, once k is free"


# --- N6: a claim's cost does not grow with stuck work ---------------------------------------------


# Blocks this session read of the outbox's tables and indexes, not yet reported to the
# statistics (they accumulate until then).
BLOCKS = (
    "SELECT sum(pg_stat_get_xact_blocks_fetched(c.oid))::int FROM pg_class c"
    " WHERE c.relnamespace = 'public'::regnamespace"
)


class Measured:
    """An executor for the claimer that also records the blocks of the outbox's tables and
    indexes (not the catalogs: planning is not the claim's work) each claim reads: the same
    statement first runs in a transaction that is rolled back."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.blocks: list[int] = []

    async def fetch(self, query: str, *args: object) -> list[asyncpg.Record]:
        tx = self.conn.transaction()
        await tx.start()
        try:
            before = await self.conn.fetchval(BLOCKS)
            await self.conn.fetch(query, *args)
            read: int = await self.conn.fetchval(BLOCKS) - before
        finally:
            await tx.rollback()
        self.blocks.append(read)
        return list(await self.conn.fetch(query, *args))


BLOCK = Settings(batch_size=100, dead_letter_policy="block")


async def claim_cost(conn: asyncpg.Connection) -> int:
    """Blocks a claim that finds one fresh row and empty claims after it read: the most."""
    measured = Measured(conn)
    settler = Settler(DispatchStore(conn, STATEMENTS), retry_for=1.0)
    for _ in range(8):  # a session's first executions of a statement are planned each time
        await Claimer(DispatchStore(conn, STATEMENTS), BLOCK, "m").claim()
    await insert(conn, ["fresh"])
    for _ in range(3):
        batch = await Claimer(DispatchStore(measured, STATEMENTS), BLOCK, "m").claim()
        if batch is not None:
            await settler.settle(batch, [PUBLISHED] * len(batch.records))
    return max(measured.blocks)


async def test_stuck_keys_and_keyless_rows_do_not_make_claims_dearer(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    """Version 9: every claim, empty polls included, read every paused, blocked or backing-off
    key and every keyless row in backoff (100k paused keys: 34-40 ms instead of 6). Here 20,000
    keys in a paused topic, 5,000 keys behind a dead row (dead_letter_policy = block) and
    20,000 keyless rows in backoff: a claim reads at most twice the blocks it does without."""
    without = await claim_cost(conn)
    await conn.execute("INSERT INTO outbox_paused (topic, paused_by) VALUES ('stuck', 'test')")
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload)"
        " SELECT 'stuck', 'p-' || g, 'x' FROM generate_series(1, 20000) g"
    )
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, attempts, next_attempt_at)"
        " SELECT 't', NULL, 'x', 1, now() + interval '1 hour' FROM generate_series(1, 20000) g"
    )
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, dead_at)"
        " SELECT 't', 'b-' || g, 'x', now() FROM generate_series(1, 5000) g"
    )
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload)"
        " SELECT 't', 'b-' || g, 'x' FROM generate_series(1, 5000) g"
    )
    # The claims look at all of it once (new rows, then each key's first row), then leave it
    # parked: until the claims are quiet (a claim reads a handful of blocks) or 1,500 of them.
    parking = Measured(conn)
    for _ in range(1500):
        await Claimer(DispatchStore(parking, STATEMENTS), BLOCK, "park").claim()
        if parking.blocks[-1] <= 2 * max(without, 20):
            break
    # What a claim meets once the stuck work has been there a while: autovacuum has visited the
    # engine's bookkeeping (the migration tunes it to within a minute of such a change), so the
    # index entries of the keys' former states are gone.
    for table in ("outbox_work", "outbox_key"):
        if await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", table):
            await conn.execute(f"VACUUM {table}")
    with_stuck = await claim_cost(conn)
    assert with_stuck <= 2 * max(without, 20), (without, with_stuck)


# --- N7: a hot key beside many shallow keys gets the batch's unused share ------------------------


async def test_a_hot_key_beside_many_shallow_keys_fills_the_batch(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    """Version 9: the per-key cap (batch / keys) was fixed before rows were counted: 5 of 10,000
    hot rows beside 100 one-row keys, the batch 21% full."""
    await insert(conn, [f"shallow-{i}" for i in range(100)])
    await insert(conn, ["hot"] * 10_000)
    sizes: list[tuple[int, int]] = []
    while (batch := await claimer(pool, 500).claim()) is not None:
        hot = sum(r.ordering_key == "hot" for r in batch.records)
        sizes.append((hot, len(batch.records) - hot))
        await settle(pool, batch)
    assert sum(h + s for h, s in sizes) == 10_100
    # Every batch full while 500 rows were left; where shallow keys were in it, the hot key had
    # the rest.
    assert all(h + s == 500 for h, s in sizes[:-1]), sizes
    assert all(h >= 390 for h, s in sizes if s), sizes


# --- N9: a writer transaction takes a small, bounded number of locks ----------------------------


async def test_a_bulk_writer_of_5000_keys_takes_no_more_locks_than_a_one_row_writer(
    conn: asyncpg.Connection,
) -> None:
    """Version 9: one shared advisory lock per lock bucket of the transaction's keys, up to 512,
    held to commit; about 25 bulk writers filled the default lock table, and then every session
    failed with 53200 (out of shared memory)."""

    async def locks_held(keys: list[str | None]) -> int:
        tx = conn.transaction()
        await tx.start()
        try:
            await insert(conn, keys)
            held: int = await conn.fetchval(
                "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid()"
            )
            return held
        finally:
            await tx.rollback()

    one, bulk = await locks_held(["one"]), await locks_held([f"k{i}" for i in range(5000)])
    assert bulk <= one + 2 <= 12, (one, bulk)  # the table, its sequence, a trigger's lookup


# --- Point 11: a late commit below the key's head ---------------------------------------------


@pytest.mark.parametrize("late_commit", ["while_in_flight", "after_the_settle"])
async def test_a_row_committed_late_below_its_keys_head_goes_before_the_keys_later_rows(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str, late_commit: str
) -> None:
    """The suspected order break (steady-cost-feasibility.md, finding 6): a lower id of a key
    commits while a higher one is in flight (or after its settle), before the next claim
    begins; the key's head already lies past it. It committed before that claim, so the claim
    must take it first, then the key's later row. Settled from the database's side: version 9
    breaks in the first case, not the second. While the higher row was in flight a second
    claimer leased the late lower row (two owners of the key; either row may reach the broker
    first); after the settle, version 9 took both in order."""
    writer = await asyncpg.connect(database_url)
    try:
        tx = writer.transaction()
        await tx.start()
        late = await writer.fetchval(
            "INSERT INTO outbox (topic, ordering_key, payload) VALUES ('t', 'k', 'x') RETURNING id"
        )
        (early,) = await insert(conn, ["k"])
        batch = await claimer(pool).claim()
        assert batch is not None and [r.id for r in batch.records] == [early]
        if late_commit == "while_in_flight":
            await tx.commit()
            assert await claimer(pool, owner="other").claim() is None  # the key is owned
        await settle(pool, batch)
        if late_commit == "after_the_settle":
            await tx.commit()
    finally:
        await writer.close()
    (later,) = await insert(conn, ["k"])
    batch = await claimer(pool).claim()
    assert batch is not None
    assert [r.id for r in batch.records] == [late, later]


# --- Point 10: a burst into a table whose statistics predate it -------------------------------


async def _drain_blocks(conn: asyncpg.Connection, table: str) -> int:
    """Blocks all claims read to drain the table, with 500-row batches."""
    queries = Statements.for_table("public", table)
    measured = Measured(conn)
    settler = Settler(DispatchStore(conn, queries), retry_for=1.0)
    settings = Settings(batch_size=500, table=table)
    for _ in range(400):
        batch = await Claimer(DispatchStore(measured, queries), settings, "m").claim()
        if batch is None:
            break
        await settler.settle(batch, [PUBLISHED] * len(batch.records))
    left = await conn.fetchval(f"SELECT count(*) FROM {table} WHERE published_at IS NULL")
    assert left == 0
    return sum(measured.blocks)


async def test_a_burst_before_the_tables_statistics_caught_up_drains_as_after_analyze(
    conn: asyncpg.Connection,
) -> None:
    """Version 9: 50,000 rows committed at once into a freshly migrated table drained at a
    tenth of the rate they drained at after an ANALYZE (the claim's statements planned for an
    empty table). Two fresh tables, the same burst, autovacuum held off both (the minute before
    it runs); one is analyzed: draining the other reads at most 1.25x the blocks."""
    for table in ("outbox_stale", "outbox_analyzed"):
        await migrations.migrate(conn, "public", table)
        await conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        await conn.execute(
            f"INSERT INTO {table} (topic, ordering_key, payload)"
            " SELECT 't', 'k' || (g % 1000), 'x' FROM generate_series(1, 50000) g"
        )
    await conn.execute("ANALYZE outbox_analyzed")
    stale = await _drain_blocks(conn, "outbox_stale")
    analyzed = await _drain_blocks(conn, "outbox_analyzed")
    print(f"\nblocks to drain 50,000 rows: {stale} (stale statistics), {analyzed} (analyzed)")
    assert stale <= 1.25 * analyzed, (stale, analyzed)
