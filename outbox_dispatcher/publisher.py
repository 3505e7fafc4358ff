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

from outbox_dispatcher import broker, errors
from outbox_dispatcher.models import OutboxRecord
from outbox_dispatcher.routing import Router
from outbox_dispatcher.settings import Settings
from outbox_dispatcher.tracing import Tracer

log = structlog.get_logger(__name__)

STOP_FLUSH_SECONDS = 5.0


class NotAttempted(Exception):  # noqa: N818 - an outcome, not an error
    """The record was not sent because an earlier record of its key failed; it keeps its place."""


class TopicMissingError(Exception):
    """The topic does not exist and the broker did not create it: create it or fix the row."""


@dataclass
class Sent:
    """Per record: the delivery future, or the exception that prevented sending."""

    futures: list[asyncio.Future[object] | BaseException] = field(default_factory=list)


def record_headers(record: OutboxRecord, event_id_header: str) -> list[tuple[str, bytes]]:
    """The row's headers, then the event id. A writer's header named like the event id header
    in any letter case is dropped: consumers that normalise header names would read it as the
    id. The schema admits only string values; a row stored under an older, laxer check may still
    hold others, and is dead-lettered, not a crash."""
    if not isinstance(record.headers, dict):
        msg = f"headers must be a JSON object of strings, not {type(record.headers).__name__}"
        raise errors.UnpublishableRowError(msg)
    headers = []
    reserved = event_id_header.casefold()
    for name, value in record.headers.items():
        if name.casefold() == reserved:
            continue
        if not isinstance(value, str):
            msg = (
                f"header {name!r} is a JSON {type(value).__name__}, not a string: Kafka header "
                "values are strings; fix the row's headers, then requeue it"
            )
            raise errors.UnpublishableRowError(msg)
        headers.append((name, value.encode()))
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
        self._context: ssl.SSLContext | None = None
        self._broken: BaseException | None = None  # the producer's state is lost: replace it
        self._replacing = asyncio.Lock()

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
        context = ssl_context(self._settings)
        problem = await diagnose(self._settings, context)
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
            raise errors.ConfigurationError(_SASL_REJECTED.format(errors.describe(exc))) from exc
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
        """Flush and close. aiokafka's stop() waits for every buffered record to be delivered,
        which never happens while the broker is away: past a bound, fail what is left (those
        rows were already given back, unmarked, by the shutdown) so that SIGTERM still ends."""
        if self._producer is None:
            return
        producer, self._producer = self._producer, None
        stopping = asyncio.ensure_future(producer.stop())
        done, _ = await asyncio.wait({stopping}, timeout=STOP_FLUSH_SECONDS)
        if not done:
            log.warning("producer_flush_abandoned", reason="the broker did not take the records")
            broker.fail_buffered(
                producer,
                errors.BrokerUnavailableError("the dispatcher stopped while the broker was away"),
            )
        await stopping

    def _note(self, outcome: BaseException | None) -> None:
        if isinstance(outcome, errors.PRODUCER_STATE_ERRORS):
            self._broken = outcome

    async def _replace_if_broken(self) -> None:
        """An idempotent producer whose sequence state the broker no longer accepts (e.g. after
        the broker restarted and lost its producer state) fails every later send: start a fresh
        producer (new producer id). Its failed records are retried in order, never counted."""
        async with self._replacing:
            if self._broken is None:
                return
            reason = errors.describe(self._broken)
            fresh = self._build(self._context)
            try:
                await fresh.start()
            except (kafka_errors.KafkaError, OSError) as exc:
                await fresh.stop()
                raise errors.BrokerUnavailableError(errors.describe(exc)) from exc
            old, self._producer = self._producer, fresh
            self._broken = None
            log.warning("producer_replaced", reason=reason)
            if old is not None:
                try:
                    await old.stop()
                except kafka_errors.KafkaError as exc:
                    log.debug("old_producer_stop_failed", error=errors.describe(exc))

    async def broker_reachable(self, seconds: float = 5.0) -> bool:
        try:
            async with asyncio.timeout(seconds):
                await broker.all_metadata(self.producer)
        except (kafka_errors.KafkaError, OSError, TimeoutError):
            return False
        return True

    async def _topic_errors(self, topics: set[str]) -> dict[str, BaseException]:
        """Fetch metadata for topics not yet known, so that send() never blocks on one."""
        producer = self.producer
        unknown = [t for t in topics if broker.known_partitions(producer, t) is None]
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
                codes = await broker.topic_error_codes(self.producer, topics)
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

    async def send(self, records: Sequence[OutboxRecord], sent: Sent) -> None:
        """Hand every record to the producer in order, filling `sent` as it goes (so that a
        cancelled send still knows what it sent); a key stops at its first failure."""
        if self._broken is not None:
            try:
                await self._replace_if_broken()
            except errors.BrokerUnavailableError as exc:
                sent.futures.extend([exc] * len(records))
                return
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
            if problem is None and key is None and record.payload is None:
                problem = errors.UnpublishableRowError(
                    "a tombstone (NULL payload) needs an ordering_key: Kafka clients refuse a "
                    "record with neither key nor value; give the row a key or a payload"
                )
            if problem is None and isinstance(topic, str):
                span = tracer.start(record, topic)
                try:
                    headers = record_headers(record, header_name)
                    if cloudevents:
                        headers = [h for h in headers if h[0] != "ce_id"] + cloudevents_headers(
                            record, self._settings
                        )
                    future = await producer.send(
                        topic,
                        value=record.payload,
                        key=key.encode() if key is not None else None,
                        headers=headers,
                    )
                except (
                    kafka_errors.KafkaError,
                    errors.UnpublishableRowError,
                    ValueError,
                    TypeError,
                    AssertionError,
                ) as exc:
                    problem = exc
                    self._note(exc)
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
        outcomes = self.outcomes(sent, NotAttempted())
        for outcome in outcomes:
            self._note(outcome)
        return outcomes


_SASL_REJECTED = (
    "Kafka rejected the SASL credentials ({}): check OUTBOX_KAFKA_SASL_USERNAME, "
    "OUTBOX_KAFKA_SASL_PASSWORD and OUTBOX_KAFKA_SASL_MECHANISM"
)


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The TLS context for SSL and SASL_SSL: the broker verified against kafka_ssl_cafile (the
    system CAs without it), a client certificate when one is configured."""
    s = settings
    if s.kafka_security_protocol not in ("SSL", "SASL_SSL"):
        return None
    try:
        context = ssl.create_default_context(cafile=s.kafka_ssl_cafile)
    except (OSError, ssl.SSLError) as exc:
        msg = (
            f"cannot load the CA file OUTBOX_KAFKA_SSL_CAFILE={s.kafka_ssl_cafile!r} "
            f"({errors.describe(exc)}): give a readable PEM bundle"
        )
        raise errors.ConfigurationError(msg) from exc
    context.check_hostname = s.kafka_ssl_check_hostname
    if s.kafka_ssl_certfile:
        key_password = s.kafka_ssl_key_password
        try:
            # Never let OpenSSL prompt on a terminal for a missing key password.
            context.load_cert_chain(
                s.kafka_ssl_certfile,
                s.kafka_ssl_keyfile,
                password=key_password.get_secret_value() if key_password else _no_password,
            )
        except (OSError, ssl.SSLError) as exc:
            msg = (
                f"cannot load the client certificate OUTBOX_KAFKA_SSL_CERTFILE="
                f"{s.kafka_ssl_certfile!r} with OUTBOX_KAFKA_SSL_KEYFILE={s.kafka_ssl_keyfile!r} "
                f"({errors.describe(exc)}): check both files and OUTBOX_KAFKA_SSL_KEY_PASSWORD"
            )
            raise errors.ConfigurationError(msg) from exc
    return context


def _no_password() -> bytes:
    return b""


async def diagnose(
    settings: Settings, context: ssl.SSLContext | None
) -> errors.ConfigurationError | None:
    """Connect once to the first bootstrap server the way the producer will, and turn a refused
    login or certificate into one clear configuration error. The producer itself would only
    report "Unable to bootstrap", which reads like an outage. Anything else (the broker is down)
    is left to the producer's own start."""
    s = settings
    host, _, port = s.kafka_bootstrap_servers.split(",")[0].rpartition(":")
    password = s.kafka_sasl_password.get_secret_value() if s.kafka_sasl_password else None
    try:
        async with asyncio.timeout(min(10.0, s.publish_timeout_seconds)):
            conn = await broker.open_connection(
                host,
                int(port),
                client_id=s.kafka_client_id,
                request_timeout_ms=int(s.publish_timeout_seconds * 1000),
                ssl_context=context,
                security_protocol=s.kafka_security_protocol,
                sasl_mechanism=s.kafka_sasl_mechanism or "PLAIN",
                sasl_plain_username=s.kafka_sasl_username,
                sasl_plain_password=password,
            )
    except (kafka_errors.SaslAuthenticationFailed, kafka_errors.AuthenticationFailedError) as exc:
        return errors.ConfigurationError(_SASL_REJECTED.format(errors.describe(exc)))
    except kafka_errors.UnsupportedSaslMechanismError as exc:
        return errors.ConfigurationError(
            f"the broker does not accept OUTBOX_KAFKA_SASL_MECHANISM={s.kafka_sasl_mechanism} "
            f"({errors.describe(exc)}): use one it enables"
        )
    except ssl.SSLCertVerificationError as exc:
        return errors.ConfigurationError(_certificate_rejected(exc))
    except ssl.SSLError as exc:
        return errors.ConfigurationError(_tls_failed(s, exc))
    except (kafka_errors.KafkaError, OSError, TimeoutError, ValueError):
        if context is not None:
            return await _diagnose_tls(s, host, int(port), context)
        return None
    conn.close()
    return None


async def _diagnose_tls(
    settings: Settings, host: str, port: int, context: ssl.SSLContext
) -> errors.ConfigurationError | None:
    """What aiokafka reports as a closed connection. With TLS 1.3 a broker that refuses the
    client's certificate (or its absence) lets the handshake finish and sends its alert after
    the client's first bytes; a listener that does not speak TLS drops the handshake."""
    writer: asyncio.StreamWriter | None = None
    handshake_done = False
    try:
        async with asyncio.timeout(5.0):
            reader, writer = await asyncio.open_connection(host, port, ssl=context)
            handshake_done = True
            writer.write(b"\x00\x00\x00\x00")  # an empty Kafka request: the broker closes
            await writer.drain()
            await reader.read(1)
    except ssl.SSLCertVerificationError as exc:
        return errors.ConfigurationError(_certificate_rejected(exc))
    except ssl.SSLError as exc:
        return errors.ConfigurationError(_tls_failed(settings, exc))
    except ConnectionResetError as exc:
        if handshake_done:
            return None
        return errors.ConfigurationError(
            f"{host}:{port} dropped the TLS handshake ({errors.describe(exc)}): it is probably "
            "not a TLS listener; check OUTBOX_KAFKA_SECURITY_PROTOCOL and the port in "
            "OUTBOX_KAFKA_BOOTSTRAP_SERVERS"
        )
    except (OSError, TimeoutError):
        return None
    finally:
        if writer is not None:
            writer.close()
    return None


def _certificate_rejected(exc: ssl.SSLCertVerificationError) -> str:
    return (
        f"the Kafka broker's TLS certificate was not accepted ({exc.verify_message or exc}): "
        "OUTBOX_KAFKA_SSL_CAFILE must name the CA that signed it, and the certificate must name "
        "the host in OUTBOX_KAFKA_BOOTSTRAP_SERVERS (or set OUTBOX_KAFKA_SSL_CHECK_HOSTNAME=false)"
    )


def _tls_failed(settings: Settings, exc: ssl.SSLError) -> str:
    alert = str(exc).upper()
    if "CERTIFICATE" in alert and not settings.kafka_ssl_certfile:
        hint = (
            "the broker wants a client certificate: set OUTBOX_KAFKA_SSL_CERTFILE and "
            "OUTBOX_KAFKA_SSL_KEYFILE"
        )
    elif "CERTIFICATE" in alert:
        hint = (
            "the broker refused the client certificate OUTBOX_KAFKA_SSL_CERTFILE: it must be "
            "signed by a CA the broker trusts"
        )
    else:
        hint = "check OUTBOX_KAFKA_SECURITY_PROTOCOL and the OUTBOX_KAFKA_SSL_* settings"
    return f"the TLS handshake with Kafka failed ({errors.describe(exc)}): {hint}"


def _consume(future: asyncio.Future[object]) -> None:
    """Retrieve a late result so that asyncio does not warn about it."""
    if not future.cancelled():
        future.exception()
