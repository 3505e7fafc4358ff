"""Idempotent consumption for Python consumers: the inbox pattern.

Delivery is at-least-once, so a consumer sees some events twice (same `event-id` header). `Inbox`
records each event id in the consumer's own PostgreSQL database in the same transaction as the
handler's writes: the handler's effects and the "seen" mark commit together, and a redelivered
event is skipped. The table is plain SQL (schema/inbox.sql), so consumers in other languages can
share it (docs/consumers.md).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from outbox_dispatcher import errors
from outbox_dispatcher.store import migrations
from outbox_dispatcher.store.statements import Statements


class Record(Protocol):
    """What Inbox needs of a Kafka record (aiokafka's ConsumerRecord has it)."""

    topic: str
    partition: int
    offset: int
    headers: Any  # a sequence of (name, bytes) pairs


Handler = Callable[["PoolConnectionProxy[Any]", Any], Awaitable[None]]


class MissingEventIdError(errors.OutboxDispatcherError):
    """The record carries no event id header: it did not come from outbox-dispatcher, or the
    header name differs (Inbox(event_id_header=...))."""


class Inbox:
    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        schema: str = "public",
        table: str = "inbox",
        event_id_header: str = "event-id",
    ) -> None:
        self._pool = pool
        self._schema = schema
        self._table = table
        self._header = event_id_header
        self._insert = Statements.for_table(schema, "outbox", inbox=table)["inbox_record"]

    async def create(self) -> None:
        """Create the inbox table if it does not exist (schema/inbox.sql)."""
        sql = (migrations.schema_dir() / "inbox.sql").read_text("utf-8")
        await self._pool.execute(migrations.render(sql, self._schema, self._table))

    def event_id(self, record: Record) -> uuid.UUID:
        for name, value in record.headers or ():
            if name == self._header and value:
                try:
                    return uuid.UUID(value.decode())
                except (ValueError, UnicodeDecodeError) as exc:
                    msg = f"header {self._header!r} is not a UUID: {value!r}"
                    raise MissingEventIdError(msg) from exc
        raise MissingEventIdError

    async def handle(self, record: Record, handler: Handler) -> bool:
        """Run `handler(conn, record)` once per event id; returns False for a duplicate.

        The handler writes through `conn`, inside the transaction that records the event id; if it
        raises, nothing is recorded and a redelivery runs it again."""
        event_id = self.event_id(record)
        async with self._pool.acquire() as conn, conn.transaction():
            values = {
                "event_id": event_id,
                "topic": record.topic,
                "partition": record.partition,
                "offset": record.offset,
            }
            first = await conn.fetchval(self._insert.sql, *self._insert.bind(values))
            if first is None:
                return False
            await handler(conn, record)
            return True
