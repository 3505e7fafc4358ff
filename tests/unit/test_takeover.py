"""Exactly-once's takeover fences (review E6, E7): the owners whose claims it stands in for are
fenced whatever their heartbeat's age, and an id it cannot fence makes it wait; any other
dispatcher's id is fenced as it can, and a failure there holds nobody up. Faked at our own seam
(kafka/exactly_once/progress.fence); the same against Kafka:
tests/integration/test_exactly_once_fence.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from aiokafka import errors as kafka_errors

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.kafka.exactly_once import takeover as takeover_module
from outbox_dispatcher.kafka.exactly_once.lanes import Registered
from outbox_dispatcher.kafka.exactly_once.progress import ProgressConfig
from outbox_dispatcher.kafka.exactly_once.retirement import Retirement
from outbox_dispatcher.kafka.exactly_once.takeover import FenceFailedError, Takeover
from outbox_dispatcher.models import OutboxRecord
from tests.fakes import FakeProgressStore

PROGRESS = ProgressConfig(
    topic="p", outbox="public.outbox", transactional_id_prefix="x.", timeout_seconds=2.0
)


def record(i: int, key: str) -> OutboxRecord:
    return OutboxRecord(
        id=i, topic="t", ordering_key=key, payload=b"", headers={}, event_id=None,
        created_at=None, attempts=0, reclaimed=True,
    )  # fmt: skip


class _Registry(FakeProgressStore):
    """owner-a's lease expired (the duty names it) and its heartbeat is hours old: the window
    of live dispatchers lists only owner-c, which has nothing to do with these keys."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[list[tuple[str, bool]], list[str]]] = []

    async def live(self) -> Sequence[Registered]:
        return [("me", "exactly-once", ["x.me"]), ("owner-c", "exactly-once", ["x.c", "x.c.1"])]

    async def record(self, ids: Sequence[str]) -> None:
        pass

    async def lost(self, keys: Any, owners: Sequence[str]) -> Sequence[Registered]:
        self.asked.append((list(keys), list(owners)))
        return [("owner-a", "exactly-once", ["x.a", "x.a.1.2"])]


def made(failed: list[int]) -> tuple[Takeover, _Registry]:
    registry = _Registry()

    async def nothing(*_: Any) -> Any:
        return []

    taker = Takeover(
        PROGRESS,
        configs_of(Settings(delivery="exactly-once")).publisher.producer,
        "me",
        registry,
        fence_seconds=1.0,
        retire=Retirement(nothing, nothing, "5f0c2a55-0000-4000-8000-000000000001"),
        fence_failed=lambda: failed.append(1),
    )
    return taker, registry


def fencing(monkeypatch: pytest.MonkeyPatch, unfenceable: set[str]) -> list[str]:
    fenced: list[str] = []

    async def fence(config: Any, transactional_id: str, seconds: float) -> None:
        if transactional_id in unfenceable:
            raise kafka_errors.KafkaTimeoutError("its markers cannot be written")
        fenced.append(transactional_id)

    monkeypatch.setattr(takeover_module.progress, "fence", fence)
    return fenced


async def test_the_lost_owner_is_fenced_whatever_its_heartbeat_s_age(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """E6: owner-a is out of the live window; its ids are fenced all the same (named by the
    duty of the taken keys), beside the live dispatchers' (never this dispatcher's own)."""
    fenced = fencing(monkeypatch, set())
    taker, registry = made([])
    await taker.fence_others([record(1, "k"), record(2, "k"), record(3, "j")])
    assert registry.asked == [([("k", False), ("j", False)], [])]
    assert sorted(fenced) == ["x.a", "x.a.1.2", "x.c", "x.c.1"]


async def test_an_unfenceable_id_of_another_dispatcher_holds_nobody_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """E7: owner-c's id cannot be fenced (a partition short of replicas holds its markers): the
    takeover of owner-a's keys goes on, the failure counted."""
    fenced = fencing(monkeypatch, {"x.c.1"})
    failed: list[int] = []
    taker, _ = made(failed)
    await taker.fence_others([record(1, "k")])
    assert sorted(fenced) == ["x.a", "x.a.1.2", "x.c"]
    assert failed == [1]


async def test_an_unfenceable_id_of_the_lost_owner_makes_the_takeover_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """E7: owner-a, whose claims the takeover stands in for, may still commit under the id it
    cannot fence: the takeover raises (its rows go back, uncounted, with the duty)."""
    fencing(monkeypatch, {"x.a.1.2"})
    failed: list[int] = []
    taker, _ = made(failed)
    with pytest.raises(FenceFailedError) as raised:
        await taker.fence_others([record(1, "k")])
    assert raised.value.unfenced == ["x.a.1.2"]
    assert failed == [], "not counted as another's"
