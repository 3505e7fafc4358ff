"""The CLI's tables: dead rows, the status per topic, and per outbox of OUTBOX_SOURCES. Every
cell passes display.columns, which makes writer-controlled text inert."""

from __future__ import annotations

from typing import Any

from outbox_dispatcher import display, registry
from outbox_dispatcher.display import age_text, columns, inert
from outbox_dispatcher.operate import reads
from outbox_dispatcher.operate.filters import NO_KEY, ROUTED
from outbox_dispatcher.operate.reads import WHOLE_TABLE, Dispatcher, Pause, TopicStatus, totals
from outbox_dispatcher.operate.sources import OutboxStatus, where

# dead list without --full: the widths of the key and last_error columns.
KEY_WIDTH = 40
ERROR_WIDTH = 160


def dead_table(found: list[dict[str, Any]], *, full: bool = False) -> str:
    """Dead rows for a terminal. Keys and errors are cut (a 2 kB key would pad every line)
    unless `full`; every cell is made inert by display.columns."""
    key_width, error_width = (None, None) if full else (KEY_WIDTH, ERROR_WIDTH)
    header = ("id", "event_id", "topic", "key", "attempts", "created_at", "dead_at", "last_error")
    cells = [
        (
            str(r["id"]),
            str(r["event_id"]),
            ROUTED if r["topic"] is None else r["topic"],
            NO_KEY if r["ordering_key"] is None else _cut(r["ordering_key"], key_width),
            str(r["attempts"]),
            r["created_at"].isoformat(timespec="seconds"),
            r["dead_at"].isoformat(timespec="seconds"),
            _cut(r["last_error"] or "", error_width),
        )
        for r in found
    ]
    return "\n".join(columns(header, cells))


def _cut(text: str, width: int | None) -> str:
    return text if width is None else display.shorten(text, width)


STATUS_HEADER = (
    "topic",
    "waiting",
    "in_flight",
    "dead",
    "published",
    "lag",
    "parked",
    "blocked_keys",
    "paused",
)


def as_table(
    topics: list[TopicStatus],
    pauses: list[Pause] | None = None,
    dispatchers: list[Dispatcher] | None = None,
    policy: str | None = None,
) -> str:
    """The table for a terminal: `waiting` and `in_flight` together are the pending rows; `lag`
    leaves out the `parked` ones (paused or held on purpose), which have their own age."""
    rows: list[tuple[str, ...]] = [
        (
            ROUTED if t.topic is None else t.topic,
            str(t.pending - t.in_flight),
            str(t.in_flight),
            str(t.dead),
            str(t.published),
            age_text(t.oldest_pending_age_seconds),
            _parked(t.parked, t.oldest_parked_age_seconds),
            _blocked(t.blocked_keys, t.dead_blocked_keys, t.held_keys),
            "yes" if t.paused else "",
        )
        for t in topics
    ]
    rows.append(_total(totals(topics)))
    lines = columns(STATUS_HEADER, rows)
    if dispatchers is not None:
        lines.append(_dispatchers_line(dispatchers, policy))
        if reads.delivery_in_force(dispatchers) == reads.MIXED:
            lines.append(MIXED_DELIVERY)
    for p in pauses or []:
        what = "the whole table" if p.topic == WHOLE_TABLE else f"topic {inert(p.topic)}"
        lines.append(
            f"paused: {what} since {p.paused_at.isoformat(timespec='seconds')}"
            f" by {inert(p.paused_by or '?')}" + (f": {inert(p.reason)}" if p.reason else "")
        )
    return "\n".join(lines)


def _total(total: dict[str, Any]) -> tuple[str, ...]:
    return (
        "TOTAL",
        str(total["waiting"]),
        str(total["in_flight"]),
        str(total["dead"]),
        str(total["published"]),
        age_text(total["oldest_pending_age_seconds"]),
        _parked(total["parked"], total["oldest_parked_age_seconds"]),
        _blocked(total["blocked_keys"], total["dead_blocked_keys"], total["held_keys"]),
        "",
    )


def _dispatchers_line(dispatchers: list[Dispatcher], policy: str | None) -> str:
    if not dispatchers:
        return (
            "dispatchers: none alive (no heartbeat in the last "
            f"{registry.LIVE_SECONDS:g}s): nothing is being published; blocked keys counted "
            f"under policy {policy}"
        )
    policies = sorted({d.dead_letter_policy for d in dispatchers})
    newest = min(d.heartbeat_age_seconds for d in dispatchers)
    line = (
        f"dispatchers: {len(dispatchers)} alive (last heartbeat {newest:.0f}s ago), "
        f"dead-letter policy {'/'.join(policies)}"
    )
    if len(policies) > 1:
        line += f" (they differ: blocked keys counted under {policy})"
    return f"{line}, delivery {inert(_delivery(dispatchers))}"


MIXED_DELIVERY = (
    "warning: the live dispatchers run different delivery modes: exactly-once's fence relies on "
    "every dispatcher of the table being transactional; set OUTBOX_DELIVERY alike on all of them"
)
OLDER = "older release"


def _delivery(dispatchers: list[Dispatcher]) -> str:
    """'exactly-once', 'mixed (1 at-least-once, 1 exactly-once)', 'not reported (older
    release)', 'exactly-once (1 not reported: older release)'."""
    mode = reads.delivery_in_force(dispatchers)
    modes = reads.delivery_modes(dispatchers)
    unreported = modes.pop(reads.NOT_REPORTED, 0)
    if mode == reads.NOT_REPORTED:
        return f"{mode} ({OLDER})"
    if mode == reads.MIXED:
        counts = [f"{n} {m}" for m, n in modes.items()]
        counts += [f"{unreported} {reads.NOT_REPORTED}"] if unreported else []
        return f"{mode} ({', '.join(counts)})"
    return f"{mode} ({unreported} {reads.NOT_REPORTED}: {OLDER})" if unreported else str(mode)


def _parked(rows: int, age: float | None) -> str:
    """'120 (3d04h)': rows waiting on purpose and the age of the oldest; empty when none."""
    return f"{rows} ({age_text(age)})" if rows else ""


def _blocked(blocked: int, dead_blocked: int, held: int = 0) -> str:
    """'5 (2 dead, 1 held)': the parts that wait for an operator."""
    parts = [f"{n} {why}" for n, why in ((dead_blocked, "dead"), (held, "held")) if n]
    return f"{blocked} ({', '.join(parts)})" if parts else str(blocked)


SOURCES_HEADER = (
    "source",
    "table",
    "state",
    "waiting",
    "in_flight",
    "dead",
    "lag",
    "paused",
    "dispatchers",
    "why",
)


def sources_table(found: list[OutboxStatus]) -> str:
    """`status` with OUTBOX_SOURCES: one line per outbox (its state, backlog, lag, pauses, live
    dispatchers, and why it is not served or could not be read), then the totals."""
    rows: list[tuple[str, ...]] = []
    for one in found:
        o, snap = one.state.outbox, one.snapshot
        why = one.error or one.refused or one.state.reason or ""
        if snap is None:
            rows.append((o.label, where(o), one.state.state.value, *[""] * 6, why))
            continue
        total = totals(snap.topics)
        rows.append(
            (
                o.label,
                where(o),
                one.state.state.value,
                str(total["waiting"]),
                str(total["in_flight"]),
                str(total["dead"]),
                age_text(total["oldest_pending_age_seconds"]),
                _paused(snap.pauses),
                str(len(snap.dispatchers)),
                why,
            )
        )
    every = [t for one in found if one.snapshot is not None for t in one.snapshot.topics]
    total = totals(every)
    failing = sum(1 for one in found if one.snapshot is None)
    rows.append(
        (
            "TOTAL",
            f"{len(found)} outbox" + ("" if len(found) == 1 else "es"),
            f"{failing} not read" if failing else "",
            str(total["waiting"]),
            str(total["in_flight"]),
            str(total["dead"]),
            age_text(total["oldest_pending_age_seconds"]),
            "",
            "",
            "",
        )
    )
    return "\n".join(columns(SOURCES_HEADER, rows))


def _paused(pauses: list[Pause]) -> str:
    """'table', or the paused topics."""
    topics = [p.topic for p in pauses]
    return "table" if WHOLE_TABLE in topics else ",".join(topics)
