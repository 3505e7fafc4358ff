"""outbox_dispatcher/broker.py reaches below aiokafka's public API. Each test names one private
attribute or internal it uses; an aiokafka upgrade that moves one fails here, saying which
function of broker.py needs a new way in. No broker is needed: the objects are built, not
started."""

from __future__ import annotations

import inspect
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiokafka
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.protocol import metadata

from outbox_dispatcher import broker

PACKAGE = Path(broker.__file__).parent


def reach(obj: object, path: str, needed_by: str) -> Any:
    """obj.<path>, or a failure naming what moved and which function needs it."""
    current: Any = obj
    for name in path.split("."):
        if not hasattr(current, name):
            pytest.fail(
                f"aiokafka {aiokafka.__version__} has no {type(obj).__name__}.{path} (missing "
                f"{name!r}): broker.{needed_by} needs a new way in; read the new aiokafka source"
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
    broker.fail_buffered(producer, RuntimeError("stopped"))
    assert reach(producer, "_message_accumulator._exception", "fail_buffered").args == (
        "stopped",
    ), "fail_all records the exception that later sends get"


async def test_the_producer_client_caches_cluster_metadata(producer: AIOKafkaProducer) -> None:
    partitions_for_topic = reach(
        producer, "client.cluster.partitions_for_topic", "known_partitions"
    )
    assert callable(partitions_for_topic)
    assert broker.known_partitions(producer, "never-seen") is None


async def test_the_producer_client_caches_which_partitions_have_a_leader(
    producer: AIOKafkaProducer,
) -> None:
    available = reach(
        producer, "client.cluster.available_partitions_for_topic", "available_partitions"
    )
    assert callable(available)
    assert broker.available_partitions(producer, "never-seen") is None


async def test_the_producer_client_fetches_all_metadata(producer: AIOKafkaProducer) -> None:
    fetch = reach(producer, "client.fetch_all_metadata", "all_metadata")
    assert inspect.iscoroutinefunction(fetch)
    assert list(inspect.signature(fetch).parameters) == []


async def test_the_producer_client_sends_a_request_to_a_random_node(
    producer: AIOKafkaProducer,
) -> None:
    get_random_node = reach(producer, "client.get_random_node", "topic_error_codes")
    send = reach(producer, "client.send", "topic_error_codes")
    assert inspect.iscoroutinefunction(send)
    assert list(inspect.signature(send).parameters)[:2] == ["node_id", "request"]
    assert get_random_node() is None, "no broker known before start"
    assert await broker.topic_error_codes(producer, ["t"]) is None


def test_metadata_request_v4_and_later_can_refuse_auto_creation() -> None:
    request = metadata.MetadataRequest(["t"], allow_auto_topic_creation=False)
    structs = [
        cls
        for name, cls in vars(metadata).items()
        if re.fullmatch(r"MetadataRequest_v\d+", name) and cls.API_VERSION >= 4
    ]
    assert structs, "aiokafka lost its Metadata v4+ requests: broker.topic_error_codes"
    for struct in structs:
        built = request.build(struct)
        assert built.topics == ["t"]
        assert built.allow_auto_topic_creation is False, struct.__name__
        topics = struct.RESPONSE_TYPE.SCHEMA.fields[
            struct.RESPONSE_TYPE.SCHEMA.names.index("topics")
        ]
        assert topics.array_of.names[:2] == ("error_code", "topic"), (
            f"{struct.RESPONSE_TYPE.__name__}: broker.topic_error_codes reads entry[0] as the "
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
        assert name in params, f"aiokafka.conn.create_conn lost {name!r}: broker.open_connection"


def test_only_broker_py_reaches_below_the_public_api() -> None:
    # A logger's name in quotes ("aiokafka.cluster" in logs.py) is not a reach into the module.
    below = re.compile(
        r"_message_accumulator|aiokafka\.(?:conn|protocol|cluster)\b(?![\"'])|\.client\.\w"
    )
    offenders = [
        f"{path.name}:{n}"
        for path in sorted(PACKAGE.glob("*.py"))
        if path.name != "broker.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if below.search(line)
    ]
    assert offenders == [], "move these reaches into outbox_dispatcher/broker.py"
