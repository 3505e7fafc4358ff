"""The records that flow claim -> publish -> settle."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple, TypeVar, cast

D = TypeVar("D")


def picked(cls: type[D], source: object, /, *, prefix: str = "", **given: object) -> D:
    """The dataclass `cls`, each field read from `source`'s attribute of the same name (after
    `prefix`), except the fields `given`; a field `source` has no attribute for keeps its default
    (none: a TypeError). One place copies same-named values from the settings into a component's
    config, or from a request into a filter, instead of a list of `name=s.name` per config."""
    values = dict(given)
    for field in dataclasses.fields(cast(Any, cls)):
        if field.init and field.name not in given and hasattr(source, prefix + field.name):
            values[field.name] = getattr(source, prefix + field.name)
    make: Callable[..., D] = cls
    return make(**values)


class Failure(enum.Enum):
    """How a failed publish of one row is handled (kafka/failures.py classifies)."""

    # The row itself cannot ever be published (too large, invalid topic, not authorized):
    # dead-letter it now.
    PERMANENT = "permanent"
    # Something about this row failed and may succeed later: count the attempt, back off,
    # dead-letter after max_attempts.
    ROW = "row"
    # The broker or the network is down: back off, but do not count the attempt; an outage must
    # not dead-letter anything.
    TRANSIENT = "transient"


class OutboxRecord(NamedTuple):
    """One claimed outbox row. A named tuple, immutable: built from the claim's result row as it
    comes (the claim selects exactly these columns, in this order), at a fraction of a frozen
    dataclass's cost per row."""

    id: int
    topic: str | None  # None: routed by the dispatcher (topic template or default topic)
    ordering_key: str | None
    payload: bytes | None
    headers: dict[str, str]
    event_id: uuid.UUID
    created_at: datetime
    attempts: int
    reclaimed: bool
    # Times an operator replayed the row: exactly-once lists (id, replays) in its progress
    # records, a pair that cannot come again (issue 35, E5).
    replays: int = 0

    @property
    def pair(self) -> tuple[int, int]:
        """The row in a progress record: its id and replay count."""
        return (self.id, self.replays)

    @classmethod
    def from_row(cls, row: Any) -> OutboxRecord:
        """From a claim's result row (its first columns are this tuple's fields, in order)."""
        return cls._make(itertools.islice(row, len(cls._fields)))


@dataclass(frozen=True, slots=True)
class Part:
    """Rows of one claim whose publish has its answers, by their index in the claim: keys that
    can be settled while others still wait (final=False; it may be empty, a moment at which the
    claim loop may go on), or every row not settled yet once nothing more is sent (final=True,
    always last). `outcomes` go with `indices`: None acknowledged, else why not."""

    indices: list[int]
    outcomes: list[BaseException | None]
    final: bool = False


@dataclass(frozen=True, slots=True)
class Batch:
    """The rows of one claim; they share one lease token. `drained`: the claim saw no new row
    left right after them (the steady path's claim), so a loop that announced its wait can wait
    for the next notification instead of claiming again at once."""

    token: uuid.UUID
    records: list[OutboxRecord]
    drained: bool = False
    # Claimed by the steady path's claim: its settle may be the steady path's one statement.
    steady: bool = False


class Outcome(enum.StrEnum):
    PUBLISHED = "published"
    RETRY = "retry"
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class Result:
    """What happened to one record, as the settle statement records it. `failure` is the class
    of a failed attempt as data (None: published, or not attempted), for metrics and the claim
    loop's pause; `error` is text for operators and is never parsed."""

    outcome: Outcome
    error: str | None = None
    delay: float = 0.0
    counted: bool = False  # whether the attempt counts towards max_attempts
    failure: Failure | None = None


PUBLISHED = Result(Outcome.PUBLISHED)  # shared by every acknowledged row: results are immutable


def work_keys(records: Sequence[OutboxRecord]) -> list[tuple[str, bool]]:
    """The work rows' keys of `records` (schema/tables.sql `<table>_work`): (key, False), or
    (id, True) for a row without one; each once, in order."""
    keys = (
        (r.ordering_key, False) if r.ordering_key is not None else (str(r.id), True)
        for r in records
    )
    return list(dict.fromkeys(keys))
