"""Publishes claimed records to Kafka: acks=all, idempotent, one producer batch per partition and
wave, built by the dispatcher (aiokafka's batch API).

A thin face over the Kafka side: the producers (kafka/producers.py), what is known of topics
(kafka/topics.py) and one claim's delivery (kafka/delivery.py), whose parts the caller settles as
they come.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from outbox_dispatcher.kafka.delivery import Delivery, DeliveryConfig
from outbox_dispatcher.kafka.producers import ProducerConfig, Producers
from outbox_dispatcher.kafka.records import RecordConfig, RecordEncoder
from outbox_dispatcher.kafka.topics import TopicConfig, TopicLookup
from outbox_dispatcher.models import OutboxRecord
from outbox_dispatcher.tracing import Tracer


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class PublisherConfig:
    """The Kafka side's configs, one per component (built by dispatch/supervisor.configs_of)."""

    producer: ProducerConfig
    records: RecordConfig
    topics: TopicConfig
    delivery: DeliveryConfig
    tracing: bool  # OpenTelemetry producer spans (tracing.py)


class KafkaPublisher:
    def __init__(self, config: PublisherConfig) -> None:
        self._encoder = RecordEncoder(config.records)
        self._tracer = Tracer(config.tracing)
        self._config = config.delivery
        self.producers = Producers(config.producer)
        self.topics = TopicLookup(self.producers, config.topics)

    async def start(self) -> None:
        await self.producers.start()

    async def stop(self) -> None:
        """Flush and close the producers (bounded: the process is stopping, see
        Producers.stop)."""
        await self.producers.stop()

    def publish(
        self,
        records: Sequence[OutboxRecord],
        heartbeat: Callable[[], None] = _nothing,
        claimed_at: float | None = None,  # exactly-once's (kafka/exactly_once/), not used here
    ) -> Delivery:
        """The claim's delivery: iterate it for its parts (models.Part) as the broker answers,
        the final one last. A wave whose acks take longer than EARLY_SETTLE_SECONDS (sooner once
        one partition answered) yields the keys already acknowledged, then the keys answered in
        each later EARLY_SETTLE_SECONDS while some are still missing (kafka/acks.py).
        `heartbeat` is called while the broker is waited for."""
        return Delivery(
            records,
            encoder=self._encoder,
            producers=self.producers,
            lookup=self.topics,
            tracer=self._tracer,
            config=self._config,
            heartbeat=heartbeat,
        )

    async def abandon(self, delivery: Delivery, reason: str) -> None:
        """Close the producers holding the delivery's answers within the bound, for a process
        that stops past its grace period (Delivery.abandon)."""
        await delivery.abandon(reason)

    def marked(self, delivery: Delivery, *, every_row: bool, final: bool = True) -> None:
        """A batch's mark is in the database (exactly-once keeps track of it; this, not)."""

    async def reachable(self, seconds: float = 5.0) -> bool:
        """A broker answers within `seconds`."""
        return await self.topics.reachable(seconds)


async def all_outcomes(delivery: Delivery) -> list[BaseException | None]:
    """Every record's outcome once the whole delivery is through (None: acknowledged), for a
    caller that settles nothing early."""
    found: list[BaseException | None] = [None] * len(delivery.records)
    async for part in delivery:
        for i, outcome in zip(part.indices, part.outcomes, strict=True):
            found[i] = outcome
    return found
