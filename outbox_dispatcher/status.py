"""What the outbox holds right now, per topic: for `outbox-dispatcher status`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any

import asyncpg

from outbox_dispatcher import registry
from outbox_dispatcher.display import age_text, columns, inert
from outbox_dispatcher.sql import Queries
from outbox_dispatcher.store import Store

WHOLE_TABLE = "*"  # the topic of a whole-table pause (never a valid Kafka topic name)


@dataclass(frozen=True)
class TopicStatus:
    topic: str | None  # None: rows the dispatcher routes itself
    pending: int
    in_flight: int
    dead: int
    published: int
    # The lag: how long the oldest pending row that nothing holds on purpose has waited (since it
    # was committed, or an operator made it pending again, by the database's clock).
    oldest_pending_age_seconds: float | None
    # Keys whose head waits: in backoff, or behind a dead row (dead_letter_policy = block).
    blocked_keys: int = 0
    # Of those, the keys that wait for an operator (requeue or discard the dead row).
    dead_blocked_keys: int = 0
    # Of those, keys whose head is held without having failed (`replay --release-held`).
    held_keys: int = 0
    paused: bool = False
    # Pending rows waiting on purpose (topic or table paused, held): not part of the lag.
    parked: int = 0
    oldest_parked_age_seconds: float | None = None


@dataclass(frozen=True)
class Dispatcher:
    """A running dispatcher, from its heartbeat row."""

    owner: str
    dead_letter_policy: str
    started_at: datetime
    heartbeat_at: datetime
    heartbeat_age_seconds: float

    def as_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "started_at": self.started_at.isoformat(),
            "heartbeat_at": self.heartbeat_at.isoformat(),
        }


async def read_dispatchers(
    conn: asyncpg.Connection, queries: Queries, live_seconds: float
) -> list[Dispatcher]:
    """Dispatchers that beat within `live_seconds`."""
    rows = await Store(conn, queries).dispatchers_live(live_seconds=live_seconds)
    return [Dispatcher(**dict(r)) for r in rows]


@dataclass(frozen=True)
class Pause:
    topic: str  # WHOLE_TABLE for the whole table
    paused_at: datetime
    paused_by: str | None
    reason: str | None

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "paused_at": self.paused_at.isoformat()}


async def read_pauses(conn: asyncpg.Connection, queries: Queries) -> list[Pause]:
    return [Pause(**dict(row)) for row in await Store(conn, queries).paused_list()]


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
    store = Store(conn, queries)
    keys = {row["topic"]: row for row in await store.status_keys(block_on_dead=block_on_dead)}
    topics = []
    for row in await store.status():
        t = TopicStatus(**dict(row))
        blocked = keys.get(t.topic)
        topics.append(
            replace(
                t,
                blocked_keys=blocked["blocked_keys"] if blocked else 0,
                dead_blocked_keys=blocked["dead_blocked_keys"] if blocked else 0,
                held_keys=blocked["held_keys"] if blocked else 0,
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


def as_json(
    topics: list[TopicStatus],
    pauses: list[Pause] | None = None,
    dispatchers: list[Dispatcher] | None = None,
    policy: str | None = None,
) -> dict[str, object]:
    """`pending` includes `in_flight`; `waiting` is pending and not in flight."""
    pauses = pauses or []
    table_pause = next((p for p in pauses if p.topic == WHOLE_TABLE), None)
    return {
        "totals": _totals(topics),
        "topics": [{**asdict(t), "waiting": t.pending - t.in_flight} for t in topics],
        "table_paused": table_pause is not None,
        "pauses": [p.as_json() for p in pauses],
        "dispatchers": [d.as_json() for d in dispatchers or []],
        "dead_letter_policy": policy,
    }


def _totals(topics: list[TopicStatus]) -> dict[str, Any]:
    return {
        "pending": sum(t.pending for t in topics),
        "waiting": sum(t.pending - t.in_flight for t in topics),
        "in_flight": sum(t.in_flight for t in topics),
        "dead": sum(t.dead for t in topics),
        "published": sum(t.published for t in topics),
        "oldest_pending_age_seconds": max(
            (t.oldest_pending_age_seconds for t in topics if t.oldest_pending_age_seconds),
            default=None,
        ),
        "parked": sum(t.parked for t in topics),
        "oldest_parked_age_seconds": max(
            (t.oldest_parked_age_seconds for t in topics if t.oldest_parked_age_seconds),
            default=None,
        ),
        "blocked_keys": sum(t.blocked_keys for t in topics),
        "dead_blocked_keys": sum(t.dead_blocked_keys for t in topics),
        "held_keys": sum(t.held_keys for t in topics),
    }


def as_table(
    topics: list[TopicStatus],
    pauses: list[Pause] | None = None,
    dispatchers: list[Dispatcher] | None = None,
    policy: str | None = None,
) -> str:
    """The table for a terminal: `waiting` and `in_flight` together are the pending rows; `lag`
    leaves out the `parked` ones (paused or held on purpose), which have their own age."""
    header = (
        "topic",
        "waiting",
        "in_flight",
        "dead",
        "published",
        "lag",
        "parked",
        "blocked_keys",
        "paused",
    )
    rows = [
        (
            "(routed)" if t.topic is None else t.topic,
            str(t.pending - t.in_flight),
            str(t.in_flight),
            str(t.dead),
            str(t.published),
            age_text(t.oldest_pending_age_seconds),
            _parked(t.parked, t.oldest_parked_age_seconds),
            _blocked(t.blocked_keys, t.dead_blocked_keys, t.held_keys),
            "yes" if t.paused else "",
        )
        for t in topics
    ]
    totals = _totals(topics)
    age = totals["oldest_pending_age_seconds"]
    rows.append(
        (
            "TOTAL",
            str(totals["waiting"]),
            str(totals["in_flight"]),
            str(totals["dead"]),
            str(totals["published"]),
            age_text(age),
            _parked(totals["parked"], totals["oldest_parked_age_seconds"]),
            _blocked(totals["blocked_keys"], totals["dead_blocked_keys"], totals["held_keys"]),
            "",
        )
    )
    lines = columns(header, rows)
    if dispatchers is not None:
        lines.append(_dispatchers_line(dispatchers, policy))
    for p in pauses or []:
        what = "the whole table" if p.topic == WHOLE_TABLE else f"topic {inert(p.topic)}"
        lines.append(
            f"paused: {what} since {p.paused_at.isoformat(timespec='seconds')}"
            f" by {inert(p.paused_by or '?')}" + (f": {inert(p.reason)}" if p.reason else "")
        )
    return "\n".join(lines)


def counting_policy(dispatchers: list[Dispatcher], default: str) -> str:
    """The dead-letter policy blocked keys are counted under: the running dispatchers' (block if
    any of them blocks), else `default` (the reader's own setting)."""
    if dispatchers:
        policies = {d.dead_letter_policy for d in dispatchers}
        return "block" if "block" in policies else "skip"
    return default


def _dispatchers_line(dispatchers: list[Dispatcher], policy: str | None) -> str:
    if not dispatchers:
        return (
            "dispatchers: none alive (no heartbeat in the last "
            f"{registry.LIVE_SECONDS:g}s): nothing is being published; blocked keys counted "
            f"under policy {policy}"
        )
    policies = sorted({d.dead_letter_policy for d in dispatchers})
    newest = min(d.heartbeat_age_seconds for d in dispatchers)
    line = (
        f"dispatchers: {len(dispatchers)} alive (last heartbeat {newest:.0f}s ago), "
        f"dead-letter policy {'/'.join(policies)}"
    )
    if len(policies) > 1:
        line += f" (they differ: blocked keys counted under {policy})"
    return line


def _parked(rows: int, age: float | None) -> str:
    """'120 (3d04h)': rows waiting on purpose and the age of the oldest; empty when none."""
    return f"{rows} ({age_text(age)})" if rows else ""


def _blocked(blocked: int, dead_blocked: int, held: int = 0) -> str:
    """'5 (2 dead, 1 held)': the parts that wait for an operator."""
    parts = [f"{n} {why}" for n, why in ((dead_blocked, "dead"), (held, "held")) if n]
    return f"{blocked} ({', '.join(parts)})" if parts else str(blocked)
