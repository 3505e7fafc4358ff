from __future__ import annotations

import ast
import inspect
import re
import typing
from pathlib import Path
from typing import Any

import pytest

import outbox_dispatcher
from outbox_dispatcher.models import OutboxRecord
from outbox_dispatcher.operate.filters import Filters
from outbox_dispatcher.operate.listings import AuditQuery, RowsQuery
from outbox_dispatcher.store import DispatchStore, OperatorStore, Statements, StoreBase
from outbox_dispatcher.store.statements import NAMES, BindError, compile_placeholders, parse

STATEMENTS = Statements.for_table("app", "events")


def test_parse_splits_named_sections_and_drops_comments() -> None:
    text = "-- a --\n-- comment\nSELECT 1\n\n-- b --\nSELECT $x\n  -- trailing\n"
    assert parse(text) == {"a": "SELECT 1", "b": "SELECT $x"}


def test_parse_rejects_duplicates_and_empty_sections() -> None:
    with pytest.raises(ValueError, match="twice"):
        parse("-- a --\nSELECT 1\n-- a --\nSELECT 2\n")
    with pytest.raises(ValueError, match="empty"):
        parse("-- a --\n-- only a comment\n")


def test_named_placeholders_are_numbered_by_first_appearance() -> None:
    statement = compile_placeholders("s", "SELECT $b, $a::int, $b IS NULL, $$ $body $$")
    assert statement.sql == "SELECT $1, $2::int, $1 IS NULL, $$ $3 $$"
    assert statement.params == ("b", "a", "body")
    assert statement.bind({"a": 1, "b": 2, "body": 3}) == (2, 1, 3)
    assert compile_placeholders("d", "DO $$ BEGIN NULL; END $$").params == ()


def test_a_missing_or_an_extra_value_is_refused() -> None:
    statement = compile_placeholders("s", "SELECT $a, $b")
    with pytest.raises(BindError, match=r"missing \['b'\], unexpected \[\]"):
        statement.bind({"a": 1})
    with pytest.raises(BindError, match=r"unexpected \['c'\]"):
        statement.bind({"a": 1, "b": 2, "c": 3})


def test_every_statement_is_rendered_with_quoted_names_and_numbered_values() -> None:
    assert set(STATEMENTS) == NAMES
    assert '"app"."events_claim_work"(' in STATEMENTS["claim"].sql
    assert '"app"."events_settle_work"(' in STATEMENTS["settle"].sql
    for statement in STATEMENTS.values():
        assert "{" not in statement.sql, statement.name
        assert len(set(statement.params)) == len(statement.params)


def test_the_claim_selects_the_records_fields_in_order() -> None:
    """OutboxRecord is built from the claim's result row as it comes (positionally)."""
    sql = STATEMENTS["claim"].sql
    select = sql.split('FROM "app"."events_claim_work"')[0].strip().removeprefix("SELECT")
    columns = re.split(r",(?![^()]*\))", select)  # top-level commas only
    names = [re.split(r"[\s.]", column.strip())[-1] for column in columns]
    assert names == list(OutboxRecord._fields)


def test_names_are_validated_before_rendering() -> None:
    with pytest.raises(ValueError, match="not allowed"):
        Statements.for_table("public", "x; DROP TABLE y")


def test_the_filters_name_what_their_fragments_name() -> None:
    """The dead-row, replay, rows and audit filters travel by name: each names exactly the
    placeholders its statements read besides their own (a filter field with no placeholder, or
    the reverse, would be refused at bind time, in production)."""
    own = {"dead_count": set(), "replay_count": set(), "audit_list": {"lock", "limit"}}
    own["rows_window"] = {"before", "window", "limit"}
    assert set(STATEMENTS["dead_count"].params) == set(Filters().dead_values())
    assert set(STATEMENTS["replay_count"].params) == set(Filters().replay_values())
    assert set(STATEMENTS["rows_window"].params) - own["rows_window"] == set(RowsQuery().values())
    assert set(STATEMENTS["audit_list"].params) - own["audit_list"] == set(AuditQuery().values())


class ReachedError(Exception):
    """What the recording executor raises once it saw the statement a method runs."""


class RecordingExecutor:
    def __init__(self) -> None:
        self.runs: list[tuple[str, tuple[object, ...]]] = []

    async def fetch(self, sql: str, *args: object) -> list[Any]:
        self.runs.append((sql, args))
        raise ReachedError


# Methods whose keywords are not their statement's names one to one, and the values to call
# them with (each value a one-element list naming the placeholder it must reach).
def _filters(statement: str, own: set[str]) -> dict[str, object]:
    return {name: [name] for name in STATEMENTS[statement].params if name not in own}


SPECIAL: dict[str, list[dict[str, object]]] = {
    "dead_page": [
        {
            "order": order,
            "filters": _filters("dead_count", set()),
            "cursor": [[name] for name in cursor],
            "limit": ["limit"],
        }
        for order, cursor in [
            ("id", ["after_id"]),
            ("-id", ["after_id"]),
            ("dead_at", ["after_dead_at", "after_id"]),
            ("-dead_at", ["after_dead_at", "after_id"]),
        ]
    ],
    "dispatcher_beat": [
        {"owner": ["owner"], "dead_letter_policy": ["dead_letter_policy"], "version": ["version"]},
        {
            "owner": ["owner"],
            "dead_letter_policy": ["dead_letter_policy"],
            "version": ["version"],
            "totals": (["published"], ["dead"]),
        },
        {
            "owner": ["owner"],
            "dead_letter_policy": ["dead_letter_policy"],
            "version": ["version"],
            "totals": (["published"], ["dead"]),
            "delivery": ["delivery"],
        },
    ],
}


def _calls(name: str, method: Any) -> list[dict[str, object]]:
    if name in SPECIAL:
        return SPECIAL[name]
    keywords: dict[str, object] = {}
    for parameter in inspect.signature(method).parameters.values():
        if parameter.name == "filters":
            own = set(inspect.signature(method).parameters) - {"self", "filters"}
            statement = "dead_count" if name.startswith("dead_") else name
            statement = "replay_count" if name.startswith("replay_") else statement
            keywords["filters"] = _filters(statement if statement in STATEMENTS else name, own)
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:  # **arguments: Unpack[...]
            (typed,) = typing.get_args(typing.get_type_hints(method)[parameter.name])
            keywords |= {key: [key] for key in typed.__annotations__}
        elif parameter.name != "self":
            keywords[parameter.name] = [parameter.name]
    return [keywords]


async def test_each_store_method_binds_its_keywords_to_the_placeholders_of_the_same_name() -> None:
    """Every statement is run by a store method (besides the inbox's, which inbox.py runs), and
    each value reaches the placeholder named like the keyword it was given as."""
    by_sql = {statement.sql: statement for statement in STATEMENTS.values()}
    reached: set[str] = set()
    for cls in (StoreBase, DispatchStore, OperatorStore):
        executor = RecordingExecutor()
        store = cls(executor, STATEMENTS)  # type: ignore[arg-type]
        for name, method in inspect.getmembers(store, inspect.iscoroutinefunction):
            if name.startswith("_"):
                continue
            for keywords in _calls(name, method):
                with pytest.raises(ReachedError):
                    await method(**keywords)
                sql, args = executor.runs.pop()
                statement = by_sql[sql]
                assert [list(arg) for arg in args] == [[p] for p in statement.params], name  # type: ignore[call-overload]
                reached.add(statement.name)
    # The steady path (schema version 16): claim and settle try their one statement first.
    executor = RecordingExecutor()
    steady = DispatchStore(executor, STATEMENTS, steady=True)  # type: ignore[arg-type]
    for name in ("claim", "settle"):
        method = getattr(steady, name)
        (keywords,) = _calls(name, method)
        if name == "settle":  # only a batch published whole, without delete-on-publish
            keywords |= {"outcomes": ["published"], "delete_published": False}
        with pytest.raises(ReachedError):
            await method(**keywords)
        sql, args = executor.runs.pop()
        statement = by_sql[sql]
        assert statement.name == f"{name}_steady"
        assert [list(arg) for arg in args] == [[p] for p in statement.params], name  # type: ignore[call-overload]
        reached.add(statement.name)
    # Below version 12 (no replays column): the claim without it.
    executor = RecordingExecutor()
    older = DispatchStore(executor, STATEMENTS, replays=False)  # type: ignore[arg-type]
    (keywords,) = _calls("claim", older.claim)
    with pytest.raises(ReachedError):
        await older.claim(**keywords)
    sql, args = executor.runs.pop()
    assert by_sql[sql].name == "claim_without_replays"
    assert [list(arg) for arg in args] == [[p] for p in by_sql[sql].params]  # type: ignore[call-overload]
    reached.add("claim_without_replays")
    assert NAMES - reached == {"inbox_record"}


# Modules that may talk to the database directly besides the store/ folder (which holds the
# executor helper, the migration runner and the LISTEN connection): the consumers' inbox library
# (its own table).
MAY_EXECUTE = {"inbox.py"}
EXECUTING = {"fetch", "fetchval", "fetchrow", "execute", "executemany", "cursor", "prepare"}


def test_only_the_store_runs_the_outbox_statements() -> None:
    """A change of the engine touches the store, the schema and their tests, not the package:
    no other module (claimer, settler, operate, console, ...) calls asyncpg's methods that run
    SQL."""
    package = Path(outbox_dispatcher.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if (path.name in MAY_EXECUTE and path.parent == package) or path.parent.name == "store":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and (node.func.attr in EXECUTING or node.func.attr.startswith("copy_"))
            ):
                offenders.append(f"{path.relative_to(package)}:{node.lineno} .{node.func.attr}()")
    assert offenders == []


def test_a_fleets_tables_are_rendered_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet's outbox asks for its table's statements for its runtime and again for its
    schema version's read: 500 tables are rendered 500 times, not twice each."""
    from outbox_dispatcher.store import statements

    real, rendered = Statements.render.__func__, []  # type: ignore[attr-defined]

    def counting(cls: type[Statements], schema: str, table: str, inbox: str) -> Statements:
        rendered.append(schema)
        return real(cls, schema, table, inbox)  # type: ignore[no-any-return]

    monkeypatch.setattr(Statements, "render", classmethod(counting))
    statements._rendered.cache_clear()
    try:
        for _ in range(2):
            for i in range(500):
                Statements.for_table(f"tenant_{i:04d}", "outbox")
    finally:
        statements._rendered.cache_clear()
    assert len(rendered) == 500
