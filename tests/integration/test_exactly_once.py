"""OUTBOX_DELIVERY=exactly-once against real PostgreSQL and Kafka: each interleaving that would
give a read_committed consumer a second copy, staged step by step with two publishers of two
owners (docs/design/exactly-once.md), and a dispatcher end to end. The fault scenarios with real
processes are in test_chaos.py (test_exactly_once_*)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from types import SimpleNamespace
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka import errors as kafka_errors
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.kafka.exactly_once import progress
from outbox_dispatcher.kafka.exactly_once.delivery import (
    TransactionalDelivery,
    TransactionFencedError,
)
from outbox_dispatcher.kafka.exactly_once.lanes import LANES, Registered, Registry, WorkKeys
from outbox_dispatcher.kafka.exactly_once.publisher import TransactionalPublisher
from outbox_dispatcher.kafka.exactly_once.store import Silent
from outbox_dispatcher.kafka.exactly_once.takeover import TakeoverWaitingError
from outbox_dispatcher.models import PUBLISHED, Batch, OutboxRecord, Part
from outbox_dispatcher.retries import RetryPolicy
from outbox_dispatcher.store import DispatchStore, Statements, db, migrations
from tests.checker import verdict_for

from .helpers import Services, count, insert_sequenced, running, wait_all_settled

pytestmark = pytest.mark.integration

STATEMENTS = Statements.for_table("public", "outbox")


@pytest.fixture
def eos_settings(make_settings: Any) -> Callable[..., Settings]:
    progress_topic = f"progress-{uuid.uuid4().hex[:10]}"

    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "delivery": "exactly-once",
            "progress_topic": progress_topic,
            "lease_seconds": 3.0,
            "transaction_timeout_seconds": 2.0,
        }
        values.update(overrides)
        settings: Settings = make_settings(**values)
        return settings

    return make


class Owners:
    """Publishers of named owners over one table, each fencing the others on a takeover."""

    def __init__(self, settings: Settings, pool: Any) -> None:
        self.settings = settings
        self.progress = configs_of(settings).progress  # whose outbox its records name
        self.store = DispatchStore(pool, STATEMENTS)
        self.publishers: dict[str, TransactionalPublisher] = {}
        self.ids: dict[str, list[str]] = {}  # the registry: each owner's recorded ids
        self.waited: list[str] = []  # takeovers that could not read the progress, why
        # The control of the identity tests: every publisher names the outbox by this instead
        # of the identity the database keeps (as the records named it before version 16).
        self.same_identity: str | None = None
        self.beating: set[str] = set()  # the ids of dispatchers that beat (none by default)

    def registry(self, owner: str) -> Registry:
        return OwnersRegistry(self, owner)

    async def publisher(self, owner: str, lanes: int = LANES) -> TransactionalPublisher:
        configs = configs_of(self.settings)
        made = TransactionalPublisher(
            configs.publisher,
            self.progress,
            owner,
            OwnerStore(self, owner, self.registry(owner)),
            self.same_identity or await self.store.outbox_identity(),
            lane_count=lanes,
            waiting=self.waited.append,
        )
        await made.start()
        self.publishers[owner] = made
        return made

    async def pending(self, pairs: list[tuple[int, int]], identity: str) -> list[OutboxRecord]:
        if self.same_identity is not None:
            identity = await self.store.outbox_identity()
        ids, replays = [i for i, _ in pairs], [r for _, r in pairs]
        rows = await self.store.pending_rows(ids=ids, replays=replays, identity=identity)
        return [OutboxRecord.from_row(r) for r in rows]

    async def needed(self, pairs: list[tuple[int, int]]) -> tuple[str, set[int]]:
        ids, replays = [i for i, _ in pairs], [r for _, r in pairs]
        row = await self.store.progress_needed(ids=ids, replays=replays)
        return self.same_identity or str(row["identity"]), {int(i) for i in row["needed"]}

    async def beats(self) -> set[str]:
        return set(self.beating)

    def last_batches(self, publisher: TransactionalPublisher, records: Any) -> dict[str, Any]:
        """Per lane name (the owner's), its last record's batches, as `publisher` reads them."""
        last = progress.last_batches(self.progress, publisher.retire.identity, records)
        prefix = self.progress.transactional_id("")
        return {key.removeprefix(prefix): batches for key, batches in last.items()}

    def reconciler(self, owner: str) -> Callable[[list[tuple[str, bool]]], Any]:
        """The owner's takeover clears its keys' reconcile duty (as the supervisor wires it)."""

        async def reconciled(keys: list[tuple[str, bool]]) -> int:
            return await self.store.reconciled(
                owner=owner, keys=[k for k, _ in keys], keyless=[kl for _, kl in keys]
            )

        return reconciled

    async def claim(self, owner: str, settings: Settings | None = None) -> Batch:
        batch = await Claimer(self.store, settings or self.settings, owner).claim()
        assert batch is not None, f"{owner} claimed nothing"
        return batch

    async def stop(self) -> None:
        for p in self.publishers.values():
            await p.stop()


class OwnersRegistry:
    """The registry of Owners' publishers: each owner's recorded ids kept in Owners.ids, the
    lost owners read from the table."""

    def __init__(self, owners: Owners, owner: str) -> None:
        self.owners = owners
        self.owner = owner

    async def live(self) -> list[Registered]:
        return [(o, "exactly-once", ids) for o, ids in self.owners.ids.items()]

    async def record(self, ids: Sequence[str]) -> None:
        self.owners.ids[self.owner] = list(ids)

    async def lost(self, keys: WorkKeys, owners: Sequence[str]) -> list[Registered]:
        """The owners the keys' duty names (from the table), with the ids they recorded."""
        rows = await self.owners.store.lost_owners(
            keys=[k for k, _ in keys], keyless=[kl for _, kl in keys], owners=owners
        )
        return [(str(r["owner"]), "exactly-once", self.owners.ids.get(r["owner"])) for r in rows]


class OwnerStore:
    """One owner's ProgressStore (kafka/exactly_once/store.py) over Owners' seams: its registry
    (Owners.registry, faked or the table's) and Owners' reads of the table."""

    def __init__(self, owners: Owners, owner: str, registry: Registry) -> None:
        self.owners = owners
        self.owner = owner
        self.registry = registry

    async def live(self) -> Sequence[Registered]:
        return await self.registry.live()

    async def record(self, ids: Sequence[str]) -> None:
        await self.registry.record(ids)

    async def lost(self, keys: WorkKeys, owners: Sequence[str]) -> Sequence[Registered]:
        return await self.registry.lost(keys, owners)

    async def pending(self, pairs: list[tuple[int, int]], identity: str) -> list[OutboxRecord]:
        return await self.owners.pending(pairs, identity)

    async def reconciled(self, keys: list[tuple[str, bool]]) -> int:
        return int(await self.owners.reconciler(self.owner)(keys))

    async def needed(self, pairs: list[tuple[int, int]]) -> tuple[str, set[int]]:
        return await self.owners.needed(pairs)

    async def beating(self) -> set[str]:
        return await self.owners.beats()

    async def unsettled(self) -> int:
        return 0  # the table is taken as new (as without the seam before)

    async def running(self) -> Sequence[Registered]:
        return await self.registry.live()

    async def silent(self) -> Sequence[Silent]:
        return []  # (the table's registry: tests/integration/test_exactly_once_bounds.py)

    async def forget(self, silent: Silent, ids: Sequence[str]) -> bool:
        return False


@pytest.fixture
async def owners(eos_settings: Callable[..., Settings], pool: Any) -> AsyncIterator[Owners]:
    made = Owners(eos_settings(), pool)
    try:
        yield made
    finally:
        await made.stop()


async def run(delivery: TransactionalDelivery) -> Part:
    """Every part of the delivery as one (a claim whose topics the lane looks up first yields
    an early part; the final one comes last), in row order."""
    parts = [part async for part in delivery]
    assert parts[-1].final and not any(p.final for p in parts[:-1])
    pairs = [(i, o) for p in parts for i, o in zip(p.indices, p.outcomes, strict=True)]
    found = sorted(pairs, key=lambda pair: pair[0])
    return Part([i for i, _ in found], [o for _, o in found], final=True)


async def expire(conn: asyncpg.Connection) -> None:
    """Every lease expires now (as when its owner died or hung)."""
    await conn.execute(
        "UPDATE outbox_work SET claim_expires_at = now() - interval '1 second'"
        " WHERE claim_token IS NOT NULL"
    )


async def read_all(bootstrap: str, topic: str, isolation: str) -> list[bytes | None]:
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level=isolation,
    )
    await consumer.start()
    got: list[bytes | None] = []
    try:
        quiet = 0
        while quiet < 4:
            batch = await consumer.getmany(timeout_ms=500)
            found = [r.value for rs in batch.values() for r in rs]
            got.extend(found)
            quiet = 0 if found else quiet + 1
    finally:
        await consumer.stop()
    return got


async def test_a_batch_is_one_transaction_with_its_progress_record(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    await insert_sequenced(conn, topic, keys=5, per_key=4)
    a = await owners.publisher("owner-a")
    batch = await owners.claim("owner-a")
    delivery = a.publish(batch.records)
    part = await run(delivery)
    assert part.outcomes == [None] * 20 and delivery.committed
    assert sorted(delivery.sent) == sorted(r.pair for r in batch.records)
    batches = owners.last_batches(a, await a.read_progress())
    assert batches["owner-a"] == {delivery.tag: delivery.sent}
    a.marked(delivery, every_row=True)
    assert a.unmarked == {}
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 20


async def test_a_takeover_marks_what_the_lost_claim_committed_and_sends_none_of_it(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    """The lost claim's owner died between the commit and the mark: the taker fences it, finds
    the batch in its progress record, and decides those rows published without a copy."""
    await insert_sequenced(conn, topic, keys=4, per_key=5)
    a = await owners.publisher("owner-a")
    b = await owners.publisher("owner-b")
    lost = await owners.claim("owner-a")
    assert (await run(a.publish(lost.records))).outcomes == [None] * 20  # committed, not marked
    await expire(conn)
    taken = await owners.claim("owner-b")
    assert {r.id for r in taken.records} == {r.id for r in lost.records}
    assert all(r.reclaimed for r in taken.records)
    delivery = b.publish(taken.records)
    part = await run(delivery)
    assert part.outcomes == [None] * 20, "decided published"
    assert delivery.sent == [] and not delivery.begun, "nothing sent again"
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 20
    # The fenced owner's next transaction is refused; it replaces its producer and goes on.
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, 'fresh', '{}')", topic
    )
    fresh = await owners.claim("owner-a")
    refused = await run(a.publish(fresh.records))
    # Fenced, not an outage: retried at once (TransactionFencedError is a NotAttempted).
    assert all(isinstance(o, TransactionFencedError) for o in refused.outcomes), refused
    again = await run(a.publish(fresh.records))
    assert again.outcomes == [None], "a fresh producer under the same id, for a new claim"
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 21


async def test_a_takeover_adopts_the_committed_rows_beyond_its_batch(
    conn: asyncpg.Connection,
    owners: Owners,
    eos_settings: Callable[..., Settings],
    topic: str,
    services: Services,
) -> None:
    """The lost claim committed 10 rows of a key; the taker's batch holds 4 (its batch size):
    the 6 others are published too, settled with the 4, so that the key is not released with
    them pending (a claim that is no takeover would send them again)."""
    await insert_sequenced(conn, topic, keys=1, per_key=10)
    a = await owners.publisher("owner-a")
    b = await owners.publisher("owner-b")
    lost = await owners.claim("owner-a")
    assert len(lost.records) == 10
    await run(a.publish(lost.records))
    await expire(conn)
    taken = await owners.claim("owner-b", eos_settings(batch_size=4))
    assert len(taken.records) == 4 and all(r.reclaimed for r in taken.records)
    delivery = b.publish(taken.records)
    part = await run(delivery)
    assert delivery.sent == []
    assert [delivery.records[i].id for i in part.indices] == [r.id for r in lost.records]
    assert part.outcomes == [None] * 10
    settled = await Settler(owners.store, retry_for=1.0, owner="owner-b").settle(
        Batch(taken.token, [delivery.records[i] for i in part.indices]),
        [PUBLISHED] * 10,
    )
    assert settled == 10
    assert await count(conn, "published_at IS NULL") == 0
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 10


async def test_a_claim_made_before_the_producer_was_replaced_is_never_sent(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    """A hung owner resumes with two claims whose leases were taken over: the first meets the
    fence and is aborted, its producer replaced; the second, claimed under the old producer,
    must not go out under the new one (the taker sent its rows). One lane, so that both claims
    are the same producer's."""
    await insert_sequenced(conn, topic, keys=2, per_key=1)
    a = await owners.publisher("owner-a", lanes=1)
    b = await owners.publisher("owner-b")
    settings = owners.settings.model_copy(update={"batch_size": 1})
    first, second = await owners.claim("owner-a", settings), await owners.claim("owner-a", settings)
    stale = [a.publish(first.records), a.publish(second.records)]  # claimed, then it hung
    await expire(conn)
    taken = await owners.claim("owner-b")
    assert len(taken.records) == 2
    assert (await run(b.publish(taken.records))).outcomes == [None, None]  # fences owner-a
    for delivery in stale:
        part = await run(delivery)
        assert all(isinstance(o, TransactionFencedError) for o in part.outcomes), part
        assert delivery.sent == [] or not delivery.committed
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 2


async def test_a_claim_begun_before_its_lane_took_a_new_id_is_never_sent(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    """The owner claims, then hangs past its lease; the taker fences the ids owner-a recorded
    and sends the rows; owner-a's lane then takes a new id (a stalled transaction given up),
    which the taker could not fence. The claim began before that id served: given back, never
    sent under it (a producer chosen when the claim is handed over, not when it began, sent it:
    a second copy)."""
    await insert_sequenced(conn, topic, keys=2, per_key=1)
    a = await owners.publisher("owner-a", lanes=1)
    b = await owners.publisher("owner-b")
    began = asyncio.get_running_loop().time()
    claimed = await owners.claim("owner-a")  # then it hung
    await expire(conn)
    taken = await owners.claim("owner-b")
    assert (await run(b.publish(taken.records))).outcomes == [None, None]  # fences owner-a
    fenced_then = list(owners.ids["owner-a"])
    await a.lanes.renew(a.lanes[0], "a stalled transaction")
    assert owners.ids["owner-a"] != fenced_then, "the new id is recorded before it serves"
    late = await run(a.publish(claimed.records, claimed_at=began))
    assert all(isinstance(o, TransactionFencedError) for o in late.outcomes), late
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 2
    await insert_sequenced(conn, topic, keys=1, per_key=1, first_seq=1)
    fresh = None
    for _ in range(100):  # once owner-b's lease expired (its batch was never marked here)
        fresh = await Claimer(owners.store, owners.settings, "owner-a").claim()
        if fresh is not None:
            break
        await asyncio.sleep(0.1)
    assert fresh is not None
    # A claim begun after the new id served: sent under it (the taken-over rows owner-b
    # committed are found in the progress, not sent again).
    assert (await run(a.publish(fresh.records))).outcomes == [None] * len(fresh.records)
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 3


@pytest.mark.parametrize("lane", [0, 1])
async def test_a_hung_owners_open_transaction_is_aborted_by_the_takeover(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services, lane: int
) -> None:
    """The owner hung with its transaction open (sent, not committed) past its lease, on either
    of its lanes: the taker's fence aborts it, so its late commit fails and only the taker's
    copy is committed. A read_uncommitted consumer sees both copies (the design note says so)."""
    await insert_sequenced(conn, topic, keys=3, per_key=2)
    a = await owners.publisher("owner-a")
    b = await owners.publisher("owner-b")
    lost = await owners.claim("owner-a")
    producer = a.lanes[lane].producers.current()
    await producer.begin_transaction()
    for r in lost.records:
        await (await producer.send(topic, r.payload, key=(r.ordering_key or "").encode()))
    await expire(conn)
    taken = await owners.claim("owner-b")
    delivery = b.publish(taken.records)
    assert (await run(delivery)).outcomes == [None] * 6
    assert len(delivery.sent) == 6, "the hung owner committed nothing: everything is sent"
    with pytest.raises((kafka_errors.ProducerFenced, kafka_errors.KafkaError)):
        await asyncio.wait_for(producer.commit_transaction(), 10)
    committed = await read_all(services.kafka_bootstrap_servers, topic, "read_committed")
    uncommitted = await read_all(services.kafka_bootstrap_servers, topic, "read_uncommitted")
    assert len(committed) == 6
    assert len(uncommitted) == 12, "the aborted copies are in the log"


async def test_two_claims_of_a_dispatcher_are_in_transactions_at_once(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    """A claim is not held behind another claim loop's transaction: it goes to the free lane
    (with one producer it waited for the whole of the other's transaction)."""
    await insert_sequenced(conn, topic, keys=2, per_key=3)
    a = await owners.publisher("owner-a")
    settings = owners.settings.model_copy(update={"batch_size": 3})
    first, second = await owners.claim("owner-a", settings), await owners.claim("owner-a", settings)
    one = a.publish(first.records)
    assert one.lane is a.lanes[0]
    async with a.lanes[0].turn:  # the first lane's transaction is open, for as long as it takes
        other = a.publish(second.records)
        assert other.lane is a.lanes[1]
        assert (await asyncio.wait_for(run(other), 20)).outcomes == [None] * 3
    assert (await run(one)).outcomes == [None] * 3
    batches = owners.last_batches(a, await a.read_progress())
    assert batches["owner-a"] == {one.tag: one.sent}, "each lane's record lists its own"
    assert batches["owner-a.1"] == {other.tag: other.sent}
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 6


async def test_a_takeover_waits_for_every_transaction_of_its_dispatcher(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    """A takeover reads what was committed with none of its own dispatcher's transactions open
    (one could commit the rows it is about to send): it holds every lane's turn."""
    await insert_sequenced(conn, topic, keys=2, per_key=2)
    a = await owners.publisher("owner-a")
    lost = await owners.claim("owner-a")
    await expire(conn)
    taken = await owners.claim("owner-a")
    assert all(r.reclaimed for r in taken.records)
    async with a.lanes[0].turn:
        takeover = a.publish(taken.records)
        assert takeover.lane is a.lanes[1]
        running_takeover = asyncio.ensure_future(run(takeover))
        await asyncio.sleep(2)
        assert not running_takeover.done(), "it waits for the other lane's transaction"
    assert (await asyncio.wait_for(running_takeover, 20)).outcomes == [None] * len(lost.records)
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 4


async def test_a_takeover_that_cannot_name_the_lost_owner_gives_its_rows_back_uncounted(
    conn: asyncpg.Connection, eos_settings: Callable[..., Settings], pool: Any, topic: str
) -> None:
    """The registry cannot be read for the taker (the database away for it): it cannot fence the
    lost owner, so nothing is sent or decided published; every row goes back after a wait,
    uncounted, and its key keeps the duty (a settle never clears it), so that the next claim is
    a takeover again. (Kept leased instead, each try counted an attempt: review E7.)"""
    await insert_sequenced(conn, topic, keys=2, per_key=2)
    good = Owners(eos_settings(), pool)
    a = await good.publisher("owner-a")
    lost = await good.claim("owner-a")
    await run(a.publish(lost.records))
    await expire(conn)

    async def unreachable(*_: Any) -> list[Registered]:
        raise ConnectionError("the database is away")

    configs = configs_of(good.settings)
    registry = SimpleNamespace(
        live=unreachable, record=good.registry("owner-b").record, lost=unreachable
    )
    b = TransactionalPublisher(
        configs.publisher,
        configs.progress,
        "owner-b",
        OwnerStore(good, "owner-b", registry),  # type: ignore[arg-type]
        await good.store.outbox_identity(),
    )
    await b.start()
    try:
        taken = await good.claim("owner-b")
        delivery = b.publish(taken.records)
        part = await run(delivery)
        assert part.indices == list(range(4)) and not delivery.begun
        assert all(isinstance(o, TakeoverWaitingError) and o.delay > 0 for o in part.outcomes)
        results = RetryPolicy(good.settings).results(delivery.records, part.outcomes)
        assert not any(r.counted for r in results)
        await Settler(good.store, retry_for=1.0, owner="owner-b").settle(taken, results)
        duty = "SELECT count(*) FROM outbox_work WHERE reconcile_owner = 'owner-a'"
        assert await conn.fetchval(duty) == 2, "both keys keep the duty"
        assert await count(conn, "published_at IS NULL AND attempts = 1") == 4
    finally:
        await b.stop()
        await good.stop()


async def test_a_dispatcher_in_exactly_once_mode_publishes_every_row_once(
    conn: asyncpg.Connection,
    eos_settings: Callable[..., Settings],
    topic: str,
    services: Services,
    database_url: str,
) -> None:
    await insert_sequenced(conn, topic, keys=20, per_key=25)
    async with running(eos_settings(batch_size=100, claim_tasks=2)):
        await wait_all_settled(conn, 60)
    assert await count(conn, "published_at IS NULL") == 0
    verdict = await verdict_for(database_url, services.kafka_bootstrap_servers, [topic])
    assert (verdict.lost, verdict.reordered, verdict.duplicates) == ([], [], 0), verdict.summary()


@pytest.mark.parametrize("named_by", ["identity", "same_identity"])
async def test_a_table_made_again_never_takes_its_predecessors_progress(
    empty_database_url: str,
    eos_settings: Callable[..., Settings],
    topic: str,
    services: Services,
    named_by: str,
) -> None:
    """A table dropped and made again starts its ids over while the progress topic keeps the
    records of the batches its predecessor committed and never saw marked. A takeover on the
    new table reads them: under the identity the schema keeps (drawn at migrate time), they are
    another outbox's and the taken rows are sent; under one identity for both (the control, as
    a name or the table's oid would be), the new rows 1 to 4 look committed and would be marked
    without being sent."""
    settings = eos_settings(database_url=empty_database_url)

    async def incarnation() -> tuple[asyncpg.Connection, asyncpg.Pool, Owners]:
        conn = await asyncpg.connect(empty_database_url)
        await migrations.migrate(conn, "public", "outbox")
        await insert_sequenced(conn, topic, keys=2, per_key=2)
        made = await asyncpg.create_pool(empty_database_url, init=db.init_connection)
        owners = Owners(settings, made)
        if named_by == "same_identity":
            owners.same_identity = "one-for-both"
        return conn, made, owners

    conn, first_pool, first = await incarnation()
    try:
        a = await first.publisher("owner-a")
        committed = await run(a.publish((await first.claim("owner-a")).records))
        assert committed.outcomes == [None] * 4  # committed, never marked: then the table went
    finally:
        await first.stop()
        await first_pool.close()
        await conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
        await conn.close()
    conn, second_pool, second = await incarnation()
    try:
        await second.claim("owner-c")  # and it died
        await expire(conn)
        b = await second.publisher("owner-b")
        taken = await second.claim("owner-b")
        assert [r.id for r in taken.records] == [1, 2, 3, 4] and all(
            r.reclaimed for r in taken.records
        )
        delivery = b.publish(taken.records)
        assert (await run(delivery)).outcomes == [None] * 4
        delivered = await read_all(services.kafka_bootstrap_servers, topic, "read_committed")
        if named_by == "identity":
            assert [i for i, _ in sorted(delivery.sent)] == [1, 2, 3, 4], "sent: not its records"
            assert len(delivered) == 8
        else:
            assert delivery.sent == [], "the control: marked as published, never sent"
            assert len(delivered) == 4
    finally:
        await second.stop()
        await second_pool.close()
        await conn.close()


async def test_a_record_the_broker_refuses_is_blamed_alone_not_its_batch(
    conn: asyncpg.Connection,
    eos_settings: Callable[..., Settings],
    services: Services,
    database_url: str,
) -> None:
    """The broker refuses a partition batch whole for one bad record (here larger than the
    topic's max.message.bytes, which the dispatcher cannot know), and every record of the batch
    shares its answer: its transaction is aborted, nobody blamed, and the batch's rows go again
    each alone, so that only the bad one is dead-lettered; the others are published once, in
    order (before, the batch's first row took the blame: a row of key `a` dead)."""
    name = f"small-{uuid.uuid4().hex[:10]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka_bootstrap_servers)
    await admin.start()
    try:
        limit = {"max.message.bytes": "2048"}
        await admin.create_topics([NewTopic(name, 1, 1, topic_configs=limit)])
        big = b'{"big": "' + b"x" * 4000 + b'"}'
        rows = [(key, seq, b'{"seq": %d}' % seq) for seq in range(3) for key in "abd"]
        rows[4] = ("c", 0, big)
        await conn.executemany(
            "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, $2, $3)",
            [(name, key, payload) for key, _, payload in rows],
        )
        async with running(eos_settings(batch_size=100)):
            await wait_all_settled(conn, 60)
        dead = await conn.fetch(
            "SELECT ordering_key, attempts FROM outbox WHERE dead_at IS NOT NULL"
        )
        assert [(r["ordering_key"], r["attempts"]) for r in dead] == [("c", 1)]
        delivered = await read_all(services.kafka_bootstrap_servers, name, "read_committed")
        assert sorted(v or b"" for v in delivered) == sorted(p for k, _, p in rows if k != "c")
    finally:
        with contextlib.suppress(Exception):
            await admin.delete_topics([name])
        await admin.close()
