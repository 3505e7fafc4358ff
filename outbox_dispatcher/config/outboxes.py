"""The outboxes a fleet serves (issue 36): OUTBOX_SOURCES, a JSON list of sources, each a
database, a schema or a pattern of schemas (`tenant_*`) and a table; without it, the one table of
OUTBOX_DATABASE_URL, OUTBOX_SCHEMA and OUTBOX_TABLE. Parsed and checked here (`sources_of`), and
expanded against a database's schemas by `expand` (pure: the caller lists the schemas).

No message quotes a database URL or any part of a source's text: a database is named by its hosts,
ports and name (`database_of`), a source by its place in the list and its name."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from outbox_dispatcher import errors
from outbox_dispatcher.config.names import (
    IDENTIFIER,
    PERCENT_ENCODE,
    RESERVED_SCHEMAS,
    common_name,
    database_of,
    database_url_problem,
    schema_matches,
    schema_or_pattern,
    validate_identifier,
)
from outbox_dispatcher.config.sources import SECRETS_DIR_VARIABLE, read_secret_file

VARIABLE = "OUTBOX_SOURCES"
KEYS = ("database_url", "schema", "table", "name", "weight")
EXAMPLE = '[{"schema": "tenant_*"}, {"schema": "billing", "table": "events", "weight": 2}]'
NAME = re.compile(r"^[a-z0-9_-]{1,40}$")  # no '.': a name never reads as an unnamed schema.table
WEIGHT_MAX = 100
LABEL_MAX = 64
RESERVED_NAME = "other"  # metrics.OTHER


class Defaults(Protocol):
    """The single-table settings (config/settings.Settings has them)."""

    @property
    def database_url(self) -> SecretStr: ...
    @property
    def db_schema(self) -> str: ...
    @property
    def table(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class SourceDefaults:
    """The single-table settings as the `sources` setting's validator has them."""

    database_url: SecretStr
    db_schema: str
    table: str


def _url(value: SecretStr | None) -> SecretStr | None:
    if value is not None and (problem := database_url_problem(value.get_secret_value())):
        msg = (
            f"not a usable PostgreSQL URL ({problem}): expected postgresql://user:password@"
            f"host:port/database[?option=value]; {PERCENT_ENCODE}"
        )
        raise ValueError(msg)
    return value


def _name(value: str | None) -> str | None:
    if value is not None and not NAME.match(value):
        msg = f"{value!r} is not allowed: use 1-40 lowercase letters, digits, '_' or '-'"
        raise ValueError(msg)
    if value == RESERVED_NAME:
        msg = (
            f"{value!r} is reserved (the `source` label of the outboxes beyond the metrics' bound)"
        )
        raise ValueError(msg)
    return value


class SourceItem(BaseModel):
    """One item of OUTBOX_SOURCES as written; `Source` is what it means."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    database_url: SecretStr | None = None
    db_schema: str = Field(alias="schema")
    table: str = "outbox"
    name: str | None = None
    weight: int = Field(default=1, ge=1, le=WEIGHT_MAX, strict=True)

    _check_url = field_validator("database_url")(_url)
    _check_schema = field_validator("db_schema")(schema_or_pattern)
    _check_table = field_validator("table")(lambda value: validate_identifier(value, "table"))
    _check_name = field_validator("name")(_name)


@dataclasses.dataclass(frozen=True)
class Source:
    """A source with its defaults applied: the tables it serves are `expand`'s."""

    database_url: SecretStr
    schema: str  # a name, or a pattern with '*'
    table: str
    name: str | None = None
    weight: int = 1

    @property
    def database(self) -> str:
        return database_of(self.database_url.get_secret_value())

    @property
    def is_pattern(self) -> bool:
        return "*" in self.schema

    @property
    def label(self) -> str:
        return bounded(self.name or f"{self.schema}.{self.table}")

    def matches(self, schema: str) -> bool:
        """Whether this source serves `schema` (its name, or a name its pattern matches)."""
        return schema_matches(self.schema, schema)


@dataclasses.dataclass(frozen=True)
class Outbox:
    """One table a source serves: what the single-table engine runs on (cursor, work, holes and
    leases are per table already)."""

    source: Source
    schema: str

    @property
    def table(self) -> str:
        return self.source.table

    @property
    def database(self) -> str:
        return self.source.database

    @property
    def label(self) -> str:
        """The `source` label of metrics: the source's name (with the schema of a pattern's
        table), or schema.table; at most LABEL_MAX characters, never the database URL."""
        s = self.source
        if s.name:
            return bounded(f"{s.name}/{self.schema}" if s.is_pattern else s.name)
        return bounded(f"{self.schema}.{self.table}")


def bounded(label: str) -> str:
    """`label`, or its first characters and a hash of the whole when it is too long (two long
    labels that share their start stay apart)."""
    if len(label) <= LABEL_MAX:
        return label
    digest = hashlib.blake2b(label.encode(), digest_size=4).hexdigest()
    return f"{label[: LABEL_MAX - 9]}~{digest}"


def sources_of(settings: Defaults, environ: Mapping[str, str] | None = None) -> tuple[Source, ...]:
    """The sources: OUTBOX_SOURCES, else the file of OUTBOX_SOURCES_FILE, else OUTBOX_SOURCES in
    OUTBOX_SECRETS_DIR (as every setting); without any, the one table of the settings. The
    `sources` setting (read from the same places, or a flag) is what counts when `environ` is
    not given."""
    given = getattr(settings, "sources", None)
    if environ is None and isinstance(given, SecretStr):
        return parse_sources(given.get_secret_value(), VARIABLE, settings)
    env = os.environ if environ is None else environ
    found = _read(env)
    if found is None:
        return (Source(settings.database_url, settings.db_schema, settings.table),)
    return parse_sources(*found, settings)


def sources_given(environ: Mapping[str, str] | None = None) -> bool:
    """Whether OUTBOX_SOURCES is set (in any of its places), rather than the one table."""
    return _read(os.environ if environ is None else environ) is not None


def _read(env: Mapping[str, str]) -> tuple[str, str] | None:
    if VARIABLE in env:
        return env[VARIABLE], VARIABLE
    if path := env.get(f"{VARIABLE}_FILE"):
        where = f"{VARIABLE}_FILE={path}"
        return read_secret_file(Path(path), where), f"the file of {where}"
    directory = env.get(SECRETS_DIR_VARIABLE)
    if directory and Path(directory).is_dir():
        for file in sorted(Path(directory).iterdir()):
            if file.name.upper() == VARIABLE and file.is_file():
                where = f"{VARIABLE} in {SECRETS_DIR_VARIABLE}"
                return read_secret_file(file, where), where
    return None


def parse_sources(text: str, where: str, defaults: Defaults) -> tuple[Source, ...]:
    """The sources of OUTBOX_SOURCES's `text` (read from `where`), checked as a whole."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        msg = (
            f"{where} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}): "
            f"expected a list of sources such as {EXAMPLE}"
        )
        raise errors.ConfigurationError(msg) from None
    if not isinstance(data, list) or not data:
        what = "an empty list" if data == [] else _kind(data)
        msg = (
            f"{where} is {what}: expected a list of one or more sources such as {EXAMPLE} "
            "(or unset it to serve OUTBOX_SCHEMA's OUTBOX_TABLE)"
        )
        raise errors.ConfigurationError(msg)
    items = [_item(item, f"{where} item {n}") for n, item in enumerate(data, 1)]
    sources = tuple(
        Source(i.database_url or defaults.database_url, i.db_schema, i.table, i.name, i.weight)
        for i in items
    )
    places = [
        f"{where} item {n}" + (f" ({s.name})" if s.name else "") for n, s in enumerate(sources, 1)
    ]
    _check_together(list(zip(sources, places, strict=True)))
    return sources


def _kind(value: Any) -> str:
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "true or false"}
    return "null" if value is None else kinds.get(type(value), "a number")


def _item(item: Any, where: str) -> SourceItem:
    if not isinstance(item, dict):
        msg = f"{where} is {_kind(item)}: expected an object with keys {', '.join(KEYS)}"
        raise errors.ConfigurationError(msg)
    try:
        return SourceItem.model_validate(item)
    except ValidationError as exc:
        # Never str(exc): pydantic's text quotes the input, and with it a database URL.
        problems = []
        for error in exc.errors():
            key = str(error["loc"][0]) if error["loc"] else "?"
            shown = repr(key) if re.fullmatch(r"[A-Za-z0-9_ -]{1,40}", key) else "a key"
            if error["type"] == "extra_forbidden":
                problems.append(f"unknown key {shown}: the keys are {', '.join(KEYS)}")
            elif error["type"] == "missing":
                problems.append(f"{key} is required (a schema name, or a pattern like tenant_*)")
            elif key == "weight":
                problems.append(f"weight must be a whole number from 1 to {WEIGHT_MAX}")
            else:
                message = str(error["msg"]).removeprefix("Value error, ")
                problems.append(message if message.startswith(key) else f"{key}: {message}")
        text = "; ".join(problems)
        for value in item.values():  # a URL given under another key is not shown either
            if isinstance(value, str) and ("://" in value or "@" in value):
                text = text.replace(repr(value), "(a URL)").replace(value, "(a URL)")
        raise errors.ConfigurationError(f"{where}: {text}") from None


def _check_together(placed: Sequence[tuple[Source, str]]) -> None:
    """Names are unique; no table is served by two sources; labels tell the tables apart."""
    for (a, place_a), (b, place_b) in itertools.combinations(placed, 2):
        if a.name and a.name == b.name:
            msg = f"{place_a} and {place_b} are both named {a.name!r}: rename one of them"
            raise errors.ConfigurationError(msg)
        if a.table != b.table or (shared := common_name(a.schema, b.schema)) is None:
            continue
        if a.database == b.database:
            msg = (
                f"{place_a} and {place_b} can both serve {shared}.{a.table} in database "
                f"{a.database}: a table is served by one source; narrow a pattern or remove one "
                "of them"
            )
            raise errors.ConfigurationError(msg)
        if not (a.name or b.name):
            msg = (
                f"{place_a} and {place_b} can both serve a table {shared}.{a.table} (in databases "
                f"{a.database} and {b.database}) and the `source` label of metrics and the "
                "console would not tell them apart: give one of them a name"
            )
            raise errors.ConfigurationError(msg)


def expand(sources: Iterable[Source], database: str, schemas: Iterable[str]) -> list[Outbox]:
    """The outboxes of `database` (as database_of names it) given its `schemas` (e.g. those that
    hold the table): each literal source of it (whether its schema is listed or not: a missing
    one is that source's failure to report), and for each pattern every listed schema it matches,
    sorted; system schemas and names that are no valid identifier never match. In the sources'
    order, each table once (the first source's)."""
    existing = sorted(
        {s for s in schemas if IDENTIFIER.match(s) and not s.startswith("pg_")} - RESERVED_SCHEMAS
    )
    seen: set[tuple[str, str]] = set()
    found = []
    for source in sources:
        if source.database != database:
            continue
        names = [s for s in existing if source.matches(s)] if source.is_pattern else [source.schema]
        for schema in names:
            if (schema, source.table) not in seen:
                seen.add((schema, source.table))
                found.append(Outbox(source, schema))
    return found
