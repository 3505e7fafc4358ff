"""outbox_dispatcher/kafka/internals.py reaches below aiokafka's public API. Each test names one
private attribute or internal it uses; an aiokafka upgrade that moves one fails here, saying which
function of kafka/internals.py needs a new way in. No broker is needed: the objects are built, not
started."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import aiokafka
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka import errors as kafka_errors
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import ConnectionGroup
from aiokafka.conn import AIOKafkaConnection
from aiokafka.protocol import metadata
from aiokafka.structs import TopicPartition

from outbox_dispatcher.kafka import failures, internals
from outbox_dispatcher.models import Failure

PACKAGE = Path(internals.__file__).parents[1]


def reach(obj: object, path: str, needed_by: str) -> Any:
    """obj.<path>, or a failure naming what moved and which function needs it."""
    current: Any = obj
    for name in path.split("."):
        if not hasattr(current, name):
            pytest.fail(
                f"aiokafka {aiokafka.__version__} has no {type(obj).__name__}.{path} (missing "
                f"{name!r}): internals.{needed_by} needs a new way in; read the new aiokafka source"
            )
        current = getattr(current, name)
    return current


@pytest.fixture
async def producer() -> AsyncIterator[AIOKafkaProducer]:
    built = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1", enable_idempotence=True)
    try:
        yield built  # never started
    finally:
        await built.stop()


async def test_the_producer_buffers_in__message_accumulator_with_fail_all(
    producer: AIOKafkaProducer,
) -> None:
    fail_all = reach(producer, "_message_accumulator.fail_all", "fail_buffered")
    assert list(inspect.signature(fail_all).parameters) == ["exception"]
    reach(producer, "_message_accumulator._batches", "fail_buffered")
    reach(producer, "_message_accumulator._pending_batches", "fail_buffered")
    internals.fail_buffered(producer, RuntimeError("stopped"))
    assert reach(producer, "_message_accumulator._exception", "fail_buffered").args == (
        "stopped",
    ), "fail_all records the exception that later sends get"


async def test_the_producer_queues_batches_in__message_accumulator__batches(
    producer: AIOKafkaProducer,
) -> None:
    """withdraw_unsent (issue 25) reads the accumulator's queue of batches per partition, each
    batch's builder, its drain count and its drain waiter."""
    batches = reach(producer, "_message_accumulator._batches", "withdraw_unsent")
    assert batches == {}, "_batches maps a TopicPartition to a deque of MessageBatch"
    append = reach(producer, "_message_accumulator._append_batch", "withdraw_unsent (test)")
    pop = reach(producer, "_message_accumulator._pop_batch", "withdraw_unsent (test)")
    assert list(inspect.signature(append).parameters) == ["builder", "tp"]
    assert list(inspect.signature(pop).parameters) == ["tp"]
    batch = append(producer.create_batch(), TopicPartition("t", 0))
    for name in ("_builder", "retry_count", "future", "_drain_waiter"):
        reach(batch, name, "withdraw_unsent")
    internals.withdraw_unsent(producer, RuntimeError("cleanup"))


async def test_withdraw_unsent_fails_queued_batches_and_leaves_those_a_request_carried(
    producer: AIOKafkaProducer,
) -> None:
    """Issue 25: a batch the sender has drained into a produce request may be in the broker's
    log: it stays with the producer, whose retries the broker recognises. A batch still queued
    has used no sequence number and cannot be in the log: it is failed, and whoever waits to
    append behind it goes on."""
    manager = reach(producer, "_txn_manager", "producer_id")
    assert internals.producer_id(producer) is None, "no producer id before the broker gives one"
    manager.set_pid_and_epoch(4242, 0)
    assert internals.producer_id(producer) == 4242
    accumulator = producer._message_accumulator
    tp, other = TopicPartition("t", 0), TopicPartition("t", 1)
    carried = accumulator._append_batch(producer.create_batch(), tp)
    assert accumulator._pop_batch(tp) is carried  # drained: a request carries it
    accumulator.reenqueue(carried)  # refused with a retriable error: queued again, first
    queued_builder = producer.create_batch()
    queued = accumulator._append_batch(queued_builder, tp)
    elsewhere = accumulator._append_batch(producer.create_batch(), other)
    refusal = RuntimeError("not acknowledged in time")

    assert internals.withdraw_unsent(producer, refusal, [queued_builder]) == 1
    assert isinstance(queued.future.exception(), RuntimeError)
    assert queued._drain_waiter.done(), "a submission waiting behind it may append"
    assert list(accumulator._batches[tp]) == [carried], "the carried batch stays, first"
    assert not carried.future.done() and not elsewhere.future.done()

    assert internals.withdraw_unsent(producer, refusal) == 1  # every queued batch: `elsewhere`
    assert elsewhere.future.done() and not carried.future.done()
    assert other not in accumulator._batches
    carried.failure(RuntimeError("cleanup"))


async def test_the_producer_client_caches_cluster_metadata(producer: AIOKafkaProducer) -> None:
    partitions_for_topic = reach(
        producer, "client.cluster.partitions_for_topic", "known_partitions"
    )
    assert callable(partitions_for_topic)
    assert internals.known_partitions(producer, "never-seen") is None


async def test_the_producer_client_caches_which_partitions_have_a_leader(
    producer: AIOKafkaProducer,
) -> None:
    available = reach(
        producer, "client.cluster.available_partitions_for_topic", "available_partitions"
    )
    assert callable(available)
    assert internals.available_partitions(producer, "never-seen") is None


async def test_the_producer_client_fetches_all_metadata(producer: AIOKafkaProducer) -> None:
    fetch = reach(producer, "client.fetch_all_metadata", "all_metadata")
    assert inspect.iscoroutinefunction(fetch)
    assert list(inspect.signature(fetch).parameters) == []


async def test_the_producer_client_sends_a_request_to_each_connected_broker(
    producer: AIOKafkaProducer,
) -> None:
    brokers = reach(producer, "client.cluster.brokers", "_first_answer")
    send = reach(producer, "client.send", "_first_answer")
    conns = reach(producer, "client._conns", "_first_answer")
    assert inspect.iscoroutinefunction(send)
    assert list(inspect.signature(send).parameters)[:2] == ["node_id", "request"]
    assert brokers() == set(), "no broker known before start"
    assert conns == {}, "_conns maps (node id, ConnectionGroup) to a connection"
    assert reach(AIOKafkaConnection, "connected", "_first_answer")
    assert ConnectionGroup.DEFAULT in ConnectionGroup
    get_random_node = reach(producer, "client.get_random_node", "topic_error_codes")
    assert get_random_node() is None
    assert await internals.topic_error_codes(producer, ["t"]) is None
    assert await internals.load_topics(producer, ["t"]) is False


async def test_the_producer_client_caches_the_topics_a_metadata_answer_names(
    producer: AIOKafkaProducer,
) -> None:
    assert reach(producer, "client.cluster.topics", "load_topics")() == set()
    update = reach(producer, "client.cluster.update_metadata", "load_topics")
    assert list(inspect.signature(update).parameters) == ["metadata"]
    tracked = reach(producer, "client._topics", "load_topics")
    assert tracked == set(), "_topics: the topics aiokafka's metadata refresh names"
    internals.track_topics(producer, ["kept"])
    assert reach(producer, "client._topics", "track_topics") == {"kept"}
    tracked.discard("kept")


V4 = metadata.MetadataRequest_v4


class Node:
    def __init__(self, node_id: int) -> None:
        self.nodeId = node_id


class Cluster:
    """The part of aiokafka's ClusterMetadata that load_topics uses."""

    def __init__(self, nodes: list[int], cached: set[str]) -> None:
        self.nodes = nodes
        self.cached = cached
        self.updates: list[Any] = []

    def brokers(self) -> set[Node]:
        return {Node(n) for n in self.nodes}

    def topics(self) -> set[str]:
        return set(self.cached)

    def update_metadata(self, metadata: Any) -> None:
        self.updates.append(metadata)


class Client:
    """A client connected to `connected` of `nodes`; node `silent` takes requests and never
    answers (a blackholed broker), and is the random node: aiokafka's own lookups ask it
    first. Connecting to a node that is not connected is aiokafka's business (it opens one
    connection at a time): this client refuses it, so that a test sees any such attempt."""

    def __init__(
        self,
        nodes: list[int],
        silent: int,
        connected: set[int] | None = None,
        failing: frozenset[int] = frozenset(),
    ) -> None:
        self.cluster = Cluster(nodes, {"cached"})
        self._conns = {
            (n, ConnectionGroup.DEFAULT): SimpleNamespace(connected=lambda: True)
            for n in (set(nodes) if connected is None else connected)
        }
        self._topics: set[str] = {"cached"}
        self.silent = silent
        self.failing = failing
        self.asked: list[tuple[int, Any]] = []
        self.cancelled: list[int] = []
        self.fetched_all = 0

    def get_random_node(self) -> int:
        return self.silent

    async def fetch_all_metadata(self) -> None:
        self.fetched_all += 1

    async def send(self, node_id: int, request: Any) -> Any:
        assert (node_id, ConnectionGroup.DEFAULT) in self._conns, f"connects to {node_id}"
        self.asked.append((node_id, request))
        if node_id == self.silent:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(node_id)
                raise
        if node_id in self.failing:
            raise kafka_errors.RequestTimedOutError
        await asyncio.sleep(0.01)
        return SimpleNamespace(
            brokers=[(n, "h", 1, None) for n in self.cluster.nodes],
            topics=[(0, topic, False, []) for topic in request.build(V4).topics],
        )


def fake(client: Client) -> AIOKafkaProducer:
    return cast("AIOKafkaProducer", SimpleNamespace(client=client))


async def test_a_lookup_does_not_wait_for_a_broker_that_never_answers() -> None:
    """CI's blackholed-partition test (issue 10): aiokafka asks one broker at a time, each within
    the request timeout, so a broker that never answers made a topic lookup wait a whole
    request timeout, and every key of the topic with it. The connected brokers are asked at
    once; the first answer is taken, the silent request is dropped, and a broker not connected
    is not asked (aiokafka opens one connection at a time: one that hangs holds up the
    others)."""
    client = Client([1, 2, 3, 4], silent=3, connected={1, 2, 3})
    async with asyncio.timeout(2):
        codes = await internals.topic_error_codes(fake(client), ["a"])
        loaded = await internals.load_topics(fake(client), ["new"])
        await internals.answers(fake(client))
    await asyncio.sleep(0)  # the last cancelled request ends
    assert codes == {"a": 0}
    assert loaded is True
    assert sorted(node for node, _ in client.asked) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert client.cancelled == [3, 3, 3], "the silent requests are cancelled, not left behind"
    (update,) = client.cluster.updates
    assert sorted(topic for _, topic, _, _ in update.topics) == ["cached", "new"], (
        "the request names the cached topics too: an answer replaces the whole cache"
    )
    assert client._topics == {"cached", "new"}
    assert client.fetched_all == 0


async def test_a_lookup_raises_the_failure_when_no_connected_broker_answers() -> None:
    client = Client([1, 2], silent=99, failing=frozenset({1, 2}))
    with pytest.raises(kafka_errors.RequestTimedOutError):
        await internals.load_topics(fake(client), ["new"])
    assert client.cluster.updates == []
    assert client._topics == {"cached"}
    await internals.answers(fake(client))
    assert client.fetched_all == 1, "aiokafka's own round of the brokers is the fallback"


async def test_with_no_broker_connected_aiokafka_chooses() -> None:
    client = Client([1, 2], silent=2, connected=set())
    client._conns[(1, ConnectionGroup.DEFAULT)] = SimpleNamespace(connected=lambda: False)
    assert await internals.load_topics(fake(client), ["new"]) is False, "a closed one is not asked"
    await internals.answers(fake(client))
    assert client.fetched_all == 1
    with pytest.raises(AssertionError, match="connects to 2"):
        await internals.topic_error_codes(fake(client), ["a"])  # aiokafka's random node
    assert client.asked == []


def test_metadata_request_v4_and_later_can_refuse_auto_creation() -> None:
    request = metadata.MetadataRequest(["t"], allow_auto_topic_creation=False)
    structs = [
        cls
        for name, cls in vars(metadata).items()
        if re.fullmatch(r"MetadataRequest_v\d+", name) and cls.API_VERSION >= 4
    ]
    assert structs, "aiokafka lost its Metadata v4+ requests: internals.topic_error_codes"
    for struct in structs:
        built = request.build(struct)
        assert built.topics == ["t"]
        assert built.allow_auto_topic_creation is False, struct.__name__
        topics = struct.RESPONSE_TYPE.SCHEMA.fields[
            struct.RESPONSE_TYPE.SCHEMA.names.index("topics")
        ]
        assert topics.array_of.names[:2] == ("error_code", "topic"), (
            f"{struct.RESPONSE_TYPE.__name__}: internals.topic_error_codes reads entry[0] as the "
            "error code and entry[1] as the topic"
        )


def test_create_conn_takes_the_options_the_diagnosis_passes() -> None:
    from aiokafka import conn

    create_conn = reach(conn, "create_conn", "open_connection")
    params = inspect.signature(create_conn).parameters
    for name in (
        "client_id",
        "request_timeout_ms",
        "ssl_context",
        "security_protocol",
        "sasl_mechanism",
        "sasl_plain_username",
        "sasl_plain_password",
    ):
        assert name in params, f"aiokafka.conn.create_conn lost {name!r}: internals.open_connection"


def test_the_transaction_retry_backoff_is_aiokafka_sender_backoff_override() -> None:
    """internals.quicken_transaction_retries sets aiokafka.producer.sender.BACKOFF_OVERRIDE, the
    wait before an AddPartitionsToTxn retried after CONCURRENT_TRANSACTIONS."""
    from aiokafka.producer import sender

    assert isinstance(sender.BACKOFF_OVERRIDE, float), "aiokafka renamed BACKOFF_OVERRIDE"
    assert "BACKOFF_OVERRIDE" in inspect.getsource(sender.AddPartitionsToTxnHandler)
    internals.quicken_transaction_retries()
    assert sender.BACKOFF_OVERRIDE == internals.TRANSACTION_RETRY_SECONDS


def test_a_transactional_producer_keeps_its_ending_error_in__txn_manager__transaction_waiter() -> (
    None
):
    """internals.read_fatal_error reads AIOKafkaProducer._txn_manager._transaction_waiter."""
    from aiokafka.producer import transaction_manager

    source = inspect.getsource(transaction_manager.TransactionManager)
    assert "self._transaction_waiter.set_exception(exc)" in source
    assert "_txn_manager" in inspect.getsource(aiokafka.AIOKafkaProducer.__init__)


def test_only_kafka_internals_reaches_below_the_public_api() -> None:
    """Every module of the package, those of its subpackages included, but kafka/internals.py."""
    # A logger's name in quotes ("aiokafka.cluster" in logs.py) is not a reach into the module,
    # nor is an HTTP request's client (the console's `request.client.host`).
    below = re.compile(
        r"_message_accumulator|_txn_manager|BACKOFF_OVERRIDE|aiokafka\.(?:conn|protocol|cluster)\b(?![\"'])"
        r"|(?<!request)\.client\.\w"
    )
    internals_path = Path(internals.__file__)
    paths = sorted(PACKAGE.rglob("*.py"))
    assert internals_path in paths and internals_path.parent != PACKAGE, "subpackages are read"
    assert below.search(internals_path.read_text()), "the pattern finds the reaches it is for"
    offenders = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in paths
        if path != internals_path
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if below.search(line)
    ]
    assert offenders == [], "move these reaches into outbox_dispatcher/kafka/internals.py"


async def test_the_admin_client_sends_a_request_by__send_request() -> None:
    """internals.describe_topics sends its own metadata request (no auto-creation) through it."""
    admin = AIOKafkaAdminClient(bootstrap_servers="127.0.0.1:1")  # never started
    try:
        assert callable(reach(admin, "_send_request", "describe_topics"))
        request = metadata.MetadataRequest(["t"], allow_auto_topic_creation=False)
        assert reach(request, "_allow_auto_topic_creation", "describe_topics") is False
    finally:
        await admin.close()


async def test_a_dead_sender_is_read_from__sender_sender_task() -> None:
    """internals.sender_failure reads the sender's task. aiokafka's sender dies on an error it
    did not expect (CI: a broker restart under an exactly-once load) with a bare KafkaError
    caused by it (failures.is_sender_death: no row's fault), fails what it holds with it, and
    puts the transaction manager in its fatal state, where aiokafka's own abort, commit and begin
    fail an assertion: why endings.py and the publisher ask sender_failure first."""
    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1", transactional_id="t-1")
    try:
        sender = reach(producer, "_sender", "sender_failure")
        reach(sender, "sender_task", "sender_failure")
        assert internals.sender_failure(producer) is None, "a producer never started"
        producer._txn_manager.set_pid_and_epoch(7, 0)
        await producer.begin_transaction()
        accumulator = producer._message_accumulator
        batch = accumulator._append_batch(producer.create_batch(), TopicPartition("t", 0))

        def unexpected(*args: Any, **kwargs: Any) -> Any:
            raise ValueError("an error aiokafka did not expect")

        accumulator.drain_by_nodes = unexpected
        sender._maybe_do_transactional_request = lambda: None  # no coordinator to ask here
        sender._sender_task = asyncio.ensure_future(sender._sender_routine())  # as start() does
        sender._sender_task.add_done_callback(sender._fail_all)
        await asyncio.wait([sender._sender_task], timeout=5)

        died = internals.sender_failure(producer)
        assert type(died) is kafka_errors.KafkaError, died
        assert isinstance(died.__cause__, ValueError)
        assert failures.is_sender_death(died) and failures.is_producer_state(died)
        assert failures.classify(died) is Failure.TRANSIENT, "never counted against a row"
        assert batch.future.exception() is died, "what it held failed with the same error"
        internals.read_drains([batch])
        assert internals.read_fatal_error(producer) is died
        with pytest.raises(AssertionError, match="Invalid state transition"):
            await producer.abort_transaction()
    finally:
        await producer.stop()
