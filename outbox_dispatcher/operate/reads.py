"""What operators read: the outbox per topic with its pauses and dispatchers (one `Snapshot` for
`status`, the console's overview and its blocked page), dead rows, one row, the audit.

Each read takes a Session and returns data; the faces print or render it.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any

from outbox_dispatcher import registry
from outbox_dispatcher.operate.session import Session
from outbox_dispatcher.store import Row, migrations

WHOLE_TABLE = "*"  # the topic of a whole-table pause (never a valid Kafka topic name)
# The delivery summary besides one mode (Settings.delivery's values): the live dispatchers report
# different modes (exactly-once's fence relies on every dispatcher of a table being
# transactional), or none reports one (releases older than schema version 14 do not).
MIXED = "mixed"
NOT_REPORTED = "not reported"


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
    """A running dispatcher, from its heartbeat row: what it reported (the schema version it
    runs, counters since it started, its delivery mode) and the rows it has in flight now."""

    owner: str  # host:pid:suffix
    dead_letter_policy: str
    started_at: datetime
    heartbeat_at: datetime
    heartbeat_age_seconds: float
    # The schema version it runs (the latest it knows); None: older than 10, which record none.
    version: int | None = None
    published_total: int | None = None  # None: older than 12, which count nothing here
    dead_total: int | None = None
    delivery: str | None = None  # None: not reported (older than 14, or a schema before 14)
    in_flight: int = 0

    @property
    def host(self) -> str:
        return self.owner.rsplit(":", 2)[0] if self.owner.count(":") >= 2 else self.owner

    def as_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "host": self.host,
            "started_at": self.started_at.isoformat(),
            "heartbeat_at": self.heartbeat_at.isoformat(),
        }


@dataclass(frozen=True)
class Pause:
    topic: str  # WHOLE_TABLE for the whole table
    paused_at: datetime
    paused_by: str | None
    reason: str | None

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "paused_at": self.paused_at.isoformat()}


@dataclass(frozen=True)
class Snapshot:
    """The outbox right now: per topic counts under the policy blocked keys are counted by, the
    pauses and the live dispatchers."""

    topics: list[TopicStatus]
    pauses: list[Pause]
    dispatchers: list[Dispatcher]
    policy: str

    def as_json(self) -> dict[str, object]:
        return as_json(self.topics, self.pauses, self.dispatchers, self.policy)


async def snapshot(session: Session, default_policy: str) -> Snapshot:
    """One read of pauses, dispatchers, their policy and the topics; `default_policy` is the
    reader's own setting, used when no dispatcher is alive."""
    pauses = await read_pauses(session)
    dispatchers, policy = await counting(session, default_policy)
    found = await topics(session, block_on_dead=policy == "block", pauses=pauses)
    return Snapshot(found, pauses, dispatchers, policy)


async def counting(session: Session, default_policy: str) -> tuple[list[Dispatcher], str]:
    """The live dispatchers and the dead-letter policy blocked keys are counted under."""
    dispatchers = await read_dispatchers(session, registry.LIVE_SECONDS)
    return dispatchers, counting_policy(dispatchers, default_policy)


def counting_policy(dispatchers: list[Dispatcher], default: str) -> str:
    """The dead-letter policy blocked keys are counted under: the running dispatchers' (block if
    any of them blocks), else `default` (the reader's own setting)."""
    if dispatchers:
        policies = {d.dead_letter_policy for d in dispatchers}
        return "block" if "block" in policies else "skip"
    return default


def delivery_modes(dispatchers: list[Dispatcher]) -> dict[str, int]:
    """How many live dispatchers run each delivery mode (NOT_REPORTED: an older release's)."""
    return dict(sorted(Counter(d.delivery or NOT_REPORTED for d in dispatchers).items()))


def delivery_in_force(dispatchers: list[Dispatcher]) -> str | None:
    """The mode the table is published in: the one its live dispatchers report, MIXED when they
    report different ones, NOT_REPORTED when none reports one; None with none alive. One that
    reports nothing beside others that do is left out here (delivery_modes counts it)."""
    if not dispatchers:
        return None
    reported = {d.delivery for d in dispatchers if d.delivery is not None}
    if not reported:
        return NOT_REPORTED
    return reported.pop() if len(reported) == 1 else MIXED


async def read_dispatchers(session: Session, live_seconds: float) -> list[Dispatcher]:
    """Dispatchers that beat within `live_seconds`, each with its rows in flight and, on a
    schema that keeps it (an operator command runs on 12 and 13 too), its delivery mode."""
    store = session.store
    if await store.schema_version() >= migrations.DELIVERY_VERSION:
        rows = await store.dispatchers_live_moded(live_seconds=live_seconds)
    else:
        rows = await store.dispatchers_live(live_seconds=live_seconds)
    if not rows:
        return []
    leased = await in_flight_by_owner(session)
    return [Dispatcher(**dict(r), in_flight=leased.get(r["owner"], 0)) for r in rows]


async def in_flight_by_owner(session: Session) -> dict[str, int]:
    """Rows held by a live claim, per owner (the one place that says what "in flight" means
    per dispatcher)."""
    return {row["owner"]: row["rows"] for row in await session.store.in_flight_by_owner()}


async def read_pauses(session: Session) -> list[Pause]:
    return [Pause(**dict(row)) for row in await session.store.paused_list()]


async def topics(
    session: Session, *, block_on_dead: bool = False, pauses: list[Pause] | None = None
) -> list[TopicStatus]:
    """Per topic counts, blocked keys and the paused flag; paused topics without rows too."""
    if pauses is None:
        pauses = await read_pauses(session)
    paused = {p.topic for p in pauses}
    table_paused = WHOLE_TABLE in paused
    store = session.store
    keys = {row["topic"]: row for row in await store.status_keys(block_on_dead=block_on_dead)}
    found = []
    for row in await store.status():
        t = TopicStatus(**dict(row))
        blocked = keys.get(t.topic)
        found.append(
            replace(
                t,
                blocked_keys=blocked["blocked_keys"] if blocked else 0,
                dead_blocked_keys=blocked["dead_blocked_keys"] if blocked else 0,
                held_keys=blocked["held_keys"] if blocked else 0,
                # Routed rows (topic NULL) are paused only with the whole table.
                paused=table_paused or (t.topic is not None and t.topic in paused),
            )
        )
    seen = {t.topic for t in found}
    found.extend(
        TopicStatus(topic, 0, 0, 0, 0, None, paused=True)
        for topic in sorted(paused - seen - {WHOLE_TABLE})
    )
    return sorted(found, key=lambda t: (t.topic is None, t.topic or ""))


async def pending_of(session: Session, topic: str | None) -> tuple[int, int]:
    """Pending and in-flight rows of a topic (None: of the whole table)."""
    chosen = [t for t in await topics(session) if topic is None or t.topic == topic]
    return sum(t.pending for t in chosen), sum(t.in_flight for t in chosen)


async def in_flight(session: Session, topic: str | None) -> int:
    """Rows under a live lease (being published right now), of a topic or all."""
    return await session.store.in_flight_rows(topic=topic)


def as_json(
    topics: list[TopicStatus],
    pauses: list[Pause] | None = None,
    dispatchers: list[Dispatcher] | None = None,
    policy: str | None = None,
) -> dict[str, object]:
    """`pending` includes `in_flight`; `waiting` is pending and not in flight; `delivery` is
    the live dispatchers' mode (delivery_in_force), `delivery_modes` how many run each."""
    pauses = pauses or []
    dispatchers = dispatchers or []
    table_pause = next((p for p in pauses if p.topic == WHOLE_TABLE), None)
    return {
        "totals": totals(topics),
        "topics": [{**asdict(t), "waiting": t.pending - t.in_flight} for t in topics],
        "table_paused": table_pause is not None,
        "pauses": [p.as_json() for p in pauses],
        "dispatchers": [d.as_json() for d in dispatchers],
        "dead_letter_policy": policy,
        "delivery": delivery_in_force(dispatchers),
        "delivery_modes": delivery_modes(dispatchers),
    }


def totals(topics: list[TopicStatus]) -> dict[str, Any]:
    return {
        "pending": sum(t.pending for t in topics),
        "waiting": sum(t.pending - t.in_flight for t in topics),
        "in_flight": sum(t.in_flight for t in topics),
        "dead": sum(t.dead for t in topics),
        "published": sum(t.published for t in topics),
        "oldest_pending_age_seconds": _oldest(t.oldest_pending_age_seconds for t in topics),
        "parked": sum(t.parked for t in topics),
        "oldest_parked_age_seconds": _oldest(t.oldest_parked_age_seconds for t in topics),
        "blocked_keys": sum(t.blocked_keys for t in topics),
        "dead_blocked_keys": sum(t.dead_blocked_keys for t in topics),
        "held_keys": sum(t.held_keys for t in topics),
    }


def _oldest(ages: Any) -> float | None:
    return max((age for age in ages if age), default=None)


async def blocked(
    session: Session, default_policy: str, *, topic: str | None, key: str | None, limit: int
) -> tuple[str, list[Row]]:
    """Keys whose head waits (backoff, held, or behind a dead row), oldest heads first, under
    the running dispatchers' policy (which is returned with them)."""
    _, policy = await counting(session, default_policy)
    rows = await session.store.blocked_keys(
        block_on_dead=policy == "block", topic=topic, key=key, limit=limit
    )
    return policy, rows


async def row(
    session: Session, row_id: int, *, payload: bool, payload_max_bytes: int
) -> Row | None:
    """One row in any state; its payload (the first bytes) only when `payload`."""
    return await session.store.row_detail(
        id=row_id, payload=payload, payload_max_bytes=payload_max_bytes
    )


async def row_by_event(session: Session, event_id: uuid.UUID) -> int | None:
    """The id of the row with this event id (the unique index), if there is one."""
    return await session.store.row_by_event(event_id=event_id)


@dataclass(frozen=True)
class Gauges:
    """The cheap numbers of the table (the gauge query behind /metrics) and each live
    dispatcher's counters (rows published, dead-lettered since it started), for a chart."""

    pending: int
    parked: int  # pending rows waiting on purpose (paused, held): not lag
    dead: int
    oldest_pending_age_seconds: float | None
    # owner -> (published, dead-lettered, Unix time of the heartbeat that reported them)
    counters: dict[str, tuple[int, int, float]]


async def gauges(session: Session) -> Gauges:
    store = session.store
    row = await store.gauges(block_on_dead=False)
    live = await store.dispatchers_live(live_seconds=registry.LIVE_SECONDS)
    counters = {
        d["owner"]: (
            int(d["published_total"]),
            int(d["dead_total"] or 0),
            d["heartbeat_at"].timestamp(),
        )
        for d in live
        if d["published_total"] is not None
    }
    return Gauges(
        pending=row["pending"],
        parked=row["paused_rows"] + row["held_rows"],
        dead=row["dead"],
        oldest_pending_age_seconds=row["oldest_pending_age_seconds"],
        counters=counters,
    )
