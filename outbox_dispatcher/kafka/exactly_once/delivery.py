"""Exactly-once's claim in one transaction (publisher.py sends it): its rows, every
row's outcome once decided, and what may be settled. All or nothing: while a begun transaction's
outcome is unknown, no row of it is settled (a partial settle would release their keys)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Protocol

from outbox_dispatcher import errors
from outbox_dispatcher.models import OutboxRecord, Part

if TYPE_CHECKING:
    from outbox_dispatcher.kafka.exactly_once.lanes import Lane
    from outbox_dispatcher.kafka.exactly_once.progress import Listed

UNKNOWN: BaseException = errors.BrokerUnavailableError("the transaction's outcome is unknown")


class Transacts(Protocol):
    """What sends a delivery: kafka/exactly_once/publisher.TransactionalPublisher."""

    def parts(self, d: TransactionalDelivery) -> AsyncGenerator[Part, None]: ...


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


class TransactionRefusedError(TransactionAbortedError, errors.NotAttempted):
    """The broker refused a record of the batch's transaction for that record's own fault (it
    gets its own error), so the transaction was aborted: the other rows are retried at once,
    uncounted. When the broker refused a producer batch whole, each of its records goes in a
    batch of its own next time, so that only the one it refuses is blamed."""


class TransactionalDelivery:
    """One claim in one transaction: one part, the final one, once the transaction ended. If
    its outcome is unknown no row is in it (a partial settle would release their keys): the
    claim stays leased, and the takeover that follows its expiry reads the progress."""

    def __init__(
        self,
        publisher: Transacts,
        lane: Lane,
        records: Sequence[OutboxRecord],
        claimed_at: float,
    ) -> None:
        self.lane = lane  # its producer, chosen at the claim (kafka/exactly_once/lanes.py)
        lane.given.add(self)
        self.records = list(records)  # grows by the rows a takeover adopts (see adopt)
        self.parked = False
        self.settled: set[int] = set()
        self.tag = uuid.uuid4().hex  # this batch in progress records
        # (id, replays) of the rows in the transaction, for the progress record
        self.sent: list[tuple[int, int]] = []
        # Those its earlier transactions committed (a claim split for its lookups): listed under
        # its tag with each later one, until every part's mark changed every row.
        self.earlier: list[tuple[int, int]] = []
        self.marked_every_row = True
        # What its last transaction's progress record said: the outbox's identity, the tags
        # listed, the keys tombstoned (kafka/exactly_once/retirement.py).
        self.identity = ""
        self.listed_tags: frozenset[str] = frozenset()
        self.tombstones: list[str] = []
        self.begun = False  # a transaction of it was begun: unknown rows may be in Kafka
        self.doubtful: set[int] = set()  # rows of a begun transaction, not decided yet
        self.committed = False
        # When the claim began (the loop's clock): a producer that began to serve after it (this
        # dispatcher was fenced, or the lane took a new id) never sends it (_send_and_commit).
        self.claimed_at = claimed_at
        self._publisher = publisher
        self._outcomes: list[BaseException | None] = [UNKNOWN] * len(records)

    def __aiter__(self) -> AsyncGenerator[Part, None]:
        return self._parts()

    async def _parts(self) -> AsyncGenerator[Part, None]:
        async with aclosing(self._publisher.parts(self)) as parts:
            async for part in parts:
                yield part
        yield self.final_part()

    def early_part(self, indices: Sequence[int]) -> Part:
        """Rows of `indices` whose transaction ended, settled before the claim's other rows
        (whole keys: topics.ClaimLookups keeps a key's rows together)."""
        done = [i for i in indices if i not in self.settled and self._outcomes[i] is not UNKNOWN]
        self.settled.update(done)
        return Part(done, [self._outcomes[i] for i in done])

    def final_part(self) -> Part:
        """Every row not settled yet, unless one's outcome is unknown: then none."""
        rest = (
            []
            if self.undecided()
            else [i for i in range(len(self.records)) if i not in self.settled]
        )
        self.settled.update(rest)
        return Part(rest, [self._outcomes[i] for i in rest], final=True)

    def listed(self) -> list[tuple[int, int]]:
        """The pairs its progress record lists under its tag: every row of its transactions."""
        return list(dict.fromkeys(self.earlier + self.sent))

    def committed_now(self) -> list[tuple[int, int]]:
        """Its transaction committed: every pair of its committed transactions so far, listed
        under its tag in its lane's batches not seen marked (returned too)."""
        self.earlier = self.listed()
        self.committed = True
        self.lane.unmarked[self.tag] = list(self.earlier)
        return list(self.earlier)

    def not_committed(self) -> None:
        """Its transaction ended without committing (aborted, given up): none of its rows is
        in Kafka, so none is listed as sent."""
        self.sent.clear()

    def handed(self, indices: Sequence[int], identity: str, tombstones: list[str]) -> Listed:
        """Its rows `indices` were handed to the producer: what its progress record lists (its
        lane's batches not seen marked, and its own under its tag), remembered with the outbox's
        identity and the keys tombstoned in the same transaction (endings.py reads them)."""
        self.sent = [self.records[i].pair for i in indices]
        listed = {**self.lane.unmarked, self.tag: self.listed()}
        self.identity = identity
        self.listed_tags = frozenset(listed)
        self.tombstones = tombstones
        return listed

    def marked(self, *, every_row: bool, final: bool) -> None:
        """A part's mark is in the database (TransactionalPublisher.marked says why): once the
        final one is, and every part's mark changed every row, its lane's later progress
        records leave it out."""
        self.marked_every_row = self.marked_every_row and every_row
        if final and self.marked_every_row:
            self.lane.unmarked.pop(self.tag, None)

    def begin(self, indices: Sequence[int]) -> None:
        """A transaction of these rows begins: until they are decided, their outcome may be
        anything (unsettled keeps their keys leased)."""
        self.begun = True
        self.doubtful.update(indices)

    def decide(self, indices: Sequence[int], outcome: BaseException | None) -> None:
        for i in indices:
            self._outcomes[i] = outcome
            if outcome is not UNKNOWN:
                self.doubtful.discard(i)

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
        """The rows a shutdown cancel may settle: every row not settled yet, but for the keys of
        rows whose begun transaction's outcome is unknown (they stay leased, whole: a settle of
        some rows of a key releases the key)."""
        held = {self.records[i].ordering_key for i in self.doubtful}
        return [
            i
            for i, r in enumerate(self.records)
            if i not in self.settled
            and i not in self.doubtful
            and (r.ordering_key is None or r.ordering_key not in held)
        ]
