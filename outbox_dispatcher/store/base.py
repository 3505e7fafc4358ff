"""What both stores share: running a statement by name, and the reads both audiences make.

A store is built once per process (or operator command) from an executor (a pool, or one
connection for an operator's transaction) and the table's statements, and handed to the
components that need it; no component builds one.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from outbox_dispatcher.store import db
from outbox_dispatcher.store.statements import Statements

Row = asyncpg.Record


class StoreBase:
    """One outbox table's statements over a pool or a connection."""

    def __init__(self, executor: asyncpg.Pool | db.Executor, statements: Statements) -> None:
        self.executor = executor
        self.statements = statements

    async def _fetch(self, name: str, **values: object) -> list[Row]:
        statement = self.statements[name]
        return await db.fetch(self.executor, statement.sql, *statement.bind(values))

    async def _value(self, name: str, **values: object) -> Any:
        [(value,)] = await self._fetch(name, **values)
        return value

    async def _one(self, name: str, **values: object) -> Row | None:
        rows = await self._fetch(name, **values)
        return rows[0] if rows else None

    async def _row(self, name: str, **values: object) -> Row:
        row = await self._one(name, **values)
        assert row is not None  # noqa: S101 - an aggregate always returns one row
        return row

    # Reads the dispatcher's upkeep and the operator's commands both make.

    async def gauges(self, *, block_on_dead: bool) -> Row:
        return await self._row("gauges", block_on_dead=block_on_dead)

    async def schema_version(self) -> int:
        return int(await self._value("schema_version"))

    async def sweep(self, *, rows: int, hold_seconds: float) -> tuple[int, bool]:
        """The next `rows` ids of the anti-entropy sweep: (keys it registered pending rows for,
        whether it finished a pass over the table)."""
        row = await self._row("sweep", rows=rows, hold_seconds=hold_seconds)
        return int(row[0]), bool(row[1])

    async def id_cache(self) -> int:
        """The outbox identity's CACHE: ids a session draws at a time."""
        return int(await self._value("id_cache"))

    async def engine_drift(self) -> Row:
        """Pending rows no claim will look at: rows, keys, the first id."""
        return await self._row("engine_drift")

    async def cleanup_window(self, *, after: int, older_than_seconds: float, limit: int) -> Row:
        """One retention batch: the next `limit` rows by id after `after`."""
        return await self._row(
            "cleanup_window", after=after, older_than_seconds=older_than_seconds, limit=limit
        )

    # What `migrate` reads before it changes the schema (store/migrations.py).

    async def schema_version_before_steps(self) -> int:
        return int(await self._value("schema_version_before_steps"))

    async def live_older_dispatchers(self, *, seconds: float, version: int) -> int:
        return int(await self._value("live_older_dispatchers", seconds=seconds, version=version))

    async def dispatchers_live(self, *, live_seconds: float) -> list[Row]:
        return await self._fetch("dispatchers_live", live_seconds=live_seconds)

    async def relation_exists(self, *, relation: str) -> bool:
        return bool(await self._value("relation_exists", relation=relation))

    async def column_exists(self, *, relation: str, column: str) -> bool:
        return bool(await self._value("column_exists", relation=relation, column=column))

    async def schema_exists(self, *, schema_name: str) -> bool:
        return bool(await self._value("schema_exists", schema_name=schema_name))

    async def migration_lock(self, *, key: int) -> None:
        await self._fetch("migration_lock", key=key)

    async def migration_unlock(self, *, key: int) -> None:
        await self._fetch("migration_unlock", key=key)
