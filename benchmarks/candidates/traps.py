"""The correctness traps, played against C1's claim and settle (prepared statements) on a fresh
database. Prints one line per scenario; exits 1 if any expectation fails.

    python traps.py
"""

from __future__ import annotations

import asyncio
import sys
import uuid

import asyncpg

from benchmarks.candidates import common

INS = "INSERT INTO outbox (topic, ordering_key, payload) VALUES ('orders', $1, 'x') RETURNING id"
failed: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(("ok   " if ok else "FAIL ") + name + ": " + detail)
    if not ok:
        failed.append(name)


async def fresh() -> list[asyncpg.Connection]:
    common.new_db("fresh", "cand_traps")
    conns = [
        await asyncpg.connect(
            common.dsn("cand_traps", "disp"), server_settings=common.CAND_SETTINGS
        )
        for _ in range(3)
    ]
    return conns


async def main() -> None:
    claim, settle = common.c1_statements()

    async def c1(conn: asyncpg.Connection, token: uuid.UUID | None = None) -> list[asyncpg.Record]:
        return await conn.fetch(claim, 500, token or uuid.uuid4(), "o", 30.0, False)

    # 1. A gap: id drawn by a writer still open. The claim must not move past it.
    d, w1, w2 = await fresh()
    t = w1.transaction()
    await t.start()
    await w1.fetchval(INS, "A")  # id 1, open
    await w2.fetchval(INS, "B")  # id 2, committed
    rows = await c1(d)
    pos = await d.fetchval("SELECT position FROM outbox_cursor")
    check(
        "gap",
        len(rows) == 1 and rows[0]["id"] is None and pos == 0,
        f"claim returned {[r['id'] for r in rows]} (None = slow path), cursor {pos}",
    )
    await t.commit()
    rows = await c1(d)
    check(
        "gap closed",
        [r["id"] for r in rows] == [1, 2],
        f"after the commit: {[r['id'] for r in rows]}",
    )
    for c in (d, w1, w2):
        await c.close()

    # 2. The settle's snapshot is older than a concurrent claim that passed a later row of a key
    #    the batch holds. v3 locks the known key FOR SHARE and re-reads heads in a new snapshot;
    #    a one-statement settle cannot, so the claim writes last_seen (upsert), which the settle
    #    sees in the row version it locks.
    for variant in ("c1-upsert", "for-share"):
        d, s, w = await fresh()
        t1 = uuid.uuid4()
        await w.fetchval(INS, "K")  # 1
        rows = await c1(d, t1)  # T1 holds K (head 2)
        await w.fetchval(INS, "K")  # 2: committed, above the cursor
        tx = d.transaction()
        await tx.start()
        if variant == "c1-upsert":
            got = await c1(d)  # passes row 2, K known: not taken
        else:  # what v3's discovery does, in one statement
            await d.execute("SELECT 1 FROM outbox_work WHERE ordering_key = 'K' FOR SHARE")
            await d.execute("UPDATE outbox_cursor SET position = 2")
            got = []
        # the settle of T1 starts now (its snapshot: row 2 committed, cursor still 1) and waits
        st = asyncio.create_task(s.fetch(settle, t1, [1], ["K"], "o"))
        await asyncio.sleep(0.3)
        await tx.commit()
        await st
        work = await s.fetch("SELECT ordering_key, state, claim_token, head_id FROM outbox_work")
        pos = await s.fetchval("SELECT position FROM outbox_cursor")
        stranded = pos >= 2 and not work and not got
        if variant == "c1-upsert":
            check(
                "older settle snapshot (C1)",
                not stranded and len(work) == 1 and work[0]["state"] in (b"r", "r"),
                f"cursor {pos}, work {[tuple(x) for x in work]}: row 2 left to the slow claim as ready work",
            )
            rows = await c1(d)
            slow = bool(rows) and rows[-1]["id"] is None
            if slow:
                rows = await d.fetch(
                    common.CLAIM_C0, 500, 500, "o", 30.0, uuid.uuid4(), False, 10, 1000
                )
            check(
                "  ...slow path takes it",
                [r["id"] for r in rows] == [2],
                f"slow path returned {[r['id'] for r in rows]}",
            )
        else:
            check(
                "older settle snapshot (FOR SHARE, expected to strand)",
                stranded,
                f"cursor {pos}, work {[tuple(x) for x in work]}: row 2 stranded = {stranded}",
            )
        for c in (d, s, w):
            await c.close()

    # 3. A writer's UPDATE of ordering_key (noted in outbox_changed): the steady path steps aside.
    d, w, _ = await fresh()
    await w.fetchval(INS, "A")
    rows = await c1(d)
    await w.fetchval(INS, "B")
    await w.execute("UPDATE outbox SET ordering_key = 'C' WHERE id = 2")
    rows = await c1(d)
    check(
        "re-keyed row",
        len(rows) == 1 and rows[0]["id"] is None,
        f"claim returned {[r['id'] for r in rows]}",
    )
    for c in (d, w, _):
        await c.close()

    # 4. Per-key order across batches while a key is held: T1 holds K's row 1; rows 2 (K) and 3 (L)
    #    come; a second claim takes L only; T1's settle keeps K's work ready; K's row 2 goes after.
    d, w, _ = await fresh()
    t1 = uuid.uuid4()
    await w.fetchval(INS, "K")
    await c1(d, t1)
    await w.fetchval(INS, "K")
    await w.fetchval(INS, "L")
    got = await c1(d)
    check(
        "held key skipped", [r["id"] for r in got] == [3], f"second claim: {[r['id'] for r in got]}"
    )
    await d.fetch(settle, t1, [1], ["K"], "o")
    rows = await c1(d)
    check(
        "held key -> slow path",
        len(rows) == 1 and rows[0]["id"] is None,
        f"third claim: {[r['id'] for r in rows]}",
    )
    for c in (d, w, _):
        await c.close()
    sys.exit(1 if failed else 0)


asyncio.run(main())
