"""results.jsonl -> the markdown tables of README.md.   python make_table.py [results.jsonl]"""

from __future__ import annotations

import json
import sys
from typing import Any

from benchmarks.candidates import common

path = sys.argv[1] if len(sys.argv) > 1 else str(common.HERE / "results.jsonl")
rows = [json.loads(x) for x in open(path) if x.strip()]
loops = [r for r in rows if r["run"] == "loop"]


def base(r: dict[str, Any]) -> dict[str, Any] | None:
    mode = "event" if r["mode"] == "lazy" else r["mode"]
    for b in loops:
        if (
            b["cand"] == "C0"
            and b["regime"] == r["regime"]
            and b["rate"] == r["rate"]
            and b["tag"] == r["tag"]
            and b["mode"] in (mode, r["mode"])
        ):
            return dict(b)
    return None


def f(v: object) -> str:
    return "–" if v is None else str(v)


def aa(r: dict[str, Any]) -> str:
    a: list[str] = [x for x in r["autovacuum"] if x.startswith("outbox analyze")]
    return a[0].split("@")[1].split()[0] + " s" if a else "none"


print(
    "| regime | load | cand | mode | CPU ms/1k | x C0 | stmts/cycle (top-level) | plan ms/cycle | WAL B/event beyond writer (dispatcher stmts) "
    "| cycles | empty claims | slow calls | us claim / settle / empty | us settle+claim (empty) | first autoanalyze of outbox |"
)
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in loops:
    b = base(r)
    ratio = round(r["cpu_ms_per_1k"] / b["cpu_ms_per_1k"], 2) if b else None
    load = "100/s x1" if r["rate"] == 100 else "1k/s x10"
    print(
        f"| {r['regime']} | {load} | {r['cand']} | {r['mode']} | {r['cpu_ms_per_1k']} | {f(ratio)} | "
        f"{r['stmts_per_cycle']} ({r['toplevel_per_cycle']}) | {r['plan_ms_per_cycle']} | "
        f"{r['wal_B_per_event_beyond_writer']} ({r['disp_wal_B_per_event']}) | {r['cycles']} | {r['empty_claims']} | "
        f"{r['slow_calls']}{' ' + json.dumps(r.get('slow_why')) if r.get('slow_why') else ''} | "
        f"{f(r['us_claim'])} / {f(r['us_settle'])} / {f(r['us_empty'])} | "
        f"{f(r['us_settle_claim'])} ({f(r['us_settle_claim_empty'])}) | {aa(r)} |"
    )
dr = [r for r in rows if r["run"] == "drain"]
if dr:
    print()
    print(
        "| drain (50k rows, 1k keys, 512 B, fresh) | CPU ms/1k | x C0 | WAL B/event (dispatcher stmts) | cycles | stmts/cycle | plan ms/cycle | slow calls | wall s | left | order ok |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    c0 = next((r for r in dr if r["cand"] == "C0"), None)
    for r in dr:
        print(
            f"| {r['cand']} | {r['cpu_ms_per_1k']} | {round(r['cpu_ms_per_1k'] / c0['cpu_ms_per_1k'], 2) if c0 else '–'} | "
            f"{r['wal_B_per_event']} ({r['disp_wal_B_per_event']}) | {r['cycles']} | {r['stmts_per_cycle']} | "
            f"{r['plan_ms_per_cycle']} | {r['slow_calls']} | {r['wall_s']} | {r['pending_left']} | {r['order_ok']} |"
        )
ck = [r for r in rows if r["run"] == "checks"]
for r in ck:
    print()
    print(
        f"| CHECKs, {r['rounds']} rounds (median us, backend CPU) | writer INSERT 1 row | writer INSERT 10 rows | mark 1 row | mark 10 rows |"
    )
    print("|---|---|---|---|---|")
    for tb, v in r["us_median"].items():
        print(f"| {tb} | {v['insert1']} | {v['insert10']} | {v['mark1']} | {v['mark10']} |")
    if r.get("wal_B_per_row"):
        print()
        print(
            "WAL per row (pg_stat_statements wal_bytes / rows): "
            + ", ".join(f"{k}: {v} B" for k, v in r["wal_B_per_row"].items())
        )
