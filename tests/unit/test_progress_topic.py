"""The progress topic's start check (kafka/exactly_once/topic.py) over a fake admin client whose
brokers learn of a topic late, as a cluster's do a moment after another dispatcher made it (CI:
two exactly-once dispatchers starting at once on three brokers, one stopped with "it does not
exist (deleted?)" for the topic the other had just created)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import errors as kafka_errors

from outbox_dispatcher.kafka.exactly_once import topic as progress_topic

TOPIC = "progress"
GOOD = {"cleanup.policy": "compact", "min.insync.replicas": "2"}


class Admin:
    """A cluster of three brokers on which the topic exists, or is being created by someone else:
    the first `late` answers of each kind do not know it yet."""

    def __init__(self, late: int, exists: bool = True, made_elsewhere: bool = False) -> None:
        self.late = {"list": late, "describe": late, "configs": late}
        self.exists = exists
        self.made_elsewhere = made_elsewhere
        self.created: list[Any] = []

    def _knows(self, kind: str) -> bool:
        if self.late[kind] > 0:
            self.late[kind] -= 1
            return False
        return self.exists

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def describe_cluster(self) -> dict[str, Any]:
        return {"brokers": [1, 2, 3]}

    async def list_topics(self) -> list[str]:
        return [TOPIC] if self._knows("list") else []

    async def describe_topics(self, topics: list[str]) -> list[dict[str, Any]]:
        if not self._knows("describe"):
            return [{"error_code": progress_topic.UNKNOWN_TOPIC, "partitions": []}]
        return [{"error_code": 0, "partitions": [{"replicas": [1, 2, 3]}]}]

    async def describe_configs(self, resources: list[Any]) -> list[Any]:
        known = self._knows("configs")
        entries = [{"config_names": k, "config_value": v} for k, v in GOOD.items()]
        resource = {"error_code": 0 if known else 3, "config_entries": entries if known else []}
        return [SimpleNamespace(to_object=lambda: {"resources": [resource]})]

    async def create_topics(self, topics: list[Any]) -> None:
        if self.made_elsewhere:
            raise kafka_errors.TopicAlreadyExistsError
        self.created.extend(topics)


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress_topic, "ASK_AGAIN_SECONDS", 0.001)
    monkeypatch.setattr(progress_topic, "PROPAGATION_SECONDS", 0.5)


def serve(monkeypatch: pytest.MonkeyPatch, admin: Admin) -> None:
    monkeypatch.setattr(progress_topic.progress, "client_options", lambda _: {})
    monkeypatch.setattr(progress_topic, "AIOKafkaAdminClient", lambda **_: admin)


async def no_keys() -> int:
    return 0


async def some_keys() -> int:
    return 5


async def test_a_topic_another_dispatcher_made_a_moment_ago_passes_the_start_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both saw no topic; the other's create won; the brokers asked next learn of it late."""
    admin = Admin(late=3, made_elsewhere=True)
    serve(monkeypatch, admin)
    await progress_topic.ensure(SimpleNamespace(), TOPIC, no_keys)  # type: ignore[arg-type]
    assert admin.created == []


async def test_a_topic_one_broker_does_not_list_yet_is_not_called_missing_while_keys_are_leased(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    serve(monkeypatch, Admin(late=2))
    await progress_topic.ensure(SimpleNamespace(), TOPIC, some_keys)  # type: ignore[arg-type]


async def test_a_missing_topic_is_made_when_no_key_needs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admin = Admin(late=0, exists=False)
    serve(monkeypatch, admin)
    await progress_topic.ensure(SimpleNamespace(), TOPIC, no_keys)  # type: ignore[arg-type]
    [made] = admin.created
    assert (made.name, made.num_partitions, made.replication_factor) == (TOPIC, 1, 3)


async def test_a_topic_that_stays_missing_while_keys_are_leased_stops_the_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    serve(monkeypatch, Admin(late=0, exists=False))
    with pytest.raises(progress_topic.ProgressTopicError, match="5 keys of the table are leased"):
        await progress_topic.ensure(SimpleNamespace(), TOPIC, some_keys)  # type: ignore[arg-type]


async def test_a_topic_deleted_under_running_dispatchers_is_still_called_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    serve(monkeypatch, Admin(late=0, exists=False))
    with pytest.raises(progress_topic.ProgressTopicError, match=r"does not exist \(deleted\?\)"):
        await progress_topic.check(SimpleNamespace(), TOPIC)  # type: ignore[arg-type]


async def test_a_topic_whose_configs_one_broker_does_not_know_yet_is_not_called_misconfigured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admin = Admin(late=0)
    admin.late["configs"] = 2
    serve(monkeypatch, admin)
    await progress_topic.check(SimpleNamespace(), TOPIC)  # type: ignore[arg-type]
