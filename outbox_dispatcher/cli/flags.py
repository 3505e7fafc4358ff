"""The command line's flags. Each setting a command reads is a flag of that command, generated
from the settings model (its variable, default and choices in the help); which settings a command
reads is declared where it is configured (`command(..., settings)`), and every OUTBOX_*
variable is still validated. Also the value types of the commands' own flags, and the filter and
safety flags the operator commands share, with the Filters they give.

Usage errors are one line naming the variable and flag (as for the environment), and invalid
settings one line each (`explain`), never quoting a value read from a secret file.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import os
import re
import types
import typing
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeAlias

from pydantic import SecretStr, ValidationError

from outbox_dispatcher import routing
from outbox_dispatcher.cli.terminal import EXIT_USAGE
from outbox_dispatcher.config.names import env_name
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.config.sources import SECRETS_DIR_VARIABLE
from outbox_dispatcher.operate.filters import ROUTED, Filters, Names

Handler = Callable[[Settings, argparse.Namespace], Coroutine[Any, Any, int]]

# The settings of the commands that only connect, and of those that also work in batches (the
# operator's bulk actions: action_batch_size, which falls back to cleanup_batch_size).
CONNECT = ("database_url", "db_schema", "table", "log_format", "log_level", "uvloop")
BATCHED = (*CONNECT, "cleanup_batch_size", "action_batch_size")
EVERY = None  # run and check read every setting

SECRETS_HELP = (
    "Secrets (passwords, a database URL with a password) belong in a file named by "
    "OUTBOX_<SETTING>_FILE (e.g. OUTBOX_DATABASE_URL_FILE) or in OUTBOX_SECRETS_DIR, not in "
    "flags: every local user can read a process's arguments."
)
SETTINGS_HELP = "each flag overrides its environment variable (shown in brackets). " + SECRETS_HELP


def _flag_name(field: str) -> str:
    return "--schema" if field == "db_schema" else "--" + field.replace("_", "-")


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line, not the usage text: a bad value of a setting flag names the
    variable and the flag (as for the environment); any other names the command and --help."""

    def error(self, message: str) -> typing.NoReturn:
        match = re.match(r"argument (--[a-z0-9-]+)(?:/--[a-z0-9-]+)?: (.*)", message, re.DOTALL)
        fields = {_flag_name(name): name for name in Settings.model_fields}
        if match and match.group(1) in fields:
            field = fields[match.group(1)]
            where = f"{env_name(field)} / {match.group(1)}"
            self.exit(EXIT_USAGE, f"outbox-dispatcher: invalid setting {where}: {match[2]}\n")
        self.exit(
            EXIT_USAGE, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n"
        )


Commands: TypeAlias = "argparse._SubParsersAction[_Parser]"


def command(
    commands: Commands,
    name: str,
    handler: Handler,
    settings: tuple[str, ...] | None,
    *,
    interrupted: str = "interrupted",
) -> _Parser:
    """A command (`name` as typed: "dead requeue") with its handler and the flags of the
    `settings` it reads (None: all); `interrupted` is what Ctrl-C says. The handler's docstring
    is its help, as in click: the first line in the list of commands, the rest its description."""
    summary, _, rest = (inspect.getdoc(handler) or "").partition("\n\n")
    parser = commands.add_parser(name.split()[-1], help=summary, description=" ".join(rest.split()))
    parser.usage = f"outbox-dispatcher {name} [options]"  # a short synopsis, not every flag
    add_setting_flags(parser, settings)
    parser.set_defaults(handler=handler, interrupted=interrupted)
    return parser


def add_setting_flags(parser: argparse.ArgumentParser, used: tuple[str, ...] | None) -> None:
    """The flags of the settings a command reads, in a group after its own options."""
    group = parser.add_argument_group(
        "settings" if used is None else "settings this command uses", SETTINGS_HELP
    )
    for name, field in Settings.model_fields.items():
        if used is not None and name not in used:
            continue
        default = field.default
        if isinstance(default, SecretStr):
            shown = _masked(default.get_secret_value())
        elif isinstance(default, enum.Enum):
            shown = default.value
        else:
            shown = repr(default)
        text = f"{field.description or ''} [{env_name(name)}, default {shown}]".strip()
        kwargs: dict[str, Any] = {"dest": name, "default": None, "help": text}
        kwargs.update(_kind(field.annotation))
        group.add_argument(_flag_name(name), **kwargs)


def _kind(annotation: Any) -> dict[str, Any]:
    """bool: --x/--no-x; a Literal or Enum (or an optional one): its choices."""
    args = typing.get_args(annotation)
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(annotation) is typing.Literal:
        return {"choices": list(args)}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {"choices": [m.value for m in annotation]}
    if typing.get_origin(annotation) in (
        typing.Union,
        types.UnionType,
    ) and typing.Literal in {typing.get_origin(a) for a in args}:
        return {"choices": [c for a in args for c in typing.get_args(a)]}
    return {}


def _masked(url: str) -> str:
    """A default URL for --help, its password as ***."""
    userinfo, at, rest = url.partition("://")[2].rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{url.partition('://')[0]}://{userinfo.split(':', 1)[0]}:***@{rest}"


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
        if env_name(name) == loc:
            return name
    return loc


def _from_file(field: str) -> str | None:
    """The variable naming the file a setting's value came from, if it came from one (and not
    from a flag or the variable itself, which win)."""
    variable = env_name(field)
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


def explain(exc: ValidationError, namespace: argparse.Namespace | None = None) -> str:
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
        where = f"{source or env_name(field)} / {_flag_name(field)}"
        lines.append(f"invalid setting {where}: {message}")
    return "\n".join(lines)


# --- the value types of the commands' own flags --------------------------------------------------


def timestamp(text: str) -> datetime:
    """An ISO-8601 time for --since/--until; without a UTC offset it is taken as UTC."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError as exc:
        msg = f"{text!r} is not an ISO-8601 time (e.g. 2026-11-30T12:00:00Z)"
        raise argparse.ArgumentTypeError(msg) from exc
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        msg = f"{text!r} is not a number of seconds >= 0"
        raise argparse.ArgumentTypeError(msg)
    return value


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        msg = f"{text!r} is not a whole number >= 1"
        raise argparse.ArgumentTypeError(msg)
    return value


def topic_name(text: str) -> str:
    if not routing.valid_topic(text):
        msg = f"{text!r} is not a valid Kafka topic name"
        raise argparse.ArgumentTypeError(msg)
    return text


# The filters by their flags, for the refusals.
FLAGS = Names(
    every="--all",
    every_given="--all",
    dead_filters="--id, --key, --keyless, --topic, --since, --until, --dead-since, --dead-until, "
    "--error",
    replay_filters="--from-id, --to-id, --key, --topic, --since, --until",
    from_id="--from-id",
    to_id="--to-id",
)


def filters_of(ns: argparse.Namespace) -> Filters:
    return Filters(
        ids=getattr(ns, "ids", None),
        key=ns.key,
        topic=ns.topic,
        since=ns.since,
        until=ns.until,
        from_id=getattr(ns, "from_id", None),
        to_id=getattr(ns, "to_id", None),
        keyless=getattr(ns, "keyless", None),
        dead_since=getattr(ns, "dead_since", None),
        dead_until=getattr(ns, "dead_until", None),
        error=getattr(ns, "error", None),
    )


# --- the flags several commands share ------------------------------------------------------------


def filter_flags(parser: argparse.ArgumentParser, *, ids: bool, everything: bool) -> None:
    if ids:
        parser.add_argument(
            "--id", dest="ids", type=int, action="append", help="a row id (repeatable)"
        )
    parser.add_argument("--key", help="rows of this ordering key")
    parser.add_argument(
        "--topic",
        help=f"rows of this topic ({ROUTED!r}: rows without one, routed by the dispatcher)"
        if ids
        else "rows of this topic",
    )
    parser.add_argument(
        "--since", type=timestamp, help="rows created at or after this ISO-8601 time (UTC if bare)"
    )
    parser.add_argument("--until", type=timestamp, help="rows created before this ISO-8601 time")
    if ids:  # the dead-row commands
        parser.add_argument(
            "--keyless", action="store_true", default=None, help="rows without an ordering key"
        )
        parser.add_argument(
            "--dead-since", type=timestamp, help="rows dead-lettered at or after this time"
        )
        parser.add_argument(
            "--dead-until", type=timestamp, help="rows dead-lettered before this time"
        )
        parser.add_argument(
            "--error", help="rows whose last_error contains this text (in any case)"
        )
    if everything:
        switch(parser, "--all", "every row (no filter)")


def source_flag(parser: argparse.ArgumentParser, *, acts: bool) -> None:
    """--source: with OUTBOX_SOURCES, which outboxes (a command that `acts` needs exactly one;
    --schema narrows it, as it filters `status`)."""
    what = "the outbox to act on" if acts else "only its outboxes"
    parser.add_argument(
        "--source",
        metavar="NAME",
        help=f"with OUTBOX_SOURCES: {what}, by the source's name or the outbox's `source` "
        "label (e.g. tenant_a.outbox); --schema NAME narrows it (a pattern's source to one schema)",
    )


def switch(parser: argparse.ArgumentParser, name: str, help: str) -> None:
    """A flag of the command's own that is off unless given."""
    parser.add_argument(name, action="store_true", help=help)


def safety_flags(parser: argparse.ArgumentParser, *, confirms: bool) -> None:
    switch(parser, "--dry-run", "say what would change, change nothing")
    if confirms:
        switch(
            parser,
            "--yes",
            "do not ask for confirmation on a terminal (--all, the whole table, "
            "--older-than 0 ask)",
        )
