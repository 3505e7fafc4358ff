"""Exactly-once's mark off the claim loop's path (issue 35: the p99 at 1k/s). Once a claim's
transaction committed, its rows are visible to read_committed consumers and only the mark is
left: the claim loop claims its next batch meanwhile (the batch's keys stay leased until the
mark). A batch that is not all published (an outage, a refusal) keeps the loop until it is
settled, so that the loop still pauses for an outage. A real TransactionalPublisher and
BatchRun over the in-memory transactional producer of test_transactions.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from aiokafka import errors as kafka_errors

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.batch import BatchRun, Settling
from outbox_dispatcher.dispatch.leases import InFlight
from outbox_dispatcher.metrics import Metrics
from outbox_dispatcher.models import Batch, Result
from outbox_dispatcher.retries import RetryPolicy
from tests.fakes import RecordingSettler
from tests.unit.test_transactions import TransactionalFake, publisher_of, record, served_by


class HeldSettler(RecordingSettler):
    """Each settle waits until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def settle_shielded(self, batch: Batch, results: Sequence[Result]) -> int:
        self.started.set()
        await self.release.wait()
        return await super().settle_shielded(batch, results)


class BrokerAway(TransactionalFake):
    async def begin_transaction(self) -> None:
        raise kafka_errors.KafkaConnectionError("the broker is away")


def run_on(producer: TransactionalFake, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """A batch of two rows run by a real BatchRun on an exactly-once publisher served by
    `producer`; the run's task, its settler, the loop's event and the run."""
    publisher = publisher_of(Settings(delivery="exactly-once"))
    served_by(publisher, producer, monkeypatch)
    settler = HeldSettler()
    settling = Settling(settler, RetryPolicy(Settings()), Metrics())
    claim_on = asyncio.Event()
    batch = Batch(uuid.uuid4(), [record(1, "a"), record(2, "b")])
    run = BatchRun(batch, publisher, settling, InFlight(), stalled=claim_on, claimed_at=1.0)
    return asyncio.ensure_future(run.run()), settler, claim_on, run


async def test_the_loop_claims_on_while_a_committed_batch_is_marked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, the claim loop waited for the mark too: a database round trip per cycle in which
    rows committed meanwhile waited for a loop, though this batch's rows were already visible."""
    producer = TransactionalFake()
    task, settler, claim_on, run = run_on(producer, monkeypatch)
    await asyncio.wait_for(settler.started.wait(), 5)
    assert producer.calls == ["begin", "commit"], "marked only after the commit"
    assert claim_on.is_set() and run.marking, "the loop claims on while the mark runs"
    assert not task.done()
    settler.release.set()
    assert await task == 0.0
    assert settler.settled == [[1, 2]]
    timed = {"claim", "turn", "retire", "ready", "lookup", "begin", "hand", "acks", "commit"}
    assert timed | {"after", "mark"} <= set(run.delivery.phases.ms), "every phase timed"


async def test_a_batch_that_met_an_outage_keeps_the_loop_until_it_is_settled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its rows go back, and the loop must pause for the outage: it waits for the run."""
    task, settler, claim_on, run = run_on(BrokerAway(), monkeypatch)
    await asyncio.wait_for(settler.started.wait(), 5)
    assert not claim_on.is_set() and not run.marking
    settler.release.set()
    assert await task > 0.0, "the outage pause"
    assert not claim_on.is_set()
