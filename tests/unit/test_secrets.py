"""Secrets from *_FILE variables and a secrets directory; no secret in any output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from outbox_dispatcher import cli
from outbox_dispatcher.config.settings import Settings

SECRET = "Sup3r-s3cret-canary"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)


def _write(path: Path, text: str) -> Path:
    path.write_text(text, "utf-8")
    return path


def _settings(*flags: str) -> Settings:
    return cli.load_settings(cli.build_parser().parse_args(["run", *flags]))


def test_file_variables_are_read_without_the_trailing_newline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    dsn = f"postgresql://app:{SECRET}@db.internal:5432/app"
    monkeypatch.setenv("OUTBOX_DATABASE_URL_FILE", str(_write(tmp_path / "dsn", dsn + "\n")))
    monkeypatch.setenv("OUTBOX_LISTEN_DATABASE_URL_FILE", str(_write(tmp_path / "l", dsn + "\r\n")))
    monkeypatch.setenv("OUTBOX_KAFKA_SASL_PASSWORD_FILE", str(_write(tmp_path / "pw", " a b \n")))
    monkeypatch.setenv("OUTBOX_KAFKA_SSL_KEY_PASSWORD_FILE", str(_write(tmp_path / "k", SECRET)))
    monkeypatch.setenv("OUTBOX_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("OUTBOX_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("OUTBOX_KAFKA_SASL_USERNAME", "app")
    monkeypatch.setenv("OUTBOX_KAFKA_SSL_CERTFILE", "/etc/client.crt")
    s = Settings()
    assert s.database_url.get_secret_value() == dsn
    assert s.listen_database_url is not None
    assert s.listen_database_url.get_secret_value() == dsn
    assert s.kafka_sasl_password is not None
    # Only the newline goes: spaces may be part of a password.
    assert s.kafka_sasl_password.get_secret_value() == " a b "
    assert s.kafka_ssl_key_password is not None
    assert s.kafka_ssl_key_password.get_secret_value() == SECRET


def test_any_setting_can_come_from_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OUTBOX_SCHEMA_FILE", str(_write(tmp_path / "schema", "app\n")))
    monkeypatch.setenv("OUTBOX_BATCH_SIZE_FILE", str(_write(tmp_path / "batch", "42\n")))
    s = Settings()
    assert (s.db_schema, s.batch_size) == ("app", 42)


def test_secrets_directory_files_are_named_like_the_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The layout of a mounted Kubernetes Secret: visible names are symlinks into ..data/.
    data = tmp_path / "..2026_11_30_00_00_00.000000001"
    data.mkdir()
    _write(data / "OUTBOX_DATABASE_URL", f"postgresql://app:{SECRET}@db:5432/app\n")
    _write(data / "outbox_kafka_sasl_password", SECRET + "\n")
    (tmp_path / "..data").symlink_to(data.name)
    for name in ("OUTBOX_DATABASE_URL", "outbox_kafka_sasl_password"):
        (tmp_path / name).symlink_to(Path("..data") / name)
    monkeypatch.setenv("OUTBOX_SECRETS_DIR", str(tmp_path))
    # A SASL password needs a SASL protocol (it would go unused otherwise, and is refused).
    monkeypatch.setenv("OUTBOX_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("OUTBOX_KAFKA_SASL_MECHANISM", "PLAIN")
    monkeypatch.setenv("OUTBOX_KAFKA_SASL_USERNAME", "app")
    s = Settings()
    assert s.database_url.get_secret_value() == f"postgresql://app:{SECRET}@db:5432/app"
    assert s.kafka_sasl_password is not None
    assert s.kafka_sasl_password.get_secret_value() == SECRET


def test_precedence_is_flag_env_file_secrets_dir_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    _write(secrets / "OUTBOX_TABLE", "from_dir\n")
    _write(secrets / "OUTBOX_SCHEMA", "dir_schema\n")
    assert (_settings().table, _settings().db_schema) == ("outbox", "public")  # default
    monkeypatch.setenv("OUTBOX_SECRETS_DIR", str(secrets))
    assert (_settings().table, _settings().db_schema) == ("from_dir", "dir_schema")
    monkeypatch.setenv("OUTBOX_TABLE_FILE", str(_write(tmp_path / "t", "from_file\n")))
    monkeypatch.setenv("OUTBOX_SCHEMA_FILE", str(_write(tmp_path / "s", "file_schema\n")))
    assert (_settings().table, _settings().db_schema) == ("from_file", "file_schema")
    monkeypatch.setenv("OUTBOX_TABLE", "from_env")
    monkeypatch.setenv("OUTBOX_SCHEMA", "env_schema")
    assert (_settings().table, _settings().db_schema) == ("from_env", "env_schema")
    flags = ("--table", "from_flag", "--schema", "flag_schema")
    assert (_settings(*flags).table, _settings(*flags).db_schema) == ("from_flag", "flag_schema")


def test_unreadable_secret_file_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    monkeypatch.setenv("OUTBOX_KAFKA_SASL_PASSWORD_FILE", str(missing))
    assert cli.main(["status"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert f"OUTBOX_KAFKA_SASL_PASSWORD_FILE={missing}" in err[0]


def test_missing_secrets_directory_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OUTBOX_SECRETS_DIR", str(tmp_path / "absent"))
    assert cli.main(["status"]) == cli.EXIT_CONFIG
    assert "OUTBOX_SECRETS_DIR" in capsys.readouterr().err


def _run_cli(env: dict[str, str], *args: str) -> tuple[int, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    result = subprocess.run(
        [sys.executable, "-m", "outbox_dispatcher", *args],
        env={**base, "OUTBOX_HTTP_PORT": "0", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("env", "args", "code", "expected"),
    [
        pytest.param(  # another setting is invalid: the DSN must not be echoed with it
            {"OUTBOX_DATABASE_URL": f"postgresql://app:{SECRET}@127.0.0.1:1/app"},
            ("run", "--batch-size", "0"),
            2,
            "OUTBOX_BATCH_SIZE",
            id="invalid-other-setting",
        ),
        pytest.param(  # the DSN itself is malformed
            {"OUTBOX_DATABASE_URL": f"postgresql://app:{SECRET}@127.0.0.1:notaport/app"},
            ("status",),
            2,
            "not a usable PostgreSQL URL",
            id="malformed-dsn",
        ),
        pytest.param(
            {"OUTBOX_DATABASE_URL": f"postgresql://app:{SECRET}@127.0.0.1:1/app?sslmode=bogus"},
            ("migrate",),
            2,
            "sslmode",
            id="bad-sslmode",
        ),
        pytest.param(  # nothing listens on port 1
            {"OUTBOX_DATABASE_URL": f"postgresql://app:{SECRET}@127.0.0.1:1/app"},
            ("run",),
            1,
            "cannot reach PostgreSQL",
            id="unreachable-database",
        ),
        pytest.param(  # SASL credentials the protocol would not use
            {
                "OUTBOX_KAFKA_SASL_MECHANISM": "PLAIN",
                "OUTBOX_KAFKA_SASL_USERNAME": "app",
                "OUTBOX_KAFKA_SASL_PASSWORD": SECRET,
            },
            ("run",),
            2,
            "OUTBOX_KAFKA_SECURITY_PROTOCOL=PLAINTEXT does not use SASL",
            id="sasl-without-sasl-protocol",
        ),
    ],
)
def test_no_secret_in_any_output_of_a_failing_cli(
    env: dict[str, str], args: tuple[str, ...], code: int, expected: str
) -> None:
    returncode, output = _run_cli(env, *args)
    assert returncode == code, output
    assert expected in output
    assert SECRET not in output


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kafka_security_protocol": "SASL_SSL"}, "needs OUTBOX_KAFKA_SASL_MECHANISM"),
        ({"kafka_ssl_cafile": "/ca.crt"}, "OUTBOX_KAFKA_SSL_CAFILE set but"),
        (
            {"kafka_security_protocol": "SSL", "kafka_ssl_keyfile": "/k.pem"},
            "need OUTBOX_KAFKA_SSL_CERTFILE",
        ),
        (
            {"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_ssl_key_password": SECRET},
            "OUTBOX_KAFKA_SSL_KEY_PASSWORD set but",
        ),
    ],
)
def test_tls_and_sasl_settings_the_protocol_would_ignore_are_refused(
    values: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CA file or credentials with a protocol that does not use them would mean plaintext."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in values.items()]
    if values.get("kafka_security_protocol", "").startswith("SASL_") and "ssl_key" in str(values):
        flags += ["--kafka-sasl-mechanism=PLAIN", "--kafka-sasl-username=u"]
        flags += [f"--kafka-sasl-password={SECRET}"]
    assert cli.main(["check", *flags]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert message in err
    assert SECRET not in err


@pytest.mark.parametrize(
    "password",
    # Unencoded '/', '?', '#' and '@' move pieces of the password into the host, port or path,
    # where a driver's parse error would quote them: pieces of every length, down to one.
    ["Pa/ssLEAK", "hunter2?x", "hunter2#x", "Pa@ssw0rd", "P/a", "x?y", "/", "a@", "@@", "ab/cd?ef"],
)
def test_a_url_that_does_not_parse_is_exit_2_saying_to_percent_encode_and_quotes_nothing(
    password: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE_URL", f"postgresql://app:{password}@db.internal:5432/app")
    assert cli.main(["status"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "OUTBOX_DATABASE_URL" in err and "percent-encode" in err
    # The message quotes nothing of the URL: the same URL with other letters gives the same line.
    other = re.sub(r"[A-Za-z0-9]", "q", password)
    monkeypatch.setenv("OUTBOX_DATABASE_URL", f"postgresql://qqq:{other}@qq.qqqqqqqq:5432/qqq")
    assert cli.main(["status"]) == cli.EXIT_CONFIG
    assert capsys.readouterr().err == err


def test_a_percent_encoded_password_is_accepted() -> None:
    s = _settings("--database-url", "postgresql://app:Pa%2Fss%40w%3Fd@db:5432/app?sslmode=require")
    assert "Pa%2Fss" in s.database_url.get_secret_value()
    assert _settings("--database-url", "postgresql:///app?host=/run/pg").database_url


def test_a_file_whose_content_does_not_parse_is_never_echoed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shadow = _write(tmp_path / "shadow", f"root:{SECRET}:19000:0:99999:7:::\n")
    monkeypatch.setenv("OUTBOX_DATABASE_URL_FILE", str(shadow))
    assert cli.main(["status"]) == cli.EXIT_CONFIG
    monkeypatch.delenv("OUTBOX_DATABASE_URL_FILE")
    # Any setting, also one whose check quotes a bad value from the environment.
    monkeypatch.setenv("OUTBOX_KAFKA_BOOTSTRAP_SERVERS_FILE", str(shadow))
    assert cli.main(["status"]) == cli.EXIT_CONFIG
    monkeypatch.delenv("OUTBOX_KAFKA_BOOTSTRAP_SERVERS_FILE")
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    _write(secrets_dir / "OUTBOX_DEFAULT_TOPIC", f"not a topic {SECRET}")
    monkeypatch.setenv("OUTBOX_SECRETS_DIR", str(secrets_dir))
    assert cli.main(["status"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "OUTBOX_DATABASE_URL_FILE / --database-url" in err
    assert "OUTBOX_KAFKA_BOOTSTRAP_SERVERS_FILE / --kafka-bootstrap-servers" in err
    assert "OUTBOX_DEFAULT_TOPIC in OUTBOX_SECRETS_DIR / --default-topic" in err
    assert SECRET not in err and "root" not in err


@pytest.mark.parametrize(
    "flags",
    [
        ["--kafka-sasl-username=u", f"--kafka-sasl-password={SECRET}"],
        [f"--kafka-sasl-password={SECRET}"],
        ["--kafka-sasl-username=u", "--kafka-security-protocol=SSL"],
    ],
)
def test_sasl_credentials_without_a_sasl_protocol_are_refused(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["check", *flags]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "does not use SASL" in err
    assert SECRET not in err


def test_help_says_secrets_belong_in_files_not_flags() -> None:
    help_text = " ".join(cli.build_parser().parse_args.__self__.format_help().split())  # type: ignore[attr-defined]
    run_help = " ".join(
        cli.build_parser()._subparsers._group_actions[0].choices["run"].format_help().split()  # type: ignore[union-attr]
    )
    for text in (help_text, run_help):
        assert "OUTBOX_SECRETS_DIR" in text and "_FILE" in text
    assert "--kafka-sasl-password" in run_help
    assert "outbox:outbox" not in run_help  # the default URL is shown without its password
    assert "postgresql://outbox:***@127.0.0.1:5432/outbox" in run_help
    assert "OUTBOX_CLAIM_TASKS" not in " ".join(
        cli.build_parser()._subparsers._group_actions[0].choices["pause"].format_help().split()  # type: ignore[union-attr]
    )
