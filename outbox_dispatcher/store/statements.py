"""Every runtime SQL statement, parsed once at import from the store's .sql files, each bound by
name.

A file holds `-- name --` sections. Values are named placeholders (`$token`, `$ids`), turned
into asyncpg's `$1..$n` once here; `Statement.bind` takes the values by name and refuses a
missing or an extra one, so no caller ever counts positions. Identifiers come in braces and are
filled once per table by `for_table` with validated, quoted names, so no name is ever pasted
into SQL later. A section whose name starts with `_` is a fragment, not a statement: statements
include it as `{_name}` (the dead-row filter is written once for every statement that reads or
changes dead rows), and its placeholders become the statement's.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources

from outbox_dispatcher.config.names import quote_identifier, validate_identifier

_HEADER = re.compile(r"^-- ([a-z_]+) --$", re.MULTILINE)
# `$name`, not the `$$` of a DO block's body.
_PLACEHOLDER = re.compile(r"(?<!\$)\$([a-z_][a-z0-9_]*)")
FILES = ("dispatch.sql", "operator.sql", "inbox.sql", "migrate.sql")


class BindError(TypeError):
    """A statement was given other values than it names: a programming error, not input."""


@dataclass(frozen=True)
class Statement:
    """One statement for one table: asyncpg's SQL and the names of its `$1..$n`, in order."""

    name: str
    sql: str
    params: tuple[str, ...]

    def bind(self, values: Mapping[str, object]) -> tuple[object, ...]:
        """The values in the statement's order; refuses a missing or an extra name."""
        missing = [name for name in self.params if name not in values]
        extra = sorted(set(values) - set(self.params))
        if missing or extra:
            msg = f"statement {self.name!r}: missing {missing}, unexpected {extra}"
            raise BindError(msg)
        return tuple(values[name] for name in self.params)


def parse(text: str) -> dict[str, str]:
    """Split a file of `-- name --` sections into {name: statement}, comments dropped."""
    parts = _HEADER.split(text)
    sections: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        statement = "\n".join(lines).strip()
        if not statement:
            msg = f"statement {name!r} is empty"
            raise ValueError(msg)
        if name in sections:
            msg = f"statement {name!r} is defined twice"
            raise ValueError(msg)
        sections[name] = statement
    return sections


def compile_placeholders(name: str, sql: str) -> Statement:
    """Number the named placeholders by first appearance: `$token ... $token` is `$1 ... $1`."""
    order: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in order:
            order.append(match.group(1))
        return f"${order.index(match.group(1)) + 1}"

    return Statement(name, _PLACEHOLDER.sub(number, sql), tuple(order))


def _read_all() -> dict[str, str]:
    sections: dict[str, str] = {}
    for file in FILES:
        for name, sql in parse(
            resources.files(__package__).joinpath(file).read_text("utf-8")
        ).items():
            if name in sections:
                msg = f"statement {name!r} is defined in two files"
                raise ValueError(msg)
            sections[name] = sql
    return sections


_SECTIONS = _read_all()
NAMES = frozenset(name for name in _SECTIONS if not name.startswith("_"))


def identifiers(schema: str, table: str, inbox: str) -> dict[str, str]:
    """The quoted names the statements' braces stand for, for one outbox table."""
    validate_identifier(schema, "schema")
    validate_identifier(table, "table")
    validate_identifier(inbox, "inbox table")

    def qualified(name: str) -> str:
        return f"{quote_identifier(schema)}.{quote_identifier(name)}"

    names = {"schema": quote_identifier(schema), "table": qualified(table)}
    names["inbox"] = qualified(inbox)
    for brace, suffix in _TABLE_SUFFIXES.items():
        names[brace] = qualified(f"{table}_{suffix}")
    return names


_TABLE_SUFFIXES = {
    "version_table": "schema_version",
    "steps_table": "schema_steps",
    "claim_fn": "claim_work",
    "settle_fn": "settle_work",
    "settle_late_fn": "settle_late",
    "extend_fn": "extend_work",
    "release_fn": "release_work",
    "reclaim_fn": "reclaim_work",
    "sweep_fn": "sweep",
    "running_fn": "running",
    "work": "work",
    "cursor": "cursor",
    "leases": "leases",
    "changed": "changed",
    "waiting": "waiting",
    "paused": "paused",
    "audit": "operator_audit",
    "dispatchers": "dispatchers",
    "clock": "clock",
    "since_fn": "pending_since",
    "sessions": "console_session",
}


class Statements(Mapping[str, Statement]):
    """The statements for one outbox table, by name, with its identifiers filled in. Each is
    compiled at its first use: a process serving 500 outboxes rendered all of every table's 90-odd
    statements when it served them (2.8 ms an outbox, twice: the registry's version read and the
    outbox's store), seconds of its start-up, for the dozen an outbox runs."""

    def __init__(self, names: dict[str, str]) -> None:
        self._names = names  # its identifiers and fragments, what the braces stand for
        self._statements: dict[str, Statement] = {}

    @classmethod
    def for_table(cls, schema: str, table: str, inbox: str = "inbox") -> Statements:
        """Made once per table and process (every operator request asks again)."""
        return _rendered(cls, schema, table, inbox)

    @classmethod
    def render(cls, schema: str, table: str, inbox: str) -> Statements:
        names = identifiers(schema, table, inbox)
        for name, sql in _SECTIONS.items():  # in file order: a fragment may use earlier ones
            if name.startswith("_"):
                names[name] = sql.format_map(names)
        return cls(names)

    def __getitem__(self, name: str) -> Statement:
        statement = self._statements.get(name)
        if statement is None:
            if name not in NAMES:
                raise KeyError(name)
            statement = compile_placeholders(name, _SECTIONS[name].format_map(self._names))
            self._statements[name] = statement
        return statement

    def __iter__(self) -> Iterator[str]:
        return iter(_SORTED_NAMES)

    def __len__(self) -> int:
        return len(NAMES)


_SORTED_NAMES = tuple(sorted(NAMES))


# As many tables as a fleet serves (OUTBOX_SOURCES): each served outbox renders its table's
# statements for its runtime and again for its schema version's read (store/migrations.py);
# with 64, 500 outboxes rendered every table twice while serving.
@functools.lru_cache(maxsize=1024)
def _rendered(cls: type[Statements], schema: str, table: str, inbox: str) -> Statements:
    return cls.render(schema, table, inbox)
