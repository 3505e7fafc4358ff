"""`outbox-dispatcher`: run, migrate, status, console and the operator commands.

Every setting is an OUTBOX_* environment variable and a flag of the same name; flags win. Each
command is configured by its `configure_X_parser` (process.py, operator.py), which names the
settings it reads and its handler; `main` runs every command the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import urllib.parse
from collections.abc import Coroutine, Sequence
from typing import Any

import structlog
from pydantic import ValidationError

from outbox_dispatcher import __version__, display, errors, logs
from outbox_dispatcher.cli import operator, process
from outbox_dispatcher.cli.flags import SECRETS_HELP, Handler, _Parser, explain, load_settings
from outbox_dispatcher.cli.terminal import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    err,
)
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.operate.actions import ActionRefusedError
from outbox_dispatcher.operate.session import PrivilegeError

__all__ = [
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "build_parser",
    "load_settings",
    "main",
]

log = structlog.get_logger(__name__)

# The commands in the order --help lists them.
CONFIGURE = (
    process.configure_run_parser,
    process.configure_migrate_parser,
    operator.configure_status_parser,
    process.configure_console_parser,
    operator.configure_dead_parser,
    operator.configure_replay_parser,
    operator.configure_pause_parser,
    operator.configure_resume_parser,
    operator.configure_cleanup_parser,
    operator.configure_check_parser,
)


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
    for configure in CONFIGURE:
        configure(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    namespace = build_parser().parse_args(argv)
    try:
        settings = load_settings(namespace)
    except ValidationError as exc:
        err(explain(exc, namespace))
        return EXIT_CONFIG
    except errors.ConfigurationError as exc:  # an unreadable *_FILE or OUTBOX_SECRETS_DIR
        err(str(exc))
        return EXIT_CONFIG
    # An operator command at a terminal logs for a person (its record is the audit table);
    # `run`, and any command whose stderr is collected, logs JSON as configured.
    human = namespace.command != "run" and sys.stderr.isatty()
    logs.configure("console" if human else settings.log_format, settings.log_level)
    handler: Handler = namespace.handler
    try:
        return _asyncio_run(handler(settings, namespace), use_uvloop=settings.uvloop)
    except KeyboardInterrupt:
        # Ctrl-C of an operator command (run handles SIGINT itself): one line, not a traceback.
        err(namespace.interrupted)
        return EXIT_INTERRUPTED
    except operator.ActionInterruptedError as exc:  # Ctrl-C of a recorded action: what it did
        err(exc.message)
        return EXIT_INTERRUPTED
    except PrivilegeError as exc:
        err(_privilege_hint(namespace, settings, exc))
        return EXIT_FAILED
    except ActionRefusedError as exc:
        err(exc.message)
        return EXIT_USAGE if exc.usage else EXIT_FAILED
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
        err(display.inert(str(exc)))


def _privilege_hint(namespace: argparse.Namespace, settings: Settings, exc: PrivilegeError) -> str:
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
