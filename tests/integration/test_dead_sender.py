"""aiokafka's sender task dies on an error it did not expect (CI, stop 41: a broker restart under
an exactly-once load) and fails what its producer holds with a bare KafkaError; the producer never
sends again, and its transaction manager's fatal state makes aiokafka's own abort, commit and
begin fail an assertion. A dispatcher in either mode replaces the producer (exactly-once: gives
the lane a new id) and sends the rows again, uncounted: no crash, no row dead-lettered or
counted, no copy. The fault is made in aiokafka's own sender, with a real broker and database."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest
from aiokafka.producer.message_accumulator import MessageAccumulator

from outbox_dispatcher.config.settings import Settings
from tests.checker import verdict_for

from .helpers import Services, count, insert_sequenced, running, wait_all_settled

pytestmark = pytest.mark.integration


def kill_sender_once(monkeypatch: pytest.MonkeyPatch, topic: str) -> list[str]:
    """The first time a producer's sender goes to drain a batch of `topic`, its drain raises an
    error aiokafka does not expect (before draining: the batches stay queued, and the dying
    sender fails them). Exactly-once: `topic` is the progress topic, whose record a transaction
    hands last, so that every record of the transaction was handed before the sender died (its
    answers fail with the death's KafkaError, and no send is refused after it: then aiokafka's
    begin or abort failed its assertion and the process exited, as CI's did after its sender
    died). Returns the list the fault appends to when it fired."""
    fired: list[str] = []
    drain = MessageAccumulator.drain_by_nodes

    def drain_or_die(self: MessageAccumulator, *args: Any, **kwargs: Any) -> Any:
        if not fired and any(tp.topic == topic for tp in self._batches):
            fired.append(topic)
            raise ValueError("an error aiokafka's sender did not expect")
        return drain(self, *args, **kwargs)

    monkeypatch.setattr(MessageAccumulator, "drain_by_nodes", drain_or_die)
    return fired


@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
async def test_a_producer_whose_sender_died_is_replaced_and_its_rows_sent_uncounted(
    delivery: str,
    conn: asyncpg.Connection,
    make_settings: Callable[..., Settings],
    database_url: str,
    services: Services,
    topic: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    eos: dict[str, Any] = {}
    if delivery == "exactly-once":
        progress = f"progress-{uuid.uuid4().hex[:10]}"
        eos = {"delivery": delivery, "progress_topic": progress, "transaction_timeout_seconds": 2.0}
    settings = make_settings(batch_size=50, claim_tasks=2, max_attempts=1, **eos)
    await insert_sequenced(conn, topic, keys=10, per_key=20)
    fired = kill_sender_once(monkeypatch, eos.get("progress_topic", topic))
    async with running(settings):  # raises on leaving if its loop died
        await wait_all_settled(conn, 60)
    assert fired, "the fault never fired: the test proves nothing"
    assert await count(conn, "published_at IS NULL") == 0
    assert await count(conn, "attempts > 0") == 0, "an attempt counted for the producer's death"
    verdict = await verdict_for(database_url, services.kafka_bootstrap_servers, [topic])
    assert (verdict.lost, verdict.reordered) == ([], []), verdict.summary()
    if delivery == "exactly-once":
        assert verdict.duplicates == 0, verdict.summary()
