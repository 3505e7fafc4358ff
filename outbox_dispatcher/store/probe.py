"""The batched idle probe's statement (store/probe.sql): one statement for the served outboxes
of one database, their branches joined by UNION ALL, in chunks of at most CHUNK outboxes.

Built once per set of tables (the caller passes every served outbox of the database in a stable
order, so the statements change only when outboxes come or go) and run without parameters:
PostgreSQL plans a statement without parameters once per connection and caches the plan
(asyncpg prepares it), so a probe costs its execution only. A chunk bounds the planning and the
estimated cost: 500 branches in one statement were JIT-compiled, 4-5 s a probe
(docs/design/many-outboxes.md, "Idle cost")."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

from outbox_dispatcher.store import db
from outbox_dispatcher.store.statements import compile_placeholders, identifiers, parse

# Outboxes per statement: planned once per connection (about 64 ms), well below jit_above_cost.
CHUNK = 100


@dataclass(frozen=True)
class Found:
    """What the probe says about one outbox (only those with something are returned)."""

    index: int  # its place in the list probed
    expired: bool  # a lease expired: takeover and the reclaimer's duty
    work: bool  # a claim would find rows


@functools.cache
def _branch() -> str:
    text = resources.files(__package__).joinpath("probe.sql").read_text("utf-8")
    return parse(text)["branch"]


@functools.lru_cache(maxsize=256)
def probe_sql(tables: tuple[tuple[str, str], ...], first: int, takes_blocked: bool) -> str:
    """The statement for `tables` ((schema, table) pairs), numbering them from `first`."""
    branches = []
    for n, (schema, table) in enumerate(tables, start=first):
        names = identifiers(schema, table, table)
        names.update(n=str(n), takes_blocked="true" if takes_blocked else "false")
        branches.append(_branch().format_map(names))
    statement = compile_placeholders("idle_probe", "\nUNION ALL\n".join(branches))
    if statement.params:  # a plan cached per connection needs a statement without any
        msg = f"the idle probe takes no parameters, found {statement.params}"
        raise ValueError(msg)
    return statement.sql


def chunks(tables: Sequence[tuple[str, str]]) -> list[tuple[int, tuple[tuple[str, str], ...]]]:
    """The tables in CHUNK-sized slices, each with the index of its first table."""
    return [(i, tuple(tables[i : i + CHUNK])) for i in range(0, len(tables), CHUNK)]


async def probe(
    executor: db.Pool | db.Executor, tables: Sequence[tuple[str, str]], *, takes_blocked: bool
) -> list[Found]:
    """Which of `tables` have something to do, a statement per chunk."""
    found: list[Found] = []
    for first, chunk in chunks(tables):
        sql = probe_sql(chunk, first, takes_blocked)
        rows = await db.fetch(executor, sql)
        found.extend(Found(int(r["outbox"]), bool(r["expired"]), bool(r["work"])) for r in rows)
    return found
