from __future__ import annotations

import pytest

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
    assert '"app"."events_claim_keys"(' in queries.claim
    assert '"app"."events_settle"(' in queries.settle
    for sql in vars(queries).values():
        assert "{" not in sql, sql


def test_names_are_validated_before_rendering() -> None:
    with pytest.raises(ValueError, match="not allowed"):
        Queries.for_table("public", "x; DROP TABLE y")
