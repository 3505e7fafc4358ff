"""Statements that belong to a database rather than to one outbox table (the catalogue reads of
source discovery, the fleet's membership table): a .sql file of `-- name --` sections as
statements.py reads them, with the identifiers in braces filled once by validated, quoted names,
run by name with named parameters."""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import asyncpg

from outbox_dispatcher.store import db
from outbox_dispatcher.store.statements import Statement, compile_placeholders, parse


@functools.lru_cache(maxsize=16)
def load(file: str, **identifiers: str) -> dict[str, Statement]:
    """The statements of `file`, its braces filled with `identifiers` (already quoted)."""
    text = resources.files(__package__).joinpath(file).read_text("utf-8")
    return {
        name: compile_placeholders(name, sql.format_map(identifiers))
        for name, sql in parse(text).items()
    }


class NamedStore:
    """A file's statements over a connection or a pool, run by name."""

    def __init__(self, executor: asyncpg.Pool | db.Executor, statements: dict[str, Statement]):
        self.executor = executor
        self.statements = statements

    async def _fetch(self, name: str, **values: object) -> list[asyncpg.Record]:
        statement = self.statements[name]
        return await db.fetch(self.executor, statement.sql, *statement.bind(values))

    async def _value(self, name: str, **values: object) -> Any:
        [(value,)] = await self._fetch(name, **values)
        return value
