"""`outbox-dispatcher`: migrate, run, status, and the operator commands of admin.py.

Every setting is an OUTBOX_* environment variable and a flag of the same name; flags win.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import os
import re
import signal
import sys
import types
import typing
import urllib.parse
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import structlog
from pydantic import SecretStr, ValidationError

from outbox_dispatcher import (
    __version__,
    admin,
    db,
    display,
    errors,
    logs,
    migrations,
    operations,
    registry,
    status,
    tracing,
)
from outbox_dispatcher.dispatcher import Dispatcher
from outbox_dispatcher.settings import SECRETS_DIR_VARIABLE, DeadLetterPolicy, Settings
from outbox_dispatcher.sql import Queries

log = structlog.get_logger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def _env_name(field: str) -> str:
    return "OUTBOX_SCHEMA" if field == "db_schema" else f"OUTBOX_{field.upper()}"


def _flag_name(field: str) -> str:
    return "--schema" if field == "db_schema" else "--" + field.replace("_", "-")


SECRETS_HELP = (
    "Secrets (passwords, a database URL with a password) belong in a file named by "
    "OUTBOX_<SETTING>_FILE (e.g. OUTBOX_DATABASE_URL_FILE) or in OUTBOX_SECRETS_DIR, not in "
    "flags: every local user can read a process's arguments."
)
SETTINGS_HELP = "each flag overrides its environment variable (shown in brackets). " + SECRETS_HELP


# The settings each command reads (one registry: its --help and flags show only these; every
# OUTBOX_* variable is still validated). run and check use them all.
_CONNECT = ("database_url", "db_schema", "table", "log_format", "log_level", "uvloop")
_BATCHED = (*_CONNECT, "cleanup_batch_size")
COMMAND_SETTINGS: dict[str, tuple[str, ...] | None] = {
    "run": None,
    "check": None,
    "migrate": _CONNECT,
    "status": (*_CONNECT, "dead_letter_policy"),
    "dead list": _CONNECT,
    "dead requeue": _BATCHED,
    "dead discard": _BATCHED,
    "replay": (*_BATCHED, "delete_on_publish"),
    "pause": _CONNECT,
    "resume": _CONNECT,
    "cleanup": (*_BATCHED, "retention_seconds"),
    "console": (
        *_BATCHED,
        "dead_letter_policy",
        "delete_on_publish",
        "console_host",
        "console_port",
        "console_token",
        "console_show_payload",
        "console_payload_max_bytes",
        "console_sample_seconds",
    ),
}


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line, not the usage text: a bad value of a setting flag names the
    variable and the flag (as for the environment); any other names the command and --help."""

    def error(self, message: str) -> typing.NoReturn:
        match = re.match(r"argument (--[a-z0-9-]+)(?:/--[a-z0-9-]+)?: (.*)", message, re.DOTALL)
        fields = {_flag_name(name): name for name in Settings.model_fields}
        if match and match.group(1) in fields:
            field = fields[match.group(1)]
            where = f"{_env_name(field)} / {match.group(1)}"
            self.exit(EXIT_CONFIG, f"outbox-dispatcher: invalid setting {where}: {match[2]}\n")
        self.exit(
            EXIT_CONFIG, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n"
        )


def _add_setting_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """The flags of the settings `command` reads (COMMAND_SETTINGS), after its own options."""
    used = COMMAND_SETTINGS[command]
    group = parser.add_argument_group(
        "settings" if used is None else "settings this command uses", SETTINGS_HELP
    )
    for name, field in Settings.model_fields.items():
        if used is not None and name not in used:
            continue
        annotation = field.annotation
        default = field.default
        if isinstance(default, SecretStr):
            shown = _masked(default.get_secret_value())
        elif isinstance(default, enum.Enum):
            shown = default.value
        else:
            shown = repr(default)
        text = f"{field.description or ''} [{_env_name(name)}, default {shown}]".strip()
        kwargs: dict[str, Any] = {"dest": name, "default": None, "help": text}
        args = typing.get_args(annotation)
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is typing.Literal:
            kwargs["choices"] = list(args)
        elif isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            kwargs["choices"] = [m.value for m in annotation]
        elif typing.get_origin(annotation) in (
            typing.Union,
            types.UnionType,
        ) and typing.Literal in {typing.get_origin(a) for a in args}:
            kwargs["choices"] = [c for a in args for c in typing.get_args(a)]
        group.add_argument(_flag_name(name), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="outbox-dispatcher",
        description=(
            "Moves events from a PostgreSQL transactional outbox table to Kafka: at-least-once, "
            "ordered per ordering key, each record carrying its event id."
        ),
        epilog="Every setting is an OUTBOX_* environment variable and a flag of each command "
        "that uses it (COMMAND --help). " + SECRETS_HELP,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run", help="dispatch until SIGTERM/SIGINT", description="Dispatch until SIGTERM/SIGINT."
    )
    migrate = commands.add_parser(
        "migrate",
        help="create or upgrade the outbox schema (idempotent)",
        description="Create or upgrade the outbox schema; safe to run concurrently.",
    )
    show = commands.add_parser(
        "status",
        help="pending, in-flight and dead rows per topic",
        description="Pending, in-flight, dead and published rows per topic, oldest pending age.",
    )
    show.add_argument("--json", action="store_true", help="print JSON")
    web = commands.add_parser(
        "console",
        help="serve the operator console (pages and a JSON API) until SIGTERM/SIGINT",
        description="Serve the operator console on OUTBOX_CONSOLE_HOST:OUTBOX_CONSOLE_PORT: the "
        "backlog, dead rows, blocked keys and the audit as pages and under /api/v1/; with "
        "OUTBOX_CONSOLE_TOKEN also requeue, discard, replay, pause and resume. Read-only without "
        "a token.",
    )
    for name, sub in (("run", run), ("migrate", migrate), ("status", show), ("console", web)):
        _add_setting_flags(sub, name)
    admin.add_parsers(commands, _add_setting_flags)
    for command, leaf in _leaves(parser):
        if command in COMMAND_SETTINGS:  # a short synopsis, not every flag
            leaf.usage = f"outbox-dispatcher {command} [options]"
    return parser


def _masked(url: str) -> str:
    """A default URL for --help, its password as ***."""
    userinfo, at, rest = url.partition("://")[2].rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{url.partition('://')[0]}://{userinfo.split(':', 1)[0]}:***@{rest}"


def _leaves(
    parser: argparse.ArgumentParser, prefix: str = ""
) -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command's parser, named as typed ("dead requeue")."""
    found = []
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        for name, sub in getattr(action, "choices", {}).items():
            full = f"{prefix} {name}".strip()
            found.append((full, sub))
            found.extend(_leaves(sub, full))
    return found


def load_settings(namespace: argparse.Namespace) -> Settings:
    overrides = {
        name: getattr(namespace, name)
        for name in Settings.model_fields
        if getattr(namespace, name, None) is not None
    }
    return Settings(**overrides)


def _field_of(loc: str) -> str:
    """The settings field of a validation error's location: the field name, or its alias when
    the value came from the environment (OUTBOX_SCHEMA is db_schema)."""
    if loc in Settings.model_fields:
        return loc
    for name in Settings.model_fields:
        if _env_name(name) == loc:
            return name
    return loc


def _from_file(field: str) -> str | None:
    """The variable naming the file a setting's value came from, if it came from one (and not
    from a flag or the variable itself, which win)."""
    variable = _env_name(field)
    if variable in os.environ:
        return None
    if os.environ.get(variable + "_FILE"):
        return variable + "_FILE"
    directory = os.environ.get(SECRETS_DIR_VARIABLE)
    if directory and any(
        p.name.upper() == variable for p in Path(directory).glob("*") if p.is_file()
    ):
        return f"{variable} in {SECRETS_DIR_VARIABLE}"
    return None


def _explain(exc: ValidationError, namespace: argparse.Namespace | None = None) -> str:
    """One line per invalid setting, naming its variable and flag. A value read from a file
    (a secret, usually) is never quoted."""
    lines = []
    for error in exc.errors():
        message = str(error["msg"]).removeprefix("Value error, ")
        if not error["loc"]:
            lines.append(f"invalid settings: {message}")
            continue
        field = _field_of(str(error["loc"][0]))
        source = None if getattr(namespace, field, None) is not None else _from_file(field)
        value = error.get("input")
        if source and isinstance(value, str) and value:
            message = message.replace(repr(value), "(the file's content)")
            message = message.replace(value, "(the file's content)")
        where = f"{source or _env_name(field)} / {_flag_name(field)}"
        lines.append(f"invalid setting {where}: {message}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    namespace = parser.parse_args(argv)
    try:
        settings = load_settings(namespace)
    except ValidationError as exc:
        print(f"outbox-dispatcher: {_explain(exc, namespace)}", file=sys.stderr)  # noqa: T201
        return EXIT_CONFIG
    except errors.ConfigurationError as exc:  # an unreadable *_FILE or OUTBOX_SECRETS_DIR
        print(f"outbox-dispatcher: {exc}", file=sys.stderr)  # noqa: T201
        return EXIT_CONFIG
    # An operator command at a terminal logs for a person (its record is the audit table);
    # `run`, and any command whose stderr is collected, logs JSON as configured.
    human = namespace.command != "run" and sys.stderr.isatty()
    logs.configure("console" if human else settings.log_format, settings.log_level)
    command: Callable[[Settings, argparse.Namespace], Coroutine[Any, Any, int]] = (
        admin.handler(namespace)
        or {
            "run": _run,
            "migrate": _migrate,
            "status": _status,
            "console": _console,
        }[namespace.command]
    )
    try:
        return _asyncio_run(command(settings, namespace), use_uvloop=settings.uvloop)
    except KeyboardInterrupt:
        # Ctrl-C of an operator command (run handles SIGINT itself): one line, not a traceback.
        said = getattr(namespace, "interrupted", "interrupted")
        print(f"outbox-dispatcher: {said}", file=sys.stderr)  # noqa: T201
        return EXIT_INTERRUPTED
    except asyncpg.InsufficientPrivilegeError as exc:
        print(f"outbox-dispatcher: {_privilege_hint(namespace, settings, exc)}", file=sys.stderr)  # noqa: T201
        return EXIT_FAILED
    except errors.ConfigurationError as exc:
        _report_error(namespace, "configuration_error", exc)
        return EXIT_CONFIG
    except errors.OutboxDispatcherError as exc:
        _report_error(namespace, "failed", exc)
        return EXIT_FAILED


def _report_error(namespace: argparse.Namespace, event: str, exc: BaseException) -> None:
    """`run` logs (its logs are collected); an operator at a terminal gets one plain line."""
    if namespace.command == "run":
        log.error(event, error=str(exc), error_type=type(exc).__name__)
    else:
        print(f"outbox-dispatcher: {display.inert(str(exc))}", file=sys.stderr)  # noqa: T201


def _privilege_hint(
    namespace: argparse.Namespace, settings: Settings, exc: asyncpg.InsufficientPrivilegeError
) -> str:
    """One line naming the role a command needs (schema/roles.sql), not a traceback."""
    role = urllib.parse.urlsplit(settings.database_url.get_secret_value()).username or "?"
    command = " ".join(
        str(part) for part in (namespace.command, getattr(namespace, "dead_command", None)) if part
    )
    if command in ("pause", "resume", "migrate"):
        needed = "the owner role of schema/roles.sql (e.g. outbox_owner)"
    else:
        needed = (
            "the dispatcher or the owner role of schema/roles.sql (e.g. outbox_dispatcher; "
            "after migrating, run roles.sql again so that the roles get the new tables)"
        )
    return (
        f"database role {display.inert(role)!r} may not do what `{command}` needs "
        f"({exc.message}): run it as {needed}"
    )


def _asyncio_run(coro: Coroutine[Any, Any, int], *, use_uvloop: bool) -> int:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:  # pragma: no cover
            pass
        else:
            return uvloop.run(coro)
    return asyncio.run(coro)


async def _run(settings: Settings, _: argparse.Namespace) -> int:
    if settings.tracing:
        try:
            tracing.configure_sdk()
        except ImportError as missing:
            msg = "OUTBOX_TRACING needs OpenTelemetry: install outbox-dispatcher[otel]"
            raise errors.ConfigurationError(msg) from missing
    dispatcher = Dispatcher(settings)
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()

    def on_signal(signum: signal.Signals) -> None:
        if dispatcher.stopping.is_set():
            log.warning("second_signal_cancelling", signal=signum.name)
            if main_task is not None:
                main_task.cancel()
        else:
            log.info("signal_received", signal=signum.name)
            dispatcher.stop()

    signals = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
        loop.add_signal_handler(signum, on_signal, signum)
    code = EXIT_OK
    try:
        await dispatcher.run()
    except* errors.ConfigurationError as config_errors:
        for exc in config_errors.exceptions:
            log.error("configuration_error", error=str(exc))
        code = EXIT_CONFIG
    except* errors.OutboxDispatcherError as failures:
        for failure in failures.exceptions:
            log.error("failed", error=str(failure), error_type=type(failure).__name__)
        code = EXIT_FAILED
    except* Exception as crashes:
        # A dead loop stopped the TaskGroup: exit non-zero so that the process is restarted.
        for crash in crashes.exceptions:
            log.error("loop_died", error=errors.describe(crash), exc_info=crash)
        code = EXIT_FAILED
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
    return code


async def _migrate(settings: Settings, _: argparse.Namespace) -> int:
    conn = await db.connect(settings.database_url.get_secret_value(), settings)
    try:
        applied = await migrations.migrate(conn, settings.db_schema, settings.table)
        version = await migrations.current_version(conn, settings.db_schema, settings.table)
    finally:
        await conn.close()
    log.info("schema_ready", version=version, applied=applied)
    where = f"{settings.db_schema}.{settings.table}"
    done = f"applied {', '.join(map(str, applied))}" if applied else "nothing to apply"
    sys.stdout.write(f"schema {where} is at version {version} ({done})\n")
    return EXIT_OK


async def _status(settings: Settings, namespace: argparse.Namespace) -> int:
    conn = await db.connect(settings.database_url.get_secret_value(), settings)
    try:
        await migrations.check_version(conn, settings.db_schema, settings.table)
        queries = Queries.for_table(settings.db_schema, settings.table)
        pauses = await status.read_pauses(conn, queries)
        dispatchers = await status.read_dispatchers(conn, queries, registry.LIVE_SECONDS)
        policy = _policy(dispatchers, settings)
        block = policy == DeadLetterPolicy.BLOCK.value
        topics = await status.read(conn, queries, block_on_dead=block, pauses=pauses)
    finally:
        await conn.close()
    if namespace.json:
        report = status.as_json(topics, pauses, dispatchers, policy)
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        sys.stdout.write("\n")
    else:
        sys.stdout.write(status.as_table(topics, pauses, dispatchers, policy) + "\n")
    return EXIT_OK


async def _console(settings: Settings, _: argparse.Namespace) -> int:
    # Imported here: the web stack is loaded only by the command that serves it.
    from outbox_dispatcher import console

    # The schema is checked once before serving, so that a wrong database fails at start.
    async with operations.connected(settings):
        pass
    log.info(
        "console_starting",
        host=settings.console_host,
        port=settings.console_port,
        read_only=settings.console_token is None,
        show_payload=settings.console_show_payload,
    )
    await console.serve(settings)
    return EXIT_OK


def _policy(dispatchers: list[status.Dispatcher], settings: Settings) -> str:
    return status.counting_policy(dispatchers, settings.dead_letter_policy.value)
