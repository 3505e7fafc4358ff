from __future__ import annotations

import ast
from pathlib import Path

import pytest

import outbox_dispatcher
from outbox_dispatcher.models import OutboxRecord
from outbox_dispatcher.sql import QUERIES, Queries, parse


def test_parse_splits_named_sections_and_drops_comments() -> None:
    text = "-- a --\n-- comment\nSELECT 1\n\n-- b --\nSELECT $1\n  -- trailing\n"
    assert parse(text) == {"a": "SELECT 1", "b": "SELECT $1"}


def test_parse_rejects_duplicates_and_empty_sections() -> None:
    with pytest.raises(ValueError, match="twice"):
        parse("-- a --\nSELECT 1\n-- a --\nSELECT 2\n")
    with pytest.raises(ValueError, match="empty"):
        parse("-- a --\n-- only a comment\n")


def test_every_query_is_a_field_and_is_rendered_with_quoted_names() -> None:
    queries = Queries.for_table("app", "events")
    assert set(QUERIES) == set(Queries.__dataclass_fields__)
    assert '"app"."events_claim_work"(' in queries.claim
    assert '"app"."events_settle_work"(' in queries.settle
    for sql in vars(queries).values():
        assert "{" not in sql, sql


def test_the_claim_selects_the_records_fields_in_order() -> None:
    """OutboxRecord is built from the claim's result row as it comes (positionally)."""
    select = QUERIES["claim"].split("FROM")[0].removeprefix("SELECT")
    assert [column.strip() for column in select.split(",")] == list(OutboxRecord._fields)


def test_names_are_validated_before_rendering() -> None:
    with pytest.raises(ValueError, match="not allowed"):
        Queries.for_table("public", "x; DROP TABLE y")


# Modules that may talk to the database directly besides the store: the executor helper, the
# migration runner (it applies schema/ files), the consumers' inbox library (its own table), and
# the listener (a keep-alive ping on its LISTEN connection).
MAY_EXECUTE = {"store.py", "db.py", "migrations.py", "inbox.py", "listener.py"}
EXECUTING = {"fetch", "fetchval", "fetchrow", "execute", "executemany", "cursor", "prepare"}


def test_only_the_store_runs_the_outbox_statements() -> None:
    """A change of the engine touches the store, the schema and their tests, not the package:
    no other module (claimer, settler, admin, status, console, ...) calls asyncpg's methods that
    run SQL."""
    package = Path(outbox_dispatcher.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if path.name in MAY_EXECUTE and path.parent == package:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and (node.func.attr in EXECUTING or node.func.attr.startswith("copy_"))
            ):
                offenders.append(f"{path.relative_to(package)}:{node.lineno} .{node.func.attr}()")
    assert offenders == []
