"""Operator commands: dead rows (list, requeue, discard), replay, pause/resume, cleanup, check.

Every command is safe while dispatchers run. Dead and published rows are never leased, so the
commands that change them cannot race a dispatcher's publish; each works in batches of
cleanup_batch_size rows, one short transaction each, between ids fixed when it starts. Pauses live
in a table the claim reads; rows already claimed when a pause commits are still published.
docs/operations.md describes each command and what it is safe against.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import logging
import socket
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg
import orjson
import structlog

from outbox_dispatcher import broker, cleanup, db, errors, listener, migrations, routing, status
from outbox_dispatcher.publisher import KafkaPublisher
from outbox_dispatcher.routing import Router
from outbox_dispatcher.settings import Settings
from outbox_dispatcher.sql import Queries

log = structlog.get_logger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

# A replay first makes every matching row pending but not due for this long, then lets the rows
# go batch by batch in id order. If the command dies in between, the held rows go out by
# themselves when the hold ends, still in id order per key.
REPLAY_HOLD_SECONDS = 600.0
# How many pending routed rows `check` routes to find the topics they need.
CHECK_ROUTED_ROWS = 1000
CHECK_BROKER_SECONDS = 15.0

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


@dataclass(frozen=True)
class Filters:
    """Which rows a command touches; None means any. Times compare with created_at."""

    ids: list[int] | None = None
    key: str | None = None
    topic: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    from_id: int | None = None
    to_id: int | None = None

    @classmethod
    def of(cls, ns: argparse.Namespace) -> Filters:
        return cls(
            ids=getattr(ns, "ids", None),
            key=ns.key,
            topic=ns.topic,
            since=ns.since,
            until=ns.until,
            from_id=getattr(ns, "from_id", None),
            to_id=getattr(ns, "to_id", None),
        )

    def empty(self) -> bool:
        return all(value is None for value in vars(self).values())

    def dead_args(self) -> tuple[object, ...]:
        return (self.ids, self.key, self.topic, self.since, self.until)

    def replay_args(self) -> tuple[object, ...]:
        return (self.from_id, self.to_id, self.key, self.topic, self.since, self.until)


# --- the commands, usable in-process (tests) and from the CLI ---------------------------------


async def dead_list(
    conn: asyncpg.Connection, queries: Queries, filters: Filters, limit: int
) -> list[dict[str, Any]]:
    rows = await conn.fetch(queries.dead_list, *filters.dead_args(), limit)
    return [{**dict(row), "event_id": str(row["event_id"])} for row in rows]


async def _walk(
    conn: asyncpg.Connection,
    queries: Queries,
    query: str,
    args: tuple[object, ...],
    batch_size: int,
) -> int:
    """Run a cursor-batched statement over ids (0, max id now], one transaction per batch."""
    bound: int = await conn.fetchval(queries.max_id)
    after = 0
    total = 0
    while True:
        row = await conn.fetchrow(query, *args, after, bound, batch_size)
        assert row is not None  # noqa: S101 - an aggregate always returns one row
        if row["last_id"] is None:
            return total
        after = row["last_id"]
        total += row["rows"]


async def dead_requeue(
    conn: asyncpg.Connection, queries: Queries, filters: Filters, batch_size: int
) -> int:
    """Make matching dead rows pending again (attempts 0, due now); returns how many."""
    return await _walk(conn, queries, queries.dead_requeue, filters.dead_args(), batch_size)


async def dead_discard(
    conn: asyncpg.Connection, queries: Queries, filters: Filters, batch_size: int
) -> int:
    """Delete matching dead rows; returns how many."""
    return await _walk(conn, queries, queries.dead_discard, filters.dead_args(), batch_size)


async def replay(
    conn: asyncpg.Connection,
    queries: Queries,
    filters: Filters,
    batch_size: int,
    hold_seconds: float = REPLAY_HOLD_SECONDS,
) -> int:
    """Make matching published rows pending again, with their event ids; returns how many.

    Batches first hold every row (pending, not due), then release them in id order, so that a
    key's replayed rows go out before any newer pending row of the key, in their original order.
    """
    bound: int = await conn.fetchval(queries.max_id)
    after = 0
    held: list[list[int]] = []
    while True:
        row = await conn.fetchrow(
            queries.replay_hold, *filters.replay_args(), after, bound, batch_size, hold_seconds
        )
        assert row is not None  # noqa: S101 - an aggregate always returns one row
        if row["last_id"] is None:
            break
        after = row["last_id"]
        if row["ids"]:
            held.append(list(row["ids"]))
    for ids in held:
        await conn.fetchval(queries.replay_release, ids)
    return sum(len(ids) for ids in held)


def operator() -> str:
    """Who pauses: user@host of the command."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


async def pause(
    conn: asyncpg.Connection,
    queries: Queries,
    topic: str | None,
    reason: str | None,
    by: str | None = None,
) -> status.Pause:
    row = await conn.fetchrow(queries.pause, topic or status.WHOLE_TABLE, by or operator(), reason)
    return status.Pause(**dict(row or {}))


async def resume(
    conn: asyncpg.Connection, queries: Queries, topic: str | None, channel: str
) -> status.Pause | None:
    """Lift a pause and wake idle dispatchers so that the rows go out at once."""
    row = await conn.fetchrow(queries.resume, topic or status.WHOLE_TABLE)
    await conn.execute(queries.wake, channel)
    return None if row is None else status.Pause(**dict(row))


# --- CLI ---------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _connected(settings: Settings) -> AsyncIterator[tuple[asyncpg.Connection, Queries]]:
    conn = await db.connect(settings.database_url.get_secret_value(), settings)
    try:
        await migrations.check_version(conn, settings.db_schema, settings.table)
        yield conn, Queries.for_table(settings.db_schema, settings.table)
    finally:
        await conn.close()


def _refuse_unfiltered(filters: Filters, ns: argparse.Namespace, what: str) -> str | None:
    if ns.all and not filters.empty():
        return "--all cannot be combined with filters"
    if not ns.all and filters.empty():
        return (
            f"refusing to {what} without a filter: give --id, --key, --topic, --since, --until "
            "(replay also --from-id, --to-id), or --all"
        )
    return None


async def _dead_list(settings: Settings, ns: argparse.Namespace) -> int:
    async with _connected(settings) as (conn, queries):
        rows = await dead_list(conn, queries, Filters.of(ns), ns.limit)
    if ns.json:
        _json(rows)
    else:
        _out(_dead_table(rows))
    if len(rows) == ns.limit:
        _err(f"showing the first {ns.limit} dead rows; --limit shows more")
    return EXIT_OK


def _dead_table(rows: list[dict[str, Any]]) -> str:
    header = ("id", "event_id", "topic", "key", "attempts", "dead_at", "last_error")
    cells = [
        (
            str(r["id"]),
            str(r["event_id"]),
            "(routed)" if r["topic"] is None else r["topic"],
            "-" if r["ordering_key"] is None else r["ordering_key"],
            str(r["attempts"]),
            r["dead_at"].isoformat(timespec="seconds"),
            _shorten(r["last_error"] or "", 100),
        )
        for r in rows
    ]
    return "\n".join(status.columns(header, cells))


def _shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


async def _dead_requeue(settings: Settings, ns: argparse.Namespace) -> int:
    filters = Filters.of(ns)
    if problem := _refuse_unfiltered(filters, ns, "requeue dead rows"):
        _err(problem)
        return EXIT_USAGE
    async with _connected(settings) as (conn, queries):
        n = await dead_requeue(conn, queries, filters, settings.cleanup_batch_size)
        if n:
            await conn.execute(queries.wake, listener.channel_name(settings))
    log.info("dead_requeued", rows=n)
    _out(f"requeued {n} dead rows")
    return EXIT_OK


async def _dead_discard(settings: Settings, ns: argparse.Namespace) -> int:
    filters = Filters.of(ns)
    if problem := _refuse_unfiltered(filters, ns, "discard dead rows"):
        _err(problem)
        return EXIT_USAGE
    async with _connected(settings) as (conn, queries):
        n = await dead_discard(conn, queries, filters, settings.cleanup_batch_size)
    log.info("dead_discarded", rows=n)
    _out(f"discarded {n} dead rows")
    return EXIT_OK


async def _replay(settings: Settings, ns: argparse.Namespace) -> int:
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
    async with _connected(settings) as (conn, queries):
        n = await replay(conn, queries, filters, settings.cleanup_batch_size)
        if n:
            await conn.execute(queries.wake, listener.channel_name(settings))
    log.info("replayed", rows=n)
    _out(f"replaying {n} published rows (they keep their event ids)")
    return EXIT_OK


async def _pause(settings: Settings, ns: argparse.Namespace) -> int:
    async with _connected(settings) as (conn, queries):
        paused = await pause(conn, queries, ns.topic, ns.reason)
        in_flight: int = await conn.fetchval(queries.in_flight_rows, ns.topic)
    what = f"topic {ns.topic}" if ns.topic else "the whole table"
    log.info("paused", topic=ns.topic, reason=ns.reason, by=paused.paused_by)
    _out(f"paused {what} (since {paused.paused_at.isoformat(timespec='seconds')})")
    if in_flight:
        _out(f"{in_flight} rows already claimed are still being published; nothing new is claimed")
    return EXIT_OK


async def _resume(settings: Settings, ns: argparse.Namespace) -> int:
    async with _connected(settings) as (conn, queries):
        lifted = await resume(conn, queries, ns.topic, listener.channel_name(settings))
        remaining = await status.read_pauses(conn, queries)
    what = f"topic {ns.topic}" if ns.topic else "the whole table"
    if lifted is None:
        _out(f"{what} was not paused")
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
    async with _connected(settings) as (conn, queries):
        swept = await cleanup.delete_published(
            conn, queries, older_than, settings.cleanup_batch_size
        )
    log.info("cleanup_done", rows=swept.deleted, batches=swept.batches)
    _out(f"deleted {swept.deleted} published rows older than {older_than:g}s")
    return EXIT_OK


@dataclass
class Report:
    problems: int = 0

    def ok(self, line: str) -> None:
        _out(f"ok: {line}")

    def note(self, line: str) -> None:
        _out(f"note: {line}")

    def problem(self, line: str) -> None:
        self.problems += 1
        sys.stderr.write(f"problem: {line}\n")


async def check(settings: Settings) -> Report:
    """Configuration, database, schema version, broker and the topics rows need."""
    report = Report()
    report.ok(f"settings are valid (table {settings.db_schema}.{settings.table})")
    needed: dict[str, str] = {}
    if settings.default_topic:
        needed[settings.default_topic] = "OUTBOX_DEFAULT_TOPIC"
    try:
        conn = await db.connect(settings.database_url.get_secret_value(), settings)
    except errors.OutboxDispatcherError as exc:
        report.problem(f"database: {exc}")
    else:
        try:
            await _check_database(conn, settings, report, needed)
        finally:
            await conn.close()
    await _check_broker(settings, report, needed)
    return report


async def _check_database(
    conn: asyncpg.Connection, settings: Settings, report: Report, needed: dict[str, str]
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
    for row in await conn.fetch(queries.pending_topics):
        needed.setdefault(row["topic"], "pending rows")
    router = Router(settings.default_topic, settings.topic_template)
    unroutable: dict[str, int] = {}
    for row in await conn.fetch(queries.pending_routed_headers, CHECK_ROUTED_ROWS):
        try:
            needed.setdefault(router.topic_for(None, row["headers"]), "pending routed rows")
        except errors.RoutingError as exc:
            unroutable[str(exc)] = unroutable.get(str(exc), 0) + 1
    for reason, n in unroutable.items():
        report.problem(f"{n} pending routed rows cannot be routed: {reason}")
    for p in await status.read_pauses(conn, queries):
        what = "the whole table" if p.topic == status.WHOLE_TABLE else f"topic {p.topic}"
        report.note(f"{what} is paused since {p.paused_at.isoformat(timespec='seconds')}")


async def _check_broker(settings: Settings, report: Report, needed: dict[str, str]) -> None:
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
    if needed and not missing:
        report.ok(f"all {len(needed)} topics the outbox needs exist")


async def _check(settings: Settings, _: argparse.Namespace) -> int:
    report = await check(settings)
    return EXIT_FAILED if report.problems else EXIT_OK


def _filter_flags(parser: argparse.ArgumentParser, *, ids: bool, everything: bool) -> None:
    if ids:
        parser.add_argument(
            "--id", dest="ids", type=int, action="append", help="a row id (repeatable)"
        )
    parser.add_argument("--key", help="rows of this ordering key")
    parser.add_argument("--topic", help="rows of this topic")
    parser.add_argument(
        "--since", type=timestamp, help="rows created at or after this ISO-8601 time (UTC if bare)"
    )
    parser.add_argument("--until", type=timestamp, help="rows created before this ISO-8601 time")
    if everything:
        parser.add_argument("--all", action="store_true", help="every row (no filter)")


def add_parsers(
    commands: argparse._SubParsersAction[Any],
    add_setting_flags: Callable[[argparse.ArgumentParser], None],
) -> None:
    """The operator commands, each with the setting flags (as run and status have)."""
    leaves: list[argparse.ArgumentParser] = []

    dead = commands.add_parser(
        "dead", help="list, requeue or discard dead-lettered rows", description=_DEAD
    )
    dead_commands = dead.add_subparsers(dest="dead_command", required=True, metavar="ACTION")
    listing = dead_commands.add_parser("list", help="show dead rows", description="Dead rows.")
    _filter_flags(listing, ids=True, everything=False)
    listing.add_argument("--limit", type=positive, default=100, help="at most this many (100)")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(handler=_dead_list)
    requeue = dead_commands.add_parser(
        "requeue",
        help="make dead rows pending again",
        description="Make matching dead rows pending again: attempts 0, due now; last_error keeps "
        "a trace. They go out before newer rows of their key.",
    )
    _filter_flags(requeue, ids=True, everything=True)
    requeue.set_defaults(handler=_dead_requeue)
    discard = dead_commands.add_parser(
        "discard", help="delete dead rows", description="Delete matching dead rows for good."
    )
    _filter_flags(discard, ids=True, everything=True)
    discard.set_defaults(handler=_dead_discard)
    leaves += [listing, requeue, discard]

    again = commands.add_parser(
        "replay",
        help="publish already published rows again",
        description="Publish matching published rows again, with their original event ids, in "
        "id order per key and before newer rows of their keys.",
    )
    again.add_argument("--from-id", type=int, help="rows with id >= this")
    again.add_argument("--to-id", type=int, help="rows with id <= this")
    _filter_flags(again, ids=False, everything=True)
    again.set_defaults(handler=_replay)

    hold = commands.add_parser(
        "pause",
        help="stop claiming rows of a topic, or of the whole table",
        description="Stop claiming rows of a topic (or, without --topic, of the whole table, "
        "routed rows included). Rows already claimed are still published.",
    )
    hold.add_argument("--topic", type=topic_name, help="the topic (default: the whole table)")
    hold.add_argument("--reason", help="why, for status and for whoever resumes")
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
    sweep.set_defaults(handler=_cleanup)

    doctor = commands.add_parser(
        "check",
        help="check configuration, database, schema, broker and topics",
        description="Check the settings, the database and its schema version, the broker, and "
        "that the topics of pending rows and OUTBOX_DEFAULT_TOPIC exist. One line per problem on "
        "stderr; exit 1 if there is any.",
    )
    doctor.set_defaults(handler=_check)

    for parser in (*leaves, again, hold, go, sweep, doctor):
        add_setting_flags(parser)


_DEAD = (
    "Dead-lettered rows: list them, requeue them (pending again) or discard them (deleted). "
    "Requeue and discard refuse to run without a filter or --all."
)


def handler(namespace: argparse.Namespace) -> Handler | None:
    found: Handler | None = getattr(namespace, "handler", None)
    return found
