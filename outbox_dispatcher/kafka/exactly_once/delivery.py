"""Exactly-once's claim (publisher.py sends it; endings.py ends its transactions): its rows, its
transactions one after the other (transaction.py: one, or several when the claim is split for
its lookups), every row's outcome once decided, and what may be settled. What its progress
record lists, what a part may settle and what a shutdown may give back follow from its
transactions' states, which only its own methods move. All or nothing: while an open
transaction's outcome is unknown, no row of it is settled (a partial settle would release their
keys)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Iterable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Protocol

from outbox_dispatcher import errors
from outbox_dispatcher.kafka.exactly_once import progress
from outbox_dispatcher.kafka.exactly_once.phases import Phases
from outbox_dispatcher.kafka.exactly_once.progress import Listed, Pair, ProgressConfig, Record
from outbox_dispatcher.kafka.exactly_once.transaction import (
    COMMITTED,
    IN_RECORD,
    OPEN,
    IllegalMoveError,
    State,
    Transaction,
)
from outbox_dispatcher.models import OutboxRecord, Part

if TYPE_CHECKING:
    from outbox_dispatcher.kafka.exactly_once.lanes import Lane

UNKNOWN: BaseException = errors.BrokerUnavailableError("the transaction's outcome is unknown")


class Transacts(Protocol):
    """What sends a delivery: kafka/exactly_once/publisher.TransactionalPublisher."""

    def parts(self, d: TransactionalDelivery) -> AsyncGenerator[Part, None]: ...
    def current_identity(self) -> str: ...


class TransactionAbortedError(errors.OutboxDispatcherError):
    """The batch's Kafka transaction was aborted (a record of it failed, or a takeover fenced
    this dispatcher): read_committed consumers saw none of it; retried, not counted."""

    retriable = True
    failure = errors.BrokerUnavailableError.failure


class TransactionFencedError(TransactionAbortedError, errors.NotAttempted):
    """The batch's transaction was ended by a fence (another dispatcher's takeover, or the
    broker's transaction timeout), given up for a partition that did not acknowledge, or its
    producer was replaced since the claim: nothing of it is visible; the broker answers, so its
    rows are retried at once, without the outage pause."""


class OutboxTruncatedError(TransactionFencedError):
    """The outbox's identity changed since the claim (a TRUNCATE): nothing of the claim is
    sent under the new identity (its rows, if any are left, are retried at once, not counted),
    since a progress record naming the new identity must never list the old table's ids."""


class TransactionRefusedError(TransactionAbortedError, errors.NotAttempted):
    """The broker refused a record of the batch's transaction for that record's own fault (it
    gets its own error), so the transaction was aborted: the other rows are retried at once,
    uncounted. When the broker refused a producer batch whole, each of its records goes in a
    batch of its own next time, so that only the one it refuses is blamed."""


class TransactionalDelivery:
    """One claim in its transactions: one part as each but the last ends, the final one last.
    If an open transaction's outcome is unknown, no row is in the final part (a partial settle
    would release their keys): the claim stays leased, and the takeover that follows its expiry
    reads the progress."""

    def __init__(
        self,
        publisher: Transacts,
        lane: Lane,
        records: Sequence[OutboxRecord],
        claimed_at: float,
        phases: Phases | None = None,
    ) -> None:
        self._lane = lane  # its producer, chosen at the claim (kafka/exactly_once/lanes.py)
        lane.given.add(self)  # counted as waiting for the lane until its turn comes
        self.records = list(records)  # the claim's rows; grows only by those adopted (adopt)
        self._tag = uuid.uuid4().hex  # this batch in progress records
        # When the claim began (the loop's clock): a producer that began to serve after it (this
        # dispatcher was fenced, or the lane took a new id) never sends it (began_before).
        self._claimed_at = claimed_at
        self._publisher = publisher
        self._transactions: list[Transaction] = []  # in order; only the last may be open
        self._outcomes: list[BaseException | None] = [UNKNOWN] * len(records)
        self._settled: set[int] = set()  # rows a part has carried
        self._marks_whole = True  # every part's mark so far changed every row of it
        # Where its time goes (one debug line once its final mark is in: phases.py).
        self.phases = Phases(time.monotonic()) if phases is None else phases
        # The outbox's identity as known at the claim: its rows are that table's (review E5;
        # a TRUNCATE seen since aborts it before anything is handed: publisher._send_all).
        self.identity = publisher.current_identity()

    @property
    def lane(self) -> Lane:
        return self._lane

    @property
    def tag(self) -> str:
        return self._tag

    @property
    def parked(self) -> bool:
        """Never: a transaction has no partial outcome to wait for (batch.Deliveries)."""
        return False

    @property
    def state(self) -> State:
        """Its last transaction's state (NEW before the first)."""
        return self._transactions[-1].state if self._transactions else State.NEW

    # What tests and logs may read of it (derived from the states).
    @property
    def begun(self) -> bool:
        """A transaction of it began: records of it may have been handed to the producer."""
        return bool(self._transactions)

    @property
    def committed(self) -> bool:
        return any(t.state in COMMITTED for t in self._transactions)

    @property
    def sent(self) -> list[Pair]:
        """The pairs its last transaction carried, unless it ended without a commit."""
        last = self._transactions[-1] if self._transactions else None
        return list(last.pairs) if last is not None and last.state in IN_RECORD else []

    def __aiter__(self) -> AsyncGenerator[Part, None]:
        return self._parts()

    async def _parts(self) -> AsyncGenerator[Part, None]:
        async with aclosing(self._publisher.parts(self)) as parts:
            async for part in parts:
                yield part
        yield self.final_part()

    # --- the moves of its transactions (transaction.MOVES), in the order they come ---

    def begin(self, indices: Sequence[int]) -> None:
        """A transaction of these rows begins, before the producer is asked: from now on records
        of them may be handed, so until they are decided their keys stay leased. The claim's
        transactions go one after the other: the last must have ended."""
        if self._transactions and self.state in OPEN:
            msg = f"a transaction begins while the claim's last one is {self.state.name}"
            raise IllegalMoveError(msg)
        transaction = Transaction(list(indices))
        transaction.move(State.BEGUN)
        self._transactions.append(transaction)

    def handed(self, indices: Sequence[int], identity: str, tombstones: list[str]) -> Listed:
        """Its rows `indices` were handed to the producer: what its progress record lists (its
        lane's batches not seen marked, and its own under its tag), remembered with the outbox's
        identity and the keys tombstoned in the same transaction."""
        pairs = [self.records[i].pair for i in indices]
        listed = self._listing(pairs)
        self._open().handed(pairs, identity, frozenset(listed), tombstones)
        return listed

    def committing(self) -> None:
        self._open().move(State.COMMITTING)

    def commit_answered(self, indices: Sequence[int]) -> None:
        """The commit answered: its rows are published, listed under its tag with every row of
        its earlier transactions in its lane's batches not seen marked (until marked)."""
        transaction = self._open()
        transaction.move(State.COMMITTED)
        self._committed(transaction, indices)

    def commit_unanswered(self) -> None:
        """The commit got no answer (or was cancelled): its rows stay undecided, leased."""
        self._open().move(State.UNKNOWN)

    def resolve(
        self, indices: Sequence[int], records: Iterable[Record], config: ProgressConfig
    ) -> bool:
        """An unknown commit, once its id's transaction was ended by a fresh producer: committed
        if its lane's last record, under the identity it was written with, lists every row of it
        under its tag (the tag also lists its earlier transactions' rows)."""
        transaction = self._open()
        last = progress.last_batches(config, transaction.identity, records)
        mine = last.get(self._lane.transactional_id, {})
        if set(mine.get(self._tag, [])) >= set(transaction.pairs):
            transaction.move(State.RESOLVED_COMMITTED)
            self._committed(transaction, indices)
            return True
        transaction.move(State.RESOLVED_ABORTED)
        self.decide(indices, TransactionAbortedError("the commit did not take"))
        return False

    def aborted(self) -> None:
        """Its transaction ended without a commit (aborted, given up, its begin refused): none
        of its rows is in Kafka, so none is listed; the caller decides each row's outcome."""
        self._open().move(State.ABORTED)

    def _open(self) -> Transaction:
        if not self._transactions or self.state not in OPEN:
            msg = f"no transaction of the claim is open (its last is {self.state.name})"
            raise IllegalMoveError(msg)
        return self._transactions[-1]

    def _committed(self, transaction: Transaction, indices: Sequence[int]) -> None:
        if transaction.identity == self._publisher.current_identity():
            self._lane.unmarked[self._tag] = self.listed()
        # else a TRUNCATE was seen while it committed: its rows are gone, and the lane's next
        # records, under the new identity, must not list their ids (new rows may take them).
        self._lane.last_listed = transaction.tags  # its id's last committed record listed them
        self.decide(indices, None)

    # --- what its states allow ---

    def listed(self) -> list[Pair]:
        """The pairs its progress record lists under its tag: every row of its committed
        transactions, and of the one whose record is handed unless it ended without a commit."""
        return list(
            dict.fromkeys(p for t in self._transactions if t.state in IN_RECORD for p in t.pairs)
        )

    def listing(self, indices: Sequence[int]) -> Listed:
        """What its progress record would list if its rows `indices` were sent now (retirement
        checks that it fits a request before anything is handed)."""
        return self._listing([self.records[i].pair for i in indices])

    def _listing(self, pairs: list[Pair]) -> Listed:
        return {**self._lane.unmarked, self._tag: list(dict.fromkeys(self.listed() + pairs))}

    def tombstoned(self) -> list[str]:
        """The keys its last transaction tombstoned (retirement forgets them once committed)."""
        return list(self._transactions[-1].tombstones) if self._transactions else []

    def began_before(self, since: float) -> bool:
        """The claim began before `since` (when its lane's producer began to serve): such a
        producer never sends it, since its lease may have expired meanwhile."""
        return self._claimed_at < since

    def turn_taken(self) -> None:
        """Its lane's turn came: no longer counted as waiting (lanes.least_busy)."""
        self._lane.given.discard(self)

    def give_back_unsent(self, outcome: BaseException) -> None:
        """A takeover that sent nothing: its undecided rows take `outcome`, unless a transaction
        of it began (then that transaction's outcome decides them, or they stay leased)."""
        if not self._transactions:
            self.decide(self.undecided(), outcome)

    def marked(self, *, every_row: bool, final: bool) -> None:
        """A part's mark is in the database (TransactionalPublisher.marked says why): once the
        final one is, and every part's mark changed every row, its lane's later progress
        records leave it out."""
        self._marks_whole = self._marks_whole and every_row
        if final and self._marks_whole:
            self._lane.unmarked.pop(self._tag, None)
        if final:
            self.phases.report(self._lane.name, len(self.records), self.records[0].id)

    def early_part(self, indices: Sequence[int]) -> Part:
        """Rows of `indices` whose transaction ended, settled before the claim's other rows
        (whole keys: topics.ClaimLookups keeps a key's rows together)."""
        done = [i for i in indices if i not in self._settled and self._outcomes[i] is not UNKNOWN]
        self._settled.update(done)
        return Part(done, [self._outcomes[i] for i in done])

    def final_part(self) -> Part:
        """Every row not settled yet, unless one's outcome is unknown: then none."""
        rest = [] if self.undecided() else self.not_settled()
        self._settled.update(rest)
        return Part(rest, [self._outcomes[i] for i in rest], final=True)

    def not_settled(self) -> list[int]:
        """The rows no part has carried yet (in flight, for the dispatcher's registry)."""
        return [i for i in range(len(self.records)) if i not in self._settled]

    def decide(self, indices: Sequence[int], outcome: BaseException | None) -> None:
        for i in indices:
            self._outcomes[i] = outcome

    def adopt(self, rows: Sequence[OutboxRecord]) -> None:
        """Rows of this claim's keys that a lost claim committed beyond its batch: settled with
        it, published (its settle marks any row of a key its lease holds)."""
        self.records.extend(rows)
        self._outcomes.extend([None] * len(rows))

    def finished(self) -> list[int]:
        """The ids of the rows whose outcome is final: published, or failed for themselves
        (not unknown, not given back to be tried again)."""
        again = (TransactionAbortedError, errors.NotAttempted)
        return [
            r.id
            for r, o in zip(self.records, self._outcomes, strict=True)
            if o is None or (o is not UNKNOWN and not isinstance(o, again))
        ]

    def undecided_of(self, indices: Sequence[int]) -> list[int]:
        return [i for i in indices if self._outcomes[i] is UNKNOWN]

    def undecided(self) -> list[int]:
        return [i for i, o in enumerate(self._outcomes) if o is UNKNOWN]

    def outcomes(self, *, stopped: BaseException) -> list[BaseException | None]:
        """At a shutdown cancel: what is decided; the rest `stopped` (see unsettled)."""
        return [stopped if o is UNKNOWN else o for o in self._outcomes]

    def unsettled(self) -> list[int]:
        """The rows a shutdown cancel may give back: every row not settled yet, but for the
        undecided rows of an open transaction (it may commit, or may have) and every row of
        their keys (they stay leased, whole: a settle of some rows of a key releases the
        key)."""
        doubtful = {
            i
            for t in self._transactions
            if t.state in OPEN
            for i in t.indices
            if self._outcomes[i] is UNKNOWN
        }
        held = {self.records[i].ordering_key for i in doubtful}
        return [
            i
            for i in self.not_settled()
            if i not in doubtful
            and (self.records[i].ordering_key is None or self.records[i].ordering_key not in held)
        ]
