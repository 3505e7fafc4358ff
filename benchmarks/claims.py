"""What one claim costs beside stuck work (issue 21: 1M keys paused, 1M keyless rows in backoff,
against none): the product's own claim and settle (Claimer, Settler) on one connection of their
own, no Kafka, no dispatcher process.

The stuck work is written by bulk SQL as the engine leaves it once its claims have parked it
(a paused key: its work row in state p under the current pauses; a keyless row in backoff: its
own work row, waiting until the row is due) and the cursor above it; at the end the engine's
own drift check must find no row it does not know of, and the claims must have left every stuck
row's work as it was. Then the product's autovacuum settings get their chance to analyze the
tables (as they have, once stuck work has been there a while) before claims are timed.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import asyncpg

from benchmarks.load import STATEMENTS, insert_rows
from benchmarks.stack import Stack, connection, fresh, settings_for
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.models import Outcome, Result
from outbox_dispatcher.store import DispatchStore, db

STUCK_KINDS = ("paused_keys", "keyless_backoff")
STUCK_TOPIC = "bench-stuck"
SESSION_FIRST = 10  # a session's first executions are planned each time: not what a dispatcher's
# long-lived connections meet, so not timed
PUBLISHED = Result(Outcome.PUBLISHED)
AUTOVACUUM_WAIT = 150.0  # seconds to wait for autovacuum to analyze the prepared tables

PREPARE = {
    "paused_keys": (
        "INSERT INTO outbox_paused (topic, paused_by, reason) "
        f"VALUES ('{STUCK_TOPIC}', 'benchmark', 'stuck work')",
        "INSERT INTO outbox (topic, ordering_key, payload) "
        f"SELECT '{STUCK_TOPIC}', 'paused-' || g, 'x' FROM generate_series(1, $1) g",
        # As a claim parks a key whose head's topic is paused.
        "INSERT INTO outbox_work (keyless, ordering_key, head_id, state, head_topic, paused_gen) "
        "SELECT false, o.ordering_key, o.id, 'p', o.topic, c.pause_gen "
        "FROM outbox o, outbox_cursor c WHERE c.one",
    ),
    "keyless_backoff": (
        "INSERT INTO outbox (topic, ordering_key, payload, attempts, next_attempt_at, last_error) "
        f"SELECT '{STUCK_TOPIC}', NULL, 'x', 1, now() + interval '1 hour', 'benchmark' "
        "FROM generate_series(1, $1) g",
        # As a claim parks a keyless row that is not due: waiting until it is.
        "INSERT INTO outbox_work (keyless, ordering_key, head_id, state, not_before, head_topic, "
        "paused_gen) SELECT true, o.id::text, o.id, 'w', o.next_attempt_at, o.topic, c.pause_gen "
        "FROM outbox o, outbox_cursor c WHERE c.one",
    ),
}
STATES = "SELECT state::text, count(*) FROM outbox_work GROUP BY 1 ORDER BY 1"
ANALYZED = (
    "SELECT bool_and(autoanalyze_count > 0) FROM pg_stat_user_tables "
    "WHERE relname IN ('outbox', 'outbox_work')"
)


def on_cpu_seconds(pid: int) -> float:
    """Time a process spent on a CPU, in ns precision (/proc/<pid>/schedstat, Linux)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


async def prepare(conn: asyncpg.Connection, kind: str, rows: int) -> dict[str, float]:
    """`rows` rows of stuck work of `kind`, by bulk SQL; returns the seconds it took and whether
    autovacuum had analyzed the tables before the timing began."""
    started = time.monotonic()
    for sql in PREPARE[kind]:
        await (conn.execute(sql, rows) if "$1" in sql else conn.execute(sql))
    await conn.execute(
        "UPDATE outbox_cursor SET position = (SELECT coalesce(max(id), 0) FROM outbox) WHERE one"
    )
    prepared = time.monotonic() - started
    deadline = time.monotonic() + AUTOVACUUM_WAIT
    while not await conn.fetchval(ANALYZED) and time.monotonic() < deadline:
        await asyncio.sleep(1)
    return {"prepare_seconds": prepared, "autoanalyzed": float(bool(await conn.fetchval(ANALYZED)))}


async def claim_cost(stack: Stack, kind: str, rows: int, claims: int) -> dict[str, float]:
    """`claims` empty claims and `claims` // 5 full ones (500 new rows over 500 keys, as a
    steady flow's claim finds them) beside `rows` rows of stuck work of `kind` (or none):
    the median claim's wall time and the mean backend CPU per claim, in ms."""
    async with fresh(stack) as (url, topic), connection(url) as conn:
        figures = await prepare(conn, kind, rows) if kind != "none" else {}
        before = await conn.fetch(STATES)
        settings = settings_for(url, stack)
        pool = await asyncpg.create_pool(
            url,
            min_size=1,
            max_size=1,
            init=db.init_connection,
            server_settings=db.server_settings(settings),
        )
        try:
            pid = await pool.fetchval("SELECT pg_backend_pid()")
            claimer = Claimer(DispatchStore(pool, STATEMENTS), settings, "benchmark-claims")
            for _ in range(SESSION_FIRST):
                assert await claimer.claim() is None, "stuck work was claimed"
            empty = await timed_claims(pool, pid, [claimer] * claims, None)
            full = await full_claims(conn, pool, pid, settings, topic, max(claims // 5, 1))
        finally:
            await pool.close()
        after = await conn.fetch(STATES)
        drift = await DispatchStore(conn, STATEMENTS).engine_drift()
    assert drift is not None and drift["rows"] == 0, f"the engine does not know {drift} rows"
    assert before == after, f"the stuck work moved: {before} -> {after}"
    figures.update(
        {
            "stuck_rows": float(rows if kind != "none" else 0),
            "empty_claim_ms": empty[0],
            "empty_claim_backend_cpu_ms": empty[1],
            "full_claim_ms": full[0],
            "full_claim_backend_cpu_ms": full[1],
        }
    )
    return figures


async def timed_claims(
    pool: asyncpg.Pool, pid: int, claimers: list[Claimer], expect: int | None
) -> tuple[float, float]:
    """The median wall time and the mean backend CPU of one claim by each claimer, in ms; each
    must take `expect` rows (None: nothing)."""
    walls = []
    cpu = 0.0
    for claimer in claimers:
        cpu0 = on_cpu_seconds(pid)
        started = time.perf_counter()
        batch = await claimer.claim()
        walls.append(time.perf_counter() - started)
        cpu += on_cpu_seconds(pid) - cpu0
        got = len(batch.records) if batch is not None else None
        assert got == expect, f"a claim took {got} rows, {expect} expected"
        if batch is not None:
            await Settler(DispatchStore(pool, STATEMENTS), retry_for=1.0).settle(
                batch, [PUBLISHED] * len(batch.records)
            )
    return 1000 * statistics.median(walls), 1000 * cpu / len(claimers)


async def full_claims(
    conn: asyncpg.Connection,
    pool: asyncpg.Pool,
    pid: int,
    settings: Settings,
    topic: str,
    claims: int,
) -> tuple[float, float]:
    """`claims` claims that each find a batch of new rows over as many keys (one writer's
    INSERT before each, not timed), each settled as published after it (not timed)."""
    walls, cpus = [], []
    for n in range(claims):
        await insert_rows(conn, topic, settings.batch_size, settings.batch_size, None, f"f{n}-")
        claimer = Claimer(DispatchStore(pool, STATEMENTS), settings, "benchmark-claims")
        wall, cpu = await timed_claims(pool, pid, [claimer], settings.batch_size)
        walls.append(wall)
        cpus.append(cpu)
    return statistics.median(walls), statistics.fmean(cpus)
