"""The operator's face of the database: the statements of operate/ and the console, one
keyword-only method each, named like its statement in operator.sql.

Filters travel as mappings by the names of their fragment's placeholders (`Filters.dead_values`,
`Filters.replay_values`, the listings' queries); each mutating statement works on one batch of
ids after `after`, up to `limit`, and returns the batch's last id, its row count and its first
changed id.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Unpack

import asyncpg

from outbox_dispatcher.store.arguments import AuditCloseArguments, AuditOpenArguments
from outbox_dispatcher.store.base import Row, StoreBase

Values = Mapping[str, object]

# A dead-row page's statement by order, and the names of its cursor's values.
_PAGES = {
    "id": ("dead_page_id", ("after_id",)),
    "-id": ("dead_page_id_desc", ("after_id",)),
    "dead_at": ("dead_page_dead_at", ("after_dead_at", "after_id")),
    "-dead_at": ("dead_page_dead_at_desc", ("after_dead_at", "after_id")),
}


class OperatorStore(StoreBase):
    """Operator commands, their audit record, and the console's reads and logins."""

    # Status reads.

    async def status(self) -> list[Row]:
        return await self._fetch("status")

    async def status_keys(self, *, block_on_dead: bool) -> list[Row]:
        return await self._fetch("status_keys", block_on_dead=block_on_dead)

    async def paused_list(self) -> list[Row]:
        return await self._fetch("paused_list")

    async def dispatchers_live_moded(self, *, live_seconds: float) -> list[Row]:
        """dispatchers_live with each one's delivery mode (a schema at DELIVERY_VERSION)."""
        return await self._fetch("dispatchers_live_moded", live_seconds=live_seconds)

    async def in_flight_by_owner(self) -> list[Row]:
        return await self._fetch("in_flight_by_owner")

    async def in_flight_rows(self, *, topic: str | None) -> int:
        return int(await self._value("in_flight_rows", topic=topic))

    async def pending_topics(self) -> list[Row]:
        return await self._fetch("pending_topics")

    async def dead_topics(self) -> list[Row]:
        return await self._fetch("dead_topics")

    async def pending_routed_headers(self, *, limit: int) -> list[Row]:
        return await self._fetch("pending_routed_headers", limit=limit)

    # Dead rows and replays: `filters` by the names of _dead_filter / _replay_filter.

    async def dead_page(
        self, *, order: str, filters: Values, cursor: Sequence[object], limit: int
    ) -> list[Row]:
        """One page of dead rows in `order` (id, -id, dead_at, -dead_at: one statement each),
        after `cursor` (its sort values; Nones: the first page)."""
        name, cursor_names = _PAGES[order]
        after = dict(zip(cursor_names, cursor, strict=True))
        return await self._fetch(name, **filters, **after, limit=limit)

    async def dead_count(self, *, filters: Values) -> int:
        return int(await self._value("dead_count", **filters))

    async def dead_bound(self, *, filters: Values) -> Row:
        return await self._row("dead_bound", **filters)

    async def dead_groups(self, *, filters: Values, limit: int) -> list[Row]:
        return await self._fetch("dead_groups", **filters, limit=limit)

    async def dead_requeue(self, *, filters: Values, after: int, limit: int) -> Row:
        return await self._row("dead_requeue", **filters, after=after, limit=limit)

    async def dead_discard(self, *, filters: Values, after: int, limit: int) -> Row:
        return await self._row("dead_discard", **filters, after=after, limit=limit)

    async def replay_count(self, *, filters: Values) -> int:
        return int(await self._value("replay_count", **filters))

    async def replay_bound(self, *, filters: Values) -> Row:
        return await self._row("replay_bound", **filters)

    async def replay_batch(self, *, filters: Values, after: int, limit: int) -> Row:
        return await self._row("replay_batch", **filters, after=after, limit=limit)

    async def release_held(self, *, topic: str | None) -> int:
        return int(await self._value("release_held", topic=topic))

    async def cleanup_count(self, *, older_than_seconds: float) -> int:
        return int(await self._value("cleanup_count", older_than_seconds=older_than_seconds))

    # Pauses and wake-ups.

    async def pause(self, *, topic: str, reason: str | None, by: str | None) -> Row | None:
        return await self._one("pause", topic=topic, reason=reason, by=by)

    async def wait_for_pause_readers(self) -> bool:
        """False when the wait ran out: transactions that read the pauses before the pause
        (claims, settles, any reader) were still open 5 s later. It takes no lock, so it never
        makes a claim or settle wait."""
        try:
            await self._fetch("wait_for_pause_readers")
        except asyncpg.LockNotAvailableError:
            return False
        return True

    async def resume(self, *, topic: str) -> Row | None:
        return await self._one("resume", topic=topic)

    async def wake(self, *, channel: str) -> None:
        await self._fetch("wake", channel=channel)

    # The audit record of an action while it runs (operate/jobs.py). `lock` is the table's
    # advisory-lock key of running actions.

    async def audit_open(self, **arguments: Unpack[AuditOpenArguments]) -> Row | None:
        """The new record's id (None: `request_key` was recorded before)."""
        return await self._one("audit_open", **arguments)

    async def audit_by_request(self, *, request_key: str) -> int | None:
        row = await self._one("audit_by_request", request_key=request_key)
        return None if row is None else int(row["id"])

    async def audit_progress(
        self, *, id: int, rows: int, first_id: int | None, last_id: int | None
    ) -> bool | None:
        """Whether an operator asked the action to stop (None: the record no longer runs)."""
        row = await self._one(
            "audit_progress", id=id, rows=rows, first_id=first_id, last_id=last_id
        )
        return None if row is None else bool(row["aborting"])

    async def audit_aborting(self, *, id: int) -> bool:
        return bool(await self._value("audit_aborting", id=id))

    async def audit_rows(self, *, id: int) -> int | None:
        value = await self._value("audit_rows", id=id)
        return None if value is None else int(value)

    async def audit_close(self, **arguments: Unpack[AuditCloseArguments]) -> bool:
        return await self._one("audit_close", **arguments) is not None

    async def audit_release(self, *, lock: int, id: int) -> None:
        await self._fetch("audit_release", lock=lock, id=id)

    async def audit_abort(self, *, id: int, by: str | None) -> bool:
        return await self._one("audit_abort", id=id, by=by) is not None

    async def audit_sweep(self, *, lock: int) -> list[int]:
        return [int(row["id"]) for row in await self._fetch("audit_sweep", lock=lock)]

    async def audit_list(self, *, lock: int, filters: Values, limit: int) -> list[Row]:
        """Operator actions, newest first; `filters`: before_id, command, status, who, since,
        until."""
        return await self._fetch("audit_list", lock=lock, **filters, limit=limit)

    async def audit_get(self, *, lock: int, id: int) -> Row | None:
        return await self._one("audit_get", lock=lock, id=id)

    # The console's reads (besides status and dead rows, which the CLI shares).

    async def blocked_keys(
        self, *, block_on_dead: bool, topic: str | None, key: str | None, limit: int
    ) -> list[Row]:
        """Keys whose head waits (backoff, held, or behind a dead row), oldest heads first."""
        return await self._fetch(
            "blocked_keys", block_on_dead=block_on_dead, topic=topic, key=key, limit=limit
        )

    async def row_detail(self, *, id: int, payload: bool, payload_max_bytes: int) -> Row | None:
        """One row in any state; its payload (the first bytes) only when `payload`."""
        return await self._one(
            "row_detail", id=id, payload=payload, payload_max_bytes=payload_max_bytes
        )

    async def row_by_event(self, *, event_id: uuid.UUID) -> int | None:
        row = await self._one("row_by_event", event_id=event_id)
        return None if row is None else int(row["id"])

    async def rows_window(
        self, *, before: int, window: int, filters: Values, limit: int
    ) -> list[Row]:
        """Rows of any state with ids in [before - window, before), newest first."""
        return await self._fetch(
            "rows_window", before=before, window=window, **filters, limit=limit
        )

    async def routed_groups(self, *, header_names: Sequence[str], limit: int) -> list[Row]:
        return await self._fetch("routed_groups", header_names=list(header_names), limit=limit)

    async def max_id(self) -> int:
        """The highest id in the table (where a scan of the newest rows starts)."""
        return int(await self._value("max_id"))

    # The console's logins.

    async def session_open(
        self, *, id: bytes, identity: str, client: str | None, token_tag: str, seconds: float
    ) -> None:
        await self._fetch(
            "session_open",
            id=id,
            identity=identity,
            client=client,
            token_tag=token_tag,
            seconds=seconds,
        )

    async def session_get(self, *, id: bytes, token_tag: str) -> Row | None:
        return await self._one("session_get", id=id, token_tag=token_tag)

    async def session_end(self, *, id: bytes) -> None:
        await self._fetch("session_end", id=id)

    async def session_prune(self) -> None:
        await self._fetch("session_prune")
