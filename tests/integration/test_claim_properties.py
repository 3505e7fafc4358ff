"""Property-based: any interleaving of claims, acknowledgements, failures, lease expiries and
extensions, crash-loop sweeps and anti-entropy steps by several claimers, with writers doing what
writers do (single rows, bulk inserts, transactions held open across many claims at READ
COMMITTED, REPEATABLE READ and SERIALIZABLE and committed or rolled back late, two first writers
of one key at once, key updates, deletes, restores with triggers off, rows written below the
claim cursor), keeps the claim engine's promises:

* one owner per key: no claim takes a key another live claim holds;
* per-key order: a claim takes a prefix of its key's pending rows, and no row is first delivered
  after a later row of its key that was claimed after it had committed;
* nothing stranded: at every step each committed pending row is where a claim will look (above
  the cursor, in a hole, in the change log, or at or after its key's head), except rows written
  around the engine's bookkeeping, which the sweep finds; a final drain publishes every row.

The checks are plain functions; test_the_checks_catch_violations shows each of them failing."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.models import Batch, OutboxRecord, Outcome, Result
from outbox_dispatcher.store import DispatchStore, Statements, db

pytestmark = pytest.mark.integration

STATEMENTS = Statements.for_table("public", "outbox")
KEYS = st.sampled_from(["a", "b", "c", "d", None])
ISOLATION = ["read committed", "repeatable read", "serializable"]


@dataclass(frozen=True)
class Op:
    actor: int  # the claimer (0-2) or the writer (0-1)
    action: str
    n: int  # a batch size, a row count, an index into the pending rows
    key: str | None


CLAIMER_ACTIONS = ["claim", "claim", "claim", "ack", "ack", "fail", "dead", "expire", "extend"]
WRITER_ACTIONS = [
    "write", "write", "bulk", "begin", "begin", "insert_open", "insert_open", "commit",
    "rollback", "rekey", "delete", "restore", "stray", "rekey_quiet",
]  # fmt: skip
ENGINE_ACTIONS = ["sweep", "reclaim"]

OPS = st.one_of(
    st.builds(Op, st.integers(0, 2), st.sampled_from(CLAIMER_ACTIONS), st.integers(1, 6), KEYS),
    st.builds(Op, st.integers(0, 1), st.sampled_from(WRITER_ACTIONS), st.integers(0, 5), KEYS),
    st.builds(Op, st.just(0), st.sampled_from(ENGINE_ACTIONS), st.integers(1, 8), KEYS),
)

# Every committed pending row must be where a claim will look for it ($1: rows written around the
# engine's bookkeeping that only the sweep finds, until it did).
UNKNOWN = """
SELECT o.id FROM outbox o, outbox_cursor c
 WHERE o.published_at IS NULL AND o.dead_at IS NULL AND o.id <= c.position
   AND o.id <> ALL ($1::bigint[])
   AND NOT EXISTS (SELECT 1 FROM unnest(c.hole_lo, c.hole_hi) AS h(lo, hi)
                    WHERE o.id BETWEEN h.lo AND h.hi)
   AND NOT EXISTS (SELECT 1 FROM outbox_changed x WHERE x.id = o.id)
   AND NOT EXISTS (
       SELECT 1 FROM outbox_work w
        WHERE w.ordering_key = coalesce(o.ordering_key, o.id::text)
          AND w.keyless = (o.ordering_key IS NULL)
          AND (w.head_id <= o.id OR (w.claim_token IS NOT NULL AND w.claim_first <= o.id)))
 ORDER BY o.id
"""

PENDING = """
SELECT o.id, o.ordering_key, l.id IS NOT NULL AND l.lease_expires_at > now() AS leased,
       o.next_attempt_at > now() AS waiting
  FROM outbox o LEFT JOIN outbox_leases l ON l.id = o.id
 WHERE o.published_at IS NULL AND o.dead_at IS NULL ORDER BY o.id
"""


@dataclass
class Held:
    """A claimer's batch, and whether its lease was made to expire (its owner hung)."""

    batch: Batch
    claimed_at: int
    expired: bool = False


@dataclass
class World:
    """What the test knows: when each row committed (op index), and which rows a writer moved
    or wrote around the engine (order is not promised for them; only the sweep finds some)."""

    committed: dict[int, int] = field(default_factory=dict)
    moved: set[int] = field(default_factory=set)
    needs_sweep: set[int] = field(default_factory=set)
    # Moved with triggers off: the engine cannot know that a claim of the old key holds it.
    bypassed: set[int] = field(default_factory=set)
    deliveries: list[tuple[str | None, int, int]] = field(default_factory=list)


def check_owners(
    held: dict[int, Held], claimer: int, batch: Batch, bypassed: frozenset[int] = frozenset()
) -> None:
    """No claim takes a key, a keyless row, or any row another claimer's live lease holds (a
    row a writer moved to another key while in flight included, unless with triggers off)."""
    mine = {(r.ordering_key, r.id if r.ordering_key is None else 0) for r in batch.records}
    rows = {r.id for r in batch.records} - bypassed
    for other, h in held.items():
        if other == claimer or h.expired:
            continue
        theirs = {(r.ordering_key, r.id if r.ordering_key is None else 0) for r in h.batch.records}
        both = (mine & theirs) | {(None, i) for i in rows & {r.id for r in h.batch.records}}
        assert not both, f"two owners of {sorted(both, key=str)}: c{claimer} and c{other}"


def check_prefix(
    before: list[Any], batch: Batch, skip: set[int], bypassed: frozenset[int] = frozenset()
) -> None:
    """Per key, the claim took its first pending rows, none leased by another claim, and nothing
    of a key whose first row waits (rows in `skip` are not the engine's to know yet; a row moved
    with triggers off while in flight may go under both keys, as docs/writers.md says)."""
    pending: dict[str, list[Any]] = {}
    state = {row["id"]: row for row in before}
    for row in before:
        if row["ordering_key"] is not None and row["id"] not in skip:
            pending.setdefault(row["ordering_key"], []).append(row)
    taken: dict[str, list[int]] = {}
    for record in batch.records:
        assert record.id in bypassed or not state[record.id]["leased"], (
            f"row {record.id} was leased by another claim"
        )
        if record.ordering_key is not None and record.id not in skip:
            taken.setdefault(record.ordering_key, []).append(record.id)
    for key, ids in taken.items():
        first = pending[key][: len(ids)]
        assert ids == [r["id"] for r in first], f"key {key}: took {ids}, not a prefix of {first}"
        assert not first[0]["waiting"], f"key {key} taken while its first row waits"


def out_of_order(world: World) -> list[str]:
    """A row first delivered after a later row of its key, although it had committed before that
    row was claimed (a consumer would see them reversed)."""
    first: dict[int, tuple[str | None, int, int]] = {}
    for position, (key, row_id, claimed_at) in enumerate(world.deliveries):
        first.setdefault(row_id, (key, position, claimed_at))
    broken = []
    for late, (key, late_pos, _) in first.items():
        if key is None or late in world.moved:
            continue
        for early, (other_key, early_pos, claimed_at) in first.items():
            if (
                other_key == key
                and early > late
                and early_pos < late_pos
                and early not in world.moved
                and world.committed.get(late, 1 << 30) < claimed_at
            ):
                broken.append(f"key {key}: row {late} first delivered after row {early}")
    return broken


def results_for(batch: Batch, op: Op) -> list[Result]:
    """ack: all published; fail/dead: the row at `n` fails, later rows are not attempted."""
    count = len(batch.records)
    if op.action == "ack":
        return [Result(Outcome.PUBLISHED)] * count
    cut = min(op.n, count - 1)
    failed = (
        Result(Outcome.RETRY, "boom", delay=3600, counted=True)
        if op.action == "fail"
        else Result(Outcome.DEAD, "poison", counted=True)
    )
    return (
        [Result(Outcome.PUBLISHED)] * cut + [failed] + [Result(Outcome.RETRY)] * (count - cut - 1)
    )


class Writers:
    """Two writer sessions; each may hold one transaction open across many other steps."""

    def __init__(self, conns: list[asyncpg.Connection], world: World) -> None:
        self.conns = conns
        self.world = world
        self.open: dict[int, tuple[Any, list[int]]] = {}

    async def run(self, op: Op, step: int, pool: asyncpg.Pool) -> None:
        try:
            await self.step(op, step, pool)
        except asyncpg.SerializationError:
            # A SERIALIZABLE writer's statement may fail too, not only its commit: the writer's
            # transaction is over, as its application would see it.
            if op.actor not in self.open:
                raise
            await self.open.pop(op.actor)[0].rollback()

    async def step(self, op: Op, step: int, pool: asyncpg.Pool) -> None:
        conn = self.conns[op.actor]
        if op.action in ("write", "bulk"):
            rows = 1 if op.action == "write" else 20
            keys = [op.key if i % 2 == 0 else ["a", "b", "d", None][i % 4] for i in range(rows)]
            ids = await insert(conn, keys)
            if op.actor in self.open:  # inside the writer's open transaction
                self.open[op.actor][1].extend(ids)
            else:
                self.world.committed.update(dict.fromkeys(ids, step))
        elif op.action == "begin" and op.actor not in self.open:
            tx = conn.transaction(isolation=ISOLATION[op.n % 3].replace(" ", "_"))
            await tx.start()
            await conn.fetchval("SELECT count(*) FROM outbox")  # the snapshot starts here
            self.open[op.actor] = (tx, [])
        elif op.action == "insert_open" and op.actor in self.open:
            self.open[op.actor][1].extend(await insert(conn, [op.key]))
        elif op.action in ("commit", "rollback") and op.actor in self.open:
            tx, ids = self.open.pop(op.actor)
            try:
                await (tx.commit() if op.action == "commit" else tx.rollback())
            except asyncpg.SerializationError:
                return
            if op.action == "commit":
                self.world.committed.update(dict.fromkeys(ids, step))
        elif op.action in ("rekey", "rekey_quiet", "delete"):
            await self.change_a_row(op, pool)
        elif op.action in ("restore", "stray"):
            await self.write_around_the_engine(op, step, pool)

    async def change_a_row(self, op: Op, pool: asyncpg.Pool) -> None:
        rows = await pool.fetch(
            "SELECT id FROM outbox WHERE published_at IS NULL AND dead_at IS NULL ORDER BY id"
        )
        if not rows:
            return
        row_id = rows[op.n % len(rows)]["id"]
        if op.action == "delete":
            await pool.execute("DELETE FROM outbox WHERE id = $1", row_id)
            return
        async with pool.acquire() as conn:
            if op.action == "rekey_quiet":
                await conn.execute("SET session_replication_role = replica")
            try:
                await conn.execute(
                    "UPDATE outbox SET ordering_key = $2 WHERE id = $1", row_id, op.key
                )
            finally:
                await conn.execute("SET session_replication_role = origin")
        self.world.moved.add(row_id)
        if op.action == "rekey_quiet":
            self.world.needs_sweep.add(row_id)
            self.world.bypassed.add(row_id)

    async def write_around_the_engine(self, op: Op, step: int, pool: asyncpg.Pool) -> None:
        """restore: rows inserted with triggers off (pg_restore --disable-triggers); stray: a
        pending row written with an explicit id below the cursor, in the place of a published
        row removed (a restore into a live table)."""
        async with pool.acquire() as conn:
            await conn.execute("SET session_replication_role = replica")
            try:
                if op.action == "restore":
                    for row_id in await insert(conn, [op.key, None]):
                        self.world.committed[row_id] = step
                    return
                gone = await conn.fetchval(
                    "DELETE FROM outbox WHERE id = (SELECT id FROM outbox"
                    " WHERE published_at IS NOT NULL ORDER BY id LIMIT 1) RETURNING id"
                )
                if gone is None:
                    return
                await conn.execute(
                    "INSERT INTO outbox (id, topic, ordering_key, payload) OVERRIDING SYSTEM"
                    " VALUE VALUES ($1, 't', $2, 'x')",
                    gone,
                    op.key,
                )
            finally:
                await conn.execute("SET session_replication_role = origin")
        self.world.committed[gone] = step
        self.world.moved.add(gone)
        self.world.needs_sweep.add(gone)

    async def finish(self) -> None:
        for tx, _ in self.open.values():
            await tx.rollback()


async def insert(conn: asyncpg.Connection, keys: list[str | None]) -> list[int]:
    rows = await conn.fetch(
        "INSERT INTO outbox (topic, ordering_key, payload) "
        "SELECT 't', k, 'x' FROM unnest($1::text[]) WITH ORDINALITY AS u(k, n) ORDER BY n "
        "RETURNING id",
        keys,
    )
    return [r["id"] for r in rows]


class Claimers:
    def __init__(self, pool: asyncpg.Pool, world: World) -> None:
        self.pool = pool
        self.world = world
        # (the steady path's one-statement settle, and the settle function when it hands over)
        self.settler = Settler(DispatchStore(pool, STATEMENTS, steady=True), retry_for=1.0)
        self.held: dict[int, Held] = {}

    async def run(self, op: Op, step: int) -> None:
        held = self.held.get(op.actor)
        if op.action == "claim" and held is None:
            # Even actors try the steady path's one-statement claim first, odd ones run the
            # claim function alone: the two interleave.
            store = DispatchStore(self.pool, STATEMENTS, steady=op.actor % 2 == 0)
            claimer = Claimer(store, Settings(batch_size=op.n), f"c{op.actor}")
            before = await self.pool.fetch(PENDING)
            batch = await claimer.claim()
            if batch is not None:
                check_owners(self.held, op.actor, batch, frozenset(self.world.bypassed))
                check_prefix(
                    before,
                    batch,
                    self.world.needs_sweep | self.world.moved,
                    frozenset(self.world.bypassed),
                )
                self.held[op.actor] = Held(batch, step)
        elif op.action == "expire" and held is not None:
            # The claimer hangs past its lease; it keeps its batch and may settle it late.
            held.expired = True
            await self.pool.execute(
                "UPDATE outbox_work SET claim_expires_at = now() - interval '1 second'"
                " WHERE claim_token = $1",
                held.batch.token,
            )
        elif op.action == "extend" and held is not None:
            # A lease keeper that may have lost its lease must only extend a live one of its own.
            ids = [r.id for r in held.batch.records]
            await DispatchStore(self.pool, STATEMENTS).extend_leases(
                ids=ids, tokens=[held.batch.token] * len(ids), seconds=60.0
            )
        elif op.action in ("ack", "fail", "dead") and held is not None:
            await self.settle(self.held.pop(op.actor), results_for(held.batch, op))

    async def settle(self, held: Held, results: list[Result]) -> None:
        # What reached the broker is in Kafka whether or not the lease still held at the mark.
        self.world.deliveries.extend(
            (r.ordering_key, r.id, held.claimed_at)
            for r, res in zip(held.batch.records, results, strict=True)
            if res.outcome is Outcome.PUBLISHED
        )
        await self.settler.settle(held.batch, results)


async def engine_step(op: Op, pool: asyncpg.Pool, world: World) -> None:
    store = DispatchStore(pool, STATEMENTS)
    if op.action == "sweep":
        await store.sweep(rows=op.n, hold_seconds=30)
        # What the sweep registered (its key's head is at or before it) is the engine's to know
        # from now on; a row inside a live claim's range waits for the sweep's next pass.
        registered = await pool.fetch(
            "SELECT o.id FROM outbox o JOIN outbox_work w"
            " ON w.ordering_key = coalesce(o.ordering_key, o.id::text)"
            " AND w.keyless = (o.ordering_key IS NULL) AND w.head_id <= o.id"
            " WHERE o.id = ANY ($1::bigint[])",
            sorted(world.needs_sweep),
        )
        world.needs_sweep -= {r["id"] for r in registered}
    else:
        await store.dead_letter_crash_loops(max_attempts=3, block_on_dead=False)


async def drain(claimers: Claimers, pool: asyncpg.Pool, world: World, rows: int) -> None:
    """Every lease expired, every backoff over (as an operator's release does), the sweep run to
    the end of a pass: then every committed row is claimed and published."""
    for held in list(claimers.held.values()):
        await claimers.settle(held, [Result(Outcome.RETRY)] * len(held.batch.records))
    claimers.held.clear()
    await pool.execute(
        "UPDATE outbox SET next_attempt_at = now() WHERE published_at IS NULL AND dead_at IS NULL"
    )
    # Time passes: what waited on a row a writer moved away with triggers off is due too.
    await pool.execute(
        "UPDATE outbox_work SET not_before = '-infinity' WHERE state = 'w' AND claim_token IS NULL"
    )
    await pool.execute(
        "UPDATE outbox_work SET claim_expires_at = now() - interval '1 second'"
        " WHERE claim_token IS NOT NULL"
    )
    wraps = 0
    while wraps < 2:  # from wherever it stood: to the end, then a whole pass
        wraps += (await DispatchStore(pool, STATEMENTS).sweep(rows=1000, hold_seconds=30))[1]
    world.needs_sweep.clear()
    drainer = Claimer(
        DispatchStore(pool, STATEMENTS), Settings(batch_size=50, max_attempts=100), "drain"
    )
    step = 1 << 20
    for _ in range(rows + 1):
        batch = await drainer.claim()
        if batch is None:
            break
        await claimers.settle(Held(batch, step), [Result(Outcome.PUBLISHED)] * len(batch.records))


async def scenario(url: str, keys: list[str | None], ops: list[Op]) -> None:
    pool = await asyncpg.create_pool(url, min_size=1, max_size=4, init=db.init_connection)
    assert pool is not None
    writer_conns = [await asyncpg.connect(url) for _ in range(2)]
    world = World()
    writers = Writers(writer_conns, world)
    try:
        await pool.execute("TRUNCATE outbox RESTART IDENTITY")
        for row_id in await insert(writer_conns[0], keys):
            world.committed[row_id] = -1
        claimers = Claimers(pool, world)
        for step, op in enumerate(ops):
            if op.action in CLAIMER_ACTIONS:
                await claimers.run(op, step)
            elif op.action in ENGINE_ACTIONS:
                await engine_step(op, pool, world)
            else:
                await writers.run(op, step, pool)
            unknown = await pool.fetch(UNKNOWN, sorted(world.needs_sweep))
            assert not unknown, f"step {step} {op}: rows no claim will find: {unknown}"
        await writers.finish()
        await drain(claimers, pool, world, len(world.committed))
        left = await pool.fetch(
            "SELECT id, ordering_key FROM outbox WHERE published_at IS NULL AND dead_at IS NULL"
        )
        assert [tuple(r) for r in left] == [], "stranded after the drain"
        assert out_of_order(world) == []
    finally:
        for conn in writer_conns:
            await conn.close()
        await pool.close()


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(keys=st.lists(KEYS, min_size=1, max_size=14), ops=st.lists(OPS, min_size=20, max_size=60))
def test_claim_and_settle_keep_per_key_invariants(
    database_url: str, keys: list[str | None], ops: list[Op]
) -> None:
    asyncio.run(scenario(database_url, keys, ops))


def test_the_checks_catch_violations(database_url: str) -> None:
    # Row 1 committed at step 0; row 2 was claimed at step 1 and delivered first: reversed.
    world = World(committed={1: 0, 2: 0, 3: 0})
    world.deliveries = [("a", 2, 1), ("a", 1, 3)]
    assert out_of_order(world) == ["key a: row 1 first delivered after row 2"]
    world.committed[1] = 2  # row 1 committed after row 2's claim: a late commit, no promise
    assert out_of_order(world) == []
    world.deliveries = [("a", 1, 3), ("a", 2, 1), ("a", 1, 4)]  # duplicates do not count
    assert out_of_order(world) == []

    def batch(*rows: tuple[int, str | None]) -> Batch:
        now = datetime.now(UTC)
        records = [OutboxRecord(i, "t", k, b"x", {}, uuid.uuid4(), now, 0, False) for i, k in rows]
        return Batch(uuid.uuid4(), records)

    with pytest.raises(AssertionError, match="two owners"):
        check_owners({1: Held(batch((1, "a")), 0)}, 0, batch((2, "a")))
    check_owners({1: Held(batch((1, "a")), 0, expired=True)}, 0, batch((2, "a")))
    check_owners({1: Held(batch((1, None)), 0)}, 0, batch((2, None)))
    before = [
        {"id": 1, "ordering_key": "a", "leased": False, "waiting": False},
        {"id": 2, "ordering_key": "a", "leased": False, "waiting": False},
    ]
    with pytest.raises(AssertionError, match="not a prefix"):
        check_prefix(before, batch((2, "a")), set())
    check_prefix(before, batch((2, "a")), {1})

    async def unknown_row() -> list[int]:
        """A pending row below the cursor that nothing points at (as a restore with explicit ids
        leaves it before the sweep came by)."""
        conn = await asyncpg.connect(database_url)
        try:
            [row] = await insert(conn, ["a"])
            await conn.execute("UPDATE outbox_cursor SET position = $1", row)
            return [r["id"] for r in await conn.fetch(UNKNOWN, [])]
        finally:
            await conn.close()

    assert asyncio.run(unknown_row()) == [1]


def test_the_property_fails_on_an_engine_that_misses_key_updates(database_url: str) -> None:
    """The same scenario against a broken engine (the trigger that notes key updates dropped):
    the row a writer moved to a new key is reported as one no claim will find."""

    async def run() -> None:
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute("DROP TRIGGER outbox_note_change ON outbox")
        finally:
            await conn.close()
        # (claimer 1 runs the claim function, whose discovery passes the key's second row;
        # the steady path's claim passes only the rows it takes)
        ops = [Op(1, "claim", 1, None), Op(1, "ack", 0, None), Op(0, "rekey", 0, "b")]
        await scenario(database_url, ["a", "a"], ops)

    with pytest.raises(AssertionError, match="rows no claim will find"):
        asyncio.run(run())


def test_a_row_moved_twice_while_in_flight_keeps_one_owner(database_url: str) -> None:
    """Found by the property test: a row claimed under key b, moved to c (its change waits for
    b's claim), found by the sweep under c, then moved to a: its second change was taken in
    because no claim of c held it, and a second claimer leased it under a while b's claim
    still did. A row's later changes now wait with its first."""
    ops = [
        Op(1, "claim", 1, "a"),
        Op(0, "rekey", 0, "c"),
        Op(0, "claim", 1, "a"),
        Op(0, "sweep", 1, "a"),
        Op(0, "claim", 1, "a"),
        Op(0, "rekey", 0, "a"),
        Op(0, "claim", 1, "a"),
        Op(0, "claim", 1, "a"),
    ]
    asyncio.run(scenario(database_url, ["b"], ops))


def test_a_keyless_row_given_a_key_while_in_flight_keeps_one_owner(database_url: str) -> None:
    """Found by the property test: a keyless row claimed, given key a by a writer, then the
    sweep ran: a second claimer leased it under a while the first claim still did."""
    ops = [
        Op(0, "claim", 1, "a"),
        Op(0, "rekey", 0, "a"),
        Op(0, "sweep", 1, "a"),
        Op(1, "claim", 1, "a"),
    ]
    asyncio.run(scenario(database_url, [None], ops))


def test_a_row_moved_into_a_key_with_a_head_below_it_waits_for_its_old_claim(
    database_url: str,
) -> None:
    """Found by the property test: row 4 claimed under b, moved to c (its change waits for b's
    claim); c's claim ended with its head at 4, so the next claim of c read row 4 through the
    key's index and leased it while b's claim still did. A key's run now stops before a row
    whose change waits."""
    ops = [
        Op(0, "claim", 1, "a"),
        Op(0, "write", 0, "a"),
        Op(0, "write", 0, "c"),
        Op(0, "fail", 1, "a"),
        Op(0, "write", 0, "b"),
        Op(0, "claim", 1, "a"),
        Op(0, "delete", 0, "a"),
        Op(1, "claim", 1, "a"),
        Op(0, "rekey", 2, "c"),
        Op(0, "ack", 1, "a"),
        Op(0, "claim", 1, "a"),
    ]
    asyncio.run(scenario(database_url, ["a"], ops))
