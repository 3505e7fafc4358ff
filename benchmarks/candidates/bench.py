"""Paced steady loops and drains of the claim-engine candidates, PostgreSQL only (no Kafka).

    python bench.py templates                       # build the four template databases
    python bench.py loop --regime fresh --load 100x1 --secs 10 --cands C0,C1p,C1f,C3,C4 --modes poll,event
    python bench.py drain --regime fresh --cands C0,C3

Each run gets its own database, copied from a template (fresh: schema.sql rendered + C1's setup,
no ANALYZE; analyzed: plus 100k published history rows, VACUUM ANALYZE). Prints one JSON line
per run (and appends it to results.jsonl).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
import uuid
from typing import Any

import asyncpg

from benchmarks.candidates import common

LIMIT, MAX_KEYS, SCAN, LEASE = 500, 500, 1000, 30.0
OWNER = "cand"
PAYLOAD = b"x" * 512
HEADERS = '{"type": "OrderPaid"}'
INSERT = (
    "INSERT INTO outbox (topic, ordering_key, payload, headers)"
    " SELECT 'orders', k, $2, $3::jsonb FROM unnest($1::text[]) k"
)
SLOW_CLAIM = common.CLAIM_C0
SETTLE_C0 = common.SETTLE_C0
C1_CLAIM_F = 'SELECT * FROM "public".outbox_c1_claim($1, $2, $3, $4, $5)'
C1_SETTLE_F = 'SELECT * FROM "public".outbox_c1_settle($1, $2, $3, $4)'
C3_CALL = 'SELECT * FROM "public".outbox_c3_settle_claim($1, $2, $3, $4, $5, $6, $7, $8)'


class Engine:
    """How a candidate claims and settles; every call timed in backend CPU."""

    def __init__(self, name: str, conn: asyncpg.Connection, pid: int) -> None:
        self.name, self.c, self.pid = name, conn, pid
        self.claim_p, self.settle_p = common.c1_statements()
        self.t: dict[str, list[int]] = {
            k: []
            for k in ("claim", "empty", "settle", "settle_claim", "settle_claim_empty", "slow")
        }
        self.slow = 0
        self.why: dict[str, int] = {}

    def cpu(self) -> int:
        with open(f"/proc/{self.pid}/schedstat") as f:
            return int(f.read().split()[0])

    async def _slow(self, token: uuid.UUID) -> list[asyncpg.Record]:
        # The slow path: today's claim, with the plan cache back on auto for it.
        async with self.c.transaction():
            await self.c.execute("SET LOCAL plan_cache_mode = auto; SET LOCAL enable_seqscan = on")
            return await self.c.fetch(
                SLOW_CLAIM, LIMIT, MAX_KEYS, OWNER, LEASE, token, False, 10, SCAN
            )

    async def claim(self) -> tuple[uuid.UUID, list[asyncpg.Record]]:
        token = uuid.uuid4()
        a = self.cpu()
        if self.name == "C0":
            rows = await self.c.fetch(
                SLOW_CLAIM, LIMIT, MAX_KEYS, OWNER, LEASE, token, False, 10, SCAN
            )
        else:
            q = self.claim_p if self.name == "C1p" else C1_CLAIM_F
            rows = await self.c.fetch(q, LIMIT, token, OWNER, LEASE, False)
            if rows and rows[-1]["id"] is None:
                self.slow += 1
                self.why[rows[-1]["topic"]] = self.why.get(rows[-1]["topic"], 0) + 1
                rows = await self._slow(token)
                self.t["slow"].append(self.cpu() - a)
                return token, rows
        self.t["claim" if rows else "empty"].append(self.cpu() - a)
        return token, rows

    async def settle(self, token: uuid.UUID, rows: list[asyncpg.Record]) -> None:
        ids = [r["id"] for r in rows]
        keys = [r["ordering_key"] for r in rows]
        a = self.cpu()
        if self.name == "C0":
            n = len(rows)
            await self.c.fetch(
                SETTLE_C0,
                token,
                OWNER,
                ids,
                keys,
                ["published"] * n,
                [None] * n,
                [0.0] * n,
                [0] * n,
                False,
                False,
            )
        elif self.name == "C1p":
            await self.c.fetch(self.settle_p, token, ids, keys, OWNER)
        else:
            await self.c.fetch(C1_SETTLE_F, token, ids, keys, OWNER)
        self.t["settle"].append(self.cpu() - a)

    async def settle_claim(
        self, token: uuid.UUID, rows: list[asyncpg.Record]
    ) -> tuple[uuid.UUID, list[asyncpg.Record]]:
        """C3/C4: settle this batch and claim the next in one call."""
        ids = [r["id"] for r in rows]
        keys = [r["ordering_key"] for r in rows]
        new = uuid.uuid4()
        a = self.cpu()
        got = await self.c.fetch(C3_CALL, token, ids, keys, OWNER, LIMIT, new, LEASE, False)
        if got and got[-1]["id"] is None:
            self.t["settle_claim_empty"].append(self.cpu() - a)
            self.slow += 1
            self.why[got[-1]["topic"]] = self.why.get(got[-1]["topic"], 0) + 1
            b = self.cpu()
            got = await self._slow(new)
            self.t["slow"].append(self.cpu() - b)
            return new, got
        self.t["settle_claim" if got else "settle_claim_empty"].append(self.cpu() - a)
        return new, got


async def connect_dispatcher(db: str, cand: str) -> tuple[asyncpg.Connection, int]:
    settings = {
        "application_name": "outbox-dispatcher",
        "synchronous_commit": "off",
        "idle_in_transaction_session_timeout": "10000",
    }
    if cand != "C0":
        settings.update(common.CAND_SETTINGS)
    c = await asyncpg.connect(common.dsn(db, "disp"), server_settings=settings)
    if os.environ.get("CAND_AUTO_EXPLAIN"):
        # (diagnosis only) plans of slow calls into the server log
        await c.execute(
            "LOAD 'auto_explain'; SET auto_explain.log_min_duration = "
            + os.environ["CAND_AUTO_EXPLAIN"]
            + "; SET auto_explain.log_nested_statements = on;"
            " SET auto_explain.log_analyze = on; SET auto_explain.log_buffers = on"
        )
    return c, await c.fetchval("SELECT pg_backend_pid()")


async def stats(adm: asyncpg.Connection, dbname: str) -> dict[str, Any]:
    r = await adm.fetchrow(
        """SELECT coalesce(sum(calls) FILTER (WHERE u.rolname = 'disp'), 0) AS disp_calls,
                  coalesce(sum(calls) FILTER (WHERE u.rolname = 'disp' AND toplevel), 0) AS disp_top,
                  coalesce(sum(total_plan_time) FILTER (WHERE u.rolname = 'disp'), 0) AS disp_plan_ms,
                  coalesce(sum(plans) FILTER (WHERE u.rolname = 'disp'), 0) AS disp_plans,
                  coalesce(sum(wal_bytes) FILTER (WHERE u.rolname = 'disp' AND toplevel), 0) AS disp_wal,
                  coalesce(sum(wal_bytes) FILTER (WHERE u.rolname = 'writer' AND toplevel), 0) AS writer_wal
             FROM pg_stat_statements s JOIN pg_roles u ON u.oid = s.userid
            WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = $1)""",
        dbname,
    )
    assert r is not None
    return dict(r)


def med(v: list[int]) -> int | None:
    return round(statistics.median(v) / 1e3) if v else None


async def loop_run(
    regime: str, cand: str, mode: str, rate: int, rows_per_tx: int, secs: float, keys: int = 1000
) -> dict[str, Any]:
    template = regime + {"C4": "_c4", "C4c": "_c4c"}.get(cand, "")
    db = "cand_run"
    common.new_db(template, db)
    adm = await asyncpg.connect(common.dsn(db))
    w = await asyncpg.connect(
        common.dsn(db, "writer"), server_settings={"application_name": "writer"}
    )
    wpid = await w.fetchval("SELECT pg_backend_pid()")
    d, dpid = await connect_dispatcher(db, cand)
    eng = Engine("C1f" if cand in ("C3", "C4", "C4c") else cand, d, dpid)
    combined = cand in ("C3", "C4", "C4c")
    wake = asyncio.Event()
    done = asyncio.Event()
    inserted = 0
    settled = 0
    empties = 0
    cycles = 0
    rng = random.Random(7)
    await adm.execute("SELECT pg_stat_statements_reset()")
    lsn0 = await adm.fetchval("SELECT pg_current_wal_insert_lsn()")
    ts0 = await adm.fetchval("SELECT clock_timestamp()")
    cpu0 = eng.cpu()
    wcpu0 = int(open(f"/proc/{wpid}/schedstat").read().split()[0])
    tx_per_s = rate / rows_per_tx

    async def writer() -> None:
        nonlocal inserted
        t0 = time.monotonic()
        n = int(secs * tx_per_s)
        for i in range(n):
            delay = t0 + i / tx_per_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await w.execute(
                INSERT, [f"k{rng.randrange(keys)}" for _ in range(rows_per_tx)], PAYLOAD, HEADERS
            )
            inserted += rows_per_tx
            wake.set()
        done.set()
        wake.set()

    async def publish(rows: list[asyncpg.Record]) -> None:
        await asyncio.sleep(0.001)

    async def claimer() -> None:
        nonlocal settled, empties, cycles
        while True:
            if mode in ("event", "lazy"):
                if done.is_set() and settled >= inserted:
                    return
                if not wake.is_set() and done.is_set():
                    wake.set()
                await wake.wait()
                wake.clear()
            token, rows = await eng.claim()
            if not rows:
                empties += 1
                if done.is_set() and settled >= inserted:
                    return
                if mode == "poll":
                    await asyncio.sleep(0.01)
                continue
            while rows:
                cycles += 1
                await publish(rows)
                full = len(rows) >= LIMIT
                if combined and mode == "lazy" and not full and not wake.is_set():
                    # C3-lazy: hold the settle until the writer's next row (or 100 ms), then
                    # settle and claim in one call.
                    try:
                        await asyncio.wait_for(wake.wait(), 0.1)
                    except TimeoutError:
                        pass
                if combined and (mode == "poll" or full or wake.is_set()):
                    wake.clear()
                    n = len(rows)
                    token, rows = await eng.settle_claim(token, rows)
                    settled += n
                    if not rows:
                        empties += 1
                    continue
                await eng.settle(token, rows)
                settled += len(rows)
                if mode in ("event", "lazy") and not full:
                    break  # C2: no extra claim after a partial batch; wait for the writer
                token, rows = await eng.claim()
                if not rows:
                    empties += 1
            if mode == "poll":
                await asyncio.sleep(0.01)

    t0 = time.monotonic()
    await asyncio.gather(writer(), claimer())
    wall = time.monotonic() - t0
    cpu = eng.cpu() - cpu0
    wcpu = int(open(f"/proc/{wpid}/schedstat").read().split()[0]) - wcpu0
    lsn1 = await adm.fetchval("SELECT pg_current_wal_insert_lsn()")
    wal = await adm.fetchval("SELECT $1::pg_lsn - $2::pg_lsn", lsn1, lsn0)
    st = await stats(adm, db)
    left = await adm.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")
    work_left = await adm.fetchval("SELECT count(*) FROM outbox_work")
    # autovacuum is left at its defaults: a run on a fresh database may see the first
    # autoanalyze of outbox (which ends the no-statistics regime); seconds after the run's start.
    av = await adm.fetch(
        "SELECT relname || coalesce(' analyze@' || round(extract(epoch FROM last_autoanalyze - $1)::numeric, 1), '')"
        " || coalesce(' vacuum@' || round(extract(epoch FROM last_autovacuum - $1)::numeric, 1), '') AS relname"
        " FROM pg_stat_user_tables"
        " WHERE relname IN ('outbox', 'outbox_work', 'outbox_cursor')"
        " AND (last_autoanalyze > $1 OR last_autovacuum > $1)",
        ts0,
    )
    order_ok = await check_order(adm)
    for c in (adm, w, d):
        await c.close()
    ev = inserted
    res = {
        "run": "loop",
        "regime": regime,
        "cand": cand,
        "mode": mode,
        "rate": rate,
        "rows_per_tx": rows_per_tx,
        "events": ev,
        "wall_s": round(wall, 1),
        "cycles": cycles,
        "empty_claims": empties,
        "slow_calls": eng.slow,
        "slow_why": eng.why,
        "cpu_ms_per_1k": round(cpu / 1e6 / ev * 1000, 1),
        "writer_us_per_row": round(wcpu / 1e3 / ev, 1),
        "stmts_per_cycle": round(st["disp_calls"] / cycles, 2),
        "toplevel_per_cycle": round(st["disp_top"] / cycles, 2),
        "plan_ms_per_cycle": round(st["disp_plan_ms"] / cycles, 3),
        "plans": st["disp_plans"],
        "wal_B_per_event_beyond_writer": round((wal - st["writer_wal"]) / ev),
        "disp_wal_B_per_event": round(st["disp_wal"] / ev),
        "us_claim": med(eng.t["claim"]),
        "us_settle": med(eng.t["settle"]),
        "us_empty": med(eng.t["empty"]),
        "us_settle_claim": med(eng.t["settle_claim"]),
        "us_settle_claim_empty": med(eng.t["settle_claim_empty"]),
        "us_slow": med(eng.t["slow"]),
        "n_claim": len(eng.t["claim"]),
        "n_settle_claim": len(eng.t["settle_claim"]),
        "pending_left": left,
        "work_left": work_left,
        "order_ok": order_ok,
        "autovacuum": [r["relname"] for r in av],
    }
    return res


async def check_order(adm: asyncpg.Connection) -> bool:
    # Per key, publication times never go down with the id (published in one settle: equal).
    bad = await adm.fetchval(
        """SELECT count(*) FROM (SELECT published_at < lag(published_at) OVER (PARTITION BY ordering_key ORDER BY id) AS b
                                   FROM outbox WHERE published_at IS NOT NULL) s WHERE b"""
    )
    return bool(bad == 0)


async def drain_run(regime: str, cand: str, n: int = 50_000, keys: int = 1000) -> dict[str, Any]:
    template = regime + {"C4": "_c4", "C4c": "_c4c"}.get(cand, "")
    db = "cand_run"
    common.new_db(template, db)
    adm = await asyncpg.connect(common.dsn(db))
    await adm.execute(
        f"INSERT INTO outbox (topic, ordering_key, payload, headers) SELECT 'orders', 'k' || (g % {keys}),"
        f" convert_to(repeat('x', 512), 'UTF8'), '{HEADERS}' FROM generate_series(1, {n}) g"
    )
    d, dpid = await connect_dispatcher(db, cand)
    eng = Engine("C1f" if cand in ("C3", "C4", "C4c") else cand, d, dpid)
    await adm.execute("SELECT pg_stat_statements_reset()")
    lsn0 = await adm.fetchval("SELECT pg_current_wal_insert_lsn()")
    cpu0 = eng.cpu()
    t0 = time.monotonic()
    settled = cycles = 0
    token, rows = await eng.claim()
    while rows:
        cycles += 1
        if cand in ("C3", "C4", "C4c"):
            k = len(rows)
            token, rows = await eng.settle_claim(token, rows)
            settled += k
        else:
            await eng.settle(token, rows)
            settled += len(rows)
            token, rows = await eng.claim()
    wall = time.monotonic() - t0
    cpu = eng.cpu() - cpu0
    lsn1 = await adm.fetchval("SELECT pg_current_wal_insert_lsn()")
    wal = await adm.fetchval("SELECT $1::pg_lsn - $2::pg_lsn", lsn1, lsn0)
    st = await stats(adm, db)
    left = await adm.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")
    order_ok = await check_order(adm)
    await adm.close()
    await d.close()
    return {
        "run": "drain",
        "regime": regime,
        "cand": cand,
        "events": n,
        "settled": settled,
        "cycles": cycles,
        "wall_s": round(wall, 1),
        "cpu_ms_per_1k": round(cpu / 1e6 / n * 1000, 1),
        "wal_B_per_event": round(wal / n),
        "disp_wal_B_per_event": round(st["disp_wal"] / n),
        "stmts_per_cycle": round(st["disp_calls"] / max(cycles, 1), 2),
        "plan_ms_per_cycle": round(st["disp_plan_ms"] / max(cycles, 1), 3),
        "slow_calls": eng.slow,
        "slow_why": eng.why,
        "pending_left": left,
        "order_ok": order_ok,
    }


def emit(res: dict[str, Any]) -> None:
    line = json.dumps(res, default=str)
    print(line, flush=True)
    with open(common.HERE / "results.jsonl", "a") as f:
        f.write(line + "\n")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["templates", "loop", "drain"])
    ap.add_argument("--regime", default="fresh")
    ap.add_argument("--load", default="100x1")
    ap.add_argument("--secs", type=float, default=10)
    ap.add_argument("--cands", default="C0,C1p,C1f,C3,C4")
    ap.add_argument("--modes", default="poll,event")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    if a.what == "templates":
        common.build_templates()
        return
    if a.what == "drain":
        for cand in a.cands.split(","):
            r = await drain_run(a.regime, cand)
            r["tag"] = a.tag
            emit(r)
        return
    rate, rows = (int(x) for x in a.load.split("x"))
    for mode in a.modes.split(","):
        for cand in a.cands.split(","):
            r = await loop_run(a.regime, cand, mode, rate, rows, a.secs)
            r["tag"] = a.tag
            emit(r)


if __name__ == "__main__":
    asyncio.run(main())
