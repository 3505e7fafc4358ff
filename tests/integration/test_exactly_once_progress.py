"""Exactly-once's progress read to its end (issue 35, review E4): a transaction open on the
progress partition before a lost claim's committed record (another outbox's, a hanging one)
must not hide that record from a takeover or from the resolution of a commit without an answer.
The read goes to the high watermark, waits (bounded) for such a transaction to end, and decides
nothing when it does not. Real PostgreSQL and Kafka, the owners of test_exactly_once.py."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import asyncpg
import orjson
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka import errors as kafka_errors
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.kafka.exactly_once.delivery import (
    TransactionAbortedError,
    TransactionalDelivery,
)
from outbox_dispatcher.kafka.exactly_once.progress import ProgressUnavailableError
from outbox_dispatcher.kafka.exactly_once.publisher import TransactionalPublisher
from outbox_dispatcher.kafka.exactly_once.takeover import Takeover, TakeoverWaitingError
from outbox_dispatcher.kafka.exactly_once.topic import ProgressTopicError
from outbox_dispatcher.kafka.exactly_once.transaction import State
from outbox_dispatcher.retries import RetryPolicy

from .helpers import Services, count, insert_sequenced, kill9, log_events, spawn
from .test_exactly_once import Owners, eos_settings, expire, owners, read_all, run

pytestmark = pytest.mark.integration
FIXTURES = (eos_settings, owners)  # test_exactly_once.py's, used here by name


@contextlib.asynccontextmanager
async def open_transaction(bootstrap: str, topic: str) -> AsyncIterator[AIOKafkaProducer]:
    """A transaction of another outbox's dispatcher, open on the progress partition (nobody of
    this table fences it) until the test ends it."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        transactional_id=f"other-outbox-{uuid.uuid4().hex[:8]}",
        transaction_timeout_ms=120_000,
    )
    await producer.start()
    try:
        await producer.begin_transaction()
        body = {"v": 1, "outbox": "another.outbox@x/1", "owner": "other", "batches": {}}
        await producer.send_and_wait(topic, orjson.dumps(body), key=b"other")
        yield producer
    finally:
        with contextlib.suppress(Exception):
            await producer.abort_transaction()
        await producer.stop()


async def abort_later(producer: AIOKafkaProducer, seconds: float) -> None:
    await asyncio.sleep(seconds)
    await producer.abort_transaction()


async def test_a_takeover_reads_past_an_open_transaction_on_the_progress(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    """The open transaction precedes owner-a's committed record: the takeover waits for it to
    end (here 3 s) and finds the 20 rows committed. Before issue 35 it read only to the last
    stable offset, found nothing, and sent the 20 rows again."""
    bootstrap = services.kafka_bootstrap_servers
    a = await owners.publisher("owner-a")
    b = await owners.publisher("owner-b")
    async with open_transaction(bootstrap, owners.progress.topic) as other:
        await insert_sequenced(conn, topic, keys=4, per_key=5)
        lost = await owners.claim("owner-a")
        assert (await run(a.publish(lost.records))).outcomes == [None] * 20
        await expire(conn)
        taken = await owners.claim("owner-b")
        ending = asyncio.create_task(abort_later(other, 3.0))
        delivery = b.publish(taken.records)
        part = await run(delivery)
        await ending
    assert part.outcomes == [None] * 20 and delivery.sent == [], "found committed, not sent"
    assert len(await read_all(bootstrap, topic, "read_committed")) == 20


async def test_a_takeover_that_cannot_read_to_the_end_decides_nothing(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    """The open transaction outlives the bound (the transaction timeout plus the broker's abort
    sweep): the takeover decides nothing, sends nothing, and says why (the metric's reason); its
    rows go back uncounted, their keys keeping the duty; once the transaction ended, the next
    takeover finds the rows committed."""
    bootstrap = services.kafka_bootstrap_servers
    a = await owners.publisher("owner-a")
    b = await owners.publisher("owner-b")
    async with open_transaction(bootstrap, owners.progress.topic):
        await insert_sequenced(conn, topic, keys=2, per_key=5)
        lost = await owners.claim("owner-a")
        assert (await run(a.publish(lost.records))).outcomes == [None] * 10
        await expire(conn)
        taken = await owners.claim("owner-b")
        delivery = b.publish(taken.records)
        part = await run(delivery)
        assert not delivery.begun and delivery.sent == [], "nothing sent"
        assert all(isinstance(o, TakeoverWaitingError) for o in part.outcomes), "none decided"
        assert owners.waited == ["end_unreached"]
        results = RetryPolicy(owners.settings).results(delivery.records, part.outcomes)
        await Settler(owners.store, retry_for=1.0, owner="owner-b").settle(taken, results)
    await conn.execute("UPDATE outbox SET next_attempt_at = now()")  # (its wait skipped)
    await conn.execute("UPDATE outbox_work SET not_before = now()")
    c = await owners.publisher("owner-c")
    again = await owners.claim("owner-c")
    later = c.publish(again.records)
    assert (await run(later)).outcomes == [None] * 10 and later.sent == []
    assert len(await read_all(bootstrap, topic, "read_committed")) == 10


async def test_a_commit_without_an_answer_is_resolved_past_an_open_transaction(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    """E4 (a): the lane's commit stood at the broker, its answer was lost on the way back; the
    delivery's transaction is UNKNOWN, the lane's producer is replaced under the same id (its
    start ends the transaction), and the resolution reads the progress past the open
    transaction before the lane's record and finds the commit. Before issue 35: "the commit did
    not take", and the rows went again."""
    bootstrap = services.kafka_bootstrap_servers
    a = await owners.publisher("owner-a")
    async with open_transaction(bootstrap, owners.progress.topic) as other:
        await insert_sequenced(conn, topic, keys=2, per_key=3)
        batch = await owners.claim("owner-a")
        delivery = a.publish(batch.records)
        answer_lost(delivery.lane.producers.current())
        ending = asyncio.create_task(abort_later(other, 3.0))
        part = await run(delivery)
        await ending
    assert delivery.state is State.RESOLVED_COMMITTED, "the commit is found in the progress"
    assert part.outcomes == [None] * 6 and delivery.committed
    assert len(await read_all(bootstrap, topic, "read_committed")) == 6


async def test_a_lane_commits_nothing_more_while_a_commit_of_it_is_unknown(
    conn: asyncpg.Connection,
    owners: Owners,
    topic: str,
    services: Services,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broker restart under load (test_chaos.py, repeated: one run in six): a lane's commit
    stood, its answer was lost, and the progress could not be read to resolve it (the broker
    away). The lane then committed its next claim under the same id, in a record that did not
    list the unknown rows (a lane lists what it knows committed); a takeover reads only an id's
    last record, and sent the rows again: 20 rows twice to read_committed consumers. Now the
    lane reads the earlier
    commit before it commits again: found committed, its rows are listed in the next record,
    and the takeover marks them without sending them. (On the old code: 9 records of 6 rows.)"""
    bootstrap = services.kafka_bootstrap_servers
    a, b, settings, unknown = await a_commit_whose_answer_is_lost(conn, owners, topic)
    with monkeypatch.context() as broker_away:
        broker_away.setattr(Takeover, "read", unreadable)
        await run(unknown)
    assert unknown.state is State.UNKNOWN
    second = await owners.claim("owner-a", settings)  # after the producer's replacement
    assert (await run(a.publish(second.records))).outcomes == [None] * 3
    await expire(conn)
    taken = await owners.claim("owner-b")
    delivery = b.publish(taken.records)
    part = await run(delivery)
    assert len(await read_all(bootstrap, topic, "read_committed")) == 6
    assert part.outcomes == [None] * 6 and delivery.sent == [], "found committed, not sent"
    assert unknown.state is State.RESOLVED_COMMITTED, "read before the lane committed again"


async def test_a_lane_keeps_its_id_while_a_commit_of_it_is_unknown(
    conn: asyncpg.Connection,
    owners: Owners,
    topic: str,
    services: Services,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same unknown commit at a graceful stop: the lane does not tombstone its id, whose
    last record is what the takeover reads to decide the leased rows; the next claim of them
    finds them committed and sends none (with the tombstone: their 3 rows sent again). While
    the progress cannot be read, the lane's next claim is given back uncounted, never sent
    (before: sent, in a record that did not list the unknown rows)."""
    bootstrap = services.kafka_bootstrap_servers
    a, b, settings, unknown = await a_commit_whose_answer_is_lost(conn, owners, topic)
    with monkeypatch.context() as broker_away:
        broker_away.setattr(Takeover, "read", unreadable)
        await run(unknown)
        held = a.publish((await owners.claim("owner-a", settings)).records)
        part = await run(held)
        assert all(isinstance(o, TransactionAbortedError) for o in part.outcomes), part
        assert held.sent == []
        await a.stop()  # graceful: its farewell
    await expire(conn)
    taken = await owners.claim("owner-b")
    delivery = b.publish(taken.records)
    outcomes = (await run(delivery)).outcomes
    sent_again = {i for i, _ in delivery.sent} & {r.id for r in unknown.records}
    assert outcomes == [None] * 6 and not sent_again, "the unknown commit's rows found committed"
    assert len(await read_all(bootstrap, topic, "read_committed")) == 6


async def a_commit_whose_answer_is_lost(
    conn: asyncpg.Connection, owners: Owners, topic: str
) -> tuple[TransactionalPublisher, TransactionalPublisher, Settings, TransactionalDelivery]:
    """owner-a (one lane) and owner-b; 6 rows of 2 keys; owner-a's first claim of 3 rows
    published with its commit's answer to be lost (its delivery, not run yet); the settings of
    claims of 3."""
    a = await owners.publisher("owner-a", lanes=1)
    b = await owners.publisher("owner-b")
    await insert_sequenced(conn, topic, keys=2, per_key=3)
    settings = owners.settings.model_copy(update={"batch_size": 3})
    unknown = a.publish((await owners.claim("owner-a", settings)).records)
    answer_lost(unknown.lane.producers.current())
    return a, b, settings, unknown


async def unreadable(self: Takeover, own: object) -> None:
    """Takeover.read while the broker is away."""
    raise ProgressUnavailableError("the broker is away")


def answer_lost(producer: AIOKafkaProducer) -> None:
    """The producer's next commit is made at the broker, and its answer lost (as when the
    connection drops before the coordinator's reply arrives)."""
    commit = producer.commit_transaction

    async def commit_whose_answer_is_lost() -> None:
        await commit()
        raise kafka_errors.KafkaConnectionError("the commit's answer was lost")

    producer.commit_transaction = commit_whose_answer_is_lost  # type: ignore[method-assign]


# --- the progress topic checked (review E10) ---------------------------------------------------


async def test_a_misconfigured_progress_topic_stops_the_mode_at_start(
    conn: asyncpg.Connection,
    services: Services,
    topic: str,
    eos_settings: Callable[..., Settings],
    tmp_path: Path,
) -> None:
    """An operator made the progress topic with 3 partitions and cleanup.policy=delete: the
    dispatcher refuses to start in exactly-once mode and says what to do; no row is sent.
    Before issue 35 it started and published, its progress at the mercy of retention."""
    settings = eos_settings(log_format="json", http_port=0)
    await insert_sequenced(conn, topic, keys=1, per_key=3)
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka_bootstrap_servers)
    await admin.start()
    try:
        config = {"cleanup.policy": "delete", "retention.ms": "60000"}
        await admin.create_topics([NewTopic(settings.progress_topic, 3, 1, topic_configs=config)])
    finally:
        await admin.close()
    log = tmp_path / "d.log"
    process = spawn(settings, log)
    try:
        code = await asyncio.to_thread(process.wait, 90)
    finally:
        if process.poll() is None:
            kill9(process)
    failed = log_events(log, "failed")
    assert code != 0 and failed, log.read_text()[-3000:]
    assert failed[-1]["error_type"] == "ProgressTopicError"
    message = failed[-1]["error"]
    assert "3 partitions (1 needed)" in message and "cleanup.policy=delete" in message
    assert "OUTBOX_PROGRESS_TOPIC" in message, "it says what to do"
    assert await count(conn, "published_at IS NOT NULL") == 0
    assert await read_all(services.kafka_bootstrap_servers, topic, "read_committed") == []


async def test_a_progress_topic_made_again_while_running_stops_the_takeover(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    """The progress topic is deleted after owner-a committed 10 rows (its record is gone), and
    owner-a's next transaction makes it again with the broker's defaults (auto-creation): the
    takeover of owner-a's rows refuses to decide from it (ProgressTopicError), sends nothing.
    Before issue 35 it read the new topic, found nothing, and sent the 10 rows again."""
    bootstrap = services.kafka_bootstrap_servers
    a = await owners.publisher("owner-a")
    b = await owners.publisher("owner-b")
    await insert_sequenced(conn, topic, keys=2, per_key=5)
    lost = await owners.claim("owner-a")
    assert (await run(a.publish(lost.records))).outcomes == [None] * 10
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([owners.progress.topic])
        await asyncio.sleep(2.0)
    finally:
        await admin.close()
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, 'other', '{}')", topic
    )
    other = await owners.claim("owner-a")
    for _ in range(10):  # the first sends wait for the topic to be made again
        if (await run(a.publish(other.records))).outcomes == [None]:
            break
    else:
        raise AssertionError("owner-a's transactions never committed on the new topic")
    await expire(conn)
    taken = await owners.claim("owner-b")
    assert {r.id for r in lost.records} <= {r.id for r in taken.records}
    with pytest.raises(ProgressTopicError, match=r"cleanup\.policy=delete"):
        await run(b.publish(taken.records))
    assert len(await read_all(bootstrap, topic, "read_committed")) == 11, "nothing again"
