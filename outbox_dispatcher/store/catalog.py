"""What a database holds for the sources (store/catalog.sql): the outbox tables a registry
serves, the schemas `migrate` expands patterns against."""

from __future__ import annotations

from outbox_dispatcher.store import db
from outbox_dispatcher.store.named import NamedStore, load


class CatalogStore(NamedStore):
    """Catalogue reads of one database, over one connection."""

    def __init__(self, executor: db.Executor) -> None:
        super().__init__(executor, load("catalog.sql"))

    async def outbox_tables(self, tables: list[str]) -> set[tuple[str, str]]:
        """(schema, table) of every table named in `tables` with its schema steps beside it."""
        rows = await self._fetch("outbox_tables", tables=tables)
        return {(row["schema_name"], row["table_name"]) for row in rows}

    async def fingerprint(self, tables: list[str]) -> tuple[int, int]:
        """What changes when an outbox table named in `tables`, or its schema steps, is created
        or dropped in any schema (catalog.sql `outbox_tables_fingerprint`)."""
        names = [*tables, *(f"{t}_schema_steps" for t in tables)]
        [row] = await self._fetch("outbox_tables_fingerprint", names=names)
        return int(row["relations"]), int(row["namespaces"])

    async def schemas(self) -> list[str]:
        return [row["nspname"] for row in await self._fetch("schemas")]

    async def migration_running(self, key: int) -> bool:
        """Whether `migrate` holds the advisory lock `key` (migrations.lock_key) right now."""
        return bool(await self._value("migration_running", key=key))
