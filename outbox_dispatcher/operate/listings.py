"""What operators page through: dead rows (keyset pages in four orders, with their total), dead
rows grouped by cause, rows in any state (bounded windows of ids, newest first), routed rows by
destination, and the audit records. Data only; the faces render it.

Every read here is bounded: a dead-row page reads its rows from the partial indexes of dead rows
(`<table>_dead_id_idx`, `<table>_dead_at_idx`) and the total counts dead rows only; a page of rows
in any state scans at most ROWS_WINDOW ids of the primary key, and says where to go on.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

from outbox_dispatcher import errors
from outbox_dispatcher.operate.filters import Bound, Filters
from outbox_dispatcher.operate.session import Session
from outbox_dispatcher.routing import Router
from outbox_dispatcher.store import Row

SORTS = ("id", "-id", "dead_at", "-dead_at")
_REVERSED = {"id": "-id", "-id": "id", "dead_at": "-dead_at", "-dead_at": "dead_at"}
# Ids a page of rows in any state scans at most (the primary key's range [before - window, before)).
ROWS_WINDOW = 50_000
STATES = ("pending", "published", "dead")


@dataclass(frozen=True)
class Cursor:
    """Where a page of dead rows starts: after the row with this id (and time of death, in the
    dead_at orders), or before it when going back."""

    id: int
    dead_at: datetime | None = None

    def encode(self) -> str:
        return str(self.id) if self.dead_at is None else f"{self.dead_at.isoformat()}_{self.id}"

    @classmethod
    def decode(cls, text: str, sort: str) -> Cursor:
        """ValueError when `text` is no cursor of `sort`'s pages."""
        if sort.endswith("dead_at"):
            when, _, row_id = text.rpartition("_")
            return cls(int(row_id), datetime.fromisoformat(when))
        return cls(int(text))

    @classmethod
    def of(cls, row: dict[str, Any], sort: str) -> Cursor:
        return cls(row["id"], row["dead_at"] if sort.endswith("dead_at") else None)

    def args(self, sort: str) -> tuple[object, ...]:
        return (self.dead_at, self.id) if sort.endswith("dead_at") else (self.id,)


@dataclass(frozen=True)
class DeadPage:
    """One page of dead rows, the total that match, and the cursors of the pages beside it
    (None: there is none)."""

    rows: list[dict[str, Any]]
    total: int
    sort: str
    next: Cursor | None
    previous: Cursor | None


def _plain(row: Row) -> dict[str, Any]:
    found = dict(row)
    if "event_id" in found:
        found["event_id"] = str(found["event_id"])
    if isinstance(found.get("headers"), str):
        found["headers"] = orjson.loads(found["headers"])
    return found


async def dead_page(
    session: Session,
    filters: Filters,
    *,
    sort: str = "id",
    after: Cursor | None = None,
    before: Cursor | None = None,
    limit: int = 100,
    within: Bound | None = None,
) -> DeadPage:
    """The dead rows matching `filters` (within `within`, the bound of an action) in `sort`
    order after `after` (or before `before`), at most `limit`, with the total."""
    back = before is not None and after is None
    cursor = before if back else after
    order = _REVERSED[sort] if back else sort
    start = cursor.args(sort) if cursor else (None,) * (2 if sort.endswith("dead_at") else 1)
    store = session.store
    values = filters.dead_values(within)
    found = await store.dead_page(order=order, filters=values, cursor=start, limit=limit + 1)
    rows = [_plain(r) for r in found[:limit]]
    more = len(found) > limit
    if back:
        rows.reverse()
    total = await store.dead_count(filters=values)
    first, last = (Cursor.of(rows[0], sort), Cursor.of(rows[-1], sort)) if rows else (None, None)
    following = last if (more if not back else True) else None
    preceding = first if (cursor is not None if not back else more) else None
    return DeadPage(rows, total, sort, following, preceding)


async def dead_list(session: Session, filters: Filters, limit: int) -> list[dict[str, Any]]:
    """Dead rows matching `filters`, by id, at most `limit` (the CLI's `dead list`)."""
    return (await dead_page(session, filters, limit=limit)).rows


async def dead_groups(
    session: Session, filters: Filters, limit: int
) -> tuple[list[dict[str, Any]], int]:
    """Dead rows matching `filters` grouped by topic and cause, the largest first, and how many
    groups there are."""
    found = await session.store.dead_groups(filters=filters.dead_values(), limit=limit)
    groups = [dict(row) for row in found]
    return groups, int(groups[0]["groups"]) if groups else 0


@dataclass(frozen=True)
class RowsQuery:
    """Which rows a page of rows in any state shows."""

    state: str | None = None  # pending, published, dead
    key: str | None = None
    topic: str | None = None  # "(routed)": none
    event_id: uuid.UUID | None = None
    header: str | None = None  # in a header's "name=value", any case
    payload: bytes | None = None  # in the payload, byte for byte
    since: datetime | None = None
    until: datetime | None = None
    from_id: int | None = None
    to_id: int | None = None

    def values(self) -> dict[str, object]:
        """The rows_window statement's filter values by name (to_id bounds the scan instead)."""
        found = dict(vars(self))
        del found["to_id"]
        return found


@dataclass(frozen=True)
class RowsPage:
    """Rows found in the ids scanned, newest first: [scanned_from, scanned_to]; `next_before`
    continues the scan below (None: nothing is left to scan)."""

    rows: list[dict[str, Any]]
    scanned_from: int
    scanned_to: int
    next_before: int | None


async def rows_page(
    session: Session,
    query: RowsQuery,
    *,
    before: int | None = None,
    limit: int = 100,
    window: int | None = None,
) -> RowsPage:
    """Rows matching `query` with ids below `before` (None: from the newest), newest first, from
    a scan of at most `window` ids (ROWS_WINDOW)."""
    window = window or ROWS_WINDOW
    store = session.store
    if query.event_id is not None:  # the unique index: no scan
        found = await store.row_by_event(event_id=query.event_id)
        top = 0 if found is None else found + 1
        window = 1
    elif before is not None:
        top = before
    else:
        top = (query.to_id + 1) if query.to_id is not None else await store.max_id() + 1
    if query.to_id is not None:
        top = min(top, query.to_id + 1)
    floor = max(query.from_id or 1, 1)
    found_rows = await store.rows_window(
        before=top, window=window, filters=query.values(), limit=limit
    )
    rows = [_plain(r) for r in found_rows]
    lowest = rows[-1]["id"] if len(rows) == limit else max(top - window, floor)
    more = lowest > floor and query.event_id is None
    return RowsPage(rows, lowest, top - 1, lowest if more else None)


async def routed(session: Session, router: Router, limit: int = 200) -> list[dict[str, Any]]:
    """Rows without a topic by the topic the dispatcher routes them to (from their headers, as
    `router` routes them): pending, dead and published rows of each, largest first."""
    names = router.header_names
    groups = await session.store.routed_groups(header_names=names, limit=limit)
    by_topic: dict[str, dict[str, Any]] = {}
    for group in groups:
        headers = {n: v for n, v in zip(names, group["header_values"] or [], strict=False) if v}
        topic: str | None
        reason: str | None
        try:
            topic = router.topic_for(None, headers)
        except errors.RoutingError as exc:
            topic, reason = None, str(exc)
        else:
            reason = None
        entry = by_topic.setdefault(
            topic or f"!{reason}",
            {"topic": topic, "unroutable": reason, "pending": 0, "dead": 0, "published": 0},
        )
        for state in ("pending", "dead", "published"):
            entry[state] += group[state]

    def size(entry: dict[str, Any]) -> int:
        return int(entry["pending"] + entry["dead"] + entry["published"])

    return sorted(by_topic.values(), key=lambda e: (-size(e), e["topic"] or ""))


# --- the audit -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditQuery:
    before: int | None = None  # records with lower ids (the next page)
    command: str | None = None
    status: str | None = None  # as read: a record whose process died reads as interrupted
    who: str | None = None  # a person the console knew, or a database role
    since: datetime | None = None
    until: datetime | None = None

    def values(self) -> dict[str, object]:
        """The audit_list statement's filter values by name."""
        return {"before_id": self.before} | {k: v for k, v in vars(self).items() if k != "before"}


def _record(row: Row) -> dict[str, Any]:
    found = dict(row)
    found["filter"] = orjson.loads(row["filter"])
    found["bound"] = orjson.loads(row["bound"]) if row["bound"] else None
    return found


async def audit(session: Session, query: AuditQuery, limit: int) -> list[dict[str, Any]]:
    """Operator actions, newest first, each with its filter and bound decoded."""
    store = session.store
    rows = await store.audit_list(lock=session.audit_lock, filters=query.values(), limit=limit)
    return [_record(r) for r in rows]


async def audit_record(session: Session, record: int) -> dict[str, Any] | None:
    row = await session.store.audit_get(lock=session.audit_lock, id=record)
    return None if row is None else _record(row)
