"""What the console's pages and API both do, over the operations of admin.py, status.py and the
store: each function opens a connection as the CLI does, returns data and renders nothing."""

from __future__ import annotations

import codecs
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from outbox_dispatcher import admin, listener, operations, registry, status
from outbox_dispatcher.console import history
from outbox_dispatcher.console.inputs import (
    AuditQuery,
    BlockedQuery,
    DeadFilter,
    DeadQuery,
    InputError,
    PauseBody,
    ReplayFilter,
)
from outbox_dispatcher.settings import Settings
from outbox_dispatcher.store import Store


def _json_value(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {name: _json_value(value) for name, value in row.items()}


async def overview(settings: Settings, samples: history.History) -> dict[str, Any]:
    """`status --json`, plus the sampled history of the last hour."""
    async with operations.connected(settings) as (conn, queries):
        pauses = await status.read_pauses(conn, queries)
        dispatchers = await status.read_dispatchers(conn, queries, registry.LIVE_SECONDS)
        policy = status.counting_policy(dispatchers, settings.dead_letter_policy.value)
        topics = await status.read(conn, queries, block_on_dead=policy == "block", pauses=pauses)
    report = status.as_json(topics, pauses, dispatchers, policy)
    report["history"] = {
        "source": "sampled by this console process, in memory",
        "interval_seconds": settings.console_sample_seconds,
        "window_seconds": samples.window_seconds,
        "samples": [s.as_json() for s in samples.samples()],
    }
    return report


async def dead(settings: Settings, query: DeadQuery) -> list[dict[str, Any]]:
    async with operations.connected(settings) as (conn, queries):
        found = await operations.dead_list(conn, queries, query.filters(), query.limit)
    return [_plain(row) for row in found]


async def blocked(settings: Settings, query: BlockedQuery) -> dict[str, Any]:
    """Blocked keys, each with why it waits, under the running dispatchers' policy."""
    async with operations.connected(settings) as (conn, queries):
        dispatchers = await status.read_dispatchers(conn, queries, registry.LIVE_SECONDS)
        policy = status.counting_policy(dispatchers, settings.dead_letter_policy.value)
        rows = await Store(conn, queries).blocked_keys(
            block_on_dead=policy == "block", topic=query.topic, key=query.key, limit=query.limit
        )
    keys = []
    for row in rows:
        found = _plain(dict(row))
        found["reason"] = (
            "dead" if row["dead_rows"] else "backoff" if row["attempts"] > 0 else "held"
        )
        keys.append(found)
    return {"dead_letter_policy": policy, "keys": keys}


async def row(settings: Settings, row_id: int) -> dict[str, Any] | None:
    """One row; its payload only with OUTBOX_CONSOLE_SHOW_PAYLOAD, decoded where it can be."""
    async with operations.connected(settings) as (conn, queries):
        found = await Store(conn, queries).row_detail(
            id=row_id,
            payload=settings.console_show_payload,
            payload_max_bytes=settings.console_payload_max_bytes,
        )
    if found is None:
        return None
    detail = _plain(dict(found))
    headers = detail["headers"]
    detail["headers"] = orjson.loads(headers) if isinstance(headers, str) else headers
    detail["state"] = (
        "published"
        if found["published_at"]
        else "dead"
        if found["dead_at"]
        else "in flight"
        if found["lease_expires_at"] and found["lease_expires_at"] > datetime.now(UTC)
        else "pending"
    )
    payload: bytes | None = detail.pop("payload")
    detail["payload"] = (
        decode_payload(payload, found["payload_bytes"]) if settings.console_show_payload else None
    )
    detail["payload_shown"] = settings.console_show_payload
    return detail


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


async def audit(settings: Settings, query: AuditQuery) -> list[dict[str, Any]]:
    async with operations.connected(settings) as (conn, queries):
        rows = await Store(conn, queries).audit_list(command=query.command, limit=query.limit)
    found = []
    for r in rows:
        entry = _plain(dict(r))
        entry["filter"] = orjson.loads(r["filter"])
        found.append(entry)
    return found


# --- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What an action did (or, as a dry run, would do): the answer of the API and the pages."""

    command: str
    rows: int
    dry_run: bool
    detail: str

    def as_json(self) -> dict[str, object]:
        return {
            "command": self.command,
            "rows": self.rows,
            "dry_run": self.dry_run,
            "detail": self.detail,
        }


def _origin(client: str | None) -> operations.Origin:
    return {"via": "console", "http_client": client or "?"}


async def dead_change(
    settings: Settings, body: DeadFilter, *, discard: bool, dry_run: bool, client: str | None
) -> Outcome:
    verb = "discard" if discard else "requeue"
    command = f"dead {verb}"
    filters = body.checked(f"{verb} dead rows")
    async with operations.connected(settings) as (conn, queries):
        if dry_run:
            n = await operations.dead_count(conn, queries, filters)
            return Outcome(command, n, True, f"would {verb} {admin.rows(n, 'dead row')}")
        operation = operations.dead_discard if discard else operations.dead_requeue
        n = await operation(
            conn, queries, filters, settings.cleanup_batch_size, origin=_origin(client)
        )
        if n and not discard:
            await operations.wake(conn, queries, listener.channel_name(settings))
    done = "discarded" if discard else "requeued"
    return Outcome(command, n, False, f"{done} {admin.rows(n, 'dead row')}")


async def replay(
    settings: Settings, body: ReplayFilter, *, dry_run: bool, client: str | None
) -> Outcome:
    filters = body.checked("replay published rows")
    if settings.delete_on_publish:
        raise InputError(
            "nothing to replay: with OUTBOX_DELETE_ON_PUBLISH the dispatcher deletes rows once "
            "they are published"
        )
    async with operations.connected(settings) as (conn, queries):
        if dry_run:
            n = await operations.replay_count(conn, queries, filters)
            return Outcome("replay", n, True, f"would replay {admin.rows(n, 'published row')}")
        n = await operations.replay(
            conn, queries, filters, settings.cleanup_batch_size, origin=_origin(client)
        )
        if n:
            await operations.wake(conn, queries, listener.channel_name(settings))
    return Outcome("replay", n, False, f"replayed {admin.rows(n, 'published row')}")


async def _pending_of(settings: Settings, topic: str | None) -> tuple[int, int]:
    """Pending and in-flight rows of a topic (None: of the whole table)."""
    async with operations.connected(settings) as (conn, queries):
        topics = await status.read(conn, queries)
    chosen = [t for t in topics if topic is None or t.topic == topic]
    return sum(t.pending for t in chosen), sum(t.in_flight for t in chosen)


def _what(topic: str | None) -> str:
    return f"topic {topic}" if topic else "the whole table"


async def pause(
    settings: Settings, body: PauseBody, *, dry_run: bool, client: str | None
) -> Outcome:
    topic = body.target()
    pending, in_flight = await _pending_of(settings, topic)
    waiting = admin.rows(pending - in_flight, "pending row")
    if dry_run:
        return Outcome("pause", pending, True, f"would pause {_what(topic)}: {waiting} would wait")
    async with operations.connected(settings) as (conn, queries):
        await operations.pause(conn, queries, topic, body.reason, origin=_origin(client))
    return Outcome(
        "pause",
        1,
        False,
        f"paused {_what(topic)}: {waiting} wait; {in_flight} already claimed still go out",
    )


async def resume(
    settings: Settings, body: PauseBody, *, dry_run: bool, client: str | None
) -> Outcome:
    topic = body.target()
    pending, _ = await _pending_of(settings, topic)
    if dry_run:
        return Outcome(
            "resume",
            pending,
            True,
            f"would resume {_what(topic)}: {admin.rows(pending, 'pending row')} go out again",
        )
    async with operations.connected(settings) as (conn, queries):
        lifted = await operations.resume(
            conn, queries, topic, listener.channel_name(settings), origin=_origin(client)
        )
    if lifted is None:
        return Outcome("resume", 0, False, f"{_what(topic)} was not paused: nothing changed")
    return Outcome("resume", 1, False, f"resumed {_what(topic)}")


def now() -> float:
    return time.time()
