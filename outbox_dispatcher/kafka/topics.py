"""What the publisher knows of topics: their partitions, lookups of topics not yet known (asked of
the brokers the producer is connected to, see internals.load_topics), whether a broker answers,
every topic that exists, and where a wave's keyless rows go; and the lookups one claim waits
for."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher.kafka import internals
from outbox_dispatcher.kafka.producers import Producers
from outbox_dispatcher.models import OutboxRecord


@dataclass(frozen=True)
class TopicConfig:
    publish_timeout_seconds: float  # a lookup waits at most this long, and at most 10 s
    allow_auto_create_topics: bool


class TopicLookup:
    def __init__(self, producers: Producers, config: TopicConfig) -> None:
        self._producers = producers
        self._config = config
        self._keyless_turn = 0  # see keyless_partition
        # One load at a time: an answer replaces the whole cache, and a request names what is
        # cached when it is sent (internals.load_topics); two sent together each dropped the
        # other's topic.
        self._loading = asyncio.Lock()

    def partitions(self, topic: str) -> set[int] | None:
        """The topic's partitions in the current producer's metadata (None: not known yet)."""
        return internals.known_partitions(self._producers.current(), topic)

    def unknown(self, topics: set[str]) -> set[str]:
        """Those of `topics` whose partitions the producer does not know yet; all of them are
        kept in its metadata refreshes from now on (internals.track_topics)."""
        internals.track_topics(self._producers.current(), topics)
        return {t for t in topics if self.partitions(t) is None}

    def keyless_partition(self, topic: str, partitions: list[int]) -> int:
        """Where a wave's keyless records of a topic go: all to one partition (they have no
        order to keep, and one batch beats several; a wave budgets their bytes against every
        partition of the topic), partitions taken in turn from wave to wave, among those with a
        leader when any has one (as the producer's own partitioner prefers)."""
        available = internals.available_partitions(self._producers.current(), topic)
        choices = sorted(available) if available else partitions
        self._keyless_turn += 1
        return choices[self._keyless_turn % len(choices)]

    async def existing(self) -> set[str]:
        """Every topic on the broker: all topics' metadata, naming none, so that nothing is
        auto-created; raises when no broker answers."""
        cluster = await internals.all_metadata(self._producers.current())
        names: set[str] = cluster.topics()
        return names

    async def reachable(self, seconds: float = 5.0) -> bool:
        """A broker answers a Metadata request naming no topic within `seconds`."""
        try:
            async with asyncio.timeout(seconds):
                await internals.answers(self._producers.current())
        except (kafka_errors.KafkaError, OSError, TimeoutError):
            return False
        return True

    async def errors_for(self, topics: set[str]) -> dict[str, BaseException]:
        """Fetch metadata for topics not yet known, so that send() never blocks on one; returns
        why each topic that cannot be sent to cannot (missing, refused, broker away)."""
        unknown = sorted(self.unknown(topics))
        if not unknown:
            return {}
        timeout = min(self._config.publish_timeout_seconds, 10.0)
        absent: dict[str, BaseException] = {}
        if not self._config.allow_auto_create_topics:
            # The producer's own metadata requests always allow auto-creation: only topics the
            # broker confirms may reach them.
            absent = await self._without_auto_creation(unknown, timeout)
            unknown = [t for t in unknown if t not in absent]
            if not unknown:
                return absent

        async def lookup(topic: str) -> BaseException | None:
            try:
                async with asyncio.timeout(timeout):
                    # Asked of several brokers at once (internals._first_answer); what this finds
                    # missing or failing, the producer's own lookup then decides.
                    with contextlib.suppress(kafka_errors.KafkaError, OSError):
                        async with self._loading:
                            await internals.load_topics(self._producers.current(), [topic])
                    await self._producers.current().partitions_for(topic)
            except (kafka_errors.KafkaError, TimeoutError) as exc:
                failure: BaseException = exc
                return failure
            return None

        results = await asyncio.gather(*(lookup(t) for t in unknown))
        failed = {t: exc for t, exc in zip(unknown, results, strict=True) if exc is not None}
        if failed and not all(
            isinstance(exc, kafka_errors.TopicAuthorizationFailedError) for exc in failed.values()
        ):
            # A missing topic and an unreachable broker look alike from here; ask the broker.
            reachable = await self.reachable()
            for topic, exc in list(failed.items()):
                if isinstance(exc, kafka_errors.TopicAuthorizationFailedError):
                    continue
                if reachable:
                    failed[topic] = errors.TopicMissingError(
                        f"topic {topic!r} does not exist and was not auto-created: create it, "
                        "or requeue the row with a valid topic"
                    )
                else:
                    failed[topic] = errors.BrokerUnavailableError()
        return absent | failed

    async def _without_auto_creation(
        self, topics: list[str], seconds: float
    ) -> dict[str, BaseException]:
        """Ask the broker about topics with allow_auto_topic_creation=false (Metadata v4+); a
        topic it does not know is missing. If the broker cannot be asked, every topic waits
        (transient): looking it up through the producer would auto-create it."""
        unavailable: dict[str, BaseException] = {
            topic: errors.BrokerUnavailableError() for topic in topics
        }
        try:
            async with asyncio.timeout(seconds):
                codes = await internals.topic_error_codes(self._producers.current(), topics)
        except (kafka_errors.KafkaError, OSError, TimeoutError):
            return unavailable
        if codes is None:
            return unavailable
        missing: dict[str, BaseException] = {}
        for topic, code in codes.items():
            if code == kafka_errors.UnknownTopicOrPartitionError.errno:
                missing[topic] = errors.TopicMissingError(
                    f"topic {topic!r} does not exist and OUTBOX_KAFKA_ALLOW_AUTO_CREATE_TOPICS is "
                    "false: create the topic (the row is retried until max_attempts; once "
                    "dead-lettered, `outbox-dispatcher dead requeue` sends it again)"
                )
        return missing


class ClaimLookups:
    """The lookups one claim waits for, one task per topic not yet known: which of its records
    go now, and which once the topics of their keys have answered. A topic that does not exist
    takes publish_timeout to be found missing, and the other keys must not wait for it
    (guarantee 5)."""

    def __init__(
        self,
        lookup: TopicLookup,
        records: Sequence[OutboxRecord],
        topics: Sequence[str | BaseException],
    ) -> None:
        self._records = records
        self._topics = topics
        unknown = lookup.unknown({t for t in topics if isinstance(t, str)})
        self._tasks = {t: asyncio.ensure_future(lookup.errors_for({t})) for t in unknown}
        self._pending = dict(self._tasks)
        self.errors: dict[str, BaseException] = {}  # the verdicts, topic by topic

    def split(self) -> tuple[list[int], list[int]]:
        """The records that go now, and those that wait for a lookup: the rows of a topic
        looked up, and every row of a key that has one."""
        unknown = self._tasks.keys()
        records, topics = self._records, self._topics
        waiting_keys = {
            r.ordering_key
            for r, t in zip(records, topics, strict=True)
            if t in unknown and r.ordering_key is not None
        }
        later = [
            i
            for i, (r, t) in enumerate(zip(records, topics, strict=True))
            if t in unknown or (r.ordering_key is not None and r.ordering_key in waiting_keys)
        ]
        waiting = set(later)
        return [i for i in range(len(records)) if i not in waiting], later

    async def ready(self, later: Sequence[int]) -> list[int]:
        """Once one more lookup has answered: the records of `later` whose key has every topic
        it has a row for answered."""
        pending = self._pending
        if pending:
            await asyncio.wait(pending.values(), return_when=asyncio.FIRST_COMPLETED)
        for topic, task in list(pending.items()):
            if task.done():
                self.errors |= task.result()
                del pending[topic]
        records, topics = self._records, self._topics
        blocked = {
            records[i].ordering_key
            for i in later
            if topics[i] in pending and records[i].ordering_key is not None
        }
        return [
            i for i in later if topics[i] not in pending and records[i].ordering_key not in blocked
        ]

    def cancel(self) -> None:
        """End the lookups nobody waits for any more."""
        for task in self._tasks.values():
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # retrieved: a lookup nobody waited for fails quietly
