from __future__ import annotations

import argparse
from typing import Any

import pytest
from pydantic import ValidationError

from outbox_dispatcher import cli
from outbox_dispatcher.cli import flags
from outbox_dispatcher.config.names import quote_identifier
from outbox_dispatcher.config.settings import DeadLetterPolicy, Settings


def test_defaults_point_at_the_local_stack() -> None:
    s = Settings()
    assert s.database_url.get_secret_value() == "postgresql://outbox:outbox@127.0.0.1:5432/outbox"
    assert s.kafka_bootstrap_servers == "127.0.0.1:9092"
    assert (s.db_schema, s.table) == ("public", "outbox")
    assert s.dead_letter_policy is DeadLetterPolicy.SKIP
    assert s.effective_pool_size == s.claim_tasks + 2


def test_environment_is_read_with_the_outbox_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_TABLE", "events")
    monkeypatch.setenv("OUTBOX_SCHEMA", "app")
    monkeypatch.setenv("OUTBOX_BATCH_SIZE", "50")
    monkeypatch.setenv("OUTBOX_DEAD_LETTER_POLICY", "block")
    s = Settings()
    assert (s.table, s.db_schema, s.batch_size) == ("events", "app", 50)
    assert s.dead_letter_policy is DeadLetterPolicy.BLOCK


@pytest.mark.parametrize(
    "name",
    ['outbox"; DROP TABLE users; --', "Outbox", "1outbox", "", "a" * 41, "out box", "x.y"],
)
def test_malicious_or_invalid_table_names_are_rejected(name: str) -> None:
    with pytest.raises(ValidationError, match="is not allowed"):
        Settings(table=name)


@pytest.mark.parametrize("name", ["pg_catalog", "information_schema", "pg_temp"])
def test_system_schemas_are_rejected(name: str) -> None:
    with pytest.raises(ValidationError):
        Settings(db_schema=name)


def test_quote_identifier_doubles_quotes() -> None:
    assert quote_identifier("outbox") == '"outbox"'
    assert quote_identifier('a"b') == '"a""b"'


def test_secrets_are_never_shown() -> None:
    s = Settings(
        database_url="postgresql://u:hunter2@h/db",
        kafka_sasl_password="s3cret",
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism="PLAIN",
        kafka_sasl_username="u",
    )
    shown = repr(s) + str(s.model_dump())
    assert "hunter2" not in shown and "s3cret" not in shown


def test_cli_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_BATCH_SIZE", "50")
    ns = cli.build_parser().parse_args(["run", "--batch-size", "7", "--no-listen"])
    s = cli.load_settings(ns)
    assert s.batch_size == 7
    assert s.listen is False


def test_invalid_setting_gives_one_clear_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["run", "--batch-size", "0"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "OUTBOX_BATCH_SIZE / --batch-size" in err
    assert "greater than or equal to 1" in err


def test_every_setting_has_a_flag_with_help() -> None:
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["run"].format_help()  # type: ignore[union-attr]
    for name, field in Settings.model_fields.items():
        assert flags._flag_name(name) in help_text
        assert field.description, f"{name} has no description for --help"


def test_an_invalid_value_from_the_environment_names_the_variable_and_flag_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OUTBOX_SCHEMA", 'x"; drop table outbox;--')
    assert cli.main(["status"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "invalid setting OUTBOX_SCHEMA / --schema:" in err
    assert "OUTBOX_OUTBOX" not in err


def test_a_cross_field_error_reads_as_one_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--backoff-initial-seconds", "5", "--backoff-max-seconds", "1"]
    assert cli.main(["check", *flags]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "invalid settings: OUTBOX_BACKOFF_MAX_SECONDS must be >=" in err
    assert "invalid setting settings" not in err


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
def test_infinite_seconds_are_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", f"--lease-seconds={value}"]) == cli.EXIT_CONFIG
    assert cli.main(["check", f"--retention-seconds={value}"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "OUTBOX_LEASE_SECONDS / --lease-seconds" in err
    assert "OUTBOX_RETENTION_SECONDS / --retention-seconds" in err


def leaves(
    parser: argparse.ArgumentParser, prefix: str = ""
) -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command's parser, named as typed ("dead requeue")."""
    found = []
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        for name, sub in getattr(action, "choices", {}).items():
            full = f"{prefix} {name}".strip()
            found.append((full, sub))
            found.extend(leaves(sub, full))
    return found


def test_each_command_shows_its_own_options_first_and_only_the_settings_it_uses() -> None:
    parser = cli.build_parser()
    commands = dict(leaves(parser))
    pause_help = commands["pause"].format_help()
    assert pause_help.startswith("usage: outbox-dispatcher pause [options]\n")
    assert pause_help.index("--reason") < pause_help.index("--database-url")
    assert "--kafka-bootstrap-servers" not in pause_help and "--cloudevents" not in pause_help
    assert len(pause_help.splitlines()) < 60
    assert "--cleanup-batch-size" in commands["dead requeue"].format_help()
    assert "--kafka-bootstrap-servers" in commands["run"].format_help()
    # Every command a user runs declares the settings it reads (its group of setting flags) and
    # has its handler, beside its own parser.
    runnable = {name: sub for name, sub in commands.items() if not sub._subparsers}
    assert len(runnable) == 12
    for name, sub in runnable.items():
        titles = {group.title for group in sub._action_groups}
        assert titles & {"settings", "settings this command uses"}, name
        assert callable(sub.get_default("handler")), name


def test_an_argument_error_is_one_line_not_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["dead", "list", "--since", "yesterday"])
    assert exited.value.code == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("outbox-dispatcher dead list: error: argument --since: 'yesterday' is")


@pytest.mark.parametrize(
    ("delivery", "chosen", "in_effect"),
    [
        ("at-least-once", None, "off"),
        ("exactly-once", None, "on"),
        ("at-least-once", "on", "on"),
        ("exactly-once", "local", "local"),
    ],
)
def test_commits_are_durable_unless_a_lost_mark_is_harmless(
    delivery: str, chosen: str | None, in_effect: str
) -> None:
    """At-least-once may lose a mark in a database crash (a re-publish); exactly-once may not:
    its progress record forgets a batch once it is marked (test_exactly_once_durability)."""
    values: dict[str, Any] = {"delivery": delivery}
    if chosen is not None:
        values["synchronous_commit"] = chosen
    assert Settings(**values).commit_durability == in_effect


def test_exactly_once_refuses_synchronous_commit_off() -> None:
    with pytest.raises(ValidationError, match="OUTBOX_SYNCHRONOUS_COMMIT=off cannot be used"):
        Settings(delivery="exactly-once", synchronous_commit="off")
