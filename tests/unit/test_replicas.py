"""Review E14: a partition that did not acknowledge a transaction is held only when it is short
of in-sync replicas; one with a leader and enough of them (KIP-890's verification reports the
transaction coordinator's trouble as NotEnoughReplicas) is not, and its rows say so. The check
against the cluster is faked at our seam (Endings.short)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.kafka.exactly_once import lanes, replicas
from outbox_dispatcher.kafka.exactly_once.delivery import TransactionalDelivery
from outbox_dispatcher.kafka.exactly_once.endings import Endings, Stall
from outbox_dispatcher.kafka.exactly_once.lanes import Lanes
from outbox_dispatcher.kafka.exactly_once.progress import ProgressConfig
from outbox_dispatcher.kafka.exactly_once.replicas import CoordinatorTroubleError, short_among
from outbox_dispatcher.kafka.exactly_once.stalls import Holds, PartitionStalledError
from outbox_dispatcher.kafka.producers import Producers
from outbox_dispatcher.models import OutboxRecord
from tests.fakes import FakeProgressStore, HandDriven

PROGRESS = ProgressConfig(
    topic="p", outbox="public.outbox", transactional_id_prefix="x.", timeout_seconds=2.0
)


def test_a_partition_is_short_without_a_leader_or_enough_in_sync_replicas() -> None:
    described = [
        {
            "topic": "t",
            "error_code": 0,
            "partitions": [
                {"partition": 0, "error_code": 0, "leader": 1, "isr": [1, 2, 3]},
                {"partition": 1, "error_code": 0, "leader": 1, "isr": [1]},
                {"partition": 2, "error_code": 0, "leader": -1, "isr": [2, 3]},
                {"partition": 3, "error_code": 0, "leader": 2, "isr": [2, 3]},
            ],
        }
    ]
    asked = {("t", 0), ("t", 1), ("t", 2), ("t", 3), ("u", 0)}
    assert short_among(asked, described, {"t": 2}) == {("t", 1), ("t", 2), ("u", 0)}
    assert short_among(asked, described, {"t": 3}) == {("t", 1), ("t", 2), ("t", 3), ("u", 0)}


class _Batches:
    def __init__(self, where: dict[asyncio.Future[object], tuple[str, int]]) -> None:
        self.where = where


def record(i: int, key: str) -> OutboxRecord:
    return OutboxRecord(i, "t", key, b"{}", None, uuid.uuid4(), datetime.now(UTC), 0, False)


async def given_up(
    monkeypatch: pytest.MonkeyPatch, short: replicas.ShortOfReplicas
) -> tuple[list[BaseException | None], Holds, list[str]]:
    """A transaction with a row on t-0 (answered) and one on t-1 (no answer) is given up."""

    async def start(self: Producers, seconds: float | None = None) -> None:
        self.since = asyncio.get_running_loop().time()

    async def fence(*_: Any) -> None:
        pass

    monkeypatch.setattr(Producers, "start", start)
    monkeypatch.setattr(lanes.progress, "fence", fence)
    publisher = configs_of(Settings(delivery="exactly-once")).publisher
    made = Lanes("o", 1, publisher.producer, PROGRESS, publisher.topics, FakeProgressStore())
    renewed: list[str] = []
    holds = Holds()
    ends = Endings(made, holds, PROGRESS, None, 8.0, renewed.append, short)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    answered, unanswered = loop.create_future(), loop.create_future()
    answered.set_result(None)
    unanswered.set_exception(errors.BrokerUnavailableError("given up"))
    d = TransactionalDelivery(HandDriven(), made[0], [record(1, "a"), record(2, "b")], 0.0)
    d.begin([0, 1])
    where = {answered: ("t", 0), unanswered: ("t", 1)}
    stall = Stall({("t", 1)}, progress=False, unanswered={unanswered})
    await ends.give_up(d, [0, 1], [answered, unanswered], _Batches(where), stall)  # type: ignore[arg-type]
    return d.outcomes(stopped=errors.NotAttempted()), holds, renewed


async def test_a_partition_short_of_replicas_is_held(monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes, holds, renewed = await given_up(monkeypatch, replicas.every_one_short)
    assert isinstance(outcomes[1], PartitionStalledError)
    assert not isinstance(outcomes[0], PartitionStalledError), "t-0 answered: it goes at once"
    assert set(holds.held) == {("t", 1)}
    assert renewed == ["stalled"]


async def test_a_partition_with_enough_replicas_is_not_held_and_names_the_coordinator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def none_short(partitions: set[tuple[str, int]]) -> set[tuple[str, int]]:
        return set()

    outcomes, holds, renewed = await given_up(monkeypatch, none_short)
    assert isinstance(outcomes[1], CoordinatorTroubleError), outcomes
    assert outcomes[1].delay == 0, "goes again at once, under the lane's new id"
    assert "transaction coordinator" in str(outcomes[1])
    assert holds.held == {}, "not held: OutboxPartitionsHeld does not point at its replicas"
    assert renewed == ["coordinator"]
