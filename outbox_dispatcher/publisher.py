"""Publishes claimed records to Kafka: acks=all, idempotent, the producer's own batching.

Sending is split from waiting so that a cancelled wait still knows which records the broker had
acknowledged (those are marked) and which it had not (those are given back).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka import errors as kafka_errors
from aiokafka.helpers import create_ssl_context

from outbox_dispatcher import errors
from outbox_dispatcher.models import OutboxRecord
from outbox_dispatcher.routing import Router
from outbox_dispatcher.settings import Settings
from outbox_dispatcher.tracing import Tracer

log = structlog.get_logger(__name__)


class NotAttempted(Exception):  # noqa: N818 - an outcome, not an error
    """The record was not sent because an earlier record of its key failed; it keeps its place."""


class TopicMissingError(Exception):
    """The topic does not exist and the broker did not create it: create it or fix the row."""


@dataclass
class Sent:
    """Per record: the delivery future, or the exception that prevented sending."""

    futures: list[asyncio.Future[object] | BaseException] = field(default_factory=list)


def record_headers(record: OutboxRecord, event_id_header: str) -> list[tuple[str, bytes]]:
    """The row's headers unchanged (traceparent included), then the event id, which always wins."""
    headers = [
        (name, value.encode()) for name, value in record.headers.items() if name != event_id_header
    ]
    headers.append((event_id_header, str(record.event_id).encode()))
    return headers


def cloudevents_headers(record: OutboxRecord, settings: Settings) -> list[tuple[str, bytes]]:
    """CloudEvents Kafka binding, binary mode: the payload is the event data and the attributes
    travel as ce_* headers. ce_id is always the event id; a row's own ce_* headers win."""
    extra = [("ce_id", str(record.event_id))]
    defaults = (
        ("ce_specversion", "1.0"),
        ("ce_source", settings.cloudevents_source),
        ("ce_type", settings.cloudevents_type),
        ("ce_time", record.created_at.isoformat()),
        ("content-type", settings.cloudevents_content_type),
    )
    extra.extend((name, value) for name, value in defaults if name not in record.headers)
    return [(name, value.encode()) for name, value in extra]


class KafkaPublisher:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._router = Router(settings.default_topic, settings.topic_template)
        self._producer: AIOKafkaProducer | None = None
        self._tracer = Tracer(settings.tracing)

    def _build(self) -> AIOKafkaProducer:
        s = self._settings
        ssl_context: ssl.SSLContext | None = None
        if s.kafka_security_protocol in ("SSL", "SASL_SSL"):
            ssl_context = create_ssl_context(cafile=s.kafka_ssl_cafile)
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
            ssl_context=ssl_context,
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
        producer = self._build()
        try:
            await producer.start()
        except (
            kafka_errors.SaslAuthenticationFailed,
            kafka_errors.AuthenticationFailedError,
        ) as exc:
            await producer.stop()
            msg = f"Kafka rejected the credentials (OUTBOX_KAFKA_SASL_*): {exc}"
            raise errors.ConfigurationError(msg) from exc
        except (kafka_errors.KafkaError, OSError) as exc:
            await producer.stop()
            msg = (
                f"cannot reach Kafka at {self._settings.kafka_bootstrap_servers} "
                f"({errors.describe(exc)}): check OUTBOX_KAFKA_BOOTSTRAP_SERVERS and the broker"
            )
            raise errors.BrokerUnavailableError(msg) from exc
        self._producer = producer

    async def stop(self) -> None:
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await producer.stop()

    async def broker_reachable(self, seconds: float = 5.0) -> bool:
        try:
            async with asyncio.timeout(seconds):
                await self.producer.client.fetch_all_metadata()
        except (kafka_errors.KafkaError, OSError, TimeoutError):
            return False
        return True

    async def _topic_errors(self, topics: set[str]) -> dict[str, BaseException]:
        """Fetch metadata for topics not yet known, so that send() never blocks on one."""
        cluster = self.producer.client.cluster
        unknown = [t for t in topics if cluster.partitions_for_topic(t) is None]
        if not unknown:
            return {}
        timeout = min(self._settings.publish_timeout_seconds, 10.0)

        async def lookup(topic: str) -> BaseException | None:
            try:
                async with asyncio.timeout(timeout):
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
        return failed

    async def send(self, records: Sequence[OutboxRecord], sent: Sent) -> None:
        """Hand every record to the producer in order, filling `sent` as it goes (so that a
        cancelled send still knows what it sent); a key stops at its first failure."""
        producer = self.producer
        header_name = self._settings.event_id_header
        cloudevents = self._settings.cloudevents
        tracer = self._tracer
        topics = [self._route(record) for record in records]
        topic_errors = await self._topic_errors({t for t in topics if isinstance(t, str)})
        failed_keys: set[str] = set()
        for record, topic in zip(records, topics, strict=True):
            key = record.ordering_key
            if key is not None and key in failed_keys:
                sent.futures.append(NotAttempted())
                continue
            problem = topic if isinstance(topic, BaseException) else topic_errors.get(topic)
            if problem is None and isinstance(topic, str):
                headers = record_headers(record, header_name)
                if cloudevents:
                    headers = [h for h in headers if h[0] != "ce_id"] + cloudevents_headers(
                        record, self._settings
                    )
                span = tracer.start(record, topic)
                try:
                    future = await producer.send(
                        topic,
                        value=record.payload,
                        key=key.encode() if key is not None else None,
                        headers=headers,
                    )
                except (kafka_errors.KafkaError, ValueError, TypeError, AssertionError) as exc:
                    problem = exc
                    tracer.fail(span, exc)
                else:
                    tracer.end_on_ack(span, future)
                    sent.futures.append(future)
                    continue
            assert problem is not None  # noqa: S101 - a topic either routed or failed
            if key is not None:
                failed_keys.add(key)
            sent.futures.append(problem)

    def _route(self, record: OutboxRecord) -> str | errors.RoutingError:
        try:
            return self._router.topic_for(record.topic, record.headers)
        except errors.RoutingError as exc:
            return exc

    @staticmethod
    def outcomes(
        sent: Sent, unacknowledged: BaseException, total: int | None = None
    ) -> list[BaseException | None]:
        """None for an acknowledged record, else why it is not acknowledged. Records past the
        end of `sent` (of `total`) were never handed to the producer."""
        results: list[BaseException | None] = []
        for item in sent.futures:
            if isinstance(item, BaseException):
                results.append(item)
            elif not item.done() or item.cancelled():
                results.append(unacknowledged)
            else:
                results.append(item.exception())
        missing = (total or 0) - len(results)
        results.extend([unacknowledged] * max(0, missing))
        return results

    async def wait(
        self, sent: Sent, heartbeat: Callable[[], None] = lambda: None
    ) -> list[BaseException | None]:
        """Wait for the broker's answers. While the broker is unreachable, keep waiting: the
        producer retries by itself and the lease keeper keeps the rows ours, so an outage ends in
        delivery, not in duplicates. If the broker answers but the records stay unacknowledged
        past publish_timeout, give up on them (they are given back and retried)."""
        pending = {f for f in sent.futures if isinstance(f, asyncio.Future)}
        while pending:
            heartbeat()  # waiting for a broker is not being stuck
            _, pending = await asyncio.wait(pending, timeout=self._settings.publish_timeout_seconds)
            if not pending:
                break
            if await self.broker_reachable():
                log.warning("publish_timed_out", unacknowledged=len(pending))
                for future in pending:
                    future.add_done_callback(_consume)
                return self.outcomes(
                    sent,
                    errors.BrokerUnavailableError(
                        "the broker did not acknowledge within OUTBOX_PUBLISH_TIMEOUT_SECONDS"
                    ),
                )
            log.warning("broker_unreachable_waiting", unacknowledged=len(pending))
        return self.outcomes(sent, NotAttempted())


def _consume(future: asyncio.Future[object]) -> None:
    """Retrieve a late result so that asyncio does not warn about it."""
    if not future.cancelled():
        future.exception()
