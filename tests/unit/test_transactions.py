"""Exactly-once's pieces that need no broker: progress records, the delivery's all-or-nothing
final part, the settings it refuses."""

from __future__ import annotations

import asyncio
import random
import uuid
import weakref
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.kafka import internals
from outbox_dispatcher.kafka.batches import Answer, Batches
from outbox_dispatcher.kafka.exactly_once import progress
from outbox_dispatcher.kafka.exactly_once.delivery import (
    OutboxTruncatedError,
    TransactionAbortedError,
    TransactionalDelivery,
    TransactionFencedError,
    TransactionRefusedError,
)
from outbox_dispatcher.kafka.exactly_once.endings import Stall
from outbox_dispatcher.kafka.exactly_once.progress import ProgressConfig
from outbox_dispatcher.kafka.exactly_once.publisher import TransactionalPublisher
from outbox_dispatcher.kafka.exactly_once.transaction import (
    MOVES,
    IllegalMoveError,
    State,
    Transaction,
)
from outbox_dispatcher.kafka.records import RecordEncoder
from outbox_dispatcher.models import Failure, OutboxRecord, Outcome, Result
from outbox_dispatcher.retries import RetryPolicy
from outbox_dispatcher.tracing import Tracer
from tests.fakes import FakeProducer, FakeProgressStore, HandDriven, publisher_with, rec

CONFIG = ProgressConfig(
    topic="p", outbox="public.outbox", transactional_id_prefix="x.", timeout_seconds=2.0
)


def record(i: int, key: str | None = "k", topic: str = "t") -> OutboxRecord:
    from datetime import UTC, datetime

    return OutboxRecord(i, topic, key, b"{}", {}, uuid.uuid4(), datetime.now(UTC), 0, False)


async def _nothing(*_: Any) -> Any:
    return []


def publisher_of(settings: Settings, needed: Any = None, beating: Any = None) -> Any:
    """A TransactionalPublisher whose database seam answers nothing (or as given)."""
    return TransactionalPublisher(
        configs_of(settings).publisher,
        CONFIG,
        "o",
        FakeProgressStore(ID, needed, beating),
        ID,
    )


ID = "5f0c2a55-0000-4000-8000-000000000001"


def test_the_last_record_of_each_key_is_what_counts() -> None:
    old = {"v": 1, "outbox": CONFIG.outbox, "owner": "d", "batches": {"t": [7]}}
    values = [
        (b"a", progress.record_value(CONFIG, ID, "a", {"t1": [(1, 0), (2, 0)]})),
        (b"b", progress.record_value(CONFIG, ID, "b", {"t2": [(5, 1)]})),
        (b"a", progress.record_value(CONFIG, ID, "a", {"t3": [(3, 0)]})),  # t1 marked meanwhile
        (b"c", progress.record_value(CONFIG, ID, "c", {"t4": [(4, 0)]})),
        (b"c", None),  # a tombstone ends the key
        (b"x", b"not json"),
        (b"e", progress.record_value(CONFIG, "another-identity", "e", {"t": [(8, 0)]})),
        (b"d", orjson.dumps(old)),  # a version 1 record (bare ids): skipped
        (b"f", orjson.dumps({"v": 2, "outbox": "other.outbox", "identity": ID, "batches": {}})),
    ]
    assert progress.last_batches(CONFIG, ID, values) == {
        "a": {"t3": [(3, 0)]},
        "b": {"t2": [(5, 1)]},
    }
    assert progress.committed_pairs(CONFIG, ID, values) == {(3, 0), (5, 1)}


def test_the_transactional_id_names_the_outbox_and_the_owner() -> None:
    assert CONFIG.transactional_id("host:1:abc") == "x.public.outbox.host:1:abc"


class _Lane:
    """What a delivery reads of its lane when it is made: where it is counted until it is
    transacted."""

    def __init__(self) -> None:
        self.given: weakref.WeakSet[object] = weakref.WeakSet()


def delivery(n: int) -> TransactionalDelivery:
    return TransactionalDelivery(HandDriven(), _Lane(), [record(i) for i in range(n)], 0.0)


def test_a_partly_decided_batch_settles_nothing() -> None:
    """A settle of some rows of a key releases the key: the rows whose transaction's outcome is
    unknown would go to a claim that is no takeover, and out again."""
    d = delivery(3)
    d.decide([0], None)  # a lost claim committed it
    assert d.final_part().indices == []
    d.decide([1, 2], None)
    part = d.final_part()
    assert part.indices == [0, 1, 2] and part.outcomes == [None, None, None] and part.final


def test_a_shutdown_gives_back_only_what_no_open_transaction_holds() -> None:
    stopped = RuntimeError("stopped")
    waiting = delivery(2)  # cancelled while waiting for its turn: never sent
    assert waiting.unsettled() == [0, 1]
    assert waiting.outcomes(stopped=stopped) == [stopped, stopped]
    sending = delivery(2)
    sending.begin([0, 1])  # its transaction may commit: the rows stay leased
    assert sending.unsettled() == []
    split = delivery(3)  # a claim split for a lookup: its first transaction's outcome unknown
    split.records[2] = record(2, "other-key")
    split.begin([0, 1])
    assert split.unsettled() == [2], "a row never in a transaction goes back, its key whole"


@pytest.mark.parametrize(
    ("delivery_mode", "ok"), [("at-least-once", True), ("exactly-once", False)]
)
def test_a_transaction_must_end_before_the_lease(delivery_mode: str, ok: bool) -> None:
    values = {"delivery": delivery_mode, "lease_seconds": 5.0, "transaction_timeout_seconds": 10.0}
    if ok:
        Settings(**values)
    else:
        with pytest.raises(ValidationError, match="OUTBOX_TRANSACTION_TIMEOUT_SECONDS must be <"):
            Settings(**values)


def test_a_fenced_transaction_is_retried_at_once_and_an_aborted_one_after_the_pause() -> None:
    """A fence (a takeover's, or the broker's transaction timeout) is no outage: the broker
    answers, so the fenced batch's rows go again at once and the claim loop does not pause; an
    abort for a broker error waits like any outage."""
    policy = RetryPolicy(Settings(), random.Random(7))
    rows = [record(1), record(2)]
    fenced = policy.results(rows, [TransactionFencedError("ProducerFenced")] * 2)
    assert fenced == [Result(Outcome.RETRY)] * 2
    assert policy.outage_streak == 0
    aborted = policy.results(rows, [TransactionAbortedError("KafkaConnectionError")] * 2)
    assert all(r.outcome is Outcome.RETRY and r.failure is Failure.TRANSIENT for r in aborted)
    assert all(r.delay > 0 and not r.counted for r in aborted)
    assert policy.outage_streak == 1


async def test_the_rows_of_a_batch_refused_whole_go_alone_their_keys_in_order() -> None:
    """Exactly-once blames a refused record only when its producer batch held it alone: the
    rows of a batch the broker refused whole go each in a batch of its own next (Batches'
    `alone`), and a later row of the same key and partition goes after it, never beside it."""
    producer = FakeProducer(partitions=1)
    publisher = publisher_with(producer)
    configs = configs_of(Settings())
    records = [rec(1, "t", "a"), rec(2, "t", "b"), rec(3, "t", "c"), rec(4, "t", "b")]
    batches = Batches(
        records,
        ["t"] * 4,
        encoder=RecordEncoder(configs.publisher.records),
        producers=publisher.producers,
        lookup=publisher.topics,
        tracer=Tracer(False),
        alone={2},
    )
    answers: list[Answer] = [None] * 4
    pending = [0, 1, 2, 3]
    batches.encode(pending)
    while pending:
        deferred = set(batches.send(pending, answers, set(), {}))
        pending = [i for i in pending if i in deferred]
    await asyncio.gather(*(a for a in answers if isinstance(a, asyncio.Future)))
    assert [[k for k, _ in s.batch.records] for s in producer.submitted] == [
        [b"a", b"c"],
        [b"b"],
        [b"b"],
    ]


def test_a_refused_record_s_transaction_retries_its_other_rows_at_once() -> None:
    """A record the broker refused for itself aborts its transaction: the other rows go again
    at once, no outage pause (the broker answers)."""
    policy = RetryPolicy(Settings(), random.Random(7))
    rows = [record(1), record(2)]
    results = policy.results(rows, [TransactionRefusedError("MessageSizeTooLargeError")] * 2)
    assert results == [Result(Outcome.RETRY)] * 2 and policy.outage_streak == 0


def test_a_claims_rows_whose_transaction_ended_settle_before_those_still_looked_up() -> None:
    """Rows whose topic is being looked up go in a later transaction; the rows of the first one
    settle as an early part (whole keys), the rest in the final part, all or nothing."""
    d = delivery(4)
    d.decide([0, 1], None)
    early = d.early_part([0, 1, 2])
    assert early.indices == [0, 1] and not early.final, "an unknown outcome is never settled"
    assert d.final_part().indices == [], "row 2 unknown: nothing more"
    d.decide([2, 3], None)
    assert d.final_part().indices == [2, 3], "the rest, once every row is decided"


class TransactionalFake(FakeProducer):
    """Our producer seam's transactional calls over FakeProducer's batches: every begin,
    progress record (key, value) and commit noted; the topic `late` is unknown until `found`
    is set (its lookup waits for it)."""

    def __init__(self) -> None:
        super().__init__(partitions=1)
        self.calls: list[str] = []
        self.records: list[progress.Record] = []
        self.found = asyncio.Event()
        self._known = self.client.cluster.partitions_for_topic
        self.client.cluster.partitions_for_topic = self._partitions

    def _partitions(self, topic: str) -> set[int] | None:
        found: set[int] | None = self._known(topic)
        return None if topic == "late" and not self.found.is_set() else found

    async def begin_transaction(self) -> None:
        self.calls.append("begin")

    async def send(self, topic: str, value: bytes | None, key: bytes) -> asyncio.Future[object]:
        self.records.append((key, value))
        answer: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        answer.set_result("metadata")
        return answer

    async def commit_transaction(self) -> None:
        self.calls.append("commit")

    async def abort_transaction(self) -> None:
        self.calls.append("abort")

    async def partitions_for(self, topic: str) -> set[int]:
        await self.found.wait()
        return {0}


def served_by(publisher: Any, producer: TransactionalFake, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The publisher's first lane serving with `producer` since the loop's time 0."""
    monkeypatch.setattr(internals, "load_topics", _nothing)  # the fake looks up: partitions_for
    lane = publisher.lanes[0]
    lane.producers.use(producer)
    lane.producers.since = 0.0
    return lane


async def every_row_needed(pairs: list[tuple[int, int]]) -> tuple[str, set[int]]:
    return ID, {i for i, _ in pairs}


async def test_a_split_claim_lists_every_committed_row_until_every_part_is_marked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A claim split for its lookups commits in several transactions under one tag: each
    progress record lists every row its transactions committed (a takeover after a failed early
    mark must find the first ones), and the tag stays listed unless every part's mark changed
    every row. Driven through the delivery's own parts: topic t is known, topic late is looked
    up, so rows 0-1 go in a first transaction and rows 2-3 in a second once the lookup answers."""
    publisher = publisher_of(Settings(delivery="exactly-once"), needed=every_row_needed)
    producer = TransactionalFake()
    lane = served_by(publisher, producer, monkeypatch)
    rows = [record(0, "a"), record(1, "b"), record(2, "c", "late"), record(3, "d", "late")]
    d = TransactionalDelivery(publisher, lane, rows, 1.0)
    parts = []
    async for part in d:
        parts.append(part)
        if not part.final:
            assert part.indices == [0, 1] and d.state is State.COMMITTED
            assert lane.unmarked[d.tag] == [(0, 0), (1, 0)]
            publisher.marked(d, every_row=False, final=False)  # the early mark missed a row
            producer.found.set()
    assert [p.indices for p in parts] == [[0, 1], [2, 3]] and parts[-1].final
    assert producer.calls == ["begin", "commit", "begin", "commit"], "two transactions"
    first, second = (progress.last_batches(CONFIG, ID, [r]) for r in producer.records)
    mine = lane.transactional_id
    assert first[mine][d.tag] == [(0, 0), (1, 0)]
    assert second[mine][d.tag] == [(0, 0), (1, 0), (2, 0), (3, 0)], "the first part's rows too"
    publisher.marked(d, every_row=True)
    assert lane.unmarked[d.tag] == [(0, 0), (1, 0), (2, 0), (3, 0)], "kept for the takeover"
    fine = TransactionalDelivery(publisher, lane, [record(5, "e")], 1.0)
    assert [p.indices async for p in fine] == [[0]]
    assert lane.unmarked[fine.tag] == [(5, 0)]
    publisher.marked(fine, every_row=True, final=False)
    assert fine.tag in lane.unmarked, "not before the final part"
    publisher.marked(fine, every_row=True)
    assert fine.tag not in lane.unmarked


# --- a transaction's states (transaction.py) -------------------------------------------------


@pytest.mark.parametrize("start", list(State))
def test_every_move_outside_the_table_raises(start: State) -> None:
    for to in State:
        transaction = Transaction([0], state=start)
        if to in MOVES[start]:
            transaction.move(to)
            assert transaction.state is to
        else:
            with pytest.raises(IllegalMoveError, match=f"from {start.name} to {to.name}"):
                transaction.move(to)
            assert transaction.state is start, "left where it was"


def test_a_claim_s_transactions_go_one_after_the_other() -> None:
    d = delivery(2)
    with pytest.raises(IllegalMoveError):
        d.committing()  # no transaction yet
    d.begin([0])
    with pytest.raises(IllegalMoveError, match="while the claim's last one is BEGUN"):
        d.begin([1])
    d.aborted()
    with pytest.raises(IllegalMoveError, match="no transaction of the claim is open"):
        d.aborted()
    d.begin([1])  # an ended one: the next may begin (a split claim's next part)
    assert d.state is State.BEGUN


def lane_of() -> Any:
    return publisher_of(Settings(delivery="exactly-once")).lanes[0]


def moved_to(state: State) -> TransactionalDelivery:
    """Rows 0-1 (key k) in a transaction moved to `state` through the delivery's own moves;
    row 2 (key other) and row 3 (key k) decided outside it (refused for their topic)."""
    lane = lane_of()
    rows = [record(0, "k"), record(1, "k"), record(2, "other"), record(3, "k")]
    d = TransactionalDelivery(HandDriven(), lane, rows, 0.0)
    d.decide([2, 3], RuntimeError("refused"))
    path = {
        State.NEW: [],
        State.BEGUN: [State.BEGUN],
        State.HANDED: [State.BEGUN, State.HANDED],
        State.COMMITTING: [State.BEGUN, State.HANDED, State.COMMITTING],
        State.COMMITTED: [State.BEGUN, State.HANDED, State.COMMITTING, State.COMMITTED],
        State.ABORTED: [State.BEGUN, State.HANDED, State.ABORTED],
        State.UNKNOWN: [State.BEGUN, State.HANDED, State.COMMITTING, State.UNKNOWN],
        State.RESOLVED_COMMITTED: [
            State.BEGUN,
            State.HANDED,
            State.COMMITTING,
            State.UNKNOWN,
            State.RESOLVED_COMMITTED,
        ],
        State.RESOLVED_ABORTED: [
            State.BEGUN,
            State.HANDED,
            State.COMMITTING,
            State.UNKNOWN,
            State.RESOLVED_ABORTED,
        ],
    }[state]
    listing: progress.Listed = {}
    for step in path:
        if step is State.BEGUN:
            d.begin([0, 1])
        elif step is State.HANDED:
            listing = d.handed([0, 1], ID, [])
        elif step is State.COMMITTING:
            d.committing()
        elif step is State.COMMITTED:
            d.commit_answered([0, 1])
        elif step is State.ABORTED:
            d.aborted()
            d.decide([0, 1], TransactionAbortedError("aborted"))
        elif step is State.UNKNOWN:
            d.commit_unanswered()
        else:
            found = step is State.RESOLVED_COMMITTED
            value = progress.record_value(CONFIG, ID, lane.name, listing if found else {})
            assert d.resolve([0, 1], [(lane.transactional_id.encode(), value)], CONFIG) is found
    assert d.state is state
    return d


EVERY_ROW = [0, 1, 2, 3]
PAIRS = [(0, 0), (1, 0)]
# state: what its record lists under its tag, what its final part settles, what a shutdown
# gives back (rows 0-1 open: they and row 3 of their key stay leased; row 2 goes).
VIEWS = {
    State.NEW: ([], [], EVERY_ROW),
    State.BEGUN: ([], [], [2]),
    State.HANDED: (PAIRS, [], [2]),
    State.COMMITTING: (PAIRS, [], [2]),
    State.UNKNOWN: (PAIRS, [], [2]),
    State.COMMITTED: (PAIRS, EVERY_ROW, EVERY_ROW),
    State.RESOLVED_COMMITTED: (PAIRS, EVERY_ROW, EVERY_ROW),
    State.ABORTED: ([], EVERY_ROW, EVERY_ROW),
    State.RESOLVED_ABORTED: ([], EVERY_ROW, EVERY_ROW),
}


@pytest.mark.parametrize("state", list(State))
def test_what_a_delivery_lists_settles_and_gives_back_follows_its_state(state: State) -> None:
    listed, settles, gives_back = VIEWS[state]
    d = moved_to(state)
    assert d.listed() == listed
    assert d.unsettled() == gives_back
    assert d.final_part().indices == settles
    if state in (State.COMMITTED, State.RESOLVED_COMMITTED):
        assert d.lane.unmarked[d.tag] == PAIRS, "listed in its lane until marked"
        assert d.outcomes(stopped=RuntimeError())[:2] == [None, None]


class _NeverAnswered:
    """A transaction's batches, one submitted to a partition that never answers (a partition
    that keeps answering NotEnoughReplicas: aiokafka retries it without end)."""

    def __init__(self) -> None:
        self.future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self.where = {self.future: ("t", 0)}

    def encode(self, indices: Any) -> None:
        pass

    def send(self, pending: list[int], answers: list[Answer], *_: Any) -> list[int]:
        for i in pending:
            answers[i] = self.future
        return []


class _RefusesProgress:
    async def send(self, *_: Any, **__: Any) -> Any:
        from aiokafka import errors as kafka_errors

        raise kafka_errors.MessageSizeTooLargeError("the progress record is too large")


async def test_a_failed_progress_send_waits_for_the_submissions_within_the_stall_bound() -> None:
    """Review E15: the progress record's send() raised while a submission never answers; the
    transaction's answers are waited for stall_seconds at most, then it is given up as a stall
    (the lane's turn, which every takeover needs, is not held for the fault's duration)."""

    publisher = publisher_of(Settings(delivery="exactly-once"))
    publisher.stall_seconds = 0.2
    lane = publisher.lanes[0]
    lane.producers.current = lambda: _RefusesProgress()  # type: ignore[method-assign]
    d = TransactionalDelivery(publisher, lane, [record(0)], 0.0)
    d.begin([0])  # (as _transaction does before it sends)
    batches = _NeverAnswered()
    answers: list[Answer] = [None]
    found = await asyncio.wait_for(
        publisher._send_all(d, batches, [0], answers, {}),  # type: ignore[arg-type]
        5.0,
    )
    assert isinstance(found, Stall), found
    assert found.partitions == {("t", 0)} and not found.progress
    batches.future.cancel()


# --- a TRUNCATE seen while a claim is on its way (review E5) ------------------------------------


def test_a_transaction_committed_across_a_truncate_leaves_its_lane_s_list_alone() -> None:
    """Lane b's retirement check reads a new identity (a TRUNCATE RESTART IDENTITY) and clears
    every lane's list while lane a's transaction of the old table's rows commits: its rows must
    not be listed, or lane a's next record, under the new identity, would name old ids that new
    rows take, and a takeover would mark those published unsent. Fails without the check."""
    lane = lane_of()
    publisher = HandDriven(ID)
    d = TransactionalDelivery(publisher, lane, [record(0, "k"), record(1, "k")], 0.0)
    d.begin([0, 1])
    d.handed([0, 1], ID, [])
    d.committing()
    publisher.identity = "the identity a TRUNCATE drew"
    lane.unmarked.clear()  # what Retirement._check does to every lane on a new identity
    d.commit_answered([0, 1])
    assert d.tag not in lane.unmarked
    assert d.outcomes(stopped=RuntimeError()) == [None, None], "committed: settled (nothing left)"


async def test_a_claim_made_before_a_truncate_is_sent_under_no_identity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The claim's rows are the old table's (or the new table's under the old identity, read
    before the TRUNCATE was seen): once the new identity is known, nothing of it is handed and
    no progress record is written; its rows (those left) are retried at once, not counted."""
    truncated = "the identity a TRUNCATE drew"

    async def after_the_truncate(pairs: list[tuple[int, int]]) -> tuple[str, set[int]]:
        return truncated, set()

    publisher = publisher_of(Settings(delivery="exactly-once"), needed=after_the_truncate)
    producer = TransactionalFake()
    lane = served_by(publisher, producer, monkeypatch)
    d = TransactionalDelivery(publisher, lane, [record(0, "a"), record(1, "b")], 1.0)
    assert d.identity == ID, "claimed while the old identity was known"
    parts = [p async for p in d]  # its turn's retirement check reads the new one first
    assert publisher.current_identity() == truncated
    assert producer.records == [], "no progress record, no row handed"
    assert "commit" not in producer.calls
    outcomes = d.outcomes(stopped=RuntimeError())
    assert all(isinstance(o, OutboxTruncatedError) for o in outcomes), outcomes
    assert all(getattr(o, "retriable", False) for o in outcomes)
    assert isinstance(outcomes[0], errors.NotAttempted), "not counted"
    assert parts[-1].final and d.tag not in lane.unmarked
