"""The operator commands of the CLI: dead rows (list, requeue, discard), replay, pause/resume,
cleanup, check. Parsing, confirmation, progress and printing live here; what the commands do
lives in operations.py, which the console calls too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg
import orjson
import structlog
from tqdm import tqdm

from outbox_dispatcher import (
    broker,
    cleanup,
    db,
    display,
    errors,
    listener,
    migrations,
    routing,
    status,
)
from outbox_dispatcher.operations import (
    NULL_KEY,
    NULL_TOPIC,
    Filters,
    Progress,
    audit,
    connected,
    dead_count,
    dead_discard,
    dead_list,
    dead_requeue,
    pause,
    release_held,
    replay,
    replay_count,
    resume,
    wake,
)
from outbox_dispatcher.publisher import KafkaPublisher
from outbox_dispatcher.routing import Router
from outbox_dispatcher.settings import SECRETS_DIR_VARIABLE, Settings, env_name
from outbox_dispatcher.sql import Queries
from outbox_dispatcher.store import Store

log = structlog.get_logger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

# How many pending routed rows `check` routes to find the topics they need.
CHECK_ROUTED_ROWS = 1000
CHECK_BROKER_SECONDS = 15.0
# dead list without --full: the widths of the key and last_error columns.
KEY_WIDTH = 40
ERROR_WIDTH = 160

Handler = Callable[[Settings, argparse.Namespace], Coroutine[Any, Any, int]]


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")


def _err(line: str) -> None:
    sys.stderr.write(f"outbox-dispatcher: {line}\n")


def _json(value: object) -> None:
    sys.stdout.write(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode() + "\n")


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


# --- CLI ---------------------------------------------------------------------------------------


def _refuse_unfiltered(filters: Filters, ns: argparse.Namespace, what: str) -> str | None:
    if ns.all and not filters.empty():
        return "--all cannot be combined with filters"
    if not ns.all and filters.empty():
        flags = (
            "--from-id, --to-id, --key, --topic, --since, --until"
            if what.startswith("replay")
            else "--id, --key, --keyless, --topic, --since, --until, --dead-since, --dead-until, "
            "--error"
        )
        return f"refusing to {what} without a filter: give {flags}, or --all"
    if (
        filters.from_id is not None
        and filters.to_id is not None
        and filters.from_id > filters.to_id
    ):
        return f"--from-id {filters.from_id} is after --to-id {filters.to_id}: no row is between"
    return None


def rows(n: int, what: str) -> str:
    """'1 dead row', '2 dead rows'."""
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def confirm(ns: argparse.Namespace, question: str) -> bool:
    """The widest commands ask on a terminal unless --yes; in a script (no terminal) they run."""
    if getattr(ns, "yes", False) or not sys.stdin.isatty():
        return True
    sys.stderr.write(f"outbox-dispatcher: {question} Type 'yes' to go on: ")
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() == "yes"


@contextlib.contextmanager
def progress(total: int | None, what: str) -> Iterator[Progress]:
    """A progress bar on stderr when it is a terminal; nothing otherwise."""
    bar = tqdm(
        total=total,
        desc=what,
        unit=" rows",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
        dynamic_ncols=True,
    )
    try:
        yield bar.update
    finally:
        bar.close()


async def _dead_list(settings: Settings, ns: argparse.Namespace) -> int:
    async with connected(settings) as (conn, queries):
        found = await dead_list(conn, queries, Filters.of(ns), ns.limit)
    if ns.json:
        _json(found)
    else:
        _out(dead_table(found, full=ns.full))
    if len(found) == ns.limit:
        _err(f"showing the first {ns.limit} dead rows; --limit shows more")
    return EXIT_OK


def dead_table(found: list[dict[str, Any]], *, full: bool = False) -> str:
    """Dead rows for a terminal. Keys and errors are cut (a 2 kB key would pad every line)
    unless `full`; every cell is made inert by display.columns."""
    key_width, error_width = (None, None) if full else (KEY_WIDTH, ERROR_WIDTH)
    header = ("id", "event_id", "topic", "key", "attempts", "created_at", "dead_at", "last_error")
    cells = [
        (
            str(r["id"]),
            str(r["event_id"]),
            NULL_TOPIC if r["topic"] is None else r["topic"],
            NULL_KEY if r["ordering_key"] is None else _cut(r["ordering_key"], key_width),
            str(r["attempts"]),
            r["created_at"].isoformat(timespec="seconds"),
            r["dead_at"].isoformat(timespec="seconds"),
            _cut(r["last_error"] or "", error_width),
        )
        for r in found
    ]
    return "\n".join(display.columns(header, cells))


def _cut(text: str, width: int | None) -> str:
    return text if width is None else display.shorten(text, width)


async def _dead_change(settings: Settings, ns: argparse.Namespace, *, discard: bool) -> int:
    verb = "discard" if discard else "requeue"
    filters = Filters.of(ns)
    if problem := _refuse_unfiltered(filters, ns, f"{verb} dead rows"):
        _err(problem)
        return EXIT_USAGE
    async with connected(settings) as (conn, queries):
        matching = await dead_count(conn, queries, filters)
        if ns.dry_run or not matching:
            _out(f"would {verb} {rows(matching, 'dead row')}" if ns.dry_run else _no_dead_rows())
            return EXIT_OK
        if ns.all and discard and not confirm(ns, f"discard all {rows(matching, 'dead row')}?"):
            _err("not confirmed: nothing changed")
            return EXIT_FAILED
        operation = dead_discard if discard else dead_requeue
        with progress(matching, f"{verb} dead rows") as advance:
            n = await operation(conn, queries, filters, settings.cleanup_batch_size, advance)
        if n and not discard:
            await wake(conn, queries, listener.channel_name(settings))
    log.info("dead_discarded" if discard else "dead_requeued", rows=n, filter=filters.as_json())
    _out(f"{'discarded' if discard else 'requeued'} {rows(n, 'dead row')}")
    return EXIT_OK


def _no_dead_rows() -> str:
    return (
        "no dead row matches: nothing changed (`outbox-dispatcher dead list` shows the dead rows)"
    )


async def _dead_requeue(settings: Settings, ns: argparse.Namespace) -> int:
    return await _dead_change(settings, ns, discard=False)


async def _dead_discard(settings: Settings, ns: argparse.Namespace) -> int:
    return await _dead_change(settings, ns, discard=True)


async def _replay(settings: Settings, ns: argparse.Namespace) -> int:
    if ns.release_held:
        async with connected(settings) as (conn, queries):
            n = await release_held(conn, queries, ns.topic)
            if n:
                await wake(conn, queries, listener.channel_name(settings))
        log.info("replay_released", rows=n, topic=ns.topic)
        _out(f"released {rows(n, 'held row')}")
        return EXIT_OK
    filters = Filters.of(ns)
    if problem := _refuse_unfiltered(filters, ns, "replay published rows"):
        _err(problem)
        return EXIT_USAGE
    if settings.delete_on_publish:
        _err(
            "nothing to replay: with OUTBOX_DELETE_ON_PUBLISH the dispatcher deletes rows once "
            "they are published, so the outbox keeps no published rows"
        )
        return EXIT_FAILED
    async with connected(settings) as (conn, queries):
        matching = await replay_count(conn, queries, filters)
        if ns.dry_run or not matching:
            _out(
                f"would replay {rows(matching, 'published row')}"
                if ns.dry_run
                else "no published row matches: nothing replayed"
            )
            return EXIT_OK
        if ns.all and not confirm(ns, f"replay all {rows(matching, 'published row')}?"):
            _err("not confirmed: nothing changed")
            return EXIT_FAILED
        with progress(matching, "replay") as advance:
            n = await replay(conn, queries, filters, settings.cleanup_batch_size, advance)
        if n:
            await wake(conn, queries, listener.channel_name(settings))
    log.info("replayed", rows=n, filter=filters.as_json())
    _out(f"replayed {rows(n, 'published row')}: pending again, with their event ids")
    return EXIT_OK


async def _pause(settings: Settings, ns: argparse.Namespace) -> int:
    what = f"topic {ns.topic}" if ns.topic else "the whole table (every topic, routed rows too)"
    if ns.dry_run:
        _out(f"would pause {what}")
        return EXIT_OK
    if ns.topic is None and not confirm(ns, f"pause {what}?"):
        _err("not confirmed: nothing changed")
        return EXIT_FAILED
    async with connected(settings) as (conn, queries):
        paused = await pause(conn, queries, ns.topic, ns.reason)
        in_flight = await Store(conn, queries).in_flight_rows(topic=ns.topic)
    log.info("paused", topic=ns.topic, reason=ns.reason, by=paused.paused_by)
    _out(f"paused {what} (since {paused.paused_at.isoformat(timespec='seconds')})")
    if in_flight:
        _out(
            f"{rows(in_flight, 'row')} already claimed still being published; "
            "nothing new is claimed"
        )
    return EXIT_OK


async def _resume(settings: Settings, ns: argparse.Namespace) -> int:
    async with connected(settings) as (conn, queries):
        lifted = await resume(conn, queries, ns.topic, listener.channel_name(settings))
        remaining = await status.read_pauses(conn, queries)
    what = f"topic {ns.topic}" if ns.topic else "the whole table"
    if lifted is None:
        _out(f"{what} was not paused: nothing changed")
    else:
        log.info("resumed", topic=ns.topic)
        _out(f"resumed {what}")
    if any(p.topic == status.WHOLE_TABLE for p in remaining):
        _out("the whole table is still paused: `outbox-dispatcher resume` lifts that")
    elif ns.topic is None and remaining:
        _out("still paused: " + ", ".join(p.topic for p in remaining))
    return EXIT_OK


async def _cleanup(settings: Settings, ns: argparse.Namespace) -> int:
    older_than = settings.retention_seconds if ns.older_than is None else ns.older_than
    if ns.older_than is None and older_than == 0:
        _out(
            "OUTBOX_RETENTION_SECONDS is 0 (keep published rows): nothing deleted; "
            "--older-than SECONDS deletes anyway"
        )
        return EXIT_OK
    async with connected(settings) as (conn, queries):
        matching = await Store(conn, queries).cleanup_count(older_than_seconds=older_than)
        if ns.dry_run:
            _out(f"would delete {rows(matching, 'published row')} older than {older_than:g}s")
            return EXIT_OK
        if ns.older_than == 0 and matching:
            question = (
                f"delete all {rows(matching, 'published row')} (the whole published history)?"
            )
            if not confirm(ns, question):
                _err("not confirmed: nothing changed")
                return EXIT_FAILED
        with progress(matching, "cleanup") as advance:
            swept = await cleanup.delete_published(
                conn, queries, older_than, settings.cleanup_batch_size, advance
            )
        await audit(conn, queries, "cleanup", {"older_than_seconds": older_than}, swept.deleted)
    log.info("cleanup_done", rows=swept.deleted, batches=swept.batches)
    _out(f"deleted {rows(swept.deleted, 'published row')} older than {older_than:g}s")
    return EXIT_OK


@dataclass
class Report:
    problems: int = 0

    def ok(self, line: str) -> None:
        _out(f"ok: {display.inert(line)}")

    def note(self, line: str) -> None:
        _out(f"note: {display.inert(line)}")

    def problem(self, line: str) -> None:
        self.problems += 1
        sys.stderr.write(f"problem: {display.inert(line)}\n")

    def warning(self, line: str) -> None:
        sys.stderr.write(f"warning: {display.inert(line)}\n")


# OUTBOX_* variables of the development tooling (deploy/local/services.sh, the tests), not settings.
TOOLING_PREFIXES = ("OUTBOX_TEST_", "OUTBOX_SERVICES_", "OUTBOX_PGBOUNCER_", "OUTBOX_KAFKA_AUTO_")


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


async def check(settings: Settings) -> Report:
    """Configuration, database, schema version, broker and the topics rows need."""
    report = Report()
    report.ok(f"settings are valid (table {settings.db_schema}.{settings.table})")
    for variable, close in unknown_variables(os.environ):
        hint = f": did you mean {close}?" if close else ""
        report.warning(f"{variable} is not a setting and is ignored{hint}")
    needed: dict[str, str] = {}
    dead_topics: set[str] = set()
    if settings.default_topic:
        needed[settings.default_topic] = "OUTBOX_DEFAULT_TOPIC"
    try:
        conn = await db.connect(settings.database_url.get_secret_value(), settings)
    except errors.OutboxDispatcherError as exc:
        report.problem(f"database: {exc}")
    else:
        try:
            await _check_database(conn, settings, report, needed, dead_topics)
        finally:
            await conn.close()
    await _check_broker(settings, report, needed, dead_topics)
    return report


async def _check_database(
    conn: asyncpg.Connection,
    settings: Settings,
    report: Report,
    needed: dict[str, str],
    dead_topics: set[str],
) -> None:
    report.ok("database is reachable")
    schema, table = settings.db_schema, settings.table
    try:
        await migrations.check_version(conn, schema, table)
    except errors.SchemaVersionError as exc:
        report.problem(f"schema: {exc}")
        return
    report.ok(f"schema {schema}.{table} is at version {migrations.latest_version()}")
    queries = Queries.for_table(schema, table)
    store = Store(conn, queries)
    for row in await store.pending_topics():
        needed.setdefault(row["topic"], "pending rows")
    for row in await store.dead_topics():
        dead_topics.add(row["topic"])
    router = Router(settings.default_topic, settings.topic_template)
    unroutable: dict[str, int] = {}
    for row in await store.pending_routed_headers(limit=CHECK_ROUTED_ROWS):
        try:
            needed.setdefault(router.topic_for(None, row["headers"]), "pending routed rows")
        except errors.RoutingError as exc:
            unroutable[str(exc)] = unroutable.get(str(exc), 0) + 1
    for reason, n in unroutable.items():
        report.problem(f"{n} pending routed rows cannot be routed: {reason}")
    for p in await status.read_pauses(conn, queries):
        what = "the whole table" if p.topic == status.WHOLE_TABLE else f"topic {p.topic}"
        report.note(f"{what} is paused since {p.paused_at.isoformat(timespec='seconds')}")


async def _check_broker(
    settings: Settings, report: Report, needed: dict[str, str], dead_topics: set[str]
) -> None:
    publisher = KafkaPublisher(settings)
    # The client logs each failed connection itself; the report line says it once.
    client_log = logging.getLogger("aiokafka")
    level = client_log.level
    client_log.setLevel(logging.CRITICAL)
    try:
        async with asyncio.timeout(CHECK_BROKER_SECONDS):
            await publisher.start()
            # All topics' metadata: naming no topic, so that nothing is auto-created.
            cluster = await broker.all_metadata(publisher.producer)
    except (errors.OutboxDispatcherError, TimeoutError) as exc:
        report.problem(f"broker: {exc or 'no answer within 15 seconds'}")
        return
    finally:
        await publisher.stop()
        client_log.setLevel(level)
    report.ok(f"broker {settings.kafka_bootstrap_servers} is reachable")
    existing = cluster.topics()
    missing = sorted(t for t in needed if t not in existing)
    for topic in missing:
        report.problem(
            f"topic {topic!r} ({needed[topic]}) does not exist on the broker: create it "
            "(or fix the rows or setting that name it)"
        )
    for topic in sorted(dead_topics - existing - set(needed)):
        report.note(
            f"topic {topic!r} of dead rows does not exist: create it before `dead requeue`, or "
            "the rows die again"
        )
    if needed and not missing:
        report.ok(
            "the one topic the outbox needs exists"
            if len(needed) == 1
            else f"all {len(needed)} topics the outbox needs exist"
        )


async def _check(settings: Settings, _: argparse.Namespace) -> int:
    report = await check(settings)
    return EXIT_FAILED if report.problems else EXIT_OK


def _filter_flags(parser: argparse.ArgumentParser, *, ids: bool, everything: bool) -> None:
    if ids:
        parser.add_argument(
            "--id", dest="ids", type=int, action="append", help="a row id (repeatable)"
        )
    parser.add_argument("--key", help="rows of this ordering key")
    parser.add_argument(
        "--topic",
        help=f"rows of this topic ({NULL_TOPIC!r}: rows without one, routed by the dispatcher)"
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
        parser.add_argument("--all", action="store_true", help="every row (no filter)")


_BATCHED_INTERRUPTED = (
    "interrupted: the batches done so far are kept and every row is in a valid state; "
    "run the command again to finish"
)


def _safety_flags(parser: argparse.ArgumentParser, *, confirms: bool) -> None:
    parser.add_argument(
        "--dry-run", action="store_true", help="say what would change, change nothing"
    )
    if confirms:
        parser.add_argument(
            "--yes",
            action="store_true",
            help="do not ask for confirmation on a terminal (--all, the whole table, "
            "--older-than 0 ask)",
        )


def add_parsers(
    commands: argparse._SubParsersAction[Any],
    add_setting_flags: Callable[[argparse.ArgumentParser, str], None],
) -> None:
    """The operator commands, each with the setting flags (as run and status have)."""

    dead = commands.add_parser(
        "dead", help="list, requeue or discard dead-lettered rows", description=_DEAD
    )
    dead_commands = dead.add_subparsers(dest="dead_command", required=True, metavar="ACTION")
    listing = dead_commands.add_parser("list", help="show dead rows", description="Dead rows.")
    _filter_flags(listing, ids=True, everything=False)
    listing.add_argument("--limit", type=positive, default=100, help="at most this many (100)")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.add_argument(
        "--full", action="store_true", help="do not cut long keys and errors in the table"
    )
    listing.set_defaults(handler=_dead_list)
    requeue = dead_commands.add_parser(
        "requeue",
        help="make dead rows pending again",
        description="Make matching dead rows pending again: attempts 0, due now; last_error keeps "
        "a trace. They go out before newer rows of their key.",
    )
    _filter_flags(requeue, ids=True, everything=True)
    _safety_flags(requeue, confirms=False)
    requeue.set_defaults(handler=_dead_requeue, interrupted=_BATCHED_INTERRUPTED)
    discard = dead_commands.add_parser(
        "discard", help="delete dead rows", description="Delete matching dead rows for good."
    )
    _filter_flags(discard, ids=True, everything=True)
    _safety_flags(discard, confirms=True)
    discard.set_defaults(handler=_dead_discard, interrupted=_BATCHED_INTERRUPTED)

    again = commands.add_parser(
        "replay",
        help="publish already published rows again",
        description="Publish matching published rows again, with their original event ids, in "
        "id order per key and before newer rows of their keys.",
    )
    again.add_argument("--from-id", type=int, help="rows with id >= this")
    again.add_argument("--to-id", type=int, help="rows with id <= this")
    _filter_flags(again, ids=False, everything=True)
    again.add_argument(
        "--release-held",
        action="store_true",
        help="instead of replaying: let go the rows an interrupted replay of version 0.1 left "
        "held (pending, not due for 10 minutes); with --topic, of that topic only",
    )
    _safety_flags(again, confirms=True)
    again.set_defaults(
        handler=_replay,
        interrupted="interrupted: nothing was replayed (a replay is one transaction)",
    )

    hold = commands.add_parser(
        "pause",
        help="stop claiming rows of a topic, or of the whole table",
        description="Stop claiming rows of a topic (or, without --topic, of the whole table, "
        "routed rows included). Rows already claimed are still published.",
    )
    hold.add_argument("--topic", type=topic_name, help="the topic (default: the whole table)")
    hold.add_argument("--reason", help="why, for status and for whoever resumes")
    _safety_flags(hold, confirms=True)
    hold.set_defaults(handler=_pause)

    go = commands.add_parser(
        "resume",
        help="lift a pause",
        description="Lift the pause of a topic (or, without --topic, of the whole table).",
    )
    go.add_argument("--topic", type=topic_name, help="the topic (default: the whole table)")
    go.set_defaults(handler=_resume)

    sweep = commands.add_parser(
        "cleanup",
        help="delete old published rows now",
        description="Delete published rows older than OUTBOX_RETENTION_SECONDS (or --older-than) "
        "in batches of OUTBOX_CLEANUP_BATCH_SIZE; pending and dead rows are kept.",
    )
    sweep.add_argument("--older-than", type=seconds, metavar="SECONDS", help="instead of retention")
    _safety_flags(sweep, confirms=True)
    sweep.set_defaults(handler=_cleanup, interrupted=_BATCHED_INTERRUPTED)

    doctor = commands.add_parser(
        "check",
        help="check configuration, database, schema, broker and topics",
        description="Check the settings, the database and its schema version, the broker, and "
        "that the topics of pending rows and OUTBOX_DEFAULT_TOPIC exist. One line per problem on "
        "stderr; exit 1 if there is any.",
    )
    doctor.set_defaults(handler=_check)

    named = (
        ("dead list", listing),
        ("dead requeue", requeue),
        ("dead discard", discard),
        ("replay", again),
        ("pause", hold),
        ("resume", go),
        ("cleanup", sweep),
        ("check", doctor),
    )
    for name, parser in named:
        add_setting_flags(parser, name)


_DEAD = (
    "Dead-lettered rows: list them, requeue them (pending again) or discard them (deleted). "
    "Requeue and discard refuse to run without a filter or --all."
)


def handler(namespace: argparse.Namespace) -> Handler | None:
    found: Handler | None = getattr(namespace, "handler", None)
    return found
