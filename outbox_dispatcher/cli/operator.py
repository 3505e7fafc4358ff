"""The operator commands: status, dead (list, requeue, discard), replay, pause, resume, cleanup
and check. Each command's parser stands beside its handler; the actions run through
operate.actions.perform, with the terminal's question and progress bar as its hooks."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

import structlog

from outbox_dispatcher import display
from outbox_dispatcher.cli import tables, terminal
from outbox_dispatcher.cli.flags import (
    BATCHED,
    CONNECT,
    EVERY,
    FLAGS,
    Commands,
    command,
    filter_flags,
    filters_of,
    positive,
    safety_flags,
    seconds,
    source_flag,
    switch,
    topic_name,
)
from outbox_dispatcher.cli.terminal import EXIT_FAILED, EXIT_OK, err, out
from outbox_dispatcher.config.outboxes import sources_of
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.operate import listings, reads, sources, text
from outbox_dispatcher.operate.actions import (
    Action,
    ActionResult,
    Cleanup,
    Confirm,
    DeadDiscard,
    DeadRequeue,
    ReleaseHeld,
    Replay,
    perform,
    refuse,
)
from outbox_dispatcher.operate.check import check
from outbox_dispatcher.operate.jobs import Ledger
from outbox_dispatcher.operate.pauses import Pause, Resume
from outbox_dispatcher.operate.session import connected

log = structlog.get_logger(__name__)

BATCHED_INTERRUPTED = (
    "interrupted: the batches done so far are kept and every row is in a valid state; "
    "run the command again to finish"
)
NOT_CONFIRMED = "not confirmed: nothing changed"


class ActionInterruptedError(Exception):
    """Ctrl-C while an action ran: what its record says it changed (main prints it, exit 130)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _asking(ns: argparse.Namespace, *, unless_none: bool) -> Confirm:
    """Go on unless the count found nothing (`unless_none`) or the question is not confirmed."""

    def go_on(matching: int | None, question: str | None) -> bool:
        if unless_none and not matching:
            return False
        return question is None or terminal.confirm(ns, question)

    return go_on


async def _perform(
    settings: Settings, ns: argparse.Namespace, action: Action, what: str, *, unless_none: bool
) -> ActionResult:
    """`action` with a progress bar named `what`, asking where it asks; refused before it
    connects. Ctrl-C ends it after what its record says it changed."""
    refuse(action)
    opened: list[Ledger] = []
    async with connected(settings) as session:
        try:
            return await perform(
                action,
                session,
                dry_run=getattr(ns, "dry_run", False),
                progress=lambda total: terminal.progress(total, what),
                confirm=_asking(ns, unless_none=unless_none),
                opened=opened.append,
            )
        except asyncio.CancelledError:
            if not opened:
                raise
            ledger = opened[0]
            rows = 0 if action.atomic else ledger.rows
            said = text.interrupted(action.command, rows)
            again = "" if action.command == "replay" else "; run the command again to finish"
            raise ActionInterruptedError(f"{said} (audit record {ledger.id}){again}") from None


def _unchanged(result: ActionResult, nothing: str | None = None) -> int:
    """What a command that changed nothing says: what it would do, that `nothing` matches, or
    that it was not confirmed."""
    if result.dry_run:
        out(result.detail)
        return EXIT_OK
    if nothing is not None and result.matching == 0:
        out(nothing)
        return EXIT_OK
    err(NOT_CONFIRMED)
    return EXIT_FAILED


# --- status --------------------------------------------------------------------------------------


def configure_status_parser(commands: Commands) -> None:
    show = command(commands, "status", _status, (*CONNECT, "dead_letter_policy"))
    switch(show, "--json", "print JSON")
    source_flag(show, acts=False)


async def _status(settings: Settings, ns: argparse.Namespace) -> int:
    """pending, in-flight and dead rows per topic

    Pending, in-flight, dead and published rows per topic, oldest pending age. With
    OUTBOX_SOURCES: every outbox of every source (its state, backlog, lag, pauses, why it is
    not served), filtered by --source and --schema."""
    if settings.sources is not None:
        return await _status_sources(settings, ns)
    await sources.target(settings, ns.source)  # refuses --source without OUTBOX_SOURCES
    async with connected(settings) as session:
        now = await reads.snapshot(session, settings.dead_letter_policy.value)
    if ns.json:
        terminal.json(now.as_json())
    else:
        out(tables.as_table(now.topics, now.pauses, now.dispatchers, now.policy))
    return EXIT_OK


async def _status_sources(settings: Settings, ns: argparse.Namespace) -> int:
    only = sources.Filter.of(settings, ns.source)
    view, found = await sources.statuses(settings, sources_of(settings), only)
    if not found:
        raise sources.nothing_matches(only, view)
    if ns.json:
        topics = [t for f in found if f.snapshot is not None for t in f.snapshot.topics]
        terminal.json(
            {
                "outboxes": [f.as_json() for f in found],
                "databases": [dataclasses.asdict(d) for d in view.databases],
                "totals": reads.totals(topics),
            }
        )
        return EXIT_OK
    out(tables.sources_table(found))
    one = found[0].snapshot if len(found) == 1 else None
    if one is not None:  # one outbox named: its topics too, as without OUTBOX_SOURCES
        out("")
        out(tables.as_table(one.topics, one.pauses, one.dispatchers, one.policy))
    return EXIT_OK


# --- dead rows -----------------------------------------------------------------------------------


def configure_dead_parser(commands: Commands) -> None:
    dead = commands.add_parser(
        "dead",
        help="list, requeue or discard dead-lettered rows",
        description="Dead-lettered rows: list them, requeue them (pending again) or discard them "
        "(deleted). Requeue and discard refuse to run without a filter or --all.",
    )
    actions = dead.add_subparsers(dest="dead_command", required=True, metavar="ACTION")
    listing = command(actions, "dead list", _dead_list, CONNECT)
    filter_flags(listing, ids=True, everything=False)
    listing.add_argument("--limit", type=positive, default=100, help="at most this many (100)")
    source_flag(listing, acts=True)
    switch(listing, "--json", "print JSON")
    switch(listing, "--full", "do not cut long keys and errors in the table")
    requeue = command(
        actions, "dead requeue", _dead_requeue, BATCHED, interrupted=BATCHED_INTERRUPTED
    )
    filter_flags(requeue, ids=True, everything=True)
    safety_flags(requeue, confirms=False)
    source_flag(requeue, acts=True)
    discard = command(
        actions, "dead discard", _dead_discard, BATCHED, interrupted=BATCHED_INTERRUPTED
    )
    filter_flags(discard, ids=True, everything=True)
    safety_flags(discard, confirms=True)
    source_flag(discard, acts=True)


async def _dead_list(settings: Settings, ns: argparse.Namespace) -> int:
    """show dead rows

    Dead rows."""
    settings = await sources.target(settings, ns.source)
    filters = filters_of(ns)
    async with connected(settings) as session:
        found = await listings.dead_list(session, filters, ns.limit)
    if ns.json:
        terminal.json(found)
    elif not found:
        out(NO_DEAD_ROW_LISTED if filters.empty() else NO_DEAD_ROW_MATCHES)
    else:
        out(tables.dead_table(found, full=ns.full))
    if len(found) == ns.limit:
        err(f"showing the first {ns.limit} dead rows; --limit shows more")
    return EXIT_OK


NO_DEAD_ROW_LISTED = "there are no dead rows"
NO_DEAD_ROW_MATCHES = "no dead row matches the filter"


NO_DEAD_ROW = (
    "no dead row matches: nothing changed (`outbox-dispatcher dead list` shows the dead rows)"
)


async def _dead_requeue(settings: Settings, ns: argparse.Namespace) -> int:
    """make dead rows pending again

    Make matching dead rows pending again: attempts 0, due now; last_error keeps a trace. They
    go out before newer rows of their key."""
    settings = await sources.target(settings, ns.source)
    filters = filters_of(ns)
    action = DeadRequeue(
        filters, settings.effective_action_batch_size, everything=ns.all, names=FLAGS
    )
    return await _dead_change(settings, ns, action, "dead_requeued")


async def _dead_discard(settings: Settings, ns: argparse.Namespace) -> int:
    """delete dead rows

    Delete matching dead rows for good."""
    settings = await sources.target(settings, ns.source)
    filters = filters_of(ns)
    action = DeadDiscard(
        filters, settings.effective_action_batch_size, everything=ns.all, names=FLAGS
    )
    return await _dead_change(settings, ns, action, "dead_discarded")


async def _dead_change(
    settings: Settings, ns: argparse.Namespace, action: DeadRequeue | DeadDiscard, event: str
) -> int:
    result = await _perform(settings, ns, action, f"{action.verb} dead rows", unless_none=True)
    if not result.done:
        return _unchanged(result, NO_DEAD_ROW)
    log.info(event, rows=result.rows, filter=action.filters.as_json())
    out(result.detail)
    return EXIT_OK


# --- replay --------------------------------------------------------------------------------------


def configure_replay_parser(commands: Commands) -> None:
    again = command(
        commands,
        "replay",
        _replay,
        (*BATCHED, "delete_on_publish"),
        interrupted="interrupted: nothing was replayed (a replay is one transaction)",
    )
    again.add_argument("--from-id", type=int, help="rows with id >= this")
    again.add_argument("--to-id", type=int, help="rows with id <= this")
    filter_flags(again, ids=False, everything=True)
    switch(
        again,
        "--release-held",
        "instead of replaying: let go the rows an interrupted replay of version 0.1 left "
        "held (pending, not due for 10 minutes); with --topic, of that topic only",
    )
    safety_flags(again, confirms=True)
    source_flag(again, acts=True)


async def _replay(settings: Settings, ns: argparse.Namespace) -> int:
    """publish already published rows again

    Publish matching published rows again, with their original event ids, in id order per key
    and before newer rows of their keys."""
    settings = await sources.target(settings, ns.source)
    if ns.release_held:
        return await _release_held(settings, ns)
    action = Replay(
        filters_of(ns),
        settings.effective_action_batch_size,
        everything=ns.all,
        deletes_on_publish=settings.delete_on_publish,
        names=FLAGS,
    )
    result = await _perform(settings, ns, action, "replay", unless_none=True)
    if not result.done:
        return _unchanged(result, "no published row matches: nothing replayed")
    log.info("replayed", rows=result.rows, filter=action.filters.as_json())
    out(f"{result.detail}: pending again, with their event ids")
    return EXIT_OK


async def _release_held(settings: Settings, ns: argparse.Namespace) -> int:
    # Its own flags only: --dry-run and the filters other than --topic are not its (as before).
    async with connected(settings) as session:
        result = await perform(ReleaseHeld(ns.topic), session)
    log.info("replay_released", rows=result.rows, topic=ns.topic)
    out(result.detail)
    return EXIT_OK


# --- pause and resume ----------------------------------------------------------------------------


def configure_pause_parser(commands: Commands) -> None:
    hold = command(commands, "pause", _pause, CONNECT)
    hold.add_argument("--topic", type=topic_name, help="the topic (default: the whole table)")
    hold.add_argument("--reason", help="why, for status and for whoever resumes")
    safety_flags(hold, confirms=True)
    source_flag(hold, acts=True)


async def _pause(settings: Settings, ns: argparse.Namespace) -> int:
    """stop claiming rows of a topic, or of the whole table

    Stop claiming rows of a topic (or, without --topic, of the whole table, routed rows
    included). Rows already claimed are still published."""
    settings = await sources.target(settings, ns.source)
    action = Pause(ns.topic, reason=ns.reason)
    async with connected(settings) as session:
        asking = _asking(ns, unless_none=False)
        result = await perform(action, session, dry_run=ns.dry_run, confirm=asking)
        in_flight = await reads.in_flight(session, ns.topic) if result.done else 0
    if not result.done:
        return _unchanged(result)
    assert action.paused is not None  # noqa: S101 - a pause that ran has its row
    log.info("paused", topic=ns.topic, reason=ns.reason, by=action.paused.paused_by)
    out(result.detail)
    if in_flight:
        out(
            f"{text.rows(in_flight, 'row')} already claimed still being published; "
            "nothing new is claimed"
        )
    return EXIT_OK


def configure_resume_parser(commands: Commands) -> None:
    go = command(commands, "resume", _resume, CONNECT)
    go.add_argument("--topic", type=topic_name, help="the topic (default: the whole table)")
    source_flag(go, acts=True)


async def _resume(settings: Settings, ns: argparse.Namespace) -> int:
    """lift a pause

    Lift the pause of a topic (or, without --topic, of the whole table)."""
    settings = await sources.target(settings, ns.source)
    action = Resume(ns.topic)
    async with connected(settings) as session:
        result = await perform(action, session)
        remaining = await reads.read_pauses(session)
    if action.lifted is not None:
        log.info("resumed", topic=ns.topic)
    out(result.detail)
    if any(p.topic == reads.WHOLE_TABLE for p in remaining):
        out("the whole table is still paused: `outbox-dispatcher resume` lifts that")
    elif ns.topic is None and remaining:
        out("still paused: " + ", ".join(p.topic for p in remaining))
    return EXIT_OK


# --- cleanup and check ---------------------------------------------------------------------------


def configure_cleanup_parser(commands: Commands) -> None:
    sweep = command(
        commands,
        "cleanup",
        _cleanup,
        (*CONNECT, "cleanup_batch_size", "retention_seconds"),
        interrupted=BATCHED_INTERRUPTED,
    )
    sweep.add_argument("--older-than", type=seconds, metavar="SECONDS", help="instead of retention")
    safety_flags(sweep, confirms=True)
    source_flag(sweep, acts=True)


async def _cleanup(settings: Settings, ns: argparse.Namespace) -> int:
    """delete old published rows now

    Delete published rows older than OUTBOX_RETENTION_SECONDS (or --older-than) in batches of
    OUTBOX_CLEANUP_BATCH_SIZE; pending and dead rows are kept."""
    settings = await sources.target(settings, ns.source)
    if ns.older_than is None and settings.retention_seconds == 0:
        out(
            "OUTBOX_RETENTION_SECONDS is 0 (keep published rows): nothing deleted; "
            "--older-than SECONDS deletes anyway"
        )
        return EXIT_OK
    older_than = settings.retention_seconds if ns.older_than is None else ns.older_than
    action = Cleanup(older_than, settings.cleanup_batch_size)
    result = await _perform(settings, ns, action, "cleanup", unless_none=False)
    if not result.done:
        return _unchanged(result)
    log.info("cleanup_done", rows=result.rows, batches=action.batches)
    out(result.detail)
    return EXIT_OK


REPAIR = (
    "first run the anti-entropy sweep over the whole table: pending rows written around the "
    "claim engine's bookkeeping (ids below its cursor, triggers off) are handed to the claims "
    "now instead of within a sweep pass"
)


def configure_check_parser(commands: Commands) -> None:
    checks = command(commands, "check", _check, EVERY)
    switch(checks, "--repair", REPAIR)
    source_flag(checks, acts=False)


async def _check(settings: Settings, args: argparse.Namespace) -> int:
    """check configuration, database, schema, broker and topics

    Check the settings, the database and its schema version, that every pending row is where a
    claim will look for it, the broker, and that the topics of pending rows and
    OUTBOX_DEFAULT_TOPIC exist. With OUTBOX_SOURCES, every outbox of the sources (--source and
    --schema narrow them). One line per problem on stderr; exit 1 if there is any."""
    problems = 0
    for finding in await check(settings, repair=args.repair, source=args.source):
        line = f"{finding.level}: {display.inert(finding.text)}"
        if finding.level in ("ok", "note"):
            out(line)
        else:
            terminal.warn(line)
            problems += finding.level == "problem"
    return EXIT_FAILED if problems else EXIT_OK
