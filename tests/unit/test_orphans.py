"""Exactly-once's sweep of dead dispatchers' progress keys (kafka/exactly_once/orphans.py; issue
35, E9): which ids it fences, which keys it ends and which ids it forgets. Faked at our seams
(the store, the progress read, the fence and the tombstone); the same against real processes,
PostgreSQL and Kafka: tests/integration/test_exactly_once_bounds.py, test_exactly_once_goal.py."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from aiokafka import errors as kafka_errors

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.kafka.exactly_once import orphans as orphans_module
from outbox_dispatcher.kafka.exactly_once import progress
from outbox_dispatcher.kafka.exactly_once.lanes import Registered
from outbox_dispatcher.kafka.exactly_once.orphans import Orphans
from outbox_dispatcher.kafka.exactly_once.progress import Pair, ProgressConfig, Record
from outbox_dispatcher.kafka.exactly_once.store import Silent
from tests.fakes import FakeProgressStore

PROGRESS = ProgressConfig(
    topic="p", outbox="public.outbox", transactional_id_prefix="x.", timeout_seconds=2.0
)
ID = "5f0c2a55-0000-4000-8000-000000000001"
SEEN = datetime(2026, 12, 7, tzinfo=UTC)


def key(name: str) -> str:
    return PROGRESS.transactional_id(name)


def value(*pairs: Pair) -> bytes:
    return progress.record_value(PROGRESS, ID, "n", {"t": list(pairs)})


class _Table(FakeProgressStore):
    """me beats; dead (two lanes) and gone no longer beat, nothing names them; leased no
    longer beats, but a lease of its is live or expired (its takeover will come). Row 1 is
    pending."""

    def __init__(self) -> None:
        super().__init__(ID)
        self.pending = {1}
        self.forgotten: list[tuple[str, list[str]]] = []
        self.forgets = True

    async def running(self) -> Sequence[Registered]:
        return [("me", "exactly-once", [key("me"), key("me.1")])]

    async def silent(self) -> Sequence[Silent]:
        return [
            Silent("dead", SEEN, (key("dead"), key("dead.1")), named=False),
            Silent("gone", SEEN, (key("gone"),), named=False),
            Silent("leased", SEEN, (key("leased"),), named=True),
        ]

    async def forget(self, silent: Silent, ids: Sequence[str]) -> bool:
        if self.forgets:
            self.forgotten.append((silent.owner, list(ids)))
        return self.forgets

    async def needed(self, pairs: list[Pair]) -> tuple[str, set[int]]:
        return ID, {i for i, _ in pairs if i in self.pending}


class _Read:
    """The progress as a takeover reads it."""

    fence_seconds = 1.0

    def __init__(self, records: list[Record]) -> None:
        self.records = records
        self.reads = 0

    async def read(self, own: Any) -> list[Record]:
        self.reads += 1
        return list(self.records)


class _Fenced:
    """Producers started under an id (the fence), stopped after the sweep."""

    def __init__(self, tid: str) -> None:
        self.tid = tid
        self.stopped = False

    async def stop(self) -> None:
        self.stopped = True


class _Sweep(Orphans):
    def __init__(self, store: _Table, read: _Read, refused: frozenset[str] = frozenset()) -> None:
        producer = configs_of(Settings(delivery="exactly-once")).publisher.producer
        super().__init__(PROGRESS, producer, store, read, [])  # type: ignore[arg-type]
        object.__setattr__(self, "log", {"fenced": [], "tombstoned": [], "made": []})
        object.__setattr__(self, "refused", refused)

    async def _fence(self, ids: Sequence[str], fenced: dict[str, Any]) -> None:
        self.log["fenced"].extend(ids)
        fenced.update({t: _Fenced(t) for t in ids})
        self.log["made"].extend(fenced.values())

    async def _tombstone(self, producers: Any, key: str) -> None:
        assert producers.tid == key, "under the id's own producer"
        if key in self.refused:
            raise kafka_errors.ProducerFenced()
        self.log["tombstoned"].append(key)


RECORDS: list[Record] = [
    (key("me").encode(), value((9, 0))),  # a running dispatcher's: never touched
    (key("dead").encode(), value((2, 0))),  # row 2 settled: ended
    (key("dead.1").encode(), value((1, 0))),  # row 1 pending: kept
    (key("leased").encode(), value((3, 0))),  # its takeover's
    (key("gave-up.0.1").encode(), value((4, 0))),  # recorded by nobody (a given-up id): ended
    (key("ended").encode(), value((5, 0))),
    (key("ended").encode(), None),  # a tombstone already: not live
    (b"y.other.outbox.dead", value((6, 0))),  # another outbox's: not ours
]


async def test_the_sweep_ends_the_keys_of_dead_dispatchers_that_nothing_needs() -> None:
    """E9: fenced: the live keys nobody that beats records, and the ids the silent dispatchers
    list, less those of one a lease names; tombstoned: those whose last record lists nothing
    needed (each under its own producer); forgotten: the ids ended, per silent dispatcher."""
    table = _Table()
    read = _Read(RECORDS)
    sweep = _Sweep(table, read)
    assert await sweep.sweep() == 2
    assert sweep.log["fenced"] == sorted(
        [key("dead"), key("dead.1"), key("gone"), key("gave-up.0.1")]
    )
    assert sweep.log["tombstoned"] == [key("dead"), key("gave-up.0.1")]
    assert read.reads == 2, "read again after the fences"
    # gone had no live key: nothing to tombstone, forgotten; dead.1 lists a pending row: kept.
    assert table.forgotten == [("dead", [key("dead")]), ("gone", [key("gone")])]
    assert all(made.stopped for made in sweep.log["made"])


async def test_a_key_whose_rows_were_settled_since_is_ended_by_a_later_sweep() -> None:
    table = _Table()
    sweep = _Sweep(table, _Read(RECORDS))
    await sweep.sweep()
    table.pending = set()
    sweep.log["tombstoned"].clear()
    await sweep.sweep()
    assert key("dead.1") in sweep.log["tombstoned"]


async def test_a_tombstone_refused_by_a_fence_is_neither_counted_nor_forgotten() -> None:
    """Another sweep (or the dispatcher itself, come back) fenced the id meanwhile: its
    tombstone did not commit, so the id stays recorded and is swept again later."""
    table = _Table()
    sweep = _Sweep(table, _Read(RECORDS), refused=frozenset({key("dead")}))
    assert await sweep.sweep() == 1
    assert ("dead", [key("dead")]) not in table.forgotten


async def test_nothing_to_sweep_fences_nothing_and_reads_once() -> None:
    class _Quiet(_Table):
        async def silent(self) -> Sequence[Silent]:
            return []

    read = _Read([(key("me").encode(), value((9, 0)))])
    sweep = _Sweep(_Quiet(), read)
    assert await sweep.sweep() == 0
    assert sweep.log["fenced"] == [] and read.reads == 1


async def test_a_database_away_skips_the_sweep() -> None:
    class _Away(_Table):
        async def running(self) -> Sequence[Registered]:
            raise ConnectionError("the database is away")

    sweep = _Sweep(_Away(), _Read(RECORDS))
    assert await sweep.sweep() == 0
    assert sweep.log["fenced"] == []


async def test_a_live_key_of_another_database_s_outbox_of_the_same_name_is_not_touched() -> None:
    """Two clusters migrated the same way share a Kafka cluster and the progress topic: their
    outboxes have the same name and oid, so their transactional ids the same prefix. The other
    one's running dispatcher ("twin", in no registry of ours) writes records under its own
    identity: the sweep neither fences its id nor ends its key (before: fenced at every sweep,
    and its key tombstoned, its commits forgotten)."""
    other = progress.record_value(PROGRESS, "another-identity", "n", {"t": [(7, 0)]})
    twin = [(key("twin").encode(), other), (key("twin.1").encode(), value((2, 0)))]
    twin.append((key("twin.1").encode(), other))  # its last record: the other identity's
    sweep = _Sweep(_Table(), _Read([*RECORDS, *twin]))
    await sweep.sweep()
    assert not {key("twin"), key("twin.1")} & set(sweep.log["fenced"])
    assert not {key("twin"), key("twin.1")} & set(sweep.log["tombstoned"])
    assert orphans_module.own_live_keys(PROGRESS, ID, twin) == set()


def test_live_keys_are_those_whose_last_value_is_a_record() -> None:
    assert orphans_module.live_keys([(b"a", b"1"), (b"b", b"2"), (b"a", None), (b"c", None)]) == {
        "b"
    }
