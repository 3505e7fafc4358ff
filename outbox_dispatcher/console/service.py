"""What the console's pages and API both do: read or build actions through operate/ on the
request's session, and shape the answer as JSON-ready data; it renders nothing."""

from __future__ import annotations

import codecs
import dataclasses
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import orjson
from pydantic import BaseModel

from outbox_dispatcher import errors
from outbox_dispatcher.config.outboxes import Source
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.console import history
from outbox_dispatcher.console.inputs import (
    AuditQuery,
    BlockedQuery,
    DeadFilter,
    DeadQuery,
    GroupsQuery,
    InputError,
    PauseBody,
    ReplayFilter,
    ResumeBody,
    RowsBrowse,
    SourcesQuery,
)
from outbox_dispatcher.operate import listings, reads
from outbox_dispatcher.operate import sources as operate_sources
from outbox_dispatcher.operate.actions import (
    Action,
    ActionRefusedError,
    ActionResult,
    DeadDiscard,
    DeadRequeue,
    Replay,
    perform,
)
from outbox_dispatcher.operate.listings import Cursor, RowsQuery
from outbox_dispatcher.operate.pauses import Pause, Resume
from outbox_dispatcher.operate.session import Session
from outbox_dispatcher.routing import Router


def _json_value(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, bytes):
        return value.hex()
    return value


def plain(row: dict[str, Any]) -> dict[str, Any]:
    return {name: _json_value(value) for name, value in row.items()}


def router_of(settings: Settings) -> Router:
    return Router(settings.default_topic, settings.topic_template)


def destination(router: Router, row: dict[str, Any]) -> dict[str, Any]:
    """A row as shown: with `routed_to`, the topic a row without one goes to (as the dispatcher
    routes it with this console's OUTBOX_TOPIC_TEMPLATE / OUTBOX_DEFAULT_TOPIC), or why none."""
    if row.get("topic") is not None or "headers" not in row:
        return row
    headers = row["headers"] if isinstance(row["headers"], dict) else {}
    try:
        return {**row, "routed_to": router.topic_for(None, headers)}
    except errors.RoutingError as exc:
        return {**row, "routed_to": None, "unroutable": str(exc)}


async def overview(
    session: Session, settings: Settings, samples: history.History
) -> dict[str, Any]:
    """`status --json` (every dispatcher with its host, version, policy and rows in flight),
    plus the sampled history of the last hour and its rates."""
    now = await reads.snapshot(session, settings.dead_letter_policy.value)
    report = now.as_json()
    report["history"] = {
        "source": "sampled by this console process, in memory",
        "interval_seconds": settings.console_sample_seconds,
        "window_seconds": samples.window_seconds,
        "samples": [s.as_json() for s in samples.samples()],
        "rates": [r.as_json() for r in samples.rates()],
    }
    return report


def _cursor(text: str | None, sort: str) -> Cursor | None:
    if text is None:
        return None
    try:
        return Cursor.decode(text, sort)
    except ValueError:
        raise InputError(f"{text!r} is not a cursor of this page's order ({sort})") from None


async def dead(session: Session, query: DeadQuery, router: Router) -> dict[str, Any]:
    """A page of dead rows with the total and the cursors of the pages beside it."""
    page = await listings.dead_page(
        session,
        query.filters(),
        sort=query.sort,
        after=_cursor(query.after, query.sort),
        before=_cursor(query.before, query.sort),
        limit=query.limit,
    )
    return {
        "rows": [plain(destination(router, row)) for row in page.rows],
        "total": page.total,
        "sort": page.sort,
        "limit": query.limit,
        "next": page.next.encode() if page.next else None,
        "previous": page.previous.encode() if page.previous else None,
    }


async def groups(session: Session, query: GroupsQuery) -> dict[str, Any]:
    found, total = await listings.dead_groups(session, query.filters(), query.limit)
    return {"groups": [plain(g) for g in found], "total_groups": total, "limit": query.limit}


async def rows(session: Session, query: RowsBrowse, router: Router) -> dict[str, Any]:
    page = await listings.rows_page(session, query.query(), before=query.before, limit=query.limit)
    return {
        "rows": [plain(destination(router, row)) for row in page.rows],
        "scanned_from_id": page.scanned_from,
        "scanned_to_id": page.scanned_to,
        "next_before": page.next_before,
        "window": listings.ROWS_WINDOW,
        "limit": query.limit,
    }


async def routed(session: Session, router: Router) -> list[dict[str, Any]]:
    return await listings.routed(session, router)


async def blocked(session: Session, settings: Settings, query: BlockedQuery) -> dict[str, Any]:
    """Blocked keys, each with why it waits (a dead row: that row's error), under the running
    dispatchers' policy."""
    policy, found = await reads.blocked(
        session,
        settings.dead_letter_policy.value,
        topic=query.topic,
        key=query.key,
        limit=query.limit,
    )
    keys = []
    for row in found:
        key = plain(dict(row))
        key["reason"] = "dead" if row["dead_rows"] else "backoff" if row["attempts"] > 0 else "held"
        key["error"] = row["dead_error"] if row["dead_rows"] else row["last_error"]
        keys.append(key)
    return {"dead_letter_policy": policy, "keys": keys}


def _state(found: Any) -> str:
    if found["published_at"]:
        return "published"
    if found["dead_at"]:
        return "dead"
    leased = found["lease_expires_at"] and found["lease_expires_at"] > datetime.now(UTC)
    return "in flight" if leased else "pending"


async def row(
    session: Session, settings: Settings, row_id: int, *, payload: bool, router: Router
) -> dict[str, Any] | None:
    """One row; its payload only when `payload` (OUTBOX_CONSOLE_SHOW_PAYLOAD and a person
    logged in), decoded where it can be; how often it was published."""
    found = await reads.row(
        session, row_id, payload=payload, payload_max_bytes=settings.console_payload_max_bytes
    )
    if found is None:
        return None
    detail = plain(dict(found))
    headers = detail["headers"]
    detail["headers"] = orjson.loads(headers) if isinstance(headers, str) else headers
    detail["state"] = _state(found)
    detail["published_times"] = found["replays"] + (1 if found["published_at"] else 0)
    data: bytes | None = found["payload"]
    detail["payload"] = decode_payload(data, found["payload_bytes"]) if payload else None
    detail["payload_shown"] = payload
    return destination(router, detail)


async def row_of_event(session: Session, event_id: uuid.UUID) -> int | None:
    return await reads.row_by_event(session, event_id)


def decode_payload(data: bytes | None, total: int | None) -> dict[str, Any] | None:
    """A payload (or its first bytes) as JSON, UTF-8 text, or hex, whichever it is."""
    if data is None:
        return None
    truncated = total is not None and len(data) < total
    if not truncated:
        try:
            value = orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
        else:
            text = orjson.dumps(value, option=orjson.OPT_INDENT_2).decode()
            return {"encoding": "json", "text": text, "bytes": total, "truncated": False}
    try:
        # Incremental: the first N bytes may end inside a character.
        text = codecs.getincrementaldecoder("utf-8")().decode(data, final=not truncated)
    except UnicodeDecodeError:
        return {"encoding": "hex", "text": data.hex(" "), "bytes": total, "truncated": truncated}
    return {"encoding": "utf-8", "text": text, "bytes": total, "truncated": truncated}


async def audit(session: Session, query: AuditQuery) -> dict[str, Any]:
    asked = listings.AuditQuery(
        before=query.before,
        command=query.command,
        status=query.status,
        who=query.who,
        since=query.since,
        until=query.until,
    )
    found = [plain(r) for r in await listings.audit(session, asked, query.limit)]
    more = len(found) == query.limit
    return {"actions": found, "next_before": found[-1]["id"] if found and more else None}


async def record(session: Session, record_id: int) -> dict[str, Any] | None:
    found = await listings.audit_record(session, record_id)
    return None if found is None else plain(found)


# --- actions -----------------------------------------------------------------------------------


def _dead(kind: type[DeadRequeue | DeadDiscard]) -> Callable[[Settings, Any, Any], Action]:
    def action(settings: Settings, body: DeadFilter, by: str | None) -> Action:
        filters = body.checked(f"{kind.verb} dead rows")
        bound = body.bound.bound() if body.bound else None
        return kind(filters, settings.effective_action_batch_size, everything=body.all, bound=bound)

    return action


def _replay(settings: Settings, body: ReplayFilter, by: str | None) -> Action:
    filters = body.checked("replay published rows")
    return Replay(
        filters,
        settings.effective_action_batch_size,
        everything=body.all,
        bound=body.bound.bound() if body.bound else None,
        deletes_on_publish=settings.delete_on_publish,
    )


def _pause(settings: Settings, body: PauseBody, by: str | None) -> Action:
    return Pause(body.target(), count_waiting=True, reason=body.reason, by=by)


def _resume(settings: Settings, body: ResumeBody, by: str | None) -> Action:
    return Resume(body.target(), count_waiting=True)


# Each action by name: the model of its body and how the body becomes the action (given who
# asks, for a pause's paused_by).
ACTIONS: dict[str, tuple[type[BaseModel], Callable[[Settings, Any, str | None], Action]]] = {
    "dead-requeue": (DeadFilter, _dead(DeadRequeue)),
    "dead-discard": (DeadFilter, _dead(DeadDiscard)),
    "replay": (ReplayFilter, _replay),
    "pause": (PauseBody, _pause),
    "resume": (ResumeBody, _resume),
}
DESTRUCTIVE = frozenset({"dead-discard"})  # what deletes rows: a typed confirmation


def build(settings: Settings, name: str, body: BaseModel, by: str | None) -> Action:
    """The action `name` of this body; a refusal is the request's fault (HTTP 400)."""
    try:
        action = ACTIONS[name][1](settings, body, by)
        refused = action.refusal()
    except ActionRefusedError as exc:
        raise InputError(exc.message) from None
    if refused is not None:
        raise InputError(refused.message)
    return action


async def count(session: Session, action: Action) -> ActionResult:
    """The dry run: what the action would change, and the bound it fixes."""
    try:
        return await perform(action, session, dry_run=True)
    except ActionRefusedError as exc:
        raise InputError(exc.message) from None


async def sample(session: Session, name: str, body: BaseModel, result: ActionResult) -> list[Any]:
    """A few of the rows an action would change, for its confirmation."""
    if isinstance(body, DeadFilter) and name.startswith("dead-"):
        filters = body.filters()
        page = await listings.dead_page(session, filters, limit=5, within=result.bound)
        return [plain(r) for r in page.rows]
    if isinstance(body, ReplayFilter):
        query = RowsQuery(
            state="published",
            key=body.key,
            topic=body.topic,
            since=body.since,
            until=body.until,
            from_id=body.from_id,
            to_id=result.bound.max_id if result.bound else body.to_id,
        )
        return [plain(r) for r in (await listings.rows_page(session, query, limit=5)).rows]
    return []


async def sources(
    settings: Settings, fleet: Sequence[Source], query: SourcesQuery | None = None
) -> dict[str, Any]:
    """Every outbox of the sources (those `query` names) with its state and `status`
    (operate/sources.statuses); `served`: the one these settings name (the console's home)."""
    only = operate_sources.Filter()
    if query is not None:
        only = operate_sources.Filter(query.source, query.schema_)
    view, found = await operate_sources.statuses(settings, fleet, only)
    served = (settings.database_url.get_secret_value(), settings.db_schema, settings.table)
    outboxes = []
    for one in found:
        o = one.state.outbox
        here = (o.source.database_url.get_secret_value(), o.schema, o.table) == served
        totals = None if one.snapshot is None else reads.totals(one.snapshot.topics)
        paused = [] if one.snapshot is None else [p.topic for p in one.snapshot.pauses]
        outboxes.append({**one.as_json(), "served": here, "totals": totals, "paused": paused})
    databases = [dataclasses.asdict(d) for d in view.databases]
    return {"outboxes": outboxes, "databases": databases}
