"""One Kafka transaction of an exactly-once delivery (delivery.py owns it), as a state machine:
its state says what may be in Kafka, so what its delivery lists in progress records, may settle
and may give back at a shutdown (docs/design/exactly-once.md, "A transaction's life").

    NEW -> BEGUN -> HANDED -> COMMITTING -> COMMITTED
    BEGUN, HANDED -> ABORTED
    COMMITTING -> UNKNOWN -> RESOLVED_COMMITTED | RESOLVED_ABORTED

Every legal move is in MOVES; Transaction.move is the one way to change a state, and an illegal
move raises IllegalMoveError (a bug: carrying on would settle or list rows on a false belief)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from outbox_dispatcher.kafka.exactly_once.progress import Pair


class State(enum.Enum):
    NEW = "new"  # its rows chosen; nothing asked of the producer yet
    BEGUN = "begun"  # begin asked: records may be handed to the producer from now on
    HANDED = "handed"  # its records and its progress record handed to the producer
    COMMITTING = "committing"  # commit asked, no answer yet
    COMMITTED = "committed"  # the commit answered: read_committed consumers see it
    ABORTED = "aborted"  # ended without a commit (aborted, refused, fenced, given up)
    UNKNOWN = "unknown"  # the commit got no answer: it may have committed or not
    RESOLVED_COMMITTED = "resolved_committed"  # unknown, then found in the progress
    RESOLVED_ABORTED = "resolved_aborted"  # unknown, then its tag's rows missing from it


MOVES: dict[State, frozenset[State]] = {
    State.NEW: frozenset({State.BEGUN}),
    State.BEGUN: frozenset({State.HANDED, State.ABORTED}),
    State.HANDED: frozenset({State.COMMITTING, State.ABORTED}),
    State.COMMITTING: frozenset({State.COMMITTED, State.UNKNOWN}),
    State.UNKNOWN: frozenset({State.RESOLVED_COMMITTED, State.RESOLVED_ABORTED}),
    State.COMMITTED: frozenset(),
    State.ABORTED: frozenset(),
    State.RESOLVED_COMMITTED: frozenset(),
    State.RESOLVED_ABORTED: frozenset(),
}
# Ended: the next transaction of a split claim may begin.
ENDED = frozenset(s for s, to in MOVES.items() if not to)
# Its rows are in Kafka for read_committed consumers: listed under the delivery's tag.
COMMITTED = frozenset({State.COMMITTED, State.RESOLVED_COMMITTED})
# Its progress record is handed and may commit: what the record lists includes its rows.
IN_RECORD = frozenset({State.HANDED, State.COMMITTING, State.UNKNOWN}) | COMMITTED
# It may still commit, or may have: its undecided rows and their keys stay leased.
OPEN = frozenset(MOVES) - ENDED


class IllegalMoveError(RuntimeError):
    """A transaction was moved where MOVES does not allow: a bug in the exactly-once wing, never
    an operator's to fix (not an OutboxDispatcherError: nothing retries or classifies it)."""


@dataclass
class Transaction:
    """Rows `indices` of a delivery in one Kafka transaction; once handed, the (id, replays)
    pairs its records carried and what its progress record said (the outbox's identity, the
    tags listed, the keys tombstoned)."""

    indices: list[int]
    state: State = State.NEW
    pairs: list[Pair] = field(default_factory=list)
    identity: str = ""
    tags: frozenset[str] = frozenset()
    tombstones: list[str] = field(default_factory=list)

    def move(self, to: State) -> None:
        if to not in MOVES[self.state]:
            msg = f"a transaction cannot go from {self.state.name} to {to.name}"
            raise IllegalMoveError(msg)
        self.state = to

    def handed(
        self, pairs: Sequence[Pair], identity: str, tags: frozenset[str], tombstones: list[str]
    ) -> None:
        self.move(State.HANDED)
        self.pairs = list(pairs)
        self.identity = identity
        self.tags = tags
        self.tombstones = tombstones
