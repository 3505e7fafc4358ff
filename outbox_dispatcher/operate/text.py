"""The words of the operator actions, which the CLI prints and the console shows and answers with
(its API's `detail`): one place, so that both faces say the same about the same change."""

from __future__ import annotations

from datetime import datetime


def rows(n: int, what: str) -> str:
    """'1 dead row', '2 dead rows'."""
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def target(topic: str | None) -> str:
    return f"topic {topic}" if topic else "the whole table"


def pause_target(topic: str | None) -> str:
    """What a pause holds, said in full where the whole table is meant."""
    return target(topic) if topic else "the whole table (every topic, routed rows too)"


def since(at: datetime) -> str:
    return at.isoformat(timespec="seconds")


def changed(verb: str, n: int, noun: str, *, dry_run: bool) -> str:
    """What a requeue, discard or replay of `n` rows did, or (dry run) would do."""
    done = {"requeue": "requeued", "discard": "discarded", "replay": "replayed"}[verb]
    return f"would {verb} {rows(n, noun)}" if dry_run else f"{done} {rows(n, noun)}"


def released(n: int) -> str:
    return f"released {rows(n, 'held row')}"


def cleanup(n: int, older_than: float, *, dry_run: bool) -> str:
    verb = "would delete" if dry_run else "deleted"
    return f"{verb} {rows(n, 'published row')} older than {older_than:g}s"


def pause_counted(topic: str | None, pending: int, in_flight: int, *, dry_run: bool) -> str:
    """A pause that counted the rows it holds: how many wait, how many still go out."""
    waiting = rows(pending - in_flight, "pending row")
    if dry_run:
        return f"would pause {target(topic)}: {waiting} would wait"
    return f"paused {target(topic)}: {waiting} wait; {in_flight} already claimed still go out"


def pause(topic: str | None, paused_at: datetime | None, *, dry_run: bool) -> str:
    if dry_run or paused_at is None:
        return f"would pause {pause_target(topic)}"
    return f"paused {pause_target(topic)} (since {since(paused_at)})"


def resume(topic: str | None, pending: int | None, *, lifted: bool, dry_run: bool) -> str:
    if dry_run:
        return f"would resume {target(topic)}: {rows(pending or 0, 'pending row')} go out again"
    if lifted:
        return f"resumed {target(topic)}"
    return f"{target(topic)} was not paused: nothing changed"


DELETES_ON_PUBLISH = (
    "nothing to replay: with OUTBOX_DELETE_ON_PUBLISH the dispatcher deletes rows once they are "
    "published, so the outbox keeps no published rows"
)


# What each command changes, for the words of an interrupted action.
_CHANGED = {
    "dead requeue": ("requeued", "dead row"),
    "dead discard": ("discarded", "dead row"),
    "replay": ("replayed", "published row"),
    "cleanup": ("deleted", "published row"),
}


def interrupted(command: str, rows: int) -> str:
    """What an action cut off had done: its batches so far are kept (a replay's are not)."""
    if command == "replay":
        return "interrupted: nothing was replayed (a replay is one transaction)"
    if command not in _CHANGED:
        return "interrupted: nothing changed"
    done, noun = _CHANGED[command]
    return f"interrupted after it {done} {rows_of(rows, noun)}; those are kept"


def rows_of(n: int, what: str) -> str:
    """`rows` with thousands separated: '1,600 dead rows'."""
    return f"{n:,} {what}" if n == 1 else f"{n:,} {what}s"


def aborted(detail: str, *, atomic: bool = False) -> str:
    """What an action an operator stopped had done."""
    if atomic:
        return "aborted: nothing was replayed (a replay is one transaction)"
    return f"aborted: {detail} before it stopped"


def more_than_confirmed(matching: int, confirmed: int, noun: str) -> str:
    return (
        f"{rows(matching, noun)} match within what was confirmed, but {confirmed} did when it "
        "was confirmed: count and confirm again (nothing changed)"
    )
