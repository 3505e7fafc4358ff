"""OUTBOX_SOURCES (issue 36): parsed, checked as a whole, expanded against a database's schemas;
every refusal names where and what, and never shows a database URL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from outbox_dispatcher import errors
from outbox_dispatcher.config.names import common_name, database_of, schema_matches
from outbox_dispatcher.config.outboxes import (
    LABEL_MAX,
    Outbox,
    Source,
    bounded,
    expand,
    sources_of,
)
from outbox_dispatcher.config.settings import Settings

DEFAULT_URL = "postgresql://outbox:hunter2@db0:5432/app"
SETTINGS = Settings(database_url=DEFAULT_URL, db_schema="events", table="outbox_x")


def parsed(items: Any) -> tuple[Source, ...]:
    return sources_of(SETTINGS, {"OUTBOX_SOURCES": json.dumps(items)})


def refused(text: str) -> str:
    with pytest.raises(errors.ConfigurationError) as raised:
        sources_of(SETTINGS, {"OUTBOX_SOURCES": text})
    return str(raised.value)


# --- where the list comes from ----------------------------------------------------------------


def test_without_outbox_sources_the_single_table_settings_are_the_one_source() -> None:
    (source,) = sources_of(SETTINGS, {})
    assert (source.schema, source.table, source.weight, source.name) == (
        "events",
        "outbox_x",
        1,
        None,
    )
    assert source.database_url.get_secret_value() == DEFAULT_URL
    assert source.label == "events.outbox_x"


def test_an_item_takes_the_defaults_it_does_not_name() -> None:
    a, b = parsed(
        [
            {"schema": "tenant_*"},
            {
                "schema": "billing",
                "table": "events",
                "name": "bill",
                "weight": 3,
                "database_url": "postgresql://u:pw@db1/billing",
            },
        ]
    )
    assert (a.schema, a.table, a.weight, a.name) == ("tenant_*", "outbox", 1, None)
    assert a.database_url.get_secret_value() == DEFAULT_URL  # OUTBOX_DATABASE_URL
    assert a.is_pattern and not b.is_pattern
    assert (b.table, b.weight, b.name, b.database) == ("events", 3, "bill", "db1:5432/billing")


def test_the_list_is_read_from_outbox_sources_file_and_the_secrets_dir(tmp_path: Path) -> None:
    file = tmp_path / "sources.json"
    file.write_text('[{"schema": "from_file"}]\n')
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "outbox_sources").write_text('[{"schema": "from_dir"}]')
    env = {"OUTBOX_SOURCES_FILE": str(file), "OUTBOX_SECRETS_DIR": str(secrets)}
    assert sources_of(SETTINGS, env)[0].schema == "from_file"
    assert sources_of(SETTINGS, {"OUTBOX_SECRETS_DIR": str(secrets)})[0].schema == "from_dir"
    # The variable itself wins over its file, as for every setting.
    env["OUTBOX_SOURCES"] = '[{"schema": "from_env"}]'
    assert sources_of(SETTINGS, env)[0].schema == "from_env"


def test_an_unreadable_file_names_its_variable_and_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(errors.ConfigurationError, match="cannot read OUTBOX_SOURCES_FILE="):
        sources_of(SETTINGS, {"OUTBOX_SOURCES_FILE": str(missing)})


# --- the list and its items -------------------------------------------------------------------


def test_invalid_json_says_where_without_quoting_the_text(tmp_path: Path) -> None:
    text = '[{"schema": "a", "database_url": "postgresql://u:hunter2@h/d"}\n  {"schema": "b"}]'
    message = refused(text)
    assert message.startswith("OUTBOX_SOURCES is not valid JSON")
    assert "line 2, column 3" in message and "expected a list of sources such as" in message
    assert "hunter2" not in message
    file = tmp_path / "sources.json"
    file.write_text(text)
    with pytest.raises(errors.ConfigurationError) as raised:
        sources_of(SETTINGS, {"OUTBOX_SOURCES_FILE": str(file)})
    assert f"the file of OUTBOX_SOURCES_FILE={file} is not valid JSON" in str(raised.value)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{}", "OUTBOX_SOURCES is an object: expected a list of one or more sources"),
        ("[]", "OUTBOX_SOURCES is an empty list: expected a list of one or more sources"),
        ('"x"', "OUTBOX_SOURCES is a string: expected a list"),
        ('[{"schema": "a"}, 7]', "OUTBOX_SOURCES item 2 is a number: expected an object with keys"),
        ("[null]", "OUTBOX_SOURCES item 1 is null: expected an object"),
    ],
)
def test_the_shape_of_the_list_is_checked(text: str, expected: str) -> None:
    assert expected in refused(text)


def test_an_unknown_key_is_named_with_the_valid_ones() -> None:
    message = refused('[{"schema": "a"}, {"schema": "b", "tabel": "x"}]')
    assert message == (
        "OUTBOX_SOURCES item 2: unknown key 'tabel': the keys are database_url, schema, table, "
        "name, weight"
    )
    assert "unknown key 'db_schema'" in refused('[{"db_schema": "a", "schema": "a"}]')


def test_a_missing_schema_is_named() -> None:
    assert refused('[{"table": "x"}]') == (
        "OUTBOX_SOURCES item 1: schema is required (a schema name, or a pattern like tenant_*)"
    )


@pytest.mark.parametrize("pattern", ["tenant_*", "*", "*_eu", "t*_*x", "_*"])
def test_valid_patterns_are_accepted(pattern: str) -> None:
    assert parsed([{"schema": pattern}])[0].schema == pattern


@pytest.mark.parametrize(
    "pattern", ["1*", "Tenant_*", "ten-ant_*", "tenant.*", "*;drop", "a" * 41 + "*"]
)
def test_a_pattern_that_is_no_identifier_once_its_stars_are_filled_is_refused(pattern: str) -> None:
    message = refused(json.dumps([{"schema": pattern}]))
    assert message.startswith("OUTBOX_SOURCES item 1: schema pattern")
    assert "is not allowed: apart from '*'" in message


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ({"schema": "Public"}, "schema 'Public' is not allowed: use 1-40 characters"),
        ({"schema": "pg_catalog"}, "schema 'pg_catalog' is a system schema"),
        ({"schema": "information_schema"}, "is a system schema"),
        ({"schema": "pg_*"}, "schema 'pg_*' is a system schema (or only matches them)"),
        ({"schema": "a", "table": "x;y"}, "1: table 'x;y' is not allowed"),
        ({"schema": "a", "table": "*"}, "1: table '*' is not allowed"),
        ({"schema": "a", "name": "a.b"}, "name: 'a.b' is not allowed: use 1-40 lowercase"),
        ({"schema": "a", "name": "other"}, "name: 'other' is reserved (the `source` label"),
        ({"schema": "a", "weight": 0}, "weight must be a whole number from 1 to 100"),
        ({"schema": "a", "weight": 101}, "weight must be a whole number from 1 to 100"),
        ({"schema": "a", "weight": "2"}, "weight must be a whole number"),
        ({"schema": "a", "weight": 1.5}, "weight must be a whole number"),
        ({"schema": "a", "weight": True}, "weight must be a whole number"),
    ],
)
def test_each_field_is_checked_and_named(item: dict[str, Any], expected: str) -> None:
    message = refused(json.dumps([item]))
    assert message.startswith("OUTBOX_SOURCES item 1: ")
    assert expected in message


# --- secrets --------------------------------------------------------------------------------


def test_a_bad_database_url_is_refused_without_showing_it() -> None:
    url = "postgresql://u:hun/ter2@h/d"
    message = refused(json.dumps([{"schema": "a", "database_url": url}]))
    assert message.startswith("OUTBOX_SOURCES item 1: database_url: not a usable PostgreSQL URL")
    assert "percent-encode" in message
    assert "hun" not in message and "ter2" not in message


def test_a_url_under_another_key_is_not_shown_either() -> None:
    message = refused('[{"schema": "postgresql://u:hunter2@h/d"}]')
    assert "schema (a URL) is not allowed" in message
    assert "hunter2" not in message


def test_sources_never_show_their_database_url() -> None:
    sources = parsed([{"schema": "a", "database_url": "postgresql://u:hunter2@db1/x", "name": "n"}])
    outbox = expand(sources, "db1:5432/x", ["a"])[0]
    shown = repr(sources) + repr(outbox) + outbox.label + sources[0].label + outbox.database
    assert "hunter2" not in shown and "u:" not in shown


# --- sources together -------------------------------------------------------------------------


def test_names_are_unique() -> None:
    message = refused(
        '[{"schema": "a", "name": "x"}, {"schema": "b"}, {"schema": "c", "name": "x"}]'
    )
    assert message == (
        "OUTBOX_SOURCES item 1 (x) and OUTBOX_SOURCES item 3 (x) are both named 'x': rename one "
        "of them"
    )


@pytest.mark.parametrize(
    ("first", "second", "shared"),
    [
        ("billing", "billing", "billing"),  # literal and literal
        ("tenant_*", "tenant_eu", "tenant_eu"),  # pattern and literal
        ("tenant_eu", "tenant_*", "tenant_eu"),
        ("tenant_*", "*_eu", "tenant_eu"),  # pattern and pattern
        ("*", "a*", "a"),
        ("t*_1", "*1", "t_1"),
    ],
)
def test_two_sources_that_can_serve_one_table_of_one_database_are_refused(
    first: str, second: str, shared: str
) -> None:
    message = refused(json.dumps([{"schema": first}, {"schema": second}]))
    assert message == (
        f"OUTBOX_SOURCES item 1 and OUTBOX_SOURCES item 2 can both serve {shared}.outbox in "
        "database db0:5432/app: a table is served by one source; narrow a pattern or remove "
        "one of them"
    )


def test_one_database_is_recognised_under_another_user_host_case_or_host_order() -> None:
    items = [
        {"schema": "a", "database_url": "postgresql://alice:pw1@H1:5432,h2/app"},
        {"schema": "a", "database_url": "postgresql://bob:pw2@h2:5432,h1/app?sslmode=require"},
    ]
    message = refused(json.dumps(items))
    assert "can both serve a.outbox in database h1:5432,h2:5432/app" in message
    assert "pw1" not in message and "pw2" not in message and "alice" not in message


@pytest.mark.parametrize(
    "items",
    [
        [{"schema": "tenant_*"}, {"schema": "tenant_*", "table": "events"}],  # other tables
        [{"schema": "tenant_*"}, {"schema": "billing"}],
        [{"schema": "a*"}, {"schema": "b*"}],
        [{"schema": "*_eu"}, {"schema": "*_us"}],
        [
            {"schema": "tenant_*", "name": "one"},
            {"schema": "tenant_*", "name": "two", "database_url": "postgresql://u@db9/other"},
        ],  # named: their labels differ
    ],
)
def test_sources_that_cannot_meet_are_accepted(items: list[dict[str, Any]]) -> None:
    assert len(parsed(items)) == 2


def test_unnamed_sources_of_two_databases_that_can_share_a_table_name_need_a_name() -> None:
    items: list[dict[str, Any]] = [
        {"schema": "public"},
        {"schema": "p*", "database_url": "postgresql://u:pw@db9/other"},
    ]
    message = refused(json.dumps(items))
    assert message == (
        "OUTBOX_SOURCES item 1 and OUTBOX_SOURCES item 2 can both serve a table public.outbox (in "
        "databases db0:5432/app and db9:5432/other) and the `source` label of metrics and the "
        "console would not tell them apart: give one of them a name"
    )
    items[1]["name"] = "shard2"
    assert [s.label for s in parsed(items)] == ["public.outbox", "shard2"]


@pytest.mark.parametrize(
    ("p", "q", "expected"),
    [
        ("a", "a", "a"),
        ("a", "b", None),
        ("tenant_*", "tenant_eu", "tenant_eu"),
        ("tenant_*", "*_eu", "tenant_eu"),
        ("a*", "b*", None),
        ("*x", "*y", None),
        ("*1", "*1", "x1"),  # no identifier begins with a digit: the star takes a letter
        ("*", "*", "x"),
        ("a*b*c", "*b*", "abc"),
        ("a" * 30 + "*", "*" + "b" * 30, None),  # only names longer than 40 characters
    ],
)
def test_common_name_decides_every_pair_of_patterns(p: str, q: str, expected: str | None) -> None:
    assert common_name(p, q) == expected
    assert common_name(q, p) == expected
    if expected is not None:
        assert schema_matches(p, expected) and schema_matches(q, expected)


# --- labels and databases -----------------------------------------------------------------------


def test_labels_are_the_name_or_schema_table_and_bounded() -> None:
    named, plain, pattern = parsed(
        [
            {"schema": "billing", "name": "bill"},
            {"schema": "orders", "table": "events"},
            {"schema": "tenant_*", "name": "tenants"},
        ]
    )
    assert [named.label, plain.label, pattern.label] == ["bill", "orders.events", "tenants"]
    assert Outbox(pattern, "tenant_7").label == "tenants/tenant_7"
    assert Outbox(plain, "orders").label == "orders.events"
    long_a, long_b = "s" * 40 + "." + "a" * 40, "s" * 40 + "." + "b" * 40
    assert len(bounded(long_a)) == LABEL_MAX and bounded(long_a) != bounded(long_b)
    assert bounded(long_a).startswith("s" * 40) and bounded("short") == "short"
    unnamed = Source(SETTINGS.database_url, "s" * 40, "t" * 40)
    assert len(Outbox(unnamed, "s" * 40).label) == LABEL_MAX


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://u:pw@db1/app", "db1:5432/app"),
        ("postgres://u:pw@DB1:6432/app?sslmode=require&password=x", "db1:6432/app"),
        ("postgresql://u:pw@h2,h1:5433/app", "h1:5433,h2:5432/app"),
        ("postgresql://u@[::1]:5433/x", "[::1]:5433/x"),
        ("postgresql://u@[::1]", "[::1]:5432/u"),
        ("postgresql:///app?host=/run/postgresql&port=5433", "/run/postgresql:5433/app"),
        ("postgresql://alice@h?dbname=d", "h:5432/d"),
    ],
)
def test_database_of_names_a_database_without_credentials(url: str, expected: str) -> None:
    assert database_of(url) == expected


def test_database_of_parses_each_url_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every served outbox's key and every pass over a fleet's outboxes ask for its database:
    the URL is parsed once, not at each ask (220k parses in a 500-outbox fleet's first 90 s)."""
    import urllib.parse

    real, parsed = urllib.parse.urlsplit, []

    def counting(url: str, *args: Any, **kwargs: Any) -> Any:
        parsed.append(url)
        return real(url, *args, **kwargs)

    monkeypatch.setattr(urllib.parse, "urlsplit", counting)
    url = "postgresql://u:pw@fleet-db-cached:5433/app"
    assert {database_of(url) for _ in range(1000)} == {"fleet-db-cached:5433/app"}
    assert parsed.count(url) <= 1, len(parsed)


# --- expansion ----------------------------------------------------------------------------------


def test_patterns_expand_to_the_existing_schemas_in_a_deterministic_order() -> None:
    sources = parsed(
        [
            {"schema": "tenant_*", "weight": 2},
            {"schema": "billing", "name": "bill"},
            {"schema": "audit"},  # literal: served even if not listed (its failure is reported)
            {"schema": "tenant_*", "database_url": "postgresql://u@db9/other", "name": "far"},
        ]
    )
    listed = ["tenant_b", "public", "tenant_a", "billing", "tenant_a", "Tenant_c", "tenant_"]
    found = expand(sources, "db0:5432/app", listed)
    assert [(o.schema, o.table, o.label, o.source.weight) for o in found] == [
        ("tenant_", "outbox", "tenant_.outbox", 2),
        ("tenant_a", "outbox", "tenant_a.outbox", 2),
        ("tenant_b", "outbox", "tenant_b.outbox", 2),
        ("billing", "outbox", "bill", 1),
        ("audit", "outbox", "audit.outbox", 1),
    ]
    assert expand(sources, "db0:5432/app", reversed(listed)) == found
    assert [o.label for o in expand(sources, "db9:5432/other", listed)] == [
        "far/tenant_",
        "far/tenant_a",
        "far/tenant_b",
    ]
    assert expand(sources, "db7:5432/none", listed) == []


def test_expansion_skips_system_schemas_and_serves_each_table_once() -> None:
    everything = Source(SETTINGS.database_url, "*", "outbox")
    tenant = Source(SETTINGS.database_url, "tenant_a", "outbox")  # overlaps: never parsed so
    listed = ["pg_catalog", "pg_toast", "information_schema", "pg_temp_3", "public", "tenant_a"]
    found = expand([everything, tenant], "db0:5432/app", listed)
    assert [(o.schema, o.source.schema) for o in found] == [("public", "*"), ("tenant_a", "*")]


def test_a_dropped_schema_is_no_longer_an_outbox() -> None:
    (source,) = parsed([{"schema": "tenant_*"}])
    before = expand([source], source.database, ["tenant_a", "tenant_b"])
    after = expand([source], source.database, ["tenant_b", "tenant_c"])
    assert [o.schema for o in before] == ["tenant_a", "tenant_b"]
    assert [o.schema for o in after] == ["tenant_b", "tenant_c"]
