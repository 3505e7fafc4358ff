"""The steady path of claim engine v4 (schema version 16; dispatch.sql `claim_steady` and
`settle_steady`, docs/design/claim-engine.md): one statement per claim and per settle in the
common case, the engine's functions for everything else. Each test is an interleaving of
statements (not of whole claims) against real PostgreSQL, or a state the steady path must hand
over to the claim function."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest

from outbox_dispatcher.store import DispatchStore, Statements
from outbox_dispatcher.store.arguments import ClaimArguments, SettleArguments

from .helpers import sessions_waiting_on_a_lock, wait_until
from .test_engine_review_3 import insert

pytestmark = pytest.mark.integration

STATEMENTS = Statements.for_table("public", "outbox")


def store(executor: Any, *, steady: bool = True) -> DispatchStore:
    return DispatchStore(executor, STATEMENTS, steady=steady)


def claim_arguments(token: uuid.UUID, owner: str = "d", limit: int = 100) -> ClaimArguments:
    return ClaimArguments(
        limit=limit,
        max_keys=limit,
        owner=owner,
        lease_seconds=30.0,
        token=token,
        block_on_dead=False,
        max_attempts=10,
        scan=max(2 * limit, 100),
    )


def settle_arguments(
    token: uuid.UUID, rows: list[asyncpg.Record], outcome: str = "published"
) -> SettleArguments:
    n = len(rows)
    return SettleArguments(
        token=token,
        owner="d",
        ids=[r["id"] for r in rows],
        keys=[r["ordering_key"] for r in rows],
        outcomes=[outcome] * n,
        errors=[None] * n,
        delays=[0.0] * n,
        counted=[1] * n,
        delete_published=False,
        block_on_dead=False,
        steady=True,  # (batches of the steady path's claim here)
    )


async def engine_functions_off(conn: asyncpg.Connection) -> None:
    """The claim and settle functions renamed away: a call that reaches them fails."""
    for name in ("claim_work", "settle_work"):
        await conn.execute(f"ALTER FUNCTION outbox_{name} RENAME TO outbox_{name}_off")


async def engine_functions_on(conn: asyncpg.Connection) -> None:
    for name in ("claim_work", "settle_work"):
        await conn.execute(f"ALTER FUNCTION outbox_{name}_off RENAME TO outbox_{name}")


async def test_a_steady_cycle_runs_no_engine_function(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    """New rows of new keys right above the cursor, nothing else in the table's state: the claim
    and the settle are the steady path's single statements (the claim and settle functions are
    renamed away, and nothing fails), an empty claim too, and the rows are published."""
    steady = store(pool)
    first = [await insert(conn, f"k{i}") for i in range(3)]
    await engine_functions_off(conn)
    token = uuid.uuid4()
    rows = await steady.claim(**claim_arguments(token))
    assert [r["id"] for r in rows] == first
    assert await steady.settle(**settle_arguments(token, rows)) == first
    assert await steady.claim(**claim_arguments(uuid.uuid4())) == []
    await engine_functions_on(conn)
    assert await conn.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0
    assert await conn.fetchval("SELECT count(*) FROM outbox_work") == 0


@pytest.mark.parametrize("passer", ["steady claim", "claim function"])
async def test_a_settle_whose_snapshot_predates_a_claim_that_passed_its_keys_next_row_keeps_it(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str, passer: str
) -> None:
    """The one-statement settle reads "is a row of the key left?" in its own snapshot. A claim
    that passed the key's next row (the key's claim in flight: the row is not taken) and
    committed after that snapshot was taken, while the settle waited for its lock, would leave
    the row below the cursor with no work: stranded until the sweep. The passing claim writes the
    key's work row (last_seen), which the settle sees in the version it locked: the key stays
    as ready work and its next claim takes the row."""
    steady = store(pool)
    first = await insert(conn, "k")
    token = uuid.uuid4()
    held = await steady.claim(**claim_arguments(token))
    assert [r["id"] for r in held] == [first]
    second = await insert(conn, "k")
    passing = await asyncpg.connect(database_url)
    try:
        tx = passing.transaction()
        await tx.start()
        passed = await store(passing, steady=passer == "steady claim").claim(
            **claim_arguments(uuid.uuid4(), owner="p")
        )
        assert passed == []  # its key is held: the row is passed, not taken
        assert await conn.fetchval("SELECT position FROM outbox_cursor") < second  # (open)
        settling = asyncio.create_task(steady.settle(**settle_arguments(token, held)))
        await wait_until(
            lambda: _waiting(conn), 10, "the settle to wait for the passing claim's lock"
        )
        await tx.commit()
        assert await settling == [first]
    finally:
        await passing.close()
    work = await conn.fetchrow(
        "SELECT state::text AS state, claim_token, head_id FROM outbox_work"
        " WHERE ordering_key = 'k'"
    )
    assert work is not None, "the key's work was dropped: its next row is stranded"
    assert (work["state"], work["claim_token"]) == ("r", None)
    taken = await steady.claim(**claim_arguments(uuid.uuid4()))
    assert [r["id"] for r in taken] == [second]


async def _waiting(conn: asyncpg.Connection) -> bool:
    return await sessions_waiting_on_a_lock(conn) >= 1


async def test_a_steady_claim_that_passes_a_row_below_its_keys_head_lowers_the_head(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str
) -> None:
    """The settle function (a claim function's batch) puts its key's head at the key's next
    pending row in its own snapshot, above the cursor: a row of the key whose writer drew its
    id first and commits after that snapshot is not in it. A steady claim whose snapshot
    predates the settle's commit passes both rows (the key's work is held: not taken) and
    lowers the head to the lower one, as discovery does. Without it, the key's next claim
    started at the higher row (its first delivery before the lower one's) and the lower one
    waited for the sweep (the 1k/s exactly-once bench: 8 rows 18 s late, and one key held a
    whole lease by the sweep)."""
    function = store(pool, steady=False)
    first = await insert(conn, "k")
    token = uuid.uuid4()
    held = await function.claim(**claim_arguments(token))
    assert [r["id"] for r in held] == [first]
    writer = await asyncpg.connect(database_url)
    settler = await asyncpg.connect(database_url)
    try:
        writing = writer.transaction()
        await writing.start()
        late = await insert(writer, "k")  # its id drawn first, committed last
        early = await insert(conn, "k")
        settling = settler.transaction()
        await settling.start()
        arguments = settle_arguments(token, held)
        arguments["steady"] = False  # (a claim function's batch)
        assert await store(settler, steady=False).settle(**arguments) == [first]
        head = "SELECT head_id FROM outbox_work WHERE ordering_key = 'k'"
        assert await settler.fetchval(head) == early  # (above the cursor: not seen by it)
        await writing.commit()
        passing = asyncio.create_task(store(pool).claim(**claim_arguments(uuid.uuid4())))
        await wait_until(
            lambda: _waiting(conn), 10, "the steady claim to wait for the settle's lock"
        )
        await settling.commit()
        assert await passing == []  # its key was held: its rows are passed, not taken
    finally:
        await writer.close()
        await settler.close()
    assert await conn.fetchval("SELECT position FROM outbox_cursor") == early
    assert await conn.fetchval(head) == late, "the late row is below its key's head: stranded"
    taken = await store(pool).claim(**claim_arguments(uuid.uuid4()))
    assert [r["id"] for r in taken] == [late, early]


async def test_a_gap_below_new_rows_is_the_claim_functions(
    pool: asyncpg.Pool, conn: asyncpg.Connection, database_url: str
) -> None:
    """An id drawn by a writer still open, below committed rows: the steady claim does not move
    the cursor past it (it may be a writer's row still to come), the claim function takes the
    rows above and keeps the hole; once the writer commits its row goes out."""
    steady = store(pool)
    writer = await asyncpg.connect(database_url)
    try:
        tx = writer.transaction()
        await tx.start()
        late = await insert(writer, "w")
        above = await insert(conn, "a")
        taken = await steady.claim(**claim_arguments(uuid.uuid4()))
        assert [r["id"] for r in taken] == [above]
        assert list(await conn.fetchval("SELECT hole_lo FROM outbox_cursor")) == [late]
        await tx.commit()
    finally:
        await writer.close()
    token = uuid.uuid4()
    again = await steady.claim(**claim_arguments(token))
    assert [r["id"] for r in again] == [late]


async def test_the_claim_function_takes_over_while_a_pause_exists(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    """Any pause is state the steady claim does not look at: the claim function runs, and
    parks the paused topic's row while the other goes out."""
    steady = store(pool)
    await conn.execute("INSERT INTO outbox_paused (topic, paused_by) VALUES ('stopped', 'op')")
    parked = await insert(conn, "a", topic="stopped")
    free = await insert(conn, "b", topic="t")
    taken = await steady.claim(**claim_arguments(uuid.uuid4()))
    assert [r["id"] for r in taken] == [free]
    assert (
        await conn.fetchval("SELECT state::text FROM outbox_work WHERE head_id = $1", parked) == "p"
    )


async def test_a_late_publication_of_a_row_dead_lettered_under_the_lease_is_recorded(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    """The reclaimer dead-lettered the batch's row as a crash loop (its owner was only slow) and
    released its key: the one-statement settle finds no work under its token and marks nothing,
    and hands the row to the settle function, which records the publication."""
    steady = store(pool)
    row = await insert(conn, "k")
    token = uuid.uuid4()
    held = await steady.claim(**claim_arguments(token))
    await conn.execute(
        "UPDATE outbox SET dead_at = now(), lease_token = $1 WHERE id = $2", token, row
    )
    await conn.execute(
        "UPDATE outbox_work SET claim_token = NULL, claim_owner = NULL, claim_expires_at = NULL,"
        " claim_first = NULL, state = 'r' WHERE ordering_key = 'k'"
    )
    assert await steady.settle(**settle_arguments(token, held)) == [row]
    published = await conn.fetchrow("SELECT published_at, dead_at FROM outbox WHERE id = $1", row)
    assert published["published_at"] is not None and published["dead_at"] is None


async def test_a_batch_with_a_retry_is_the_settle_functions(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    """Outcomes other than published (a retry here) are settled by the settle function: the row
    backs off and its key waits."""
    steady = store(pool)
    row = await insert(conn, "k")
    token = uuid.uuid4()
    held = await steady.claim(**claim_arguments(token))
    arguments = settle_arguments(token, held, "retry")
    arguments["delays"] = [60.0]
    assert await steady.settle(**arguments) == [row]
    state = await conn.fetchrow(
        "SELECT state::text AS state, claim_token FROM outbox_work WHERE ordering_key = 'k'"
    )
    assert (state["state"], state["claim_token"]) == ("w", None)
    assert await steady.claim(**claim_arguments(uuid.uuid4())) == []


async def test_under_block_a_new_row_of_a_key_with_a_dead_row_is_never_passed(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    """dead_letter_policy = block: a new key with a dead row is the claim function's (it blocks
    the key). The steady claim stops its run there, so the cursor never passes the row with
    nobody registering it; the rows after it go out once the claim function took over."""
    steady = store(pool)
    dead = await insert(conn, "k")
    await conn.execute("UPDATE outbox SET dead_at = now() WHERE id = $1", dead)
    blocked = await insert(conn, "k")
    other = await insert(conn, "o")
    arguments = claim_arguments(uuid.uuid4())
    arguments["block_on_dead"] = True
    taken = []
    for _ in range(3):
        arguments["token"] = uuid.uuid4()
        taken += [r["id"] for r in await steady.claim(**arguments)]
    assert taken == [other]
    work = await conn.fetchval(
        "SELECT state::text FROM outbox_work WHERE ordering_key = 'k' AND head_id = $1", blocked
    )
    assert work == "b"
