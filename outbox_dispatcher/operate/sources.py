"""The operator's faces over many outboxes (OUTBOX_SOURCES, issue 36): which outboxes the sources
stand for now and in what state (one pass of the source registry), filtered by a source's name
or label and a schema; the one outbox an action acts on; the status of each, as data.

Every action still acts on one table through the single-table code: `target` gives the settings
of the outbox a filter names (its database URL, schema and table), which `session.connected`
opens as it opens OUTBOX_DATABASE_URL's table without OUTBOX_SOURCES."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from outbox_dispatcher import errors
from outbox_dispatcher.config.names import schema_matches
from outbox_dispatcher.config.outboxes import Outbox, Source, sources_of
from outbox_dispatcher.config.settings import DeliveryMode, Settings
from outbox_dispatcher.operate import reads
from outbox_dispatcher.operate.actions import ActionRefusedError
from outbox_dispatcher.operate.session import Session, audit_lock_key
from outbox_dispatcher.sources import registry as registry_module
from outbox_dispatcher.sources.registry import OutboxState, SourceRegistry, State, View
from outbox_dispatcher.store import Statements, db, migrations

# The outboxes a refusal lists (the rest are counted).
LISTED = 20


@dataclasses.dataclass(frozen=True)
class Filter:
    """--source (a source's name, or an outbox's `source` label) and --schema (a schema);
    None: any."""

    source: str | None = None
    schema: str | None = None

    @classmethod
    def of(cls, settings: Settings, source: str | None) -> Filter:
        """`source` as given; the schema when --schema or OUTBOX_SCHEMA was given (as for
        `migrate`: with OUTBOX_SOURCES they are a filter, not a table)."""
        schema = settings.db_schema if "db_schema" in settings.model_fields_set else None
        return cls(source, schema)

    def matches(self, outbox: Outbox) -> bool:
        if self.source is not None and self.source not in (outbox.source.name, outbox.label):
            return False
        return self.schema is None or schema_matches(self.schema, outbox.schema)

    def text(self) -> str:
        given = [f"--source {self.source}"] if self.source is not None else []
        given += [f"--schema {self.schema}"] if self.schema is not None else []
        return " ".join(given) or "no filter"


async def survey(settings: Settings, sources: Sequence[Source], only: Filter) -> View:
    """Every outbox of the sources with its state (ready, pending, missing, broken, unreachable)
    and every database, after one pass of the registry; the outboxes `only` matches."""
    registry = SourceRegistry.from_settings(sources, settings)
    try:
        with _quiet(registry_module.__name__):
            view = await registry.refresh()
    finally:
        await registry.close()
    chosen = tuple(o for o in view.outboxes if only.matches(o.outbox))
    return View(chosen, view.databases)


async def target(settings: Settings, source: str | None) -> Settings:
    """The settings of the one table an operator command acts on: without OUTBOX_SOURCES the
    settings' own; with it, the outbox `source` and --schema name (refused, listing the
    outboxes, when they name none or several)."""
    only = Filter.of(settings, source)
    if settings.sources is None:
        if source is not None:
            msg = "--source needs OUTBOX_SOURCES: without it the table is OUTBOX_SCHEMA's"
            raise ActionRefusedError(msg)
        return settings
    everything = await survey(settings, sources_of(settings), Filter())
    found = [o for o in everything.outboxes if only.matches(o.outbox)]
    if len(found) == 1:
        return settings_of(settings, found[0].outbox)
    if not found:
        raise nothing_matches(only, everything)
    msg = (
        f"{only.text()} matches {len(found)} outboxes ({listing(found)}): name one with "
        "--source LABEL (or --schema NAME when that is enough)"
    )
    raise ActionRefusedError(msg)


def settings_of(settings: Settings, outbox: Outbox) -> Settings:
    """The settings of one outbox's table (an operator command's, a console's)."""
    return settings.model_copy(
        update={
            "database_url": outbox.source.database_url,
            "db_schema": outbox.schema,
            "table": outbox.table,
        }
    )


async def labelled(settings: Settings, sources: Sequence[Source], label: str) -> Settings | None:
    """The settings of the outbox whose `source` label is `label` (the console's pages of
    another outbox: console/outboxes.py), or None."""
    view = await survey(settings, sources, Filter())
    found = [o.outbox for o in view.outboxes if o.outbox.label == label]
    return settings_of(settings, found[0]) if len(found) == 1 else None


def nothing_matches(only: Filter, view: View) -> ActionRefusedError:
    """The refusal of a filter that names no outbox: the outboxes there are, and the databases
    that could not be read (a pattern's outboxes there are unknown)."""
    away = [f"{d.database} ({d.reason})" for d in view.databases if not d.reachable]
    unread = f"; not reachable now: {', '.join(away)}" if away else ""
    return ActionRefusedError(
        f"no outbox matches {only.text()}: the outboxes are {listing(view.outboxes)}{unread}"
    )


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """The registry's lines about each outbox it finds (one per outbox) are what the command
    prints as data: not logged beside it, unless an error."""
    logger = logging.getLogger(name)
    was = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(was)


def listing(outboxes: Sequence[OutboxState]) -> str:
    """The outboxes as a refusal lists them: label, table and database, LISTED at most."""
    shown = [f"{o.label} ({where(o.outbox)})" for o in outboxes[:LISTED]]
    more = len(outboxes) - LISTED
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "") if shown else "none"


def where(outbox: Outbox) -> str:
    return f"{outbox.schema}.{outbox.table} of {outbox.database}"


@dataclasses.dataclass(frozen=True)
class OutboxStatus:
    """One outbox of the sources for `status`: its state in the registry and, when its table
    could be read, its status as the single-table `status` gives it (`error`: why not)."""

    state: OutboxState
    snapshot: reads.Snapshot | None = None
    error: str | None = None
    refused: str | None = None  # why OUTBOX_DELIVERY=exactly-once does not serve it

    def as_json(self) -> dict[str, Any]:
        o, snap = self.state.outbox, self.snapshot
        return {
            "source": o.label,
            "source_name": o.source.name,
            "database": o.database,
            "schema": o.schema,
            "table": o.table,
            "state": self.state.state.value,
            "reason": self.state.reason,
            "version": self.state.version,
            "error": self.error,
            "refused": self.refused,
            "status": None if snap is None else snap.as_json(),
        }


async def statuses(
    settings: Settings, sources: Sequence[Source], only: Filter
) -> tuple[View, list[OutboxStatus]]:
    """The registry's view (every outbox) and the status of every outbox `only` matches; each
    database over one connection; an outbox or database that cannot be read says why and stops
    no other."""
    view = await survey(settings, sources, Filter())
    chosen = [o for o in view.outboxes if only.matches(o.outbox)]
    found: list[OutboxStatus] = []
    for database in sorted({o.outbox.database for o in chosen}):
        of_database = [o for o in chosen if o.outbox.database == database]
        found += await _statuses_of(settings, of_database)
    return view, [_refusal(settings, one) for one in found]


async def _statuses_of(settings: Settings, outboxes: list[OutboxState]) -> list[OutboxStatus]:
    readable = [o for o in outboxes if _readable(o)]
    found = {o.outbox: OutboxStatus(o, error=_unreadable(o)) for o in outboxes}
    if not readable:
        return list(found.values())
    url = readable[0].outbox.source.database_url.get_secret_value()
    try:
        conn = await db.connect(url, settings, setting="OUTBOX_SOURCES")
    except FAILURES as exc:
        error = _reason(exc, url)
        return [dataclasses.replace(s, error=s.error or error) for s in found.values()]
    try:
        for state in readable:
            found[state.outbox] = await _status_of(conn, url, state, settings)
    finally:
        await conn.close()
    return list(found.values())


async def _status_of(
    conn: db.Connection, url: str, state: OutboxState, settings: Settings
) -> OutboxStatus:
    o = state.outbox
    session = Session(
        conn,
        Statements.for_table(o.schema, o.table),
        f"{o.schema}.{o.table}",
        audit_lock_key(o.schema, o.table),
    )
    try:
        policy = settings.dead_letter_policy.value  # when none of its dispatchers is alive
        return OutboxStatus(state, await reads.snapshot(session, policy))
    except FAILURES as exc:
        return OutboxStatus(state, error=_reason(exc, url))


def _refusal(settings: Settings, one: OutboxStatus) -> OutboxStatus:
    """Exactly-once: an outbox the fleet refuses (its schema too old for the mode), said so."""
    version = one.state.version
    if settings.delivery is not DeliveryMode.EXACTLY_ONCE or version is None:
        return one
    if one.state.state is not State.READY:
        return one
    return dataclasses.replace(one, refused=migrations.exactly_once_refusal(version))


def _readable(state: OutboxState) -> bool:
    version = state.version
    return state.state is State.READY and version is not None and version >= CONSOLE_VERSION


def _unreadable(state: OutboxState) -> str | None:
    if state.state is not State.READY:
        return None  # its state and reason say why
    return (
        f"its schema is at version {state.version}; status needs {CONSOLE_VERSION}: run "
        "`outbox-dispatcher migrate`"
    )


def _reason(exc: BaseException, url: str) -> str:
    return db.redact(errors.describe(exc), url)


CONSOLE_VERSION = migrations.CONSOLE_VERSION
FAILURES: tuple[type[BaseException], ...] = (
    db.PostgresError,
    errors.OutboxDispatcherError,
    *db.CONNECTION_ERRORS,
)
