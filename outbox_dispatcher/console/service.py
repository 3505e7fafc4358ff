"""What the console's pages and API both do: each function opens a session (as the CLI does),
reads or performs through operate/, and shapes the answer as JSON-ready data; it renders nothing.
"""

from __future__ import annotations

import codecs
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import orjson
from pydantic import BaseModel

from outbox_dispatcher.console import history
from outbox_dispatcher.console.inputs import (
    AuditQuery,
    BlockedQuery,
    DeadFilter,
    DeadQuery,
    InputError,
    PauseBody,
    ReplayFilter,
    ResumeBody,
)
from outbox_dispatcher.operate import reads
from outbox_dispatcher.operate.actions import (
    Action,
    ActionRefusedError,
    ActionResult,
    DeadDiscard,
    DeadRequeue,
    Origin,
    Pause,
    Replay,
    Resume,
    perform,
    refuse,
)
from outbox_dispatcher.operate.session import connected
from outbox_dispatcher.settings import Settings


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
    async with connected(settings) as session:
        now = await reads.snapshot(session, settings.dead_letter_policy.value)
    report = now.as_json()
    report["history"] = {
        "source": "sampled by this console process, in memory",
        "interval_seconds": settings.console_sample_seconds,
        "window_seconds": samples.window_seconds,
        "samples": [s.as_json() for s in samples.samples()],
    }
    return report


async def dead(settings: Settings, query: DeadQuery) -> list[dict[str, Any]]:
    async with connected(settings) as session:
        found = await reads.dead_list(session, query.filters(), query.limit)
    return [_plain(row) for row in found]


async def blocked(settings: Settings, query: BlockedQuery) -> dict[str, Any]:
    """Blocked keys, each with why it waits, under the running dispatchers' policy."""
    async with connected(settings) as session:
        policy, rows = await reads.blocked(
            session,
            settings.dead_letter_policy.value,
            topic=query.topic,
            key=query.key,
            limit=query.limit,
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
    async with connected(settings) as session:
        found = await reads.row(
            session,
            row_id,
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
    async with connected(settings) as session:
        found = await reads.audit(session, query.command, query.limit)
    return [_plain(entry) for entry in found]


# --- actions -----------------------------------------------------------------------------------


def _dead(kind: type[DeadRequeue | DeadDiscard]) -> Callable[[Settings, Any], Action]:
    def action(settings: Settings, body: DeadFilter) -> Action:
        filters = body.checked(f"{kind.verb} dead rows")
        return kind(filters, settings.cleanup_batch_size, everything=body.all)

    return action


def _replay(settings: Settings, body: ReplayFilter) -> Action:
    filters = body.checked("replay published rows")
    return Replay(
        filters,
        settings.cleanup_batch_size,
        everything=body.all,
        deletes_on_publish=settings.delete_on_publish,
    )


def _pause(settings: Settings, body: PauseBody) -> Action:
    return Pause(body.target(), count_waiting=True, reason=body.reason)


def _resume(settings: Settings, body: PauseBody) -> Action:
    return Resume(body.target(), count_waiting=True)


# Each action by name: the model of its body and how the body becomes the action.
ACTIONS: dict[str, tuple[type[BaseModel], Callable[[Settings, Any], Action]]] = {
    "dead-requeue": (DeadFilter, _dead(DeadRequeue)),
    "dead-discard": (DeadFilter, _dead(DeadDiscard)),
    "replay": (ReplayFilter, _replay),
    "pause": (PauseBody, _pause),
    "resume": (ResumeBody, _resume),
}


def _origin(client: str | None) -> Origin:
    return {"via": "console", "http_client": client or "?"}


async def act(
    settings: Settings, name: str, body: BaseModel, *, dry_run: bool, client: str | None
) -> ActionResult:
    """The action `name` of this body: counted as a dry run (the confirmation page), or done.
    A refusal is the request's fault (HTTP 400)."""
    action = ACTIONS[name][1](settings, body)
    try:
        refuse(action)
        async with connected(settings) as session:
            return await perform(action, session, dry_run=dry_run, origin=_origin(client))
    except ActionRefusedError as exc:
        raise InputError(exc.message) from None


def now() -> float:
    return time.time()
