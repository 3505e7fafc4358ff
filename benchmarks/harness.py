"""The benchmark harness: `make bench` (or `python -m benchmarks`).

Runs against the local stack (`make services`): each measurement gets a fresh database cloned from a
migrated template and its own topic; the dispatcher under test is a real `outbox-dispatcher run`
process, so its CPU is its own. Every figure is the median of `--runs` runs, and every headline is
also given as a ratio to a baseline measured in the same run, because these machines are shared
and noisy. Results: a table on stdout and a JSON file (benchmarks/results/latest.json), each with
the goal table (benchmarks/goals.py). The scenarios: stack.py (databases), load.py (rows and
writers), processes.py (the dispatcher and its CPU), drains.py, steady.py, writers.py, claims.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import uvloop

from benchmarks import baselines, fleet, fleet_lanes, handwritten, statements
from benchmarks.claims import STUCK_KINDS as STUCK_WORK_KINDS
from benchmarks.claims import claim_cost
from benchmarks.drains import burst, drain, drain_beside_at_least_once, hot_key, open_writer
from benchmarks.goals import goals, goals_table
from benchmarks.incidents import orphans_killed, pause_readers, scaling_new_keys
from benchmarks.load import KEYS, PAYLOAD, STUCK_KEY_KINDS, prefill
from benchmarks.stack import RESULTS, Stack, drop_template, fresh, make_template, settings_for
from benchmarks.steady import idle, sustained
from benchmarks.writers import writer_cost, writer_cost_parts

BROKER_DELAY = 0.02  # latency the proxy adds each way (40 ms a round trip): scaling_processes_*
LATENCY_KEYS = 10_000  # more keys than 4 processes x 2 claim loops x 500 rows per batch
NEW_KEYS_RATE = 2_000.0  # rows/s of new keys written during scaling_new_keys_*' drain
# The steady scenarios whose dispatcher's statements are counted (issue 34).
COUNTED = ("sustained_100_per_s_1_per_tx", "sustained_1000_per_s_10_per_tx")


@dataclass
class Sizes:
    drain: int
    hot_key: int
    handwritten: int
    kafka_only: int
    sustained_seconds: float
    slow_seconds: float  # sustained at 100/s: enough events for a CPU figure per 1k
    idle_seconds: float
    writer_seconds: float
    runs: int
    scaling_latency: int  # the drain of scaling_processes_latency_*
    stuck_rows: int  # pending rows of the stuck key
    stuck_drain: int  # the other keys' drain behind it (and open_writer's)
    burst: int  # the rows of burst_*
    stuck_work: int  # claim_cost_*: paused keys, keyless rows in backoff
    claims: int  # claim_cost_*: empty claims timed (a fifth as many full ones)
    orphans: int  # orphans_killed: the backlog of new keys' rows
    pause_seconds: float  # pause_readers: the load before and after the pause
    fleet_outboxes: int = 500  # fleet_*: tenant schemas of one database (issue 36)
    # fleet_quiet_*: tenants written at 20 events/s each (`--fleet-quiet-tenants`: 20 of them,
    # 400 one-row transactions a second, saturate a 2-core machine that runs the writers too)
    fleet_quiet: int = 20
    # fleet_quiet_*'s window (0: sustained_seconds); longer judges the steady state apart from
    # the start-up (`--fleet-quiet-seconds`).
    fleet_quiet_seconds: float = 0.0


FULL = Sizes(
    200_000, 50_000, 10_000, 200_000, 10.0, 30.0, 30.0, 5.0, 3, 50_000, 100_000, 20_000, 50_000,
    1_000_000, 100, 50_000, 4.0,
)  # fmt: skip
QUICK = Sizes(
    3_000, 1_000, 300, 3_000, 1.5, 3.0, 1.0, 1.0, 1, 1_000, 2_000, 1_000, 3_000, 5_000, 20,
    2_000, 2.0, fleet_outboxes=10, fleet_quiet=3,
)  # fmt: skip


# -- ceilings --


async def kafka_ceiling(stack: Stack, count: int) -> dict[str, float]:
    async with fresh(stack) as (url, topic):
        elapsed = await baselines.kafka_only(
            stack.bootstrap, topic, count, PAYLOAD, KEYS, settings_for(url, stack)
        )
    return {"events_per_second": count / elapsed}


async def kafka_batch_api_ceiling(stack: Stack, count: int) -> dict[str, float]:
    async with fresh(stack) as (url, topic):
        elapsed = await baselines.kafka_only_batch_api(
            stack.bootstrap, topic, count, PAYLOAD, KEYS, settings_for(url, stack)
        )
    return {"events_per_second": count / elapsed}


async def pg_ceiling(stack: Stack, rows: int) -> dict[str, float]:
    async with fresh(stack) as (url, topic):
        await prefill(url, topic, rows, KEYS)
        marked, elapsed = await baselines.pg_only(url, settings_for(url, stack))
    return {"events_per_second": marked / elapsed}


async def handwritten_pattern(stack: Stack, rows: int) -> dict[str, float]:
    async with fresh(stack) as (url, topic):
        await prefill(url, topic, rows, KEYS)
        marked, elapsed = await handwritten.run(url, stack.bootstrap)
    return {"events_per_second": marked / elapsed}


# -- runner --


Scenario = Callable[[], Awaitable[dict[str, float]]]


async def median_of(runs: int, scenario: Scenario) -> dict[str, float]:
    samples = [await scenario() for _ in range(runs)]
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def plan(stack: Stack, sizes: Sizes) -> dict[str, Scenario]:
    s = sizes
    quiet_seconds = s.fleet_quiet_seconds or s.sustained_seconds
    scenarios: dict[str, Scenario] = {
        "baseline_kafka_only": lambda: kafka_ceiling(stack, s.kafka_only),
        "baseline_kafka_batch_api": lambda: kafka_batch_api_ceiling(stack, s.kafka_only),
        "baseline_postgres_only": lambda: pg_ceiling(stack, s.drain),
        "baseline_handwritten": lambda: handwritten_pattern(stack, s.handwritten),
        "drain": lambda: drain(stack, s.drain, KEYS),
        # Issue 34's drain: 50k rows committed at once (one INSERT) before the dispatcher starts.
        "drain_50k": lambda: drain(stack, s.burst, KEYS),
        # Issue 34: a process killed under a backlog of new keys; a pause waiting for a reader.
        "orphans_killed": lambda: orphans_killed(stack, s.orphans),
        "pause_readers": lambda: pause_readers(stack, 200, s.pause_seconds),
        # Issue 36: tenant schemas served by OUTBOX_SOURCES processes.
        "fleet_idle": lambda: fleet.idle(stack, s.fleet_outboxes, 2, s.idle_seconds),
        "fleet_quiet_alone": lambda: fleet.quiet_beside(
            stack, s.fleet_quiet, s.fleet_outboxes - s.fleet_quiet - 1, 0, quiet_seconds
        ),
        "fleet_quiet_beside_backlog": lambda: fleet.quiet_beside(
            stack, s.fleet_quiet, s.fleet_outboxes - s.fleet_quiet - 1, s.drain, quiet_seconds
        ),
        "fleet_drain_beside_idle": lambda: fleet.drain_beside_idle(
            stack, s.drain, s.fleet_outboxes - 1
        ),
        "fleet_new_tenant": lambda: fleet.new_tenant(stack, s.fleet_quiet),
        # An idle tenant's first event; with exactly-once (issue 35) its lanes open for it.
        "fleet_first_after_idle": lambda: fleet_lanes.first_after_idle(
            stack, s.fleet_quiet, max(1, s.fleet_quiet // 4), "at-least-once"
        ),
        "fleet_first_after_idle_exactly_once": lambda: fleet_lanes.first_after_idle(
            stack, s.fleet_quiet, max(1, s.fleet_quiet // 4), "exactly-once"
        ),
        "hot_key": lambda: hot_key(stack, s.hot_key),
        # A burst committed while the dispatcher waits, into a table whose statistics are those
        # of the empty table, and the same with an ANALYZE in the burst's transaction.
        "burst_stale": lambda: burst(stack, s.burst, analyze=False),
        "burst_analyzed": lambda: burst(stack, s.burst, analyze=True),
        # A writer transaction holding one row stays open while 1,000 keys empty (review N1).
        "open_writer_none": lambda: open_writer(stack, s.stuck_drain, held=False),
        "open_writer_held": lambda: open_writer(stack, s.stuck_drain, held=True),
        "scaling_1_task": lambda: drain(stack, s.drain // 2, KEYS, claim_tasks=1),
        "scaling_2_tasks": lambda: drain(stack, s.drain // 2, KEYS, claim_tasks=2),
        "scaling_4_tasks": lambda: drain(stack, s.drain // 2, KEYS, claim_tasks=4),
        "scaling_2_processes": lambda: drain(stack, s.drain // 2, KEYS, processes=2),
        "idle": lambda: idle(stack, s.idle_seconds),
        "writer_cost": lambda: writer_cost(stack, s.writer_seconds),
        "writer_cost_parts": lambda: writer_cost_parts(stack, s.writer_seconds),
    }
    # One claim's cost beside stuck work, and without it.
    for kind in ("none", *STUCK_WORK_KINDS):
        scenarios[f"claim_cost_{kind}"] = functools.partial(
            claim_cost, stack, kind, s.stuck_work, s.claims
        )
    # Processes against a slow broker (the fault proxy), so the database is not the limit.
    for n in (1, 2, 4):
        scenarios[f"scaling_processes_latency_{n}"] = functools.partial(
            drain, stack, s.scaling_latency, LATENCY_KEYS, processes=n, broker_delay=BROKER_DELAY
        )
    # New keys arriving faster than one process drains (issue 34 point 3), same slow broker.
    for n in (1, 4):
        scenarios[f"scaling_new_keys_{n}"] = functools.partial(
            scaling_new_keys,
            stack,
            s.scaling_latency,
            n,
            broker_delay=BROKER_DELAY,
            rate=NEW_KEYS_RATE,
        )
    # A key that cannot move, with many pending rows written first; the other keys' drain and
    # their latency at a steady 1k/s, each also measured without it ("none").
    for kind in ("none", *STUCK_KEY_KINDS):
        stuck = None if kind == "none" else kind
        scenarios[f"stuck_key_{kind}"] = functools.partial(
            drain, stack, s.stuck_drain, KEYS, stuck=stuck, stuck_rows=s.stuck_rows
        )
        scenarios[f"stuck_key_latency_{kind}"] = functools.partial(
            sustained, stack, 1_000, 10, s.sustained_seconds, stuck=stuck, stuck_rows=s.stuck_rows
        )
    # Techniques: the drain with one setting changed from the defaults, to see what each is worth.
    techniques: dict[str, dict[str, Any]] = {
        "synchronous_commit_on": {"synchronous_commit": "on"},
        "linger_0ms": {"kafka_linger_ms": 0},
        "linger_10ms": {"kafka_linger_ms": 10},
        "batch_16k": {"kafka_max_batch_bytes": 16_384},
        "batch_1m": {"kafka_max_batch_bytes": 1_048_576},
        "lz4": {"kafka_compression": "lz4"},
        "zstd": {"kafka_compression": "zstd"},
        "asyncio_loop": {"uvloop": False},
        "no_prepared_statements": {"statement_cache_size": 0},
        "delete_on_publish": {"delete_on_publish": True},
        "claim_batch_100": {"batch_size": 100},
        "claim_batch_1000": {"batch_size": 1000},
        "claim_tasks_2": {"claim_tasks": 2},
    }
    scenarios["technique_defaults"] = lambda: drain(stack, s.drain // 4, KEYS)
    for name, opts in techniques.items():
        scenarios[f"technique_{name}"] = functools.partial(drain, stack, s.drain // 4, KEYS, **opts)
    # Exactly-once beside the same scenarios at-least-once (issue 23's goals).
    eos: dict[str, Any] = {"delivery": "exactly-once"}
    scenarios["drain_exactly_once"] = functools.partial(
        drain_beside_at_least_once, stack, s.drain, KEYS, **eos
    )
    scenarios["sustained_1000_per_s_10_per_tx_exactly_once"] = functools.partial(
        sustained, stack, 1_000, 10, s.sustained_seconds, **eos
    )
    scenarios["sustained_100_per_s_1_per_tx"] = functools.partial(
        sustained, stack, 100, 1, s.slow_seconds, count_statements="sustained_100_per_s_1_per_tx"
    )
    for rate in (1_000, 2_000, 5_000, 15_000, None):
        for per_tx in (10, 1):
            name = f"sustained_{rate or 'max'}_per_s_{per_tx}_per_tx"
            counted = name if name in COUNTED else ""
            scenarios[name] = functools.partial(
                sustained, stack, rate, per_tx, s.sustained_seconds, count_statements=counted
            )
    return scenarios


def ratios(results: dict[str, dict[str, float]]) -> dict[str, float]:
    """Ratios (and differences, and sums) between scenarios of the same run; NaN where one is
    missing."""

    def fig(name: str, figure: str = "events_per_second") -> float:
        return results.get(name, {}).get(figure, float("nan"))

    checked = [f["rows_stranded"] for f in results.values() if "rows_stranded" in f]
    reordered = [f["rows_reordered"] for f in results.values() if "rows_reordered" in f]
    derived = {
        # Every drain and steady scenario counts the rows it left pending (or never saw
        # consumed) once nothing had moved for a while.
        "rows_stranded": math.fsum(checked) if checked else float("nan"),
        "rows_stranded_scenarios_checked": float(len(checked)) if checked else float("nan"),
        # Issue 34: stranded or reordered (the hot key's consumer checks the order).
        "rows_stranded_or_reordered": math.fsum(checked) + math.fsum(reordered)
        if checked
        else float("nan"),
        "rows_reordered_scenarios_checked": float(len(reordered)) if reordered else float("nan"),
        "drain_vs_kafka_only": fig("drain") / fig("baseline_kafka_only"),
        "kafka_batch_api_vs_send": fig("baseline_kafka_batch_api") / fig("baseline_kafka_only"),
        "drain_vs_postgres_only": fig("drain") / fig("baseline_postgres_only"),
        "drain_vs_handwritten": fig("drain") / fig("baseline_handwritten"),
        "burst_stale_vs_analyzed": fig("burst_stale") / fig("burst_analyzed"),
        "open_writer_held_vs_none": fig("open_writer_held") / fig("open_writer_none"),
        "two_processes_vs_one": fig("scaling_2_processes") / fig("scaling_4_tasks"),
        "processes_latency_2_vs_1": fig("scaling_processes_latency_2")
        / fig("scaling_processes_latency_1"),
        "processes_latency_4_vs_1": fig("scaling_processes_latency_4")
        / fig("scaling_processes_latency_1"),
        "new_keys_4_vs_1": fig("scaling_new_keys_4") / fig("scaling_new_keys_1"),
        "fleet_quiet_p99_beside_backlog_vs_alone": fig("fleet_quiet_beside_backlog", "p99_ms")
        / fig("fleet_quiet_alone", "p99_ms"),
        "fleet_drain_beside_idle_vs_one_table": fig("fleet_drain_beside_idle") / fig("drain"),
        # The median over runs of each run's ratio to the drain run just before it.
        "drain_exactly_once_vs_at_least_once": fig("drain_exactly_once", "vs_at_least_once"),
        "drain_exactly_once_postgres_cpu_vs_at_least_once": fig(
            "drain_exactly_once", "postgres_cpu_vs_at_least_once"
        ),
        "sustained_1k_exactly_once_postgres_cpu_vs_at_least_once": fig(
            "sustained_1000_per_s_10_per_tx_exactly_once", "postgres_cpu_ms_per_1k"
        )
        / fig("sustained_1000_per_s_10_per_tx", "postgres_cpu_ms_per_1k"),
    }
    for kind in STUCK_WORK_KINDS:
        for claim in ("empty", "full"):
            derived[f"claim_cost_{kind}_{claim}_vs_none"] = fig(
                f"claim_cost_{kind}", f"{claim}_claim_ms"
            ) / fig("claim_cost_none", f"{claim}_claim_ms")
    for kind in STUCK_KEY_KINDS:
        derived[f"stuck_key_{kind}_vs_none"] = fig(f"stuck_key_{kind}") / fig("stuck_key_none")
        # A difference in ms, not a ratio: how much p99 commit-to-consume rises.
        derived[f"stuck_key_{kind}_p99_rise_ms"] = fig(f"stuck_key_latency_{kind}", "p99_ms") - fig(
            "stuck_key_latency_none", "p99_ms"
        )
    return derived


def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "note": "PostgreSQL, the Kafka broker, the dispatcher and the load all on this machine",
    }


def table(
    results: dict[str, dict[str, float]],
    derived: dict[str, float],
    verdicts: list[dict[str, Any]],
) -> str:
    lines = ["| scenario | figures |", "|---|---|"]
    for name, figures in results.items():
        shown = ", ".join(f"{k} {v:,.1f}" for k, v in figures.items())
        lines.append(f"| {name} | {shown} |")
    for name, value in derived.items():
        lines.append(f"| ratio {name} | {value:.2f} |")
    return (
        "\n".join(lines)
        + "\n\n### Goals (issue 34; issues 21 and 23; issue 10's still measured)\n\n"
        + goals_table(verdicts)
        + "".join(
            "\n\n" + statements.top_table(name, runs[-1])
            for name, runs in statements.REPORTS.items()
            if name in results and runs
        )
    )


async def main_async(args: argparse.Namespace) -> int:
    sizes = QUICK if args.quick else FULL
    if args.fleet_quiet_seconds:
        sizes = dataclasses.replace(sizes, fleet_quiet_seconds=args.fleet_quiet_seconds)
    if args.fleet_quiet_tenants:
        sizes = dataclasses.replace(sizes, fleet_quiet=args.fleet_quiet_tenants)
    runs = args.runs or sizes.runs
    stack = Stack.from_env()
    scenarios = plan(stack, sizes)
    chosen = args.only.split(",") if args.only else list(scenarios)
    unknown = [name for name in chosen if name not in scenarios]
    if unknown:
        print(f"unknown scenarios: {', '.join(unknown)}; known: {', '.join(scenarios)}")
        return 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    await make_template(stack)
    if any(name in COUNTED for name in chosen):
        await statements.prepare(stack.admin_url)
    results: dict[str, dict[str, float]] = {}
    try:
        for name in chosen:
            started = time.monotonic()
            results[name] = await median_of(runs, scenarios[name])
            print(f"{name}: {results[name]} ({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        await drop_template(stack)
    derived = ratios(results)
    verdicts = goals(results, derived, statements.WHY_NOT)
    report = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "runs": runs,
        "quick": args.quick,
        "results": results,
        "ratios": derived,
        "goals": verdicts,
        # Issue 34: each counted scenario's top statements, per run; why a figure is missing.
        "statements": statements.REPORTS,
        "not_measured": statements.WHY_NOT,
    }
    out = Path(args.out) if args.out else RESULTS / "latest.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    m = report["machine"]
    markdown = (
        f"Run {report['when']} on {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, "
        f"Python {m['python']} ({m['note']}); median of {runs} runs.\n\n"
        + table(results, derived, verdicts)
    )
    out.with_suffix(".md").write_text(markdown + "\n")
    print(table(results, derived, verdicts))
    print(f"written: {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--runs", type=int, default=0, help="runs per scenario (median)")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--out", default="", help="JSON result file")
    parser.add_argument(
        "--fleet-quiet-seconds",
        type=float,
        default=0.0,
        help="fleet_quiet_*'s window in seconds (default: the sustained scenarios')",
    )
    parser.add_argument(
        "--fleet-quiet-tenants",
        type=int,
        default=0,
        help="fleet_quiet_*'s tenants written at 20 events/s each (default: 20)",
    )

    return uvloop.run(main_async(parser.parse_args()))
