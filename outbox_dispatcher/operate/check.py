"""`check`: the settings, the database and its schema version, the broker, and the topics the
outbox needs, as findings (data); the CLI prints them, one line each."""

from __future__ import annotations

import asyncio
import difflib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from outbox_dispatcher import errors
from outbox_dispatcher.config.names import env_name
from outbox_dispatcher.config.outboxes import Outbox, sources_of
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.config.sources import SECRETS_DIR_VARIABLE
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.kafka.publisher import KafkaPublisher
from outbox_dispatcher.operate import reads, sources
from outbox_dispatcher.operate.session import Session
from outbox_dispatcher.routing import Router
from outbox_dispatcher.sources.registry import State
from outbox_dispatcher.store import StoreBase, db, migrations

# Ids a step of `check --repair`'s sweep walks (at least).
SWEEP_STEP_ROWS = 50_000
# How many pending routed rows `check` routes to find the topics they need.
CHECK_ROUTED_ROWS = 1000
CHECK_BROKER_SECONDS = 15.0

# OUTBOX_* variables of the development tooling (deploy/local/services.sh, the tests), not settings.
TOOLING_PREFIXES = ("OUTBOX_TEST_", "OUTBOX_SERVICES_", "OUTBOX_PGBOUNCER_", "OUTBOX_KAFKA_AUTO_")


Level = Literal["ok", "note", "warning", "problem"]


@dataclass(frozen=True)
class Finding:
    """One line of the report: `ok` and `note` inform, a `warning` is worth a look, and any
    `problem` fails the check."""

    level: Level
    text: str


@dataclass
class _Findings:
    found: list[Finding] = field(default_factory=list)
    needed: dict[str, str] = field(default_factory=dict)  # topic -> who needs it
    dead_topics: set[str] = field(default_factory=set)
    where: str = ""  # with OUTBOX_SOURCES: the outbox being checked, before each line

    def add(self, level: Level, text: str) -> None:
        self.found.append(Finding(level, self.where + text))


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """OUTBOX_* variables that name no setting (a misspelling is otherwise silently ignored),
    each with the closest setting's variable, if one is close."""
    known = {env_name(name) for name in Settings.model_fields}
    valid = known | {f"{name}_FILE" for name in known} | {SECRETS_DIR_VARIABLE}
    found = []
    for variable in sorted(environ):
        if not variable.startswith("OUTBOX_") or variable in valid:
            continue
        if variable.startswith(TOOLING_PREFIXES):
            continue
        close = difflib.get_close_matches(variable, sorted(valid), n=1, cutoff=0.8)
        found.append((variable, close[0] if close else None))
    return found


async def check(
    settings: Settings, *, repair: bool = False, source: str | None = None
) -> list[Finding]:
    """Configuration, database, schema version, the claim engine's view of the table (`repair`:
    run the sweep over the whole table first), broker and the topics rows need. With
    OUTBOX_SOURCES, every outbox of the sources (`source` and --schema filter them)."""
    report = _Findings()
    if settings.sources is None and source is not None:
        report.add(
            "problem", "--source needs OUTBOX_SOURCES: without it the table is OUTBOX_SCHEMA's"
        )
        return report.found
    what = (
        f"table {settings.db_schema}.{settings.table}"
        if settings.sources is None
        else f"{len(sources_of(settings))} sources"
    )
    report.add("ok", f"settings are valid ({what})")
    for variable, close in unknown_variables(os.environ):
        hint = f": did you mean {close}?" if close else ""
        # A problem, not a warning: the setting the operator meant is not in effect.
        report.add("problem", f"{variable} is not a setting and is ignored{hint}")
    if settings.default_topic:
        report.needed[settings.default_topic] = "OUTBOX_DEFAULT_TOPIC"
    if settings.sources is None:
        await _check_table(settings, report, repair=repair)
    else:
        await _check_outboxes(settings, report, sources.Filter.of(settings, source), repair=repair)
    await _check_broker(settings, report)
    return report.found


async def _check_table(settings: Settings, report: _Findings, *, repair: bool) -> None:
    try:
        conn = await db.connect(settings.database_url.get_secret_value(), settings)
    except errors.OutboxDispatcherError as exc:
        report.add("problem", f"database: {exc}")
        return
    try:
        await _check_database(conn, settings, report, repair=repair)
    finally:
        await conn.close()


async def _check_database(
    conn: db.Connection, settings: Settings, report: _Findings, *, repair: bool
) -> None:
    report.add("ok", "database is reachable")
    schema, table = settings.db_schema, settings.table
    try:
        version = await migrations.check_version(conn, schema, table)
    except errors.SchemaVersionError as exc:
        report.add("problem", f"schema: {exc}")
        return
    report.add("ok", f"schema {schema}.{table} is at version {version}")
    if version < migrations.CONSOLE_VERSION:
        # A rolling upgrade's expand step: dispatchers run, operator commands wait.
        report.add(
            "warning",
            f"schema: the operator commands and the console need version "
            f"{migrations.CONSOLE_VERSION}: run `outbox-dispatcher migrate` once no dispatcher "
            f"older than version {migrations.OLDEST_SUPPORTED} runs",
        )
    try:
        await db.require_read_committed(conn)
    except errors.ConfigurationError as exc:
        report.add("problem", str(exc))
    session = Session.of(conn, settings)
    store = session.store
    for row in await store.pending_topics():
        report.needed.setdefault(row["topic"], f"{report.where}pending rows")
    for row in await store.dead_topics():
        report.dead_topics.add(row["topic"])
    await _check_routed(session, settings, report)
    if repair:
        keys = await sweep_whole_table(session.store, settings)
        report.add("ok" if not keys else "note", f"repair: the sweep registered {keys} keys' rows")
    await _check_engine(session, settings, report)
    for p in await reads.read_pauses(session):
        what = "the whole table" if p.topic == reads.WHOLE_TABLE else f"topic {p.topic}"
        report.add("note", f"{what} is paused since {p.paused_at.isoformat(timespec='seconds')}")


async def _check_outboxes(
    settings: Settings, report: _Findings, only: sources.Filter, *, repair: bool
) -> None:
    """Every outbox of the sources that `only` matches: one that cannot be served now is a
    problem (a migration under way: a warning); each served one is checked as a single table is,
    its lines prefixed with its `source` label, one connection per database. An outbox with
    nothing to say is counted, not listed (a pattern may stand for hundreds)."""
    view = await sources.survey(settings, sources_of(settings), only)
    for database in view.databases:
        if not database.reachable:
            report.add("problem", f"database {database.database}: {database.reason}")
    if not view.outboxes:
        report.add("problem", str(sources.nothing_matches(only, view)))
        return
    ready: dict[str, list[Outbox]] = {}
    for o in view.outboxes:
        if o.state is State.READY:
            ready.setdefault(o.outbox.source.database_url.get_secret_value(), []).append(o.outbox)
        elif o.state is not State.UNREACHABLE:  # its database's line says why
            level: Level = "warning" if o.state is State.PENDING else "problem"
            report.add(level, f"{o.label} ({sources.where(o.outbox)}): {o.state}: {o.reason}")
    quiet = 0
    for url, outboxes in ready.items():
        try:
            conn = await db.connect(url, settings)
        except errors.OutboxDispatcherError as exc:
            report.add("problem", f"database of {outboxes[0].label}: {exc}")
            continue
        try:
            for outbox in outboxes:
                quiet += await _check_outbox(conn, settings, outbox, report, repair=repair)
        finally:
            await conn.close()
    report.add("ok", f"{quiet} of {len(view.outboxes)} outboxes ({only.text()}): nothing to report")


async def _check_outbox(
    conn: db.Connection, settings: Settings, outbox: Outbox, report: _Findings, *, repair: bool
) -> bool:
    """One served outbox checked as a single table; whether it had nothing but `ok` to say."""
    one = _Findings(needed=report.needed, dead_topics=report.dead_topics, where=f"{outbox.label}: ")
    table = settings.model_copy(update={"db_schema": outbox.schema, "table": outbox.table})
    await _check_database(conn, table, one, repair=repair)
    said = [f for f in one.found if f.level != "ok"]
    report.found.extend(said)
    return not said


async def sweep_whole_table(store: StoreBase, settings: Settings) -> int:
    """Run the anti-entropy sweep from where it stands to the end and then a whole pass (a claim
    holding the cursor makes a step wait); the keys it registered rows for."""
    rows = max(settings.sweep_rows, SWEEP_STEP_ROWS)
    keys = passes = 0
    while passes < 2:
        found, wrapped = await store.sweep(rows=rows, hold_seconds=settings.lease_seconds)
        keys += found
        passes += wrapped
    return keys


async def _check_engine(session: Session, settings: Settings, report: _Findings) -> None:
    """Pending rows no claim will look at (written around the engine's bookkeeping) until the
    sweep finds them: a drift of the engine's cache from the table."""
    cache = await session.store.id_cache()
    if cache > 1:
        report.add(
            "problem",
            f"the outbox's id identity has CACHE {cache}: a session's cached ids fall below ids "
            "others committed long before, and such rows are found only by the sweep, after "
            f"their key's later rows: ALTER TABLE {settings.db_schema}.{settings.table} ALTER "
            "COLUMN id SET CACHE 1 (docs/writers.md)",
        )
    drift = await session.store.engine_drift()
    if not drift["rows"]:
        report.add("ok", "claim engine: every pending row is where a claim will look for it")
        return
    report.add(
        "warning",
        f"claim engine: {drift['rows']} pending rows of {drift['keys']} keys (first id "
        f"{drift['first_id']}) are known to no claim yet (written with ids below the claim "
        "cursor, or with triggers off): the sweep finds them within a pass; run `check "
        "--repair` to sweep the whole table now",
    )


async def _check_routed(session: Session, settings: Settings, report: _Findings) -> None:
    """The topics of pending rows without one, as the dispatcher would route them."""
    router = Router(settings.default_topic, settings.topic_template)
    unroutable: dict[str, int] = {}
    for row in await session.store.pending_routed_headers(limit=CHECK_ROUTED_ROWS):
        try:
            report.needed.setdefault(router.topic_for(None, row["headers"]), "pending routed rows")
        except errors.RoutingError as exc:
            unroutable[str(exc)] = unroutable.get(str(exc), 0) + 1
    for reason, n in unroutable.items():
        report.add("problem", f"{n} pending routed rows cannot be routed: {reason}")


async def _existing_topics(settings: Settings) -> set[str]:
    """Every topic on the broker: all topics' metadata, naming none, so nothing is auto-created."""
    publisher = KafkaPublisher(configs_of(settings).publisher)
    # The client logs each failed connection itself; the report's line says it once.
    client_log = logging.getLogger("aiokafka")
    level = client_log.level
    client_log.setLevel(logging.CRITICAL)
    try:
        async with asyncio.timeout(CHECK_BROKER_SECONDS):
            await publisher.start()
            return await publisher.topics.existing()
    finally:
        await publisher.stop()
        client_log.setLevel(level)


async def _check_broker(settings: Settings, report: _Findings) -> None:
    try:
        existing = await _existing_topics(settings)
    except (errors.OutboxDispatcherError, TimeoutError) as exc:
        report.add("problem", f"broker: {exc or 'no answer within 15 seconds'}")
        return
    report.add("ok", f"broker {settings.kafka_bootstrap_servers} is reachable")
    needed = report.needed
    missing = sorted(t for t in needed if t not in existing)
    for topic in missing:
        report.add(
            "problem",
            f"topic {topic!r} ({needed[topic]}) does not exist on the broker: create it "
            "(or fix the rows or setting that name it)",
        )
    for topic in sorted(report.dead_topics - existing - set(needed)):
        report.add(
            "note",
            f"topic {topic!r} of dead rows does not exist: create it before `dead requeue`, or "
            "the rows die again",
        )
    if needed and not missing:
        report.add(
            "ok",
            "the one topic the outbox needs exists"
            if len(needed) == 1
            else f"all {len(needed)} topics the outbox needs exist",
        )
