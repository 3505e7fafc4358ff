"""What the outbox holds right now, per topic: for `outbox-dispatcher status`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import asyncpg

from outbox_dispatcher.sql import Queries


@dataclass(frozen=True)
class TopicStatus:
    topic: str | None  # None: rows the dispatcher routes itself
    pending: int
    in_flight: int
    dead: int
    published: int
    oldest_pending_age_seconds: float | None


async def read(conn: asyncpg.Connection, queries: Queries) -> list[TopicStatus]:
    return [TopicStatus(**dict(row)) for row in await conn.fetch(queries.status)]


def as_json(topics: list[TopicStatus]) -> dict[str, object]:
    return {"totals": _totals(topics), "topics": [asdict(t) for t in topics]}


def _totals(topics: list[TopicStatus]) -> dict[str, Any]:
    return {
        "pending": sum(t.pending for t in topics),
        "in_flight": sum(t.in_flight for t in topics),
        "dead": sum(t.dead for t in topics),
        "published": sum(t.published for t in topics),
        "oldest_pending_age_seconds": max(
            (t.oldest_pending_age_seconds for t in topics if t.oldest_pending_age_seconds),
            default=None,
        ),
    }


def as_table(topics: list[TopicStatus]) -> str:
    header = ("topic", "pending", "in_flight", "dead", "published", "oldest_pending_s")
    rows = [
        (
            "(routed)" if t.topic is None else t.topic,
            str(t.pending),
            str(t.in_flight),
            str(t.dead),
            str(t.published),
            "-" if t.oldest_pending_age_seconds is None else f"{t.oldest_pending_age_seconds:.1f}",
        )
        for t in topics
    ]
    totals = _totals(topics)
    age = totals["oldest_pending_age_seconds"]
    rows.append(
        (
            "TOTAL",
            str(totals["pending"]),
            str(totals["in_flight"]),
            str(totals["dead"]),
            str(totals["published"]),
            "-" if age is None else f"{age:.1f}",
        )
    )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in [header, *rows]
    )
