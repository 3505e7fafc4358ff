"""Each component's config is built from the settings in one place (dispatch/supervisor.py's
configs_of, through models.picked): every field must carry the setting it is named after."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import SecretStr

from outbox_dispatcher.config.settings import DeadLetterPolicy, Settings
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.models import picked

# A value for each setting the configs read, none of them its default.
CHANGED: dict[str, Any] = {
    "kafka_bootstrap_servers": "b1:9093,b2:9093",
    "kafka_client_id": "relay-7",
    "kafka_security_protocol": "SASL_SSL",
    "kafka_sasl_mechanism": "SCRAM-SHA-512",
    "kafka_sasl_username": "relay",
    "kafka_sasl_password": "s3cret",
    "kafka_ssl_cafile": "/ca.pem",
    "kafka_ssl_certfile": "/cert.pem",
    "kafka_ssl_keyfile": "/key.pem",
    "kafka_ssl_key_password": "k3y",
    "kafka_ssl_check_hostname": False,
    "kafka_linger_ms": 17,
    "kafka_max_batch_bytes": 123_456,
    "kafka_max_request_bytes": 2_345_678,
    "kafka_compression": "lz4",
    "kafka_allow_auto_create_topics": False,
    "publish_timeout_seconds": 7.5,
    "default_topic": "fallback",
    "topic_template": "events.{aggregate}",
    "event_id_header": "x-event",
    "cloudevents": True,
    "cloudevents_source": "orders",
    "cloudevents_type": "order.changed",
    "cloudevents_content_type": "application/avro",
    "batch_size": 77,
    "backoff_initial_seconds": 0.3,
    "backoff_max_seconds": 9.0,
    "poll_interval_seconds": 0.7,
    "linger_seconds": 0.4,
    "linger_poll_seconds": 0.02,
    "lease_seconds": 11.0,
    "delete_on_publish": True,
    "dead_letter_policy": "block",
    "tracing": True,
}


def settings() -> Settings:
    return Settings(database_url="postgresql://u@h/d", **CHANGED)


def plain(value: object) -> object:
    return value.get_secret_value() if isinstance(value, SecretStr) else value


def test_every_config_field_carries_the_setting_of_its_name() -> None:
    s = settings()
    c = configs_of(s)
    # The fields named otherwise than their setting, and what they carry.
    renamed = {
        ("connection", "request_timeout_seconds"): s.publish_timeout_seconds,
        ("records", "max_request_bytes"): s.kafka_max_request_bytes,
        ("topics", "allow_auto_create_topics"): s.kafka_allow_auto_create_topics,
        ("delivery", "max_batch_bytes"): s.kafka_max_batch_bytes,
        ("settle", "retry_for_seconds"): s.lease_seconds,
        ("settle", "block_on_dead"): True,
        ("producer", "transactional_id"): None,  # the owner's, set by TransactionalPublisher
        ("producer", "transaction_timeout_seconds"): s.transaction_timeout_seconds,
        ("progress", "topic"): s.progress_topic,
        ("progress", "outbox"): f"{s.db_schema}.{s.table}",
        ("progress", "timeout_seconds"): s.transaction_timeout_seconds,
    }
    configs = {
        "connection": (c.publisher.producer.connection, "kafka_"),
        "producer": (c.publisher.producer, "kafka_"),
        "records": (c.publisher.records, ""),
        "topics": (c.publisher.topics, ""),
        "delivery": (c.publisher.delivery, ""),
        "claim_loop": (c.claim_loop, ""),
        "settle": (c.settle, ""),
        "progress": (c.progress, ""),
    }
    checked = 0
    for part, (config, prefix) in configs.items():
        for field in dataclasses.fields(config):
            value = plain(getattr(config, field.name))
            if dataclasses.is_dataclass(value):
                continue
            expected = renamed.get((part, field.name), plain(getattr(s, prefix + field.name, None)))
            if isinstance(expected, DeadLetterPolicy):
                expected = expected.value
            assert value == expected, f"{part}.{field.name}"
            checked += 1
    assert checked >= 30
    assert c.publisher.tracing is True


@dataclasses.dataclass(frozen=True)
class Sample:
    size: int
    name: str = "default"


def test_picked_reads_same_named_attributes_and_refuses_a_missing_required_one() -> None:
    class Source:
        size = 3
        x_size = 4
        x_name = "prefixed"

    assert picked(Sample, Source()) == Sample(3)
    assert picked(Sample, Source(), prefix="x_") == Sample(4, "prefixed")
    assert picked(Sample, Source(), size=9) == Sample(9)
    with pytest.raises(TypeError):
        picked(Sample, object())
