"""EXPLAIN (ANALYZE) of C1's claim and settle as generic plans (plan_cache_mode =
force_generic_plan) on a database copied from a template: fresh (no statistics) by default.

    python explain.py [fresh|analyzed] [rows]
"""

from __future__ import annotations

import asyncio
import sys
import uuid

import asyncpg

from benchmarks.candidates import common


async def main(regime: str, rows: int) -> None:
    common.new_db(regime, "cand_explain")
    d = await asyncpg.connect(
        common.dsn("cand_explain", "disp"), server_settings=common.CAND_SETTINGS
    )
    claim, settle = common.c1_statements()
    await d.execute(f"PREPARE claim(integer, uuid, text, float8, boolean) AS {claim}")
    await d.execute(f"PREPARE settle(uuid, bigint[], text[], text) AS {settle}")
    await d.execute(
        "INSERT INTO outbox (topic, ordering_key, payload) SELECT 'orders', 'k' || g, 'x'"
        f" FROM generate_series(1, {rows}) g"
    )
    t = uuid.uuid4()
    plan = await d.fetch(
        f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING ON) EXECUTE claim(500, '{t}', 'o', 30, false)"
    )
    print("-- claim, generic plan\n" + "\n".join(r[0] for r in plan))
    ids = await d.fetch(
        "SELECT o.id, o.ordering_key FROM outbox o JOIN outbox_work w ON w.ordering_key = o.ordering_key"
        " AND w.claim_token = $1",
        t,
    )
    plan = await d.fetch(
        "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE settle("
        f"'{t}', '{{{','.join(str(r[0]) for r in ids)}}}', '{{{','.join(r[1] for r in ids)}}}', 'o')"
    )
    print("-- settle, generic plan\n" + "\n".join(r[0] for r in plan))
    plan = await d.fetch(
        f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) EXECUTE claim(500, '{uuid.uuid4()}', 'o', 30, false)"
    )
    print("-- empty claim, generic plan\n" + "\n".join(r[0] for r in plan))
    await d.close()


asyncio.run(
    main(
        sys.argv[1] if len(sys.argv) > 1 else "fresh", int(sys.argv[2]) if len(sys.argv) > 2 else 1
    )
)
