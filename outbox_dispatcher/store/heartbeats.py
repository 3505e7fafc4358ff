"""The registry heartbeat of many outboxes of one database as one statement per chunk
(store/heartbeats.sql): a writable CTE per outbox, the values shared but each outbox's counters
(arrays, by its place in the chunk). Each outbox's own heartbeat statement is its own prepared
statement: 250 outboxes beating every 30 s were prepared again at each beat (a connection's
cache of 100 statements never holds them), which cost the database more than running them.
Built once per set of tables, so it is prepared once on the idle probe's connection
(store/probe.py `Session`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import resources

from outbox_dispatcher.store.probe import CHUNK, Session
from outbox_dispatcher.store.statements import Statement, compile_placeholders, identifiers, parse

KEPT = "heartbeats"  # their statements' group on the session


@functools.cache
def _beat() -> str:
    text = resources.files(__package__).joinpath("heartbeats.sql").read_text("utf-8")
    return parse(text)["beat"]


@functools.lru_cache(maxsize=256)
def beat_statement(tables: tuple[tuple[str, str], ...]) -> Statement:
    """The heartbeat of `tables` ((schema, table) pairs) in one statement."""
    ctes = []
    for n, (schema, table) in enumerate(tables, start=1):
        names = identifiers(schema, table, table)
        names["n"] = str(n)
        ctes.append(_beat().format_map(names))
    return compile_placeholders("heartbeats", "WITH " + ",\n".join(ctes) + "\nSELECT 1")


async def beat(
    session: Session,
    tables: Sequence[tuple[str, str]],
    totals: Sequence[tuple[int, int]],
    *,
    owner: str,
    dead_letter_policy: str,
    version: int,
    delivery: str,
) -> None:
    """Beat for `tables` (schema version 14 or later), each with its (published, dead-lettered)
    totals, a statement per CHUNK of them."""
    for first in range(0, len(tables), CHUNK):
        chunk = tuple(tables[first : first + CHUNK])
        counted = totals[first : first + CHUNK]
        statement = beat_statement(chunk)
        values = {
            "owner": owner,
            "dead_letter_policy": dead_letter_policy,
            "version": version,
            "delivery": delivery,
            "published": [p for p, _ in counted],
            "dead": [d for _, d in counted],
        }
        await session.fetch(statement.sql, *statement.bind(values), keep=KEPT)


def statements_of(tables: Sequence[tuple[str, str]]) -> set[str]:
    """The statements `beat` runs for `tables`."""
    return {
        beat_statement(tuple(tables[first : first + CHUNK])).sql
        for first in range(0, len(tables), CHUNK)
    }
