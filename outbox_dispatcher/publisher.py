"""Publishes claimed records to Kafka: acks=all, idempotent, one producer batch per partition and
wave, built by the dispatcher (aiokafka's batch API).

Sending is split from waiting so that a cancelled wait still knows which records the broker had
acknowledged (those are marked) and which it had not (those are given back).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher.errors import NotAttempted as NotAttempted
from outbox_dispatcher.errors import TopicMissingError as TopicMissingError
from outbox_dispatcher.kafka import failures, internals, tls
from outbox_dispatcher.kafka.records import (
    KafkaRecord,
    RecordEncoder,
    partition_in,
)
from outbox_dispatcher.kafka.waves import plan_waves
from outbox_dispatcher.models import OutboxRecord
from outbox_dispatcher.settings import Settings
from outbox_dispatcher.tracing import Tracer

log = structlog.get_logger(__name__)

STOP_FLUSH_SECONDS = 5.0
# A wave whose acks are missing this long after it was sent settles the keys already acknowledged
# and lets the claim loop go on, so that one partition that does not acknowledge holds back only
# its own keys (review F10). Sooner once one partition has answered: the others normally answer
# within EARLY_SETTLE_FACTOR times as long (they share the broker's round trip), so a wave still
# waiting after that (at least EARLY_SETTLE_MIN_SECONDS) has a partition that does not answer.
EARLY_SETTLE_SECONDS = 0.25
EARLY_SETTLE_MIN_SECONDS = 0.05
EARLY_SETTLE_FACTOR = 3.0


@dataclass
class Sent:
    """Per record: the delivery future, the exception that prevented sending, or None while it
    has not been handed to the producer."""

    futures: list[asyncio.Future[object] | BaseException | None] = field(default_factory=list)
    # The producers that hold its futures: closing them settles every future (see abandon).
    producers: list[AIOKafkaProducer] = field(default_factory=list)
    # Each submission's producer and batch builder: what withdraw_unsent looks for.
    batches: dict[asyncio.Future[object], tuple[AIOKafkaProducer, Any]] = field(
        default_factory=dict
    )
    # Nothing more will be sent for this claim: every record without an answer yet is being
    # retried by its producer, or will not be attempted (see KafkaPublisher._stop_sending).
    final: bool = False
    # Past publish_timeout, waiting only for requests in flight (the broker answers, refusing
    # them for now): nothing the claim loop could do would help, see dispatcher.MAX_STALLED_BATCHES.
    parked: bool = False


class KafkaPublisher:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._encoder = RecordEncoder(settings)
        self._producer: AIOKafkaProducer | None = None
        self._tracer = Tracer(settings.tracing)
        self._context: ssl.SSLContext | None = None
        self._broken: BaseException | None = None  # the producer's state is lost: replace it
        self._replacing = asyncio.Lock()
        self._closing: dict[int, asyncio.Future[None]] = {}  # id(producer): its bounded close
        # id(producer): a replaced producer and its unbounded close (see _retire).
        self._retiring: dict[int, tuple[AIOKafkaProducer, asyncio.Future[None]]] = {}
        # Submissions not yet handed to their producer (waiting in send_batch, see _submit).
        self._submitting: dict[asyncio.Future[object], AIOKafkaProducer] = {}
        self._keyless_turn = 0  # see _keyless_partition

    def _build(self, context: ssl.SSLContext | None) -> AIOKafkaProducer:
        s = self._settings
        return AIOKafkaProducer(
            bootstrap_servers=s.kafka_bootstrap_servers.split(","),
            client_id=s.kafka_client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=s.kafka_linger_ms,
            max_batch_size=s.kafka_max_batch_bytes,
            max_request_size=s.kafka_max_request_bytes,
            compression_type=None if s.kafka_compression == "none" else s.kafka_compression,
            request_timeout_ms=int(s.publish_timeout_seconds * 1000),
            security_protocol=s.kafka_security_protocol,
            ssl_context=context,
            sasl_mechanism=s.kafka_sasl_mechanism or "PLAIN",
            sasl_plain_username=s.kafka_sasl_username,
            sasl_plain_password=(
                s.kafka_sasl_password.get_secret_value() if s.kafka_sasl_password else None
            ),
        )

    @property
    def producer(self) -> AIOKafkaProducer:
        if self._producer is None:
            msg = "the publisher is not started"
            raise errors.OutboxDispatcherError(msg)
        return self._producer

    async def start(self) -> None:
        context = tls.ssl_context(self._settings)
        problem = await tls.diagnose(self._settings, context)
        if problem is not None:
            raise problem
        self._context = context
        producer = self._build(context)
        try:
            await producer.start()
        except (
            kafka_errors.SaslAuthenticationFailed,
            kafka_errors.AuthenticationFailedError,
        ) as exc:
            await producer.stop()
            raise errors.ConfigurationError(tls.SASL_REJECTED.format(errors.describe(exc))) from exc
        except (kafka_errors.KafkaError, OSError) as exc:
            await producer.stop()
            msg = (
                f"cannot reach Kafka at {self._settings.kafka_bootstrap_servers} "
                f"({errors.describe(exc)}): check OUTBOX_KAFKA_BOOTSTRAP_SERVERS and the broker"
            )
            raise errors.BrokerUnavailableError(msg) from exc
        except (ValueError, OverflowError) as exc:  # e.g. a port the socket layer refuses
            await producer.stop()
            msg = (
                f"the Kafka client refused the settings ({errors.describe(exc)}): check the "
                "OUTBOX_KAFKA_* settings"
            )
            raise errors.ConfigurationError(msg) from exc
        self._producer = producer

    async def stop(self) -> None:
        """Flush and close (bounded, see _close) the producer and any producer still being
        retired: the process is stopping, so what a partition still holds past the bound is
        failed and given back (a copy may then follow, as after a crash; docs/guarantees.md)."""
        if self._producer is not None:
            producer, self._producer = self._producer, None
            self._close(producer, "the dispatcher stopped while the broker was away")
        for producer, _ in list(self._retiring.values()):
            self._close(producer, "the dispatcher stopped while the broker was away")
        if self._closing:
            await asyncio.wait(list(self._closing.values()))

    def _note(self, outcome: BaseException | None) -> None:
        if isinstance(outcome, failures.PRODUCER_STATE):
            self._broken = outcome

    async def _replace_if_broken(self) -> None:
        """An idempotent producer whose sequence state the broker no longer accepts (e.g. after
        the broker restarted and lost its producer state, or refused a batch whose sequence
        numbers were used up) fails every later send: start a fresh producer (new producer id).
        Its failed records are retried in order, never counted. The old producer is retired
        outside the lock and without waiting for it (see _retire): what it still has in flight
        may be in the broker's log, and only its own retries are recognised as such."""
        if self._broken is None:
            return
        async with self._replacing:
            if self._broken is None:
                return
            reason = errors.describe(self._broken)
            fresh = self._build(self._context)
            try:
                async with asyncio.timeout(max(self._settings.publish_timeout_seconds, 10.0)):
                    await fresh.start()
            except (kafka_errors.KafkaError, OSError, TimeoutError) as exc:
                await _close(fresh, "the fresh producer could not start")
                raise errors.BrokerUnavailableError(errors.describe(exc)) from exc
            old, self._producer = self._producer, fresh
            self._broken = None
            log.warning(
                "producer_replaced",
                reason=reason,
                old_producer_id=None if old is None else internals.producer_id(old),
                producer_id=internals.producer_id(fresh),
            )
        if old is not None:
            self._retire(old, "the producer was replaced; the broker did not take its records")

    def _retire(self, producer: AIOKafkaProducer, reason: str) -> None:
        """Stop using `producer` without failing what a request has carried. Submissions still
        waiting to reach it end (their rows are given back: never sent), and so do its batches
        no request has carried yet (internals.withdraw_unsent). What is in flight stays with it:
        its retries, under its producer id and sequence numbers, are the only ones the broker
        recognises as an append it already made. It is closed once the broker has answered
        everything (aiokafka's stop() flushes), or at the process's stop (bounded there)."""
        unsent = errors.BrokerUnavailableError(reason)
        for task, owner in list(self._submitting.items()):
            if owner is producer:
                task.cancel()
        internals.withdraw_unsent(producer, unsent)
        if id(producer) in self._retiring:
            return

        async def close() -> None:
            try:
                await producer.stop()
            except Exception as exc:  # noqa: BLE001 - discarded whatever its stop() raised
                log.debug("producer_stop_failed", error=errors.describe(exc))
            # A batch appended after stop()'s flush took its snapshot (N11) is never sent.
            internals.withdraw_unsent(producer, unsent)

        retiring = asyncio.ensure_future(close())
        self._retiring[id(producer)] = (producer, retiring)
        retiring.add_done_callback(lambda _: self._retiring.pop(id(producer), None))

    def _close(self, producer: AIOKafkaProducer, reason: str) -> asyncio.Future[None]:
        """The producer's bounded close (_close), started once however many callers ask; a
        producer being retired gets the bound too (the process is stopping)."""
        closing = self._closing.get(id(producer))
        if closing is None:
            retiring = self._retiring.get(id(producer))
            closing = asyncio.ensure_future(
                _close(producer, reason, None if retiring is None else retiring[1])
            )
            self._closing[id(producer)] = closing
            closing.add_done_callback(lambda _: self._closing.pop(id(producer), None))
        return closing

    async def abandon(self, sent: Sent, reason: str) -> None:
        """The process is stopping past its grace period: close the producers holding sent's
        futures (bounded, see _close), so that every future is settled, acknowledged or failed
        for good, before unacknowledged rows are given back (an open idempotent producer retries
        a drained batch for ever, and would deliver it after the re-claim did: review F4). A
        request in flight when the bound ends may still be appended: docs/guarantees.md counts
        that among the copies a crash can make."""
        used = [p for p in dict.fromkeys(sent.producers) if p is not None]
        closing = [self._close(p, reason) for p in used]
        if closing:
            await asyncio.wait(closing)  # not gather: a cancelled caller must not cancel them
        # A submission still waiting for its partition's previous batch to leave never reached
        # the closed producer: it ends here, unacknowledged (its rows are given back). The
        # others wait on answers the close has settled: let them take those answers first (an
        # acknowledged row must not be given back).
        tasks = {t for t in sent.futures if isinstance(t, asyncio.Future) and not t.done()}
        for task in tasks & self._submitting.keys():
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_FLUSH_SECONDS)

    async def broker_reachable(self, seconds: float = 5.0) -> bool:
        try:
            async with asyncio.timeout(seconds):
                await internals.answers(self.producer)
        except (kafka_errors.KafkaError, OSError, TimeoutError):
            return False
        return True

    async def _topic_errors(self, topics: set[str]) -> dict[str, BaseException]:
        """Fetch metadata for topics not yet known, so that send() never blocks on one."""
        producer = self.producer
        unknown = [t for t in topics if internals.known_partitions(producer, t) is None]
        if not unknown:
            return {}
        timeout = min(self._settings.publish_timeout_seconds, 10.0)
        absent: dict[str, BaseException] = {}
        if not self._settings.kafka_allow_auto_create_topics:
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
                        await internals.load_topics(self.producer, [topic])
                    await self.producer.partitions_for(topic)
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
            reachable = await self.broker_reachable()
            for topic, exc in list(failed.items()):
                if isinstance(exc, kafka_errors.TopicAuthorizationFailedError):
                    continue
                if reachable:
                    failed[topic] = TopicMissingError(
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
                codes = await internals.topic_error_codes(self.producer, topics)
        except (kafka_errors.KafkaError, OSError, TimeoutError):
            return unavailable
        if codes is None:
            return unavailable
        missing: dict[str, BaseException] = {}
        for topic, code in codes.items():
            if code == kafka_errors.UnknownTopicOrPartitionError.errno:
                missing[topic] = TopicMissingError(
                    f"topic {topic!r} does not exist and OUTBOX_KAFKA_ALLOW_AUTO_CREATE_TOPICS is "
                    "false: create the topic (the row is retried until max_attempts; once "
                    "dead-lettered, `outbox-dispatcher dead requeue` sends it again)"
                )
        return missing

    async def publish(
        self,
        records: Sequence[OutboxRecord],
        sent: Sent,
        heartbeat: Callable[[], None] = lambda: None,
        early: Callable[[], Awaitable[None]] | None = None,
    ) -> list[BaseException | None]:
        """Publish a claim and return each record's outcome (None: acknowledged). `early` is
        called when a wave's acks take longer than EARLY_SETTLE_SECONDS (sooner once one
        partition answered), then every EARLY_SETTLE_SECONDS in which later answers came while
        some are still missing (the caller settles the keys already acknowledged).

        A key's rows go out in waves, one per topic it visits in this claim: its rows for the
        next topic are handed to the producer only once every earlier row of the key is
        acknowledged, and not at all once one failed. Within one topic (one partition) the
        idempotent producer keeps the order. `sent` is filled as records are handed over, so
        that a cancelled publish still knows what it sent."""
        sent.futures = [None] * len(records)
        if not records:
            return []
        topics = [self._encoder.topic(record) for record in records]
        try:
            await self._replace_if_broken()
        except errors.BrokerUnavailableError as exc:
            sent.futures = [exc] * len(records)
            return self.outcomes(sent, exc)
        # Topics without metadata yet are looked up, each on its own, while every key without a
        # row for such a topic goes out at once: a topic that does not exist takes
        # publish_timeout to be found missing, and other keys must not wait for it (guarantee 5).
        # The keys with a row for a looked-up topic go out once its lookup has answered.
        producer = self.producer
        unknown = {
            t
            for t in {t for t in topics if isinstance(t, str)}
            if internals.known_partitions(producer, t) is None
        }
        lookups = {t: asyncio.ensure_future(self._topic_errors({t})) for t in unknown}
        topic_errors: dict[str, BaseException] = {}
        now: list[int] = list(range(len(records)))
        later: list[int] = []
        if unknown:
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
            now = [i for i in now if i not in waiting]
        failed_keys: set[str] = set()
        try:
            if now and await self._publish_part(
                records, topics, now, sent, heartbeat, early, topic_errors, failed_keys
            ):
                return await self._given_up(sent, heartbeat, early)
            if now and later and early is not None:
                await early()  # settle the keys already acknowledged while lookups run
            pending = dict(lookups)
            while later:
                # Each key goes once every topic it has a row for has answered its lookup.
                if pending:
                    await asyncio.wait(pending.values(), return_when=asyncio.FIRST_COMPLETED)
                for t, lookup in list(pending.items()):
                    if lookup.done():
                        topic_errors |= lookup.result()
                        del pending[t]
                blocked = {
                    records[i].ordering_key
                    for i in later
                    if topics[i] in pending and records[i].ordering_key is not None
                }
                ready = [
                    i
                    for i in later
                    if topics[i] not in pending and records[i].ordering_key not in blocked
                ]
                if not ready:
                    continue
                if await self._publish_part(
                    records, topics, ready, sent, heartbeat, early, topic_errors, failed_keys
                ):
                    return await self._given_up(sent, heartbeat, early)
                done = set(ready)
                later = [i for i in later if i not in done]
                if later and early is not None:
                    await early()
        finally:
            for lookup in lookups.values():
                if not lookup.done():
                    lookup.cancel()
                elif not lookup.cancelled():
                    lookup.exception()  # retrieved: a lookup nobody waited for fails quietly
        return self._final_outcomes(sent)

    async def _given_up(
        self,
        sent: Sent,
        heartbeat: Callable[[], None],
        early: Callable[[], Awaitable[None]] | None,
    ) -> list[BaseException | None]:
        """publish_timeout passed and records were withdrawn unsent (_await_acks): nothing more
        is sent for this claim. The keys that have all their answers are settled at once (their
        rows given back or marked), then what is in flight is waited for (_drain)."""
        self._stop_sending(sent)
        if early is not None:
            await early()
        await self._drain(sent, heartbeat, early)
        return self._final_outcomes(sent)

    def _stop_sending(self, sent: Sent) -> None:
        """Every record not handed to the producer yet is not attempted. The records of a batch
        the broker refused whole are not blamed either: they are not retried one by one now
        (review F9), and the refusal used up the producer's sequence numbers."""
        sent.final = True
        shared: dict[int, int] = {}
        for item in sent.futures:
            shared[id(item)] = shared.get(id(item), 0) + 1
        for i, item in enumerate(sent.futures):
            if item is None:
                sent.futures[i] = NotAttempted()
            elif isinstance(item, asyncio.Future) and _rejected(item) and shared[id(item)] > 1:
                self._broken = self._broken or item.exception()
                sent.futures[i] = NotAttempted()

    async def _publish_part(
        self,
        records: Sequence[OutboxRecord],
        topics: Sequence[str | BaseException],
        indices: Sequence[int],
        sent: Sent,
        heartbeat: Callable[[], None],
        early: Callable[[], Awaitable[None]] | None,
        topic_errors: Mapping[str, BaseException],
        failed_keys: set[str],
    ) -> bool:
        """Send records[indices] wave by wave (see publish); True if given up on after
        publish_timeout (the rest is not attempted)."""
        producer = self.producer
        encoded = self._encode(records, topics, indices)
        sizes = [item.size if isinstance(item, KafkaRecord) else 0 for item in encoded]
        waves = plan_waves(
            [records[i] for i in indices],
            [topics[i] for i in indices],
            self._settings.kafka_max_batch_bytes,
            lambda topic: internals.known_partitions(producer, topic),
            sizes=sizes,
        )
        encoding = dict(zip(indices, encoded, strict=True))
        queue = deque([indices[j] for j in part] for part in waves)
        while queue:
            wave = queue.popleft()
            try:
                await self._replace_if_broken()
            except errors.BrokerUnavailableError as exc:
                for i in wave:
                    sent.futures[i] = exc
                return False
            deferred = await self._send_wave(
                records, topics, encoding, wave, sent, topic_errors, failed_keys
            )
            if deferred:
                # Their partition's batch was full: they go next, before any later row of their
                # keys (which are all in later waves).
                queue.appendleft(deferred)
                held = set(deferred)
                wave = [i for i in wave if i not in held]
            if await self._await_acks(sent, wave, heartbeat, early):
                return True
            self._unsubmitted(records, wave, sent, failed_keys)
            await self._retry_rejected_alone(records, topics, encoding, wave, sent, heartbeat)
            self._after_wave(records, wave, sent, failed_keys)
        return False

    def _encode(
        self,
        records: Sequence[OutboxRecord],
        topics: Sequence[str | BaseException],
        indices: Sequence[int],
    ) -> list[KafkaRecord | BaseException | None]:
        """Each record as the producer will send it, or why it cannot be one (None: its topic
        failed already)."""
        encoder = self._encoder
        encoded: list[KafkaRecord | BaseException | None] = []
        for i in indices:
            if not isinstance(topics[i], str):
                encoded.append(None)
                continue
            try:
                encoded.append(encoder.encode(records[i]))
            except (errors.UnpublishableRowError, kafka_errors.KafkaError) as exc:
                encoded.append(exc)
        return encoded

    def _after_wave(
        self,
        records: Sequence[OutboxRecord],
        wave: Sequence[int],
        sent: Sent,
        failed_keys: set[str],
    ) -> None:
        """Note what the wave's answers say about the producer, and which keys failed (their
        later rows are not attempted). Records of one batch share one future: each is looked
        at once."""
        failed: dict[int, bool] = {}
        for i in wave:
            answer = sent.futures[i]
            if isinstance(answer, asyncio.Future):
                verdict = failed.get(id(answer))
                if verdict is None:
                    verdict = failed[id(answer)] = _failed(answer)
                    if answer.done() and not answer.cancelled():
                        self._note(answer.exception())
                        if _rejected(answer):  # its sequence numbers were used up: a new producer
                            self._broken = answer.exception()
            else:
                verdict = True
            key = records[i].ordering_key
            if verdict and key is not None:
                failed_keys.add(key)

    async def _send_wave(
        self,
        records: Sequence[OutboxRecord],
        topics: Sequence[str | BaseException],
        encoded: Mapping[int, KafkaRecord | BaseException | None],
        wave: Sequence[int],
        sent: Sent,
        topic_errors: Mapping[str, BaseException],
        failed_keys: set[str],
    ) -> list[int]:
        """Hand a wave to the producer as one batch per (topic, partition), built here and
        submitted whole (aiokafka's batch API), so that the dispatcher decides which records
        share a produce request and the producer does no work per record. A record of a key
        that failed earlier is not attempted; one that cannot be sent gets why. Returns the
        records that found their partition's batch full (an estimate fell short), with the later
        rows of their keys: they go out in a wave of their own, next."""
        producer = self.producer
        batches: dict[tuple[str, int], tuple[Any, list[int]]] = {}
        ordered: dict[str, list[int] | None] = {}  # topic: its partitions by id
        keyless: dict[str, int] = {}  # topic: the partition of its keyless records in this wave
        deferred: list[int] = []
        deferred_keys: set[str] = set()
        for i in wave:
            record, topic, item = records[i], topics[i], encoded[i]
            key = record.ordering_key
            if key is not None:
                if key in failed_keys:
                    sent.futures[i] = NotAttempted()
                    continue
                if key in deferred_keys:
                    deferred.append(i)
                    continue
            target = self._target(topic, item, topic_errors, ordered)
            if isinstance(target, BaseException):
                sent.futures[i] = target
                if key is not None:
                    failed_keys.add(key)
                continue
            topic, item, partitions = target
            if key is not None:
                partition = partition_in(partitions, key)
            else:
                partition = keyless.get(topic, -1)
                if partition < 0:
                    partition = keyless[topic] = self._keyless_partition(topic, partitions)
            slot = batches.get((topic, partition))
            if slot is None:
                slot = batches[(topic, partition)] = (producer.create_batch(), [])
            builder, members = slot
            if (
                builder.append(key=item.key, value=item.value, timestamp=None, headers=item.headers)
                is None
            ):
                deferred.append(i)
                if key is not None:
                    deferred_keys.add(key)
                continue
            members.append(i)
        if batches and (not sent.producers or sent.producers[-1] is not producer):
            sent.producers.append(producer)
        for (topic, partition), (builder, members) in batches.items():
            # Left open, the batch waits OUTBOX_KAFKA_LINGER_MS before it is sent, as the
            # producer's own batches did (closed, it would go at once; nothing else appends to
            # it: the dispatcher never uses send()).
            spans = [self._tracer.start(records[i], topic) for i in members]
            # Submitted concurrently: aiokafka's send_batch waits until the partition's previous
            # batch has left, and a partition that does not answer must not hold back the
            # submission (and so the acks and the early settle) of the wave's other partitions.
            submission: asyncio.Future[object] = asyncio.ensure_future(
                self._submit(producer, builder, topic, partition)
            )
            # Registered before it runs: a retirement that comes first must find it (N11).
            self._submitting[submission] = producer
            submission.add_done_callback(self._submitted)
            sent.batches[submission] = (producer, builder)
            for i in members:
                sent.futures[i] = submission
            for span in spans:
                self._tracer.end_on_ack(span, submission)
        return deferred

    async def _submit(
        self, producer: AIOKafkaProducer, builder: Any, topic: str, partition: int
    ) -> object:
        """Hand a built batch to the producer, then wait for the broker's answer: one awaitable
        per batch from submission to ack. A send_batch that raises (a producer being closed by
        another loop, an assertion on a partition its metadata no longer has) fails as
        _NotSubmitted: nothing of the batch was sent (see _unsubmitted)."""
        try:
            delivery = await producer.send_batch(builder, topic, partition=partition)
        except (kafka_errors.KafkaError, errors.BrokerUnavailableError, AssertionError) as exc:
            raise _NotSubmitted(exc) from exc
        finally:
            task = asyncio.current_task()
            if task is not None:
                self._submitting.pop(task, None)
        return await delivery

    def _submitted(self, submission: asyncio.Future[object]) -> None:
        self._submitting.pop(submission, None)

    def _unsubmitted(
        self,
        records: Sequence[OutboxRecord],
        wave: Sequence[int],
        sent: Sent,
        failed_keys: set[str],
    ) -> None:
        """Batches of the wave that never reached the producer, as if the send had failed at
        once: a key's first row takes the failure, its later rows were not attempted on their own
        account."""
        seen: set[str] = set()
        for i in wave:
            item = sent.futures[i]
            if not (isinstance(item, asyncio.Future) and item.done() and not item.cancelled()):
                continue
            problem = item.exception()
            if not isinstance(problem, _NotSubmitted):
                continue
            self._note(problem.cause)
            key = records[i].ordering_key
            sent.futures[i] = NotAttempted() if key is not None and key in seen else problem.cause
            if key is not None:
                seen.add(key)
                failed_keys.add(key)

    def _target(
        self,
        topic: str | BaseException,
        item: KafkaRecord | BaseException | None,
        topic_errors: Mapping[str, BaseException],
        ordered: dict[str, list[int] | None],
    ) -> tuple[str, KafkaRecord, list[int]] | BaseException:
        """The record, its topic and the topic's partitions by id (`ordered` caches them for a
        wave), or why the record cannot be sent."""
        if isinstance(topic, BaseException):
            return topic
        problem = topic_errors.get(topic)
        if problem is not None:
            return problem
        if not isinstance(item, KafkaRecord):
            return item if item is not None else errors.UnpublishableRowError()
        if topic in ordered:
            partitions = ordered[topic]
        else:
            known = internals.known_partitions(self.producer, topic)
            partitions = ordered[topic] = sorted(known) if known else None
        if partitions is None:
            return errors.BrokerUnavailableError(
                f"the producer knows no partitions of topic {topic!r} yet"
            )
        return topic, item, partitions

    def _keyless_partition(self, topic: str, partitions: list[int]) -> int:
        """Where a wave's keyless records of a topic go: all to one partition (they have no
        order to keep, and one batch beats several; a wave budgets their bytes against every
        partition of the topic), partitions taken in turn from wave to wave, among those with a
        leader when any has one (as the producer's own partitioner prefers)."""
        available = internals.available_partitions(self.producer, topic)
        choices = sorted(available) if available else partitions
        self._keyless_turn += 1
        return choices[self._keyless_turn % len(choices)]

    async def _await_acks(
        self,
        sent: Sent,
        indices: Sequence[int],
        heartbeat: Callable[[], None],
        early: Callable[[], Awaitable[None]] | None = None,
    ) -> bool:
        """Wait for the broker's answers to sent[indices]. True once publish_timeout has passed
        with the broker answering and some of them withdrawn unsent (see _withdraw): the rest of
        the claim is not attempted, and what is in flight is waited for (_drain). While the
        broker is unreachable, keep waiting: the producer retries by itself and the lease keeper
        keeps the rows ours, so an outage ends in delivery, not in duplicates. Requests in flight
        are never failed: a request the broker appended and then answered with an error (a
        follower out of the ISR: NOT_ENOUGH_REPLICAS_AFTER_APPEND, REQUEST_TIMED_OUT) is
        committed once the ISR shrinks, and only its producer's own retry is recognised by the
        broker as that append; a row given back would be sent again under another producer id
        and appended twice (issue 25)."""
        pending = {f for i in indices if isinstance(f := sent.futures[i], asyncio.Future)}
        if pending and early is not None:
            pending = await self._await_first_answers(pending, heartbeat, early)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.publish_timeout_seconds
        while pending:
            heartbeat()  # waiting for a broker is not being stuck
            remaining = deadline - loop.time()
            if remaining > 0:
                # With `early`, the answers that came meanwhile are settled every
                # EARLY_SETTLE_SECONDS while others are missing: a partition that answers after
                # the early settle (e.g. behind another partition's retries on the same broker)
                # must not wait for the silent one. Coalesced, not one settle per answer: a wave
                # of many partitions that lingers past the early settle would otherwise add a
                # statement per partition.
                step = remaining if early is None else min(remaining, EARLY_SETTLE_SECONDS)
                done, pending = await asyncio.wait(pending, timeout=step)
                if early is not None and done and pending:
                    await early()
                continue
            if not await self.broker_reachable():
                log.warning("broker_unreachable_waiting", unacknowledged=len(pending))
            elif withdrawn := self._withdraw(sent, pending):
                log.warning(
                    "publish_timed_out",
                    given_back=len(withdrawn),
                    in_flight=len(pending - withdrawn),
                )
                await asyncio.wait(withdrawn, timeout=STOP_FLUSH_SECONDS)
                return True
            else:
                sent.parked = True
                log.warning(
                    "publish_waiting_for_broker",
                    in_flight=len(pending),
                    why=_IN_FLIGHT,
                )
            deadline = loop.time() + self._settings.publish_timeout_seconds
        return False

    async def _await_first_answers(
        self,
        pending: set[asyncio.Future[object]],
        heartbeat: Callable[[], None],
        early: Callable[[], Awaitable[None]],
    ) -> set[asyncio.Future[object]]:
        """The early settle (review F10): once EARLY_SETTLE_SECONDS have passed, or sooner once
        one partition answered (EARLY_SETTLE_FACTOR times its wait, at least
        EARLY_SETTLE_MIN_SECONDS), settle what is acknowledged; returns what is still pending."""
        loop = asyncio.get_running_loop()
        heartbeat()
        limit = min(EARLY_SETTLE_SECONDS, self._settings.publish_timeout_seconds)
        started = loop.time()
        done, pending = await asyncio.wait(
            pending, timeout=limit, return_when=asyncio.FIRST_COMPLETED
        )
        if pending and done:
            first = loop.time() - started
            wait = min(limit, max(EARLY_SETTLE_MIN_SECONDS, EARLY_SETTLE_FACTOR * first))
            if wait > first:
                _, pending = await asyncio.wait(pending, timeout=wait - first)
        if pending:
            await early()
        return pending

    def _withdraw(
        self, sent: Sent, pending: set[asyncio.Future[object]]
    ) -> set[asyncio.Future[object]]:
        """The pending submissions that never reached the broker, ended now: those still
        waiting to be handed to their producer, and batches the producer still queues behind a
        request in flight on the same partition (internals.withdraw_unsent). Their rows can be
        given back with no copy left anywhere."""
        withdrawn: set[asyncio.Future[object]] = set()
        unsent = errors.BrokerUnavailableError(_UNACKNOWLEDGED)
        for future in pending:
            if future in self._submitting:
                future.cancel()
                withdrawn.add(future)
                continue
            producer, builder = sent.batches.get(future, (None, None))
            if producer is not None and internals.withdraw_unsent(producer, unsent, [builder]):
                withdrawn.add(future)
        return withdrawn

    async def _drain(
        self,
        sent: Sent,
        heartbeat: Callable[[], None],
        early: Callable[[], Awaitable[None]] | None,
    ) -> None:
        """Once the claim was given up on: wait for every request still in flight, however long
        the broker refuses it (see _await_acks), settling the keys answered meanwhile."""
        pending = {f for f in sent.futures if isinstance(f, asyncio.Future) and not f.done()}
        loop = asyncio.get_running_loop()
        warned = loop.time()
        while pending:
            sent.parked = True
            heartbeat()
            done, pending = await asyncio.wait(pending, timeout=EARLY_SETTLE_SECONDS)
            if early is not None and done:
                await early()
            if pending and loop.time() - warned >= self._settings.publish_timeout_seconds:
                warned = loop.time()
                log.warning("publish_waiting_for_broker", in_flight=len(pending), why=_IN_FLIGHT)

    async def _retry_rejected_alone(
        self,
        records: Sequence[OutboxRecord],
        topics: Sequence[str | BaseException],
        encoded: Mapping[int, KafkaRecord | BaseException | None],
        indices: Sequence[int],
        sent: Sent,
        heartbeat: Callable[[], None],
    ) -> None:
        """The broker refuses a whole partition batch for one bad record, and every record of
        the batch shares its one future: send the records of a refused batch again one at a
        time, so that only the record the broker refuses alone takes the blame (dead-lettered
        or counted). A record alone in its batch was refused for itself."""
        batches: dict[int, list[int]] = {}
        for i in indices:
            item = sent.futures[i]
            if isinstance(item, asyncio.Future) and _rejected(item):
                batches.setdefault(id(item), []).append(i)
        suspects = sorted(i for batch in batches.values() if len(batch) > 1 for i in batch)
        if not suspects:
            return
        # The rejected batch used up sequence numbers the broker never saw: a fresh producer id.
        self._broken = self._broken or _exception_of(sent.futures[suspects[0]])
        log.info("batch_rejected_retrying_alone", rows=len(suspects))
        for i in suspects:
            sent.futures[i] = None  # not sent (a cancelled retry gives it back, not blames it)
        failed_keys: set[str] = set()
        for i in suspects:
            key = records[i].ordering_key
            if key is not None and key in failed_keys:
                sent.futures[i] = NotAttempted()
                continue
            try:
                await self._replace_if_broken()
            except errors.BrokerUnavailableError as exc:
                sent.futures[i] = exc
            else:
                # Alone in an empty batch: never deferred.
                await self._send_wave(records, topics, encoded, [i], sent, {}, failed_keys)
                if await self._await_acks(sent, [i], heartbeat):
                    sent.futures[i] = errors.BrokerUnavailableError(_UNACKNOWLEDGED)
            item = sent.futures[i]
            if isinstance(item, asyncio.Future) and _rejected(item):
                self._broken = item.exception()  # this refusal also used up a sequence number
            if key is not None and _failed(item):
                failed_keys.add(key)

    def _final_outcomes(self, sent: Sent) -> list[BaseException | None]:
        outcomes = self.outcomes(
            sent, errors.BrokerUnavailableError(_UNACKNOWLEDGED), unsent=NotAttempted()
        )
        for outcome in outcomes:
            self._note(outcome)
        return outcomes

    @staticmethod
    def outcomes(
        sent: Sent,
        unacknowledged: BaseException,
        total: int | None = None,
        *,
        unsent: BaseException | None = None,
    ) -> list[BaseException | None]:
        """None for an acknowledged record, else why it is not acknowledged. Records never handed
        to the producer (None in `sent`, or past its end up to `total`) get `unsent`, by default
        `unacknowledged`."""
        not_sent = unacknowledged if unsent is None else unsent
        results: list[BaseException | None] = []
        for item in sent.futures:
            if item is None:
                results.append(not_sent)
            elif isinstance(item, BaseException):
                results.append(item)
            elif not item.done() or item.cancelled():
                results.append(unacknowledged)
            else:
                problem = item.exception()
                results.append(problem.cause if isinstance(problem, _NotSubmitted) else problem)
        missing = (total or 0) - len(results)
        results.extend([not_sent] * max(0, missing))
        return results


_UNACKNOWLEDGED = "the broker did not acknowledge within OUTBOX_PUBLISH_TIMEOUT_SECONDS"
_IN_FLIGHT = (
    "the broker answers but refuses or does not confirm records a request carried (e.g. "
    "NotEnoughReplicas); they may be in its log already, so they are retried by the same "
    "producer until it answers, never given back to be sent twice"
)


def _failed(item: asyncio.Future[object] | BaseException | None) -> bool:
    """A record that is not (or not yet) acknowledged: its key's later rows must wait."""
    if item is None or isinstance(item, BaseException):
        return True
    return not item.done() or item.cancelled() or item.exception() is not None


class _NotSubmitted(Exception):  # noqa: N818 (a wrapper, not an error of its own)
    """send_batch raised: the batch never reached the producer (see KafkaPublisher._submit)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _rejected(future: asyncio.Future[object]) -> bool:
    """The broker refused the record's batch (an error that is neither an outage nor the
    producer's own state): the refusal may be another record's fault."""
    if not future.done() or future.cancelled():
        return False
    exc = future.exception()
    return (
        isinstance(exc, kafka_errors.KafkaError)
        and not isinstance(exc, failures.PRODUCER_STATE + failures.TOPIC)
        and failures.classify(exc) is not errors.Failure.TRANSIENT
    )


def _exception_of(item: asyncio.Future[object] | BaseException | None) -> BaseException:
    """The exception of a rejected batch (what marks the producer for replacement)."""
    if isinstance(item, asyncio.Future) and item.done() and not item.cancelled():
        exc = item.exception()
        if exc is not None:
            return exc
    return errors.BrokerUnavailableError("the broker refused a batch")


async def _close(
    producer: AIOKafkaProducer, reason: str, stopping: asyncio.Future[None] | None = None
) -> None:
    """Flush and close a producer within STOP_FLUSH_SECONDS (`stopping`: its stop() already
    under way, see KafkaPublisher._retire). aiokafka's stop() waits for every buffered record
    to be delivered, which never happens while a partition does not acknowledge: past the
    bound, fail what is left (its records are then given back, unmarked: once stopped, the
    producer sends nothing more). Only where the process stops or a producer never served."""
    if stopping is None:
        stopping = asyncio.ensure_future(producer.stop())
    done, _ = await asyncio.wait({stopping}, timeout=STOP_FLUSH_SECONDS)
    if not done:
        log.warning("producer_flush_abandoned", reason=reason)
        internals.fail_buffered(producer, errors.BrokerUnavailableError(reason))
    try:
        await stopping
    except Exception as exc:  # noqa: BLE001 - the producer is discarded whatever its stop() raised
        # Once its batches were failed here, aiokafka's sender can raise KeyError while ending: a
        # request still in flight re-enqueues a batch that fail_buffered already completed.
        log.debug("producer_stop_failed", error=errors.describe(exc))


def _consume(future: asyncio.Future[object]) -> None:
    """Retrieve a late result so that asyncio does not warn about it."""
    if not future.cancelled():
        future.exception()
