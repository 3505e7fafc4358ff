"""The claim and settle statements against real PostgreSQL: key ownership, per-key order,
leases and fencing, backoff, dead-letter policies. No Kafka involved."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from typing import Any

import asyncpg
import orjson
import pytest

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.models import Batch, Outcome, Result
from outbox_dispatcher.store import DispatchStore, Statements, db
from tests.faultproxy import fault_proxy
from tests.integration.helpers import sessions_waiting_on_a_lock, wait_until

pytestmark = pytest.mark.integration

STATEMENTS = Statements.for_table("public", "outbox")


def claimer(pool: asyncpg.Pool, settings: Settings, owner: str = "test") -> Claimer:
    return Claimer(DispatchStore(pool, STATEMENTS), settings, owner)


async def insert(conn: asyncpg.Connection, keys: list[str | None]) -> list[int]:
    rows = await conn.fetch(
        "INSERT INTO outbox (topic, ordering_key, payload) "
        "SELECT 't', k, 'x' FROM unnest($1::text[]) WITH ORDINALITY AS u(k, n) ORDER BY n "
        "RETURNING id",
        keys,
    )
    return [r["id"] for r in rows]


def by_key(batch: Batch | None) -> dict[str | None, list[int]]:
    grouped: dict[str | None, list[int]] = defaultdict(list)
    for record in batch.records if batch else []:
        grouped[record.ordering_key].append(record.id)
    return dict(grouped)


async def expire(conn: asyncpg.Connection) -> None:
    """Every lease expires now (as when its owner died)."""
    await conn.execute(
        "UPDATE outbox_work SET claim_expires_at = now() - interval '1 second'"
        " WHERE claim_token IS NOT NULL"
    )


async def settle(pool: asyncpg.Pool, batch: Batch, results: list[Result]) -> int:
    return await Settler(DispatchStore(pool, STATEMENTS), retry_for=1.0).settle(batch, results)


async def test_claim_leases_a_prefix_of_each_key_in_id_order(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    ids = await insert(conn, ["a", "b", "a", None, "b", "a"])
    batch = await claimer(pool, make_settings(batch_size=100)).claim()
    assert batch is not None
    assert [r.id for r in batch.records] == ids
    assert by_key(batch) == {"a": [ids[0], ids[2], ids[5]], "b": [ids[1], ids[4]], None: [ids[3]]}
    # The lease is the keys' (and the keyless row's) work, not the rows: no row was written.
    leased = await conn.fetch(
        "SELECT ordering_key, keyless, claim_token, claim_owner, claim_expires_at > now() AS live"
        " FROM outbox_work ORDER BY keyless, ordering_key"
    )
    assert [tuple(r) for r in leased] == [
        ("a", False, batch.token, "test", True),
        ("b", False, batch.token, "test", True),
        (str(ids[3]), True, batch.token, "test", True),
    ]
    assert await conn.fetchval("SELECT count(*) FROM outbox WHERE lease_token IS NOT NULL") == 0
    # Nothing is left to claim while the lease lives.
    assert await claimer(pool, make_settings()).claim() is None


async def test_a_key_has_one_owner_while_its_claim_is_open_and_while_leased(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str, make_settings: Any
) -> None:
    ids = await insert(conn, ["k"] * 10)
    settings = make_settings(batch_size=3)
    holder = await asyncpg.connect(database_url)
    try:
        tx = holder.transaction()
        await tx.start()
        token = uuid.uuid4()
        held = await DispatchStore(holder, STATEMENTS).claim(
            **claimer(pool, settings).arguments(token)
        )
        assert [r["id"] for r in held] == ids[:3]
        ids += await insert(conn, ["other"] * 2)
        # The holder's claim is not committed: it holds the discovery cursor, so a concurrent
        # claim takes nothing new (and k's work is not even visible to it yet).
        assert await claimer(pool, make_settings(batch_size=20), "b").claim() is None
        await tx.commit()
    finally:
        await holder.close()
    # Committed: k's lease carries the ownership (its later rows wait for its head); the next
    # claim discovers `other`.
    concurrent = await claimer(pool, make_settings(batch_size=20), "c").claim()
    assert by_key(concurrent) == {"other": ids[10:]}
    assert await claimer(pool, make_settings(batch_size=20), "d").claim() is None
    owners = await conn.fetch("SELECT ordering_key, claim_token FROM outbox_work ORDER BY 1")
    assert concurrent is not None
    assert [tuple(r) for r in owners] == [("k", token), ("other", concurrent.token)]


async def test_a_key_resumes_where_its_settled_prefix_ended(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    ids = await insert(conn, ["k"] * 5)
    c = claimer(pool, make_settings(batch_size=2))
    first = await c.claim()
    assert first is not None and [r.id for r in first.records] == ids[:2]
    assert await settle(pool, first, [Result(Outcome.PUBLISHED)] * 2) == 2
    second = await c.claim()
    assert second is not None and [r.id for r in second.records] == ids[2:4]


async def test_expired_lease_is_taken_over_and_the_stale_owner_is_fenced(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    ids = await insert(conn, ["k", "k"])
    settings = make_settings()
    stale = await claimer(pool, settings, "stale").claim()
    assert stale is not None
    await expire(conn)
    fresh = await claimer(pool, settings, "fresh").claim()
    assert fresh is not None and [r.id for r in fresh.records] == ids
    assert all(r.reclaimed and r.attempts == 1 for r in fresh.records)
    # The stale owner's acknowledgement arrives late: it changes nothing.
    assert await settle(pool, stale, [Result(Outcome.PUBLISHED)] * 2) == 0
    assert await conn.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 2
    assert await settle(pool, fresh, [Result(Outcome.PUBLISHED)] * 2) == 2


async def test_extending_a_lease_that_expired_changes_nothing(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    """The lease keeper of an owner that hung past its lease must not revive it: after a partial
    takeover that would give the key two owners (review finding F5)."""
    ids = await insert(conn, ["k"] * 4)
    stale = await claimer(pool, make_settings(batch_size=4), "stale").claim()
    assert stale is not None and [r.id for r in stale.records] == ids
    await expire(conn)
    fresh = await claimer(pool, make_settings(batch_size=2), "fresh").claim()
    assert fresh is not None and [r.id for r in fresh.records] == ids[:2]
    store = DispatchStore(pool, STATEMENTS)
    assert await store.extend_leases(ids=ids, tokens=[stale.token] * 4, seconds=60.0) == 0
    live = await conn.fetch(
        "SELECT DISTINCT claim_owner FROM outbox_work WHERE claim_expires_at > now()"
    )
    assert [r["claim_owner"] for r in live] == ["fresh"]
    # The live owner's own extension works.
    ours = [r.id for r in fresh.records]
    assert await store.extend_leases(ids=ours, tokens=[fresh.token] * 2, seconds=60.0) == 2
    assert await conn.fetchval(
        "SELECT claim_expires_at > now() + interval '50 seconds' FROM outbox_work"
    )


async def test_the_lease_keeper_locks_a_claims_keys_in_key_order(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str, make_settings: Any
) -> None:
    """Found by the long-transactions test at full scale: the lease keeper updated a claim's
    work in scan order while discovery (and the claim's own settle) locked it in key order, and
    they deadlocked. Here a session holds key a as discovery does and then asks for key b: the
    lease keeper, waiting for a, must not be holding b already."""
    await insert(conn, ["a", "b"])
    batch = await claimer(pool, make_settings(batch_size=2)).claim()
    assert batch is not None and len(batch.records) == 2
    # b first in the table and in the lease index, so that a scan meets it first.
    for key, seconds in (("b", 50), ("a", 60)):
        await conn.execute(
            "UPDATE outbox_work SET claim_expires_at = now() + $2 * interval '1 second'"
            " WHERE ordering_key = $1",
            key,
            seconds,
        )
    discovery = await asyncpg.connect(database_url)
    try:
        holder = discovery.transaction()
        await holder.start()
        await discovery.execute("SELECT 1 FROM outbox_work WHERE ordering_key = 'a' FOR SHARE")
        ids = [r.id for r in batch.records]
        extending = asyncio.ensure_future(
            DispatchStore(pool, STATEMENTS).extend_leases(
                ids=ids, tokens=[batch.token] * 2, seconds=60.0
            )
        )

        async def waiting() -> bool:
            return await sessions_waiting_on_a_lock(conn) > 0

        await wait_until(waiting, 10, "the lease keeper to wait for key a")
        await discovery.execute("SET LOCAL lock_timeout = '3s'")
        await discovery.execute("SELECT 1 FROM outbox_work WHERE ordering_key = 'b' FOR SHARE")
        await holder.commit()
        assert await extending == len(ids)  # both rows still held, no deadlock
    finally:
        await discovery.close()


async def test_a_claim_whose_reply_was_lost_is_released_by_its_token(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    """The claim committed but its reply never arrived: the dispatcher chose the token, so its
    next claim gives those rows back at once instead of leaving their keys stalled for a lease
    and counting an attempt (review finding F12)."""
    ids = await insert(conn, ["k", "k", None])
    c = claimer(pool, make_settings())
    lost = uuid.uuid4()
    assert len(await DispatchStore(pool, STATEMENTS).claim(**c.arguments(lost))) == 3
    c._unsure.append((lost, time.monotonic() + 30))  # what claim() records on a lost reply
    batch = await c.claim()
    assert batch is not None and [r.id for r in batch.records] == ids
    assert all(not r.reclaimed and r.attempts == 0 for r in batch.records)
    assert c._unsure == []


async def test_a_lost_claim_still_running_on_the_server_is_released_once_it_commits(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str, make_settings: Any
) -> None:
    """Review N14: the network dropped a claim's bytes while the claim was still running on the
    server (here: waiting for a lock). The claimer's first release found nothing, the claim then
    committed, and its keys stayed leased to nobody for a whole lease, with an attempt counted.
    The claimer now tries the token again at each claim until its lease could have expired."""
    host, port = database_url.split("@", 1)[1].split("/", 1)[0].rsplit(":", 1)
    await insert(conn, ["k", "k"])
    first = await claimer(pool, make_settings(batch_size=1)).claim()
    assert first is not None
    await settle(pool, first, [Result(Outcome.PUBLISHED)])  # k is known, its next row ready
    new = await insert(conn, ["k", "new"])
    async with fault_proxy(host, int(port)) as proxy:
        proxied = await asyncpg.create_pool(
            database_url.replace(f"{host}:{port}", proxy.address),
            min_size=1,
            max_size=2,
            init=db.init_connection,
            command_timeout=1,
        )
        try:
            c = claimer(proxied, make_settings(batch_size=10, lease_seconds=30))
            holder = conn.transaction()
            await holder.start()
            await conn.execute("SELECT 1 FROM outbox_work WHERE ordering_key = 'k' FOR UPDATE")
            claiming = asyncio.ensure_future(c.claim())
            await asyncio.sleep(0.3)  # the claim waits for k's lock on the server
            proxy.blackhole()
            with pytest.raises(db.RETRIABLE_ERRORS):
                await claiming
            await proxy.restore()
            assert await c.claim() is None, "released nothing: the lost claim has not committed"
            await holder.commit()  # the lost claim goes on and commits k and new

            async def committed() -> bool:
                return bool(
                    await conn.fetchval(
                        "SELECT count(*) FROM outbox_work WHERE claim_token IS NOT NULL"
                    )
                )

            for _ in range(50):
                if await committed():
                    break
                await asyncio.sleep(0.1)
            batch = await c.claim()
            assert batch is not None, "the lost claim's keys were given back"
            assert sorted(r.id for r in batch.records) == [first.records[0].id + 1, *new]
            assert all(r.attempts == 0 for r in batch.records)
        finally:
            await proxied.close()


async def test_a_key_in_backoff_does_not_hold_back_other_keys(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    ids = await insert(conn, ["bad", "bad", "good"])
    c = claimer(pool, make_settings(batch_size=10))
    batch = await c.claim()
    assert batch is not None
    await settle(
        pool,
        batch,
        [
            Result(Outcome.RETRY, "boom", delay=3600, counted=True),
            Result(Outcome.RETRY),
            Result(Outcome.RETRY),
        ],
    )
    again = await c.claim()
    assert by_key(again) == {"good": [ids[2]]}
    row = await conn.fetchrow("SELECT attempts, last_error FROM outbox WHERE id = $1", ids[0])
    assert (row["attempts"], row["last_error"]) == (1, "boom")
    await conn.execute("UPDATE outbox SET next_attempt_at = now() WHERE id = $1", ids[0])
    assert by_key(await c.claim()) == {"bad": ids[:2]}


@pytest.mark.parametrize(("policy", "expected"), [("skip", [1]), ("block", [])])
async def test_dead_letter_policy(
    pool: asyncpg.Pool,
    conn: asyncpg.Connection,
    make_settings: Any,
    policy: str,
    expected: list[int],
) -> None:
    ids = await insert(conn, ["k", "k", "other"])
    c = claimer(pool, make_settings(batch_size=1, dead_letter_policy=policy))
    batch = await c.claim()
    assert batch is not None and batch.records[0].id == ids[0]
    await settle(pool, batch, [Result(Outcome.DEAD, "too large", counted=True)])
    dead = await conn.fetchrow("SELECT dead_at, last_error FROM outbox WHERE id = $1", ids[0])
    assert dead["dead_at"] is not None and dead["last_error"] == "too large"
    c = claimer(pool, make_settings(batch_size=10, dead_letter_policy=policy))
    claimed = by_key(await c.claim())
    assert claimed.get("k", []) == [ids[i] for i in expected]
    assert claimed["other"] == [ids[2]]


async def test_an_expired_lease_the_batch_has_no_room_for_waits_for_a_takeover(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    """Found by the stuck-owner scenario at full scale (0 takeovers of 200 held rows): a claim
    locked more keys than its batch had room for, and gave the expired leases among those it
    could not take back as fresh work, so no takeover was counted (nor a crash loop seen). Now
    a key the batch has no room for is left as it was (not even written)."""
    x, a, b = await insert(conn, ["x", "a", "b"])
    # x's row waits while the owner that will die claims a and b; then it is due, and older.
    await conn.execute("UPDATE outbox SET next_attempt_at = now() + interval '1 hour'")
    await conn.execute("UPDATE outbox SET next_attempt_at = now() WHERE id <> $1", x)
    dead = await claimer(pool, make_settings(batch_size=3), "dead").claim()
    assert by_key(dead) == {"a": [a], "b": [b]}
    await conn.execute("UPDATE outbox SET next_attempt_at = now() WHERE id = $1", x)
    await conn.execute(
        "UPDATE outbox_work SET state = 'r', not_before = '-infinity' WHERE ordering_key = 'x'"
    )
    await expire(conn)
    version = "SELECT xmin::text FROM outbox_work WHERE ordering_key = 'b'"
    before = await conn.fetchval(version)
    # One row of room, three keys: the orphans go first (a, then b), before x's older head;
    # b has no room.
    first = await claimer(pool, make_settings(batch_size=1), "rescuer").claim()
    assert by_key(first) == {"a": [a]}
    assert await conn.fetchval(version) == before, "b was left as it was"
    assert await conn.fetchval("SELECT lease_owner FROM outbox_leases WHERE id = $1", b) == "dead"
    second = await claimer(pool, make_settings(batch_size=1), "rescuer").claim()
    assert second is not None and [r.id for r in second.records] == [b]
    assert second.records[0].reclaimed and second.records[0].attempts == 1, "a takeover"
    assert by_key(await claimer(pool, make_settings(batch_size=1), "rescuer").claim()) == {"x": [x]}


async def test_a_claim_that_finds_the_cursor_taken_still_takes_over_expired_leases(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str, make_settings: Any
) -> None:
    """Found by the stuck-owner scenario inside `make chaos` (0 takeovers of 200 held rows, and
    the `kill -9` orphans' slow re-publication): while another claim held the discovery cursor
    (new rows above it, two claim loops), a claim's `SELECT ... INTO c ... SKIP LOCKED` found no
    row and set the cursor record to NULL. Every row it then looked at was "not ok" (NULL), and
    every key it had locked, expired leases included, was written back as fresh work: no
    takeover, no attempt counted, nothing claimed. Now the claim takes them over."""
    a, b = await insert(conn, ["a", "b"])
    dead = await claimer(pool, make_settings(batch_size=2), "dead").claim()
    assert by_key(dead) == {"a": [a], "b": [b]}
    await expire(conn)
    [c] = await insert(conn, ["c"])  # above the cursor: a claim wants to discover it
    other = await asyncpg.connect(database_url)
    try:
        # Another claim loop's discovery holds the cursor.
        lock = other.transaction()
        await lock.start()
        await other.execute("SELECT 1 FROM outbox_cursor WHERE one FOR UPDATE")
        taken = await claimer(pool, make_settings(batch_size=10), "rescuer").claim()
        assert by_key(taken) == {"a": [a], "b": [b]}, "the expired leases are taken over"
        assert taken is not None
        assert all(r.reclaimed and r.attempts == 1 for r in taken.records), "a takeover each"
        owners = await conn.fetch("SELECT DISTINCT lease_owner FROM outbox_leases")
        assert [r["lease_owner"] for r in owners] == ["rescuer"]
        await lock.rollback()
    finally:
        await other.close()
    assert by_key(await claimer(pool, make_settings(batch_size=10), "rescuer").claim()) == {
        "c": [c]
    }


async def test_a_takeover_sends_the_lost_claims_rows_first(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    """Found by the `kill -9` scenario inside `make chaos` (the last orphan re-published 8.55 s
    after its kill, against 8.2 s, while every takeover came within 0.21 s of expiry): a
    takeover took a share of the batch like any key (one row, with more keys than room), so a
    key's orphans went out one batch at a time behind the write load. Now the orphans go first,
    as far as the room goes (each with its attempt); the key's later row, which the dead owner
    never held, follows in a claim that is no takeover."""
    orphans = await insert(conn, ["k"] * 5)
    dead = await claimer(pool, make_settings(batch_size=5), "dead").claim()
    assert by_key(dead) == {"k": orphans}
    [later] = await insert(conn, ["k"])
    others = await insert(conn, [f"r{i}" for i in range(5)])
    # r0..r4 become known work, ready (discovered, then given back).
    found = await claimer(pool, make_settings(batch_size=5), "discover").claim()
    assert found is not None and set(by_key(found)) == {f"r{i}" for i in range(5)}
    await DispatchStore(pool, STATEMENTS).release_claim(token=found.token)
    await expire(conn)
    taken = await claimer(pool, make_settings(batch_size=5), "rescuer").claim()
    assert by_key(taken) == {"k": orphans}, "the orphans before the other keys' shares"
    assert taken is not None
    assert all(r.reclaimed and r.attempts == 1 for r in taken.records)
    await settle(pool, taken, [Result(Outcome.PUBLISHED)] * len(taken.records))
    rest = await claimer(pool, make_settings(batch_size=10), "rescuer").claim()
    assert by_key(rest) == {"k": [later], **{f"r{i}": [others[i]] for i in range(5)}}
    assert rest is not None
    assert not any(r.reclaimed or r.attempts for r in rest.records), "never held: no attempt"


async def test_rows_whose_owners_keep_dying_are_dead_lettered(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    ids = await insert(conn, ["k", "k"])
    settings = make_settings(max_attempts=3)
    crashed = await claimer(pool, make_settings(batch_size=1), "crashed").claim()
    assert crashed is not None and [r.id for r in crashed.records] == ids[:1]
    await conn.execute("UPDATE outbox SET attempts = 2 WHERE id = $1", ids[0])
    await expire(conn)
    # The claim leaves the crash-looping head alone, and so the key waits ...
    assert await claimer(pool, settings).claim() is None
    dead = await DispatchStore(conn, STATEMENTS).dead_letter_crash_loops(
        max_attempts=settings.max_attempts, block_on_dead=False
    )
    assert [r["id"] for r in dead] == [ids[0]]
    row = await conn.fetchrow("SELECT attempts, last_error FROM outbox WHERE id = $1", ids[0])
    assert row["attempts"] == 3 and "lease expired 3 times" in row["last_error"]
    # ... and with the default "skip" policy the key goes on after it.
    assert by_key(await claimer(pool, settings).claim()) == {"k": [ids[1]]}


@pytest.mark.parametrize("query", ["dead_letter_crash_loops", "count_expired_leases"])
async def test_the_reclaimers_sweeps_do_not_read_the_table(
    conn: asyncpg.Connection, query: str
) -> None:
    """They run every reclaim interval in every dispatcher: a sweep that scans the outbox reads
    every row (a million-row backlog: 0.4 s and 870 MB of buffers per sweep). A backlog of
    20,000 rows over 19 keys and a key of 10 rows whose head is crash-looping: the sweep reads
    that key's rows and one row per key, not the table."""
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload) "
        "SELECT 't', 'k' || (1 + g % 19), convert_to(repeat('x', 500), 'UTF8') "
        "FROM generate_series(0, 19999) g"
    )
    await insert(conn, ["k0"] * 10)
    await conn.execute(
        "INSERT INTO outbox_work (keyless, ordering_key, head_id, state, claim_token,"
        " claim_owner, claim_expires_at, claim_first)"
        " SELECT false, 'k0', min(id) + 1, 'x', gen_random_uuid(), 'x',"
        " now() - interval '1 second', min(id) FROM outbox WHERE ordering_key = 'k0'"
    )
    await conn.execute("UPDATE outbox SET attempts = 2 WHERE ordering_key = 'k0'")
    await conn.execute("ANALYZE outbox")
    pages = await conn.fetchval("SELECT pg_relation_size('outbox') / 8192")
    statement = STATEMENTS[query]
    sql = statement.sql
    args = statement.bind({"max_attempts": 3, "block_on_dead": False} if statement.params else {})
    tx = conn.transaction()
    await tx.start()
    try:
        [plan] = orjson.loads(
            await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, *args)
        )
    finally:
        await tx.rollback()
    touched = plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"]
    assert pages > 1000
    assert touched < pages / 4, f"{touched} buffers for a table of {pages} pages"


async def test_rows_without_a_key_are_claimed_by_anyone(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    ids = await insert(conn, [None] * 4)
    first = await claimer(pool, make_settings(batch_size=2), "a").claim()
    second = await claimer(pool, make_settings(batch_size=2), "b").claim()
    assert first is not None and second is not None
    assert [r.id for r in first.records] + [r.id for r in second.records] == ids


async def test_settle_records_each_outcome(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    ids = await insert(conn, [None, None, None])
    batch = await claimer(pool, make_settings()).claim()
    assert batch is not None
    await settle(
        pool,
        batch,
        [
            Result(Outcome.PUBLISHED),
            Result(Outcome.RETRY, "broker down", delay=60, counted=False),
            Result(Outcome.DEAD, "invalid", counted=True),
        ],
    )
    rows = await conn.fetch(
        "SELECT published_at IS NOT NULL AS published, dead_at IS NOT NULL AS dead, attempts, "
        "last_error, next_attempt_at > now() + interval '50 seconds' AS backed_off, "
        "lease_token IS NULL AS released FROM outbox ORDER BY id"
    )
    assert [tuple(r) for r in rows] == [
        (True, False, 0, None, False, True),
        (False, False, 0, "broker down", True, True),
        (False, True, 1, "invalid", False, True),
    ]
    assert ids


async def test_a_takeover_in_progress_fences_the_stale_owners_late_settle(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    """The stale owner's acknowledgement arrives while a new claim is between its two statements
    (key locked, rows not yet read): the settle waits for the key, then finds it taken over and
    changes nothing. A copy of the claim function that pauses between its statements makes the
    race happen on purpose."""
    ids = await insert(conn, ["k", "k", "k"])
    settings = make_settings(batch_size=10)
    stale = await claimer(pool, settings, "stale").claim()
    assert stale is not None and [r.id for r in stale.records] == ids
    await expire(conn)
    source = await conn.fetchval("SELECT pg_get_functiondef('public.outbox_claim_work'::regproc)")
    marker = "    RETURN QUERY\n    WITH held AS MATERIALIZED ("
    assert marker in source
    slow = source.replace("public.outbox_claim_work(", "public.outbox_claim_slow(", 1).replace(
        marker, "    PERFORM pg_sleep(1);\n" + marker, 1
    )
    await conn.execute(slow)
    late = claimer(pool, settings, "late")
    slow_claim = STATEMENTS["claim"].sql.replace('"outbox_claim_work"', '"outbox_claim_slow"')
    token = uuid.uuid4()
    arguments = STATEMENTS["claim"].bind(late.arguments(token))
    racing = asyncio.create_task(pool.fetch(slow_claim, *arguments))
    await asyncio.sleep(0.3)  # it holds k's work now, and sleeps
    assert await settle(pool, stale, [Result(Outcome.PUBLISHED)] * 3) == 0
    taken = await racing
    assert [r["id"] for r in taken] == ids
    assert all(r["reclaimed"] and r["attempts"] == 1 for r in taken)
    rows = await conn.fetch("SELECT published_at IS NULL AS pending FROM outbox")
    assert {tuple(r) for r in rows} == {(True,)}
    owner = await conn.fetchval("SELECT claim_owner FROM outbox_work WHERE ordering_key = 'k'")
    assert owner == "late"


async def test_a_key_emptied_by_its_settle_is_forgotten_with_one_write(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    """At a steady rate most keys empty out with every batch: the settle deletes such a key's
    work straight away instead of releasing it and deleting it after (a write per event). A key
    with rows left is released and points at its next row."""
    await conn.execute(
        "CREATE TABLE registry_writes (op text, ordering_key text);"
        "CREATE FUNCTION log_registry_write() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " INSERT INTO registry_writes VALUES (TG_OP, coalesce(NEW.ordering_key, OLD.ordering_key));"
        " RETURN NULL; END $$;"
        "CREATE TRIGGER log_registry_write AFTER UPDATE OR DELETE ON outbox_work"
        " FOR EACH ROW EXECUTE FUNCTION log_registry_write();"
        "GRANT INSERT ON registry_writes TO PUBLIC"
    )
    ids = await insert(conn, ["done", "more", "more"])
    batch = await claimer(pool, make_settings(batch_size=2)).claim()
    assert by_key(batch) == {"done": [ids[0]], "more": [ids[1]]}
    assert batch is not None
    await conn.execute("TRUNCATE registry_writes")
    assert await settle(pool, batch, [Result(Outcome.PUBLISHED)] * 2) == 2
    writes = await conn.fetch("SELECT op, ordering_key FROM registry_writes ORDER BY 2, 1")
    assert [tuple(r) for r in writes] == [("DELETE", "done"), ("UPDATE", "more")]
    left = await conn.fetch("SELECT ordering_key, head_id, claim_token FROM outbox_work")
    assert [tuple(r) for r in left] == [("more", ids[2], None)]


async def test_a_row_a_writer_commits_while_its_key_is_settled_is_claimed(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str, make_settings: Any
) -> None:
    """A writer of the key may be about to commit a row the settle cannot see: the settle drops
    the key's work, and the row, new to the cursor, is claimed next."""
    await insert(conn, ["k"])
    batch = await claimer(pool, make_settings()).claim()
    assert batch is not None
    writer = await asyncpg.connect(database_url)
    try:
        tx = writer.transaction()
        await tx.start()
        new_id = await writer.fetchval(
            "INSERT INTO outbox (topic, ordering_key, payload) VALUES ('t', 'k', 'x') RETURNING id"
        )
        assert await settle(pool, batch, [Result(Outcome.PUBLISHED)]) == 1
        await tx.commit()
    finally:
        await writer.close()
    again = await claimer(pool, make_settings()).claim()
    assert by_key(again) == {"k": [new_id]}


async def test_rows_a_settle_publishes_while_discovery_reads_them_are_not_claimed_again(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str, make_settings: Any
) -> None:
    """Discovery reads new rows in one snapshot and leases keys it finds no work for afterwards.
    A key's previous owner (it took a late row through its key's run) may settle the row and drop
    the key's work in between: the row, pending in discovery's snapshot, is published. It must
    not be leased and published again (seen as 1 copy in 15 runs of 6 overlapping writers)."""
    (row,) = await insert(conn, ["k"])
    await conn.execute(
        "INSERT INTO outbox_work (keyless, ordering_key, head_id, claim_token, claim_owner,"
        " claim_expires_at, claim_first) VALUES (false, 'k', $1 + 1, gen_random_uuid(), 'a',"
        " now() + interval '30 seconds', $1)",
        row,
    )
    settler = await asyncpg.connect(database_url)
    try:
        tx = settler.transaction()
        await tx.start()
        await settler.execute("UPDATE outbox SET published_at = now() WHERE id = $1", row)
        await settler.execute("DELETE FROM outbox_work WHERE ordering_key = 'k'")
        claim = asyncio.create_task(claimer(pool, make_settings()).claim())

        async def waiting() -> bool:
            return await sessions_waiting_on_a_lock(conn) > 0

        await wait_until(waiting, 10, "discovery to wait for the settle's lock")
        await tx.commit()
        batch = await asyncio.wait_for(claim, 10)
    finally:
        await settler.close()
    assert by_key(batch) == {}
    assert (
        await conn.fetchval("SELECT count(*) FROM outbox_work WHERE claim_token IS NOT NULL") == 0
    )
    assert by_key(await claimer(pool, make_settings()).claim()) == {}
    assert await conn.fetchval("SELECT count(*) FROM outbox_work") == 0


async def test_claims_beside_an_open_writer_do_not_rewrite_the_cursor(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str, make_settings: Any
) -> None:
    """While a writer's transaction stays open its id is a hole, read again only when a
    transaction running when it was found ends. Claims that find nothing new leave the cursor row
    alone: a rewrite per claim left versions that the open transaction's snapshot keeps from
    vacuum, and claims grew dearer with its age."""
    writer = await asyncpg.connect(database_url)
    try:
        tx = writer.transaction()
        await tx.start()
        held = await writer.fetchval(
            "INSERT INTO outbox (topic, ordering_key, payload) VALUES ('t', 'w', 'x') RETURNING id"
        )
        ids = await insert(conn, ["a"])
        batch = await claimer(pool, make_settings()).claim()
        assert by_key(batch) == {"a": ids}
        assert batch is not None
        await settle(pool, batch, [Result(Outcome.PUBLISHED)])
        # (a new hole is read once more by the next claim, which records that only the open
        # writer can still fill it: one rewrite; from then on, none)
        assert await claimer(pool, make_settings()).claim() is None
        before = await conn.fetchrow("SELECT ctid, hole_lo FROM outbox_cursor")
        assert list(before["hole_lo"]) == [held]
        for _ in range(20):
            assert await claimer(pool, make_settings()).claim() is None
        after = await conn.fetchrow("SELECT ctid, hole_lo FROM outbox_cursor")
        assert after["ctid"] == before["ctid"]
        await tx.commit()
    finally:
        await writer.close()
    assert by_key(await claimer(pool, make_settings()).claim()) == {"w": [held]}


# --- Rows that reach the table around the engine's bookkeeping: the anti-entropy sweep -------


async def claim_and_publish_all(pool: asyncpg.Pool, make_settings: Any) -> None:
    while (batch := await claimer(pool, make_settings(batch_size=100)).claim()) is not None:
        await settle(pool, batch, [Result(Outcome.PUBLISHED)] * len(batch.records))


async def test_a_row_written_below_the_cursor_is_found_by_the_sweep(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    """A writer that sets ids itself (or a restore into a live table) may write a pending row
    below the cursor, where no claim looks again: the sweep registers it, once."""
    ids = await insert(conn, ["a", "b", "c", "d"])
    await claim_and_publish_all(pool, make_settings)
    await conn.execute("DELETE FROM outbox WHERE id = ANY ($1)", ids[1:3])
    await conn.execute(
        "INSERT INTO outbox (id, topic, ordering_key, payload) OVERRIDING SYSTEM VALUE"
        " VALUES ($1, 't', 'stray', 'x'), ($2, 't', NULL, 'x')",
        ids[1],
        ids[2],
    )
    assert await claimer(pool, make_settings()).claim() is None, "below the cursor: unseen"
    store = DispatchStore(pool, STATEMENTS)
    assert await store.sweep(rows=1000, hold_seconds=30) == (2, True)
    assert await store.sweep(rows=1000, hold_seconds=30) == (0, True), "registered once"
    batch = await claimer(pool, make_settings(batch_size=100)).claim()
    assert batch is not None
    assert sorted((r.ordering_key or "", r.id) for r in batch.records)[1:] == [("stray", ids[1])]
    assert len(batch.records) == 2


async def test_the_sweep_walks_the_table_in_steps_and_starts_over(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    await insert(conn, [f"k{i}" for i in range(10)])
    await claim_and_publish_all(pool, make_settings)
    store = DispatchStore(pool, STATEMENTS)
    steps = [await store.sweep(rows=4, hold_seconds=30) for _ in range(4)]
    assert steps == [(0, False), (0, False), (0, True), (0, False)]


async def test_a_key_update_with_triggers_off_is_found_by_the_sweep(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    """session_replication_role = replica (pg_restore --disable-triggers, logical replication's
    apply) skips the trigger that notes a key change: the row's new key is unknown to the engine,
    its old key's work finds nothing. The sweep gives the row to its new key."""
    [moved] = await insert(conn, ["old"])
    known = await claimer(pool, make_settings()).claim()
    assert by_key(known) == {"old": [moved]}
    assert known is not None
    assert await DispatchStore(pool, STATEMENTS).release_claim(token=known.token) == 1
    await conn.execute("SET session_replication_role = replica")
    try:
        await conn.execute("UPDATE outbox SET ordering_key = 'new' WHERE id = $1", moved)
    finally:
        await conn.execute("SET session_replication_role = origin")
    assert await claimer(pool, make_settings()).claim() is None
    assert await DispatchStore(pool, STATEMENTS).sweep(rows=1000, hold_seconds=30) == (1, True)
    assert by_key(await claimer(pool, make_settings()).claim()) == {"new": [moved]}


async def test_a_row_moved_to_another_key_while_in_flight_has_one_owner(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    """A writer gives an in-flight row another key: the new key's claims do not take the row
    while the old key's claim holds it; once that claim gave it back, the new key does."""
    [moved] = await insert(conn, ["old"])
    held = await claimer(pool, make_settings(), "a").claim()
    assert by_key(held) == {"old": [moved]}
    await conn.execute("UPDATE outbox SET ordering_key = 'new' WHERE id = $1", moved)
    assert await claimer(pool, make_settings(), "b").claim() is None, "in flight under 'old'"
    assert held is not None
    await settle(pool, held, [Result(Outcome.RETRY)])
    assert by_key(await claimer(pool, make_settings(), "b").claim()) == {"new": [moved]}


async def test_a_key_whose_waiting_row_moves_away_goes_on(
    pool: asyncpg.Pool, conn: asyncpg.Connection, make_settings: Any
) -> None:
    """Key k waits out its first row's backoff; a writer moves that row to another key: k's
    next row does not wait for a backoff that is no longer k's."""
    first, second = await insert(conn, ["k", "k"])
    batch = await claimer(pool, make_settings(batch_size=1)).claim()
    assert batch is not None
    await settle(pool, batch, [Result(Outcome.RETRY, "boom", delay=3600, counted=True)])
    assert await claimer(pool, make_settings()).claim() is None, "k waits"
    await conn.execute("UPDATE outbox SET ordering_key = 'elsewhere' WHERE id = $1", first)
    taken = await claimer(pool, make_settings()).claim()
    assert by_key(taken) == {"k": [second]}
