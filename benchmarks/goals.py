"""The goal table of issue 34 ("Claim engine v4"), issue 21's ("Claim engine v3"), issue 23's
(exactly-once), and issue 10's ("Publisher v2") that its scenarios still measure, judged from one
run's results.

Each goal names the scenario figure (or the same-run ratio) it is judged on, so the printed table
and the JSON say target, measured, measured/target and met or missed without anyone copying
figures by hand. A goal whose scenario did not run (`--only`) is "not measured", with why when
the scenario said (statements per cycle without pg_stat_statements).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from benchmarks.claims import STUCK_KINDS
from benchmarks.incidents import ORPHAN_GRACE, ORPHAN_LEASE

STUCK_WORK = {"paused_keys": "keys paused", "keyless_backoff": "keyless rows in backoff"}


@dataclass(frozen=True)
class Goal:
    figure: str  # what is judged, as the issue words it
    at_least: bool  # >= threshold (else <=)
    threshold: float
    source: str  # "<scenario>.<figure>" or "ratio.<name>"
    unit: str = ""
    also: tuple[str, ...] = ()  # figures shown beside it (same form as source)
    strict: bool = False  # < threshold (else <=); with at_least, >


STEADY_1K = "sustained_1000_per_s_10_per_tx"
STEADY_2K = "sustained_2000_per_s_10_per_tx"
STEADY_100 = "sustained_100_per_s_1_per_tx"


def _issue_34() -> list[Goal]:
    """Claim engine v4: on a freshly migrated table, as users meet it."""

    def statements(steady: str) -> tuple[str, ...]:
        return tuple(
            f"{steady}.{name}"
            for name in ("statements_toplevel_per_cycle", "claims_empty_per_cycle", "cycles")
        )

    return [
        Goal(
            "PostgreSQL backend CPU per 1k events, steady 100/s, one-row writer transactions "
            "(issue 34)",
            False,
            500,
            f"{STEADY_100}.postgres_cpu_ms_per_1k",
            "ms",
        ),
        Goal(
            "PostgreSQL backend CPU per 1k events, steady 1k/s, ten-row transactions (issue 34)",
            False,
            60,
            f"{STEADY_1K}.postgres_cpu_ms_per_1k",
            "ms",
        ),
        Goal(
            "PostgreSQL backend CPU per 1k events, drain of 50k rows committed at once, 1k keys, "
            "512 B (issue 34)",
            False,
            20,
            "drain_50k.postgres_cpu_ms_per_1k",
            "ms",
            also=("drain.postgres_cpu_ms_per_1k", "burst_stale.postgres_cpu_ms_per_1k"),
        ),
        Goal(
            "WAL per event beyond the writer's insert, drain of 50k rows (issue 34)",
            False,
            300,
            "drain_50k.wal_bytes_per_event_dispatcher",
            "B",
            also=(
                "drain_50k.wal_bytes_per_event_writer",
                "drain_50k.wal_full_page_images_per_1k_events",
                "drain.wal_bytes_per_event_dispatcher",
            ),
        ),
        Goal(
            "statements per steady cycle (claim that returned rows), pg_stat_statements "
            "track = all, 100/s one-row tx (issue 34)",
            False,
            3,
            f"{STEADY_100}.statements_per_cycle",
            also=statements(STEADY_100),
        ),
        Goal(
            "statements per steady cycle (claim that returned rows), pg_stat_statements "
            "track = all, 1k/s ten-row tx (issue 34)",
            False,
            3,
            f"{STEADY_1K}.statements_per_cycle",
            also=statements(STEADY_1K),
        ),
        Goal("latency at 100/s p99 (issue 34)", False, 20, f"{STEADY_100}.p99_ms", "ms"),
        Goal("latency at 2k/s p50 (issue 34)", False, 5, f"{STEADY_2K}.p50_ms", "ms"),
        Goal("latency at 2k/s p99 (issue 34)", False, 20, f"{STEADY_2K}.p99_ms", "ms"),
        Goal(
            "drain of 200k rows over 1k keys (issue 34)",
            True,
            30_000,
            "drain.events_per_second",
            "events/s",
        ),
        Goal(
            "4 processes vs 1, 20 ms broker latency, new keys arriving faster than one process "
            "drains (issue 34)",
            True,
            3.2,
            "ratio.new_keys_4_vs_1",
            also=(
                "scaling_new_keys_1.events_per_second",
                "scaling_new_keys_4.events_per_second",
                "ratio.processes_latency_4_vs_1",
            ),
        ),
        Goal(
            f"orphans of a killed process under a backlog of new keys: worst first row "
            f"republished after the kill, lease {ORPHAN_LEASE:g} s (issue 34)",
            False,
            ORPHAN_LEASE + ORPHAN_GRACE,
            "orphans_killed.worst_first_republished_s",
            "s",
            also=(
                "orphans_killed.orphan_keys",
                "orphans_killed.p99_first_republished_s",
                "orphans_killed.orphan_keys_late",
                "orphans_killed.orphan_keys_unpublished",
            ),
        ),
        Goal(
            "other topics' worst delay while a pause waits for its readers (an open transaction "
            "that read the pauses) (issue 34)",
            False,
            1,
            "pause_readers.worst_delay_s",
            "s",
            also=("pause_readers.pause_seconds", "pause_readers.p99_ms"),
            strict=True,
        ),
        Goal(
            "rows stranded or reordered, over every scenario of the run (issue 34)",
            False,
            0,
            "ratio.rows_stranded_or_reordered",
            also=(
                "ratio.rows_stranded_scenarios_checked",
                "ratio.rows_reordered_scenarios_checked",
                "orphans_killed.orphan_keys_unpublished",
            ),
        ),
    ]


def _issue_36() -> list[Goal]:
    """Many outboxes: tenant schemas of one database served by OUTBOX_SOURCES processes."""
    return [
        Goal(
            "quiet tenants' p99 commit-to-consume at 20 events/s each, while one tenant drains "
            "a 200k-row backlog (issue 36)",
            False,
            50,
            "fleet_quiet_beside_backlog.p99_ms",
            "ms",
            also=(
                "fleet_quiet_beside_backlog.backlog_left_when_writers_stopped",
                "fleet_quiet_alone.p99_ms",
            ),
        ),
        Goal(
            "quiet tenants' p99 beside the backlog vs without it (issue 36)",
            False,
            2,
            "ratio.fleet_quiet_p99_beside_backlog_vs_alone",
            "x",
        ),
        Goal(
            "a tenant schema migrated while the fleet runs: its first row published (issue 36)",
            False,
            5,
            "fleet_new_tenant.first_row_published_s_max",
            "s",
        ),
        Goal(
            "500 tenant schemas, 2 processes: connections per process (issue 36)",
            False,
            10,
            "fleet_idle.connections_per_process_max",
            also=("fleet_idle.outboxes",),
        ),
        Goal(
            "500 idle tenant schemas, 2 processes: PostgreSQL backend CPU of the fleet (issue 36)",
            False,
            2,
            "fleet_idle.postgres_cpu_percent_of_one_core",
            "% of a core",
        ),
        Goal(
            "one tenant's drain beside 499 idle ones vs the one-table drain (issue 36)",
            True,
            0.9,
            "ratio.fleet_drain_beside_idle_vs_one_table",
            "x",
            also=("fleet_drain_beside_idle.events_per_second", "drain.events_per_second"),
        ),
    ]


def _goals() -> list[Goal]:
    steady_1k, steady_2k, steady_100 = STEADY_1K, STEADY_2K, STEADY_100
    goals = _issue_34() + _issue_36()
    goals += [
        Goal(
            "rows stranded, over every scenario of the run (pending or never consumed when "
            "nothing moved for a while)",
            False,
            0,
            "ratio.rows_stranded",
            also=("ratio.rows_stranded_scenarios_checked",),
        ),
        Goal(
            "other keys' drain while one writer transaction stays open and 1,000 keys empty, "
            "vs without",
            True,
            0.9,
            "ratio.open_writer_held_vs_none",
            also=("open_writer_held.events_per_second",),
        ),
    ]
    goals += [
        Goal(
            f"{claim} claim's cost with 1M {STUCK_WORK[kind]} (stuck_rows: how many this run "
            "used) vs none (wall time)",
            False,
            2,
            f"ratio.claim_cost_{kind}_{claim}_vs_none",
            # The rows of stuck work the run used (1M in a full run, fewer with --quick).
            also=(
                f"claim_cost_{kind}.stuck_rows",
                f"claim_cost_{kind}.{claim}_claim_ms",
                f"claim_cost_none.{claim}_claim_ms",
            ),
        )
        for kind in STUCK_KINDS
        for claim in ("empty", "full")
    ]
    goals += [
        Goal(
            "PostgreSQL backend CPU per 1k events, steady 1k/s (10-row transactions)",
            False,
            60,
            f"{steady_1k}.postgres_cpu_ms_per_1k",
            "ms",
        ),
        Goal(
            "PostgreSQL backend CPU per 1k events, steady 100/s (1-row transactions)",
            False,
            500,
            f"{steady_100}.postgres_cpu_ms_per_1k",
            "ms",
        ),
        Goal(
            "PostgreSQL backend CPU per 1k events, drain",
            False,
            20,
            "drain.postgres_cpu_ms_per_1k",
            "ms",
        ),
        Goal(
            "WAL per event beyond the writer's insert (drain)",
            False,
            400,
            "drain.wal_bytes_per_event_dispatcher",
            "B",
            also=("drain.wal_bytes_per_event_writer",),
        ),
        Goal(
            "writers' insert throughput lost to the relay's schema (a dispatcher waiting)",
            False,
            15,
            "writer_cost.cost_percent_dispatcher_waiting",
            "%",
            also=("writer_cost.cost_percent", "writer_cost_parts.cost_percent"),
        ),
        Goal(
            "drain of 200k rows over 1,000 keys",
            True,
            35_000,
            "drain.events_per_second",
            "events/s",
        ),
        Goal(
            "drain of a 50k-row burst into a table whose statistics predate it, vs the same "
            "after ANALYZE",
            True,
            0.9,
            "ratio.burst_stale_vs_analyzed",
            also=("burst_stale.events_per_second", "burst_analyzed.events_per_second"),
        ),
        Goal(
            "4 processes vs 1, 20 ms added broker latency, 10,000 keys",
            True,
            3.2,
            "ratio.processes_latency_4_vs_1",
            also=("ratio.processes_latency_2_vs_1",),
        ),
        Goal("latency at 2k/s, 10-row transactions, p50", False, 5, f"{steady_2k}.p50_ms", "ms"),
        Goal("latency at 2k/s, 10-row transactions, p99", False, 20, f"{steady_2k}.p99_ms", "ms"),
        Goal("latency at 100/s, 1-row transactions, p99", False, 20, f"{steady_100}.p99_ms", "ms"),
    ]
    goals += [  # issue 10
        Goal(
            "dispatcher CPU per 1k events in the drain (issue 10)",
            False,
            10,
            "drain.dispatcher_cpu_ms_per_1k",
            "ms",
        ),
        Goal(
            "hot key: one ordering key, order checked (issue 10)",
            True,
            20_000,
            "hot_key.events_per_second",
            "events/s",
        ),
        Goal(
            "Kafka client alone: the batch API (used) vs send() (issue 10: use the faster)",
            True,
            1.0,
            "ratio.kafka_batch_api_vs_send",
            also=("baseline_kafka_batch_api.events_per_second",),
        ),
    ]
    goals += [
        Goal(
            "exactly-once: drain of the drain's rows vs at-least-once (issue 23)",
            True,
            0.8,
            "ratio.drain_exactly_once_vs_at_least_once",
            also=(
                "drain_exactly_once.events_per_second",
                "drain_exactly_once.at_least_once_events_per_second",
            ),
        ),
        Goal(
            "exactly-once: p99 commit to read_committed consume at 1k/s, 10 rows/tx (issue 23)",
            False,
            50,
            "sustained_1000_per_s_10_per_tx_exactly_once.p99_ms",
            "ms",
            also=("sustained_1000_per_s_10_per_tx.p99_ms",),
        ),
        Goal(
            "exactly-once: PostgreSQL backend CPU per 1k events vs at-least-once, drain (issue 23)",
            False,
            1.1,
            "ratio.drain_exactly_once_postgres_cpu_vs_at_least_once",
            also=(
                "drain_exactly_once.postgres_cpu_ms_per_1k",
                "drain_exactly_once.at_least_once_postgres_cpu_ms_per_1k",
                "ratio.sustained_1k_exactly_once_postgres_cpu_vs_at_least_once",
            ),
        ),
    ]
    return goals


GOALS = _goals()


def _lookup(source: str, results: dict[str, dict[str, float]], ratios: dict[str, float]) -> Any:
    scenario, _, figure = source.partition(".")
    value = ratios.get(figure) if scenario == "ratio" else results.get(scenario, {}).get(figure)
    if value is None or math.isnan(value):
        return None
    return float(value)


def goals(
    results: dict[str, dict[str, float]],
    ratios: dict[str, float],
    why_not: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One row per goal: target, measured (None if its scenario did not run), measured/target
    and the verdict; `why_not` (by scenario) says why a scenario that ran gave no figure."""
    rows = []
    for goal in GOALS:
        measured = _lookup(goal.source, results, ratios)
        why = ""
        if measured is None:
            verdict, ratio = "not measured", None
            scenario = goal.source.partition(".")[0]
            if scenario in results:
                why = (why_not or {}).get(scenario, "")
        else:
            if goal.at_least:
                met = measured > goal.threshold if goal.strict else measured >= goal.threshold
            else:
                met = measured < goal.threshold if goal.strict else measured <= goal.threshold
            verdict = "met" if met else "missed"
            ratio = measured / goal.threshold if goal.threshold else None
        sign = (">" if goal.strict else ">=") if goal.at_least else ("<" if goal.strict else "<=")
        rows.append(
            {
                "goal": goal.figure,
                "target": f"{sign} {goal.threshold:,g} {goal.unit}".strip(),
                "measured": measured,
                "ratio_to_target": ratio,
                "verdict": verdict,
                "why_not_measured": why,
                "source": goal.source,
                "also": {name: _lookup(name, results, ratios) for name in goal.also},
            }
        )
    return rows


def goals_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| goal | target | measured | measured/target | verdict | also |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        measured = "" if row["measured"] is None else f"{row['measured']:,.2f}"
        ratio = "" if row["ratio_to_target"] is None else f"{row['ratio_to_target']:.2f}x"
        also = ", ".join(
            f"{name} {'' if value is None else f'{value:,.2f}'}"
            for name, value in row["also"].items()
        )
        verdict = row["verdict"] + (f" ({why})" if (why := row.get("why_not_measured")) else "")
        lines.append(
            f"| {row['goal']} | {row['target']} | {measured} | {ratio} | {verdict} | {also} |"
        )
    met = sum(row["verdict"] == "met" for row in rows)
    measured_count = sum(row["verdict"] != "not measured" for row in rows)
    lines.append(f"\n{met} of {measured_count} measured goals met ({len(rows)} goals).")
    return "\n".join(lines)
