"""The `sources` setting (OUTBOX_SOURCES) as a field of Settings: read from the same places as
every setting, checked at start with config/outboxes.py's messages, never shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from outbox_dispatcher import cli, errors
from outbox_dispatcher.config.outboxes import sources_of
from outbox_dispatcher.config.settings import Settings

SECRET_URL = "postgresql://relay:s3cr3t-pw@shard2:5432/app"


def test_without_sources_the_single_table_settings_are_the_one_source() -> None:
    settings = Settings(db_schema="billing", table="events")
    assert settings.sources is None
    (source,) = sources_of(settings)
    assert (source.schema, source.table) == ("billing", "events")
    assert source.database_url == settings.database_url


def test_sources_from_the_environment_are_parsed_with_the_settings_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    items = [{"schema": "tenant_*"}, {"schema": "b", "database_url": SECRET_URL, "name": "b2"}]
    monkeypatch.setenv("OUTBOX_SOURCES", json.dumps(items))
    monkeypatch.setenv("OUTBOX_TABLE", "events")
    settings = Settings()
    first, second = sources_of(settings)
    assert (first.schema, first.table, first.database_url) == (
        "tenant_*",
        "outbox",
        settings.database_url,
    )
    assert second.database_url.get_secret_value() == SECRET_URL
    assert SECRET_URL not in repr(settings)
    assert "s3cr3t" not in str(settings.model_dump())


def test_sources_from_a_file_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    file = tmp_path / "sources.json"
    file.write_text(json.dumps([{"schema": "from_file"}]) + "\n")
    monkeypatch.setenv("OUTBOX_SOURCES_FILE", str(file))
    (source,) = sources_of(Settings())
    assert source.schema == "from_file"


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        ([{"schema": "pg_x", "database_url": SECRET_URL}], "item 1: schema 'pg_x' is a system"),
        ([{"schema": "a", "database_url": SECRET_URL, "weight": SECRET_URL}], "weight must be"),
        ([{"schema": "a", "port": SECRET_URL}], "unknown key 'port'"),
        ([{"schema": "t_*"}, {"schema": "t_1"}], "can both serve t_1.outbox"),
    ],
)
def test_a_bad_list_fails_at_start_with_its_message_and_no_url(
    monkeypatch: pytest.MonkeyPatch, items: list[dict[str, object]], expected: str
) -> None:
    monkeypatch.setenv("OUTBOX_SOURCES", json.dumps(items))
    with pytest.raises(errors.ConfigurationError, match=expected) as caught:
        Settings()
    assert "s3cr3t" not in str(caught.value)
    assert "shard2" not in str(caught.value)


def test_the_command_line_says_what_is_wrong_in_one_line_without_the_url(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = json.dumps([{"schema": "a", "database_url": SECRET_URL}])[:-3]  # broken JSON
    monkeypatch.setenv("OUTBOX_SOURCES", text)
    assert cli.main(["status"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "OUTBOX_SOURCES is not valid JSON" in err
    assert "s3cr3t" not in err


def test_the_fleet_in_flight_budget_is_at_least_the_claim_slots_with_sources() -> None:
    """Each claim slot holds a batch in flight while it claims: a budget below the slots is
    refused with sources, and means nothing (so is not checked) without them."""
    sources = json.dumps([{"schema": "tenant_*"}])
    assert Settings(sources=sources, claim_tasks=16).fleet_in_flight_batches == 16
    with pytest.raises(ValueError, match="OUTBOX_FLEET_IN_FLIGHT_BATCHES=16 is below") as refused:
        Settings(sources=sources, claim_tasks=20)
    assert "OUTBOX_CLAIM_TASKS=20" in str(refused.value)
    assert Settings(claim_tasks=20).claim_tasks == 20  # a single-table dispatcher: unused
