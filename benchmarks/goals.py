"""The goal tables of issue 14 ("Claim engine v2") and issue 10 ("Publisher v2"), judged from one
run's results.

Each goal names the scenario figure (or the same-run ratio) it is judged on, so the printed table
and the JSON say target, measured, measured/target and met or missed without anyone copying
figures by hand. A goal whose scenario did not run (`--only`) is "not measured".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

STUCK_KINDS = ("block", "backoff", "paused", "replay")


@dataclass(frozen=True)
class Goal:
    figure: str  # what is judged, as issue 14 words it
    at_least: bool  # >= threshold (else <=)
    threshold: float
    source: str  # "<scenario>.<figure>" or "ratio.<name>"
    unit: str = ""
    also: str = ""  # a figure shown beside it (same form as source)


def _goals() -> list[Goal]:
    steady_1k = "sustained_1000_per_s_10_per_tx"
    steady_2k = "sustained_2000_per_s_10_per_tx"
    goals = [
        Goal(
            "PostgreSQL alone (claim + mark, no Kafka)",
            True,
            60_000,
            "baseline_postgres_only.events_per_second",
            "events/s",
        ),
        Goal(
            "PostgreSQL backend CPU per 1k events in the drain",
            False,
            25,
            "drain.postgres_cpu_ms_per_1k",
            "ms",
        ),
        Goal(
            "WAL bytes per event beyond the writer's insert (ours)",
            False,
            400,
            "drain.wal_bytes_per_event_dispatcher",
            "B",
            also="drain.wal_bytes_per_event_writer",
        ),
        Goal("drain", True, 35_000, "drain.events_per_second", "events/s"),
        Goal("drain vs the Kafka client's send() ceiling", True, 0.5, "ratio.drain_vs_kafka_only"),
        Goal(
            "2 processes vs 1, 20 ms added broker latency",
            True,
            1.8,
            "ratio.processes_latency_2_vs_1",
        ),
        Goal(
            "4 processes vs 1, 20 ms added broker latency",
            True,
            3.2,
            "ratio.processes_latency_4_vs_1",
        ),
    ]
    goals += [
        Goal(
            f"other keys' drain behind a stuck key ({kind}) vs without",
            True,
            0.9,
            f"ratio.stuck_key_{kind}_vs_none",
        )
        for kind in STUCK_KINDS
    ]
    goals += [
        Goal(
            f"p99 commit-to-ack rise at 1k/s with a stuck key ({kind})",
            False,
            5,
            f"ratio.stuck_key_{kind}_p99_rise_ms",
            "ms",
        )
        for kind in STUCK_KINDS
    ]
    goals += [
        Goal(
            "PostgreSQL backend CPU per 1k events at a steady 1k/s",
            False,
            60,
            f"{steady_1k}.postgres_cpu_ms_per_1k",
            "ms",
        ),
        Goal(
            "PostgreSQL backend CPU per 1k events at a steady 2k/s",
            False,
            60,
            f"{steady_2k}.postgres_cpu_ms_per_1k",
            "ms",
        ),
        Goal(
            "dispatcher CPU per 1k events at a steady 1k/s",
            False,
            100,
            f"{steady_1k}.dispatcher_cpu_ms_per_1k",
            "ms",
        ),
        Goal(
            "writers' cost of the relay's schema vs a primary key only, no dispatcher waiting",
            False,
            15,
            "writer_cost.cost_percent",
            "%",
        ),
        Goal(
            "writers' cost of the relay's schema vs a primary key only, a dispatcher waiting",
            False,
            15,
            "writer_cost.cost_percent_dispatcher_waiting",
            "%",
        ),
        Goal("latency at 2k/s, 10-row transactions, p50", False, 5, f"{steady_2k}.p50_ms", "ms"),
        Goal("latency at 2k/s, 10-row transactions, p99", False, 20, f"{steady_2k}.p99_ms", "ms"),
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
            also="baseline_kafka_batch_api.events_per_second",
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


def goals(results: dict[str, dict[str, float]], ratios: dict[str, float]) -> list[dict[str, Any]]:
    """One row per goal: target, measured (None if its scenario did not run), measured/target
    and the verdict."""
    rows = []
    for goal in GOALS:
        measured = _lookup(goal.source, results, ratios)
        if measured is None:
            verdict, ratio = "not measured", None
        else:
            met = measured >= goal.threshold if goal.at_least else measured <= goal.threshold
            verdict, ratio = ("met" if met else "missed"), measured / goal.threshold
        sign = ">=" if goal.at_least else "<="
        also = _lookup(goal.also, results, ratios) if goal.also else None
        rows.append(
            {
                "goal": goal.figure,
                "target": f"{sign} {goal.threshold:,g} {goal.unit}".strip(),
                "measured": measured,
                "ratio_to_target": ratio,
                "verdict": verdict,
                "source": goal.source,
                "also": {goal.also: also} if goal.also else {},
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
        lines.append(
            f"| {row['goal']} | {row['target']} | {measured} | {ratio} | {row['verdict']} "
            f"| {also} |"
        )
    met = sum(row["verdict"] == "met" for row in rows)
    measured_count = sum(row["verdict"] != "not measured" for row in rows)
    lines.append(f"\n{met} of {measured_count} measured goals met ({len(rows)} goals).")
    return "\n".join(lines)
