"""The records that flow claim -> publish -> settle."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from outbox_dispatcher.errors import Failure


@dataclass(frozen=True, slots=True)
class OutboxRecord:
    """One claimed outbox row."""

    id: int
    topic: str | None  # None: routed by the dispatcher (topic template or default topic)
    ordering_key: str | None
    payload: bytes | None
    headers: dict[str, str]
    event_id: uuid.UUID
    created_at: datetime
    attempts: int
    reclaimed: bool

    @classmethod
    def from_row(cls, row: Any) -> OutboxRecord:
        return cls(
            id=row["id"],
            topic=row["topic"],
            ordering_key=row["ordering_key"],
            payload=row["payload"],
            headers=row["headers"],
            event_id=row["event_id"],
            created_at=row["created_at"],
            attempts=row["attempts"],
            reclaimed=row["reclaimed"],
        )


@dataclass(frozen=True, slots=True)
class Batch:
    """The rows of one claim; they share one lease token."""

    token: uuid.UUID
    records: list[OutboxRecord]


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
