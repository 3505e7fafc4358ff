"""What the outbox holds right now, per topic: for `outbox-dispatcher status`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any

import asyncpg

from outbox_dispatcher.display import columns, inert
from outbox_dispatcher.sql import Queries

WHOLE_TABLE = "*"  # the topic of a whole-table pause (never a valid Kafka topic name)


@dataclass(frozen=True)
class TopicStatus:
    topic: str | None  # None: rows the dispatcher routes itself
    pending: int
    in_flight: int
    dead: int
    published: int
    oldest_pending_age_seconds: float | None
    # Keys whose head waits: in backoff, or behind a dead row (dead_letter_policy = block).
    blocked_keys: int = 0
    # Of those, the keys that wait for an operator (requeue or discard the dead row).
    dead_blocked_keys: int = 0
    paused: bool = False


@dataclass(frozen=True)
class Pause:
    topic: str  # WHOLE_TABLE for the whole table
    paused_at: datetime
    paused_by: str | None
    reason: str | None

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "paused_at": self.paused_at.isoformat()}


async def read_pauses(conn: asyncpg.Connection, queries: Queries) -> list[Pause]:
    return [Pause(**dict(row)) for row in await conn.fetch(queries.paused_list)]


async def read(
    conn: asyncpg.Connection,
    queries: Queries,
    *,
    block_on_dead: bool = False,
    pauses: list[Pause] | None = None,
) -> list[TopicStatus]:
    """Per topic counts, blocked keys and the paused flag; paused topics without rows too."""
    if pauses is None:
        pauses = await read_pauses(conn, queries)
    paused = {p.topic for p in pauses}
    table_paused = WHOLE_TABLE in paused
    keys = {row["topic"]: row for row in await conn.fetch(queries.status_keys, block_on_dead)}
    topics = []
    for row in await conn.fetch(queries.status):
        t = TopicStatus(**dict(row))
        blocked = keys.get(t.topic)
        topics.append(
            replace(
                t,
                blocked_keys=blocked["blocked_keys"] if blocked else 0,
                dead_blocked_keys=blocked["dead_blocked_keys"] if blocked else 0,
                # Routed rows (topic NULL) are paused only with the whole table.
                paused=table_paused or (t.topic is not None and t.topic in paused),
            )
        )
    seen = {t.topic for t in topics}
    topics.extend(
        TopicStatus(topic, 0, 0, 0, 0, None, paused=True)
        for topic in sorted(paused - seen - {WHOLE_TABLE})
    )
    return sorted(topics, key=lambda t: (t.topic is None, t.topic or ""))


def as_json(topics: list[TopicStatus], pauses: list[Pause] | None = None) -> dict[str, object]:
    pauses = pauses or []
    table_pause = next((p for p in pauses if p.topic == WHOLE_TABLE), None)
    return {
        "totals": _totals(topics),
        "topics": [asdict(t) for t in topics],
        "table_paused": table_pause is not None,
        "pauses": [p.as_json() for p in pauses],
    }


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
        "blocked_keys": sum(t.blocked_keys for t in topics),
        "dead_blocked_keys": sum(t.dead_blocked_keys for t in topics),
    }


def as_table(topics: list[TopicStatus], pauses: list[Pause] | None = None) -> str:
    header = (
        "topic",
        "pending",
        "in_flight",
        "dead",
        "published",
        "oldest_pending_s",
        "blocked_keys",
        "paused",
    )
    rows = [
        (
            "(routed)" if t.topic is None else t.topic,
            str(t.pending),
            str(t.in_flight),
            str(t.dead),
            str(t.published),
            "-" if t.oldest_pending_age_seconds is None else f"{t.oldest_pending_age_seconds:.1f}",
            _blocked(t.blocked_keys, t.dead_blocked_keys),
            "yes" if t.paused else "",
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
            _blocked(totals["blocked_keys"], totals["dead_blocked_keys"]),
            "",
        )
    )
    lines = columns(header, rows)
    for p in pauses or []:
        what = "the whole table" if p.topic == WHOLE_TABLE else f"topic {inert(p.topic)}"
        lines.append(
            f"paused: {what} since {p.paused_at.isoformat(timespec='seconds')}"
            f" by {inert(p.paused_by or '?')}" + (f": {inert(p.reason)}" if p.reason else "")
        )
    return "\n".join(lines)


def _blocked(blocked: int, dead_blocked: int) -> str:
    return f"{blocked} ({dead_blocked} dead)" if dead_blocked else str(blocked)
