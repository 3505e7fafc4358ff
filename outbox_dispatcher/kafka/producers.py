"""The producers of one publisher: the current one, its replacement when the broker no longer
accepts its sequence state, the retirement of a replaced one, and the bounded close that only the
process's stop uses.

A replaced producer is retired, never closed with its requests failed: the broker may have
appended what a request carried before it answered with an error, and only the same producer's
retries, under its producer id and sequence numbers, are recognised as that append (issue 25).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka import errors as kafka_errors

from outbox_dispatcher import errors
from outbox_dispatcher.kafka import failures, internals, tls
from outbox_dispatcher.kafka.tls import ConnectionConfig

log = structlog.get_logger(__name__)

STOP_FLUSH_SECONDS = 5.0

# Builds a producer (unstarted) for a TLS context: aiokafka's, or a test's fake.
Factory = Callable[[ssl.SSLContext | None], AIOKafkaProducer]


class NotSubmitted(Exception):  # noqa: N818 (a wrapper, not an error of its own)
    """send_batch raised: the batch never reached the producer (see Producers.submit)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


@dataclass(frozen=True)
class ProducerConfig:
    connection: ConnectionConfig
    linger_ms: int
    max_batch_bytes: int
    max_request_bytes: int
    compression: str  # "none", or aiokafka's compression_type
    # exactly-once (kafka/exactly_once/publisher.py): the producers' transactional id and timeout.
    transactional_id: str | None = None
    transaction_timeout_seconds: float = 60.0


class Producers:
    def __init__(self, config: ProducerConfig, factory: Factory | None = None) -> None:
        self._config = config
        self.factory: Factory = factory or self._aiokafka
        self._current: AIOKafkaProducer | None = None
        self._context: ssl.SSLContext | None = None
        self._broken: BaseException | None = None  # the producer's state is lost: replace it
        self._replacing = asyncio.Lock()
        self._closing: dict[int, asyncio.Future[None]] = {}  # id(producer): its bounded close
        # id(producer): a replaced producer and its unbounded close (see retire).
        self._retiring: dict[int, tuple[AIOKafkaProducer, asyncio.Future[None]]] = {}
        # Submissions not yet handed to their producer (waiting in send_batch, see submit).
        self._submitting: dict[asyncio.Future[object], AIOKafkaProducer] = {}
        # The loop's time when the current producer began to serve (exactly-once sends a claim
        # only with a producer that served before the claim began: kafka/exactly_once/publisher.py).
        self.since = float("inf")
        # exactly-once: what must happen before a fresh producer starts under the transactional
        # id (the lanes record their ids: kafka/exactly_once/lanes.py); it raises to refuse.
        self.before_start: Callable[[], Awaitable[None]] | None = None

    def _aiokafka(self, context: ssl.SSLContext | None) -> AIOKafkaProducer:
        c, s = self._config, self._config.connection
        transactions: dict[str, Any] = {}
        if c.transactional_id is not None:
            transactions = {
                "transactional_id": c.transactional_id,
                "transaction_timeout_ms": int(c.transaction_timeout_seconds * 1000),
            }
        return AIOKafkaProducer(
            **transactions,
            bootstrap_servers=s.bootstrap_servers.split(","),
            client_id=s.client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=c.linger_ms,
            max_batch_size=c.max_batch_bytes,
            max_request_size=c.max_request_bytes,
            compression_type=None if c.compression == "none" else c.compression,
            request_timeout_ms=int(s.request_timeout_seconds * 1000),
            security_protocol=s.security_protocol,
            ssl_context=context,
            sasl_mechanism=s.sasl_mechanism or "PLAIN",
            sasl_plain_username=s.sasl_username,
            sasl_plain_password=s.sasl_password.get_secret_value() if s.sasl_password else None,
        )

    def current(self) -> AIOKafkaProducer:
        if self._current is None:
            msg = "the publisher is not started"
            raise errors.OutboxDispatcherError(msg)
        return self._current

    @property
    def serving(self) -> bool:
        """A producer is started and not stopped."""
        return self._current is not None

    def use(self, producer: AIOKafkaProducer | None) -> None:
        """Serve with `producer`, already started (tests); None: serve with none."""
        self._current = producer

    @property
    def retiring(self) -> list[AIOKafkaProducer]:
        """Replaced producers not closed yet (they wait for their requests in flight)."""
        return [producer for producer, _ in self._retiring.values()]

    async def start(self, seconds: float | None = None) -> None:
        """Diagnose the connection, then start the first producer (within `seconds`; None:
        aiokafka's own bound); a refused login or certificate is one configuration error, an
        unreachable broker a retriable one."""
        connection = self._config.connection
        context = tls.ssl_context(connection)
        problem = await tls.diagnose(connection, context)
        if problem is not None:
            raise problem
        self._context = context
        try:
            self._current = await self._start_fresh(seconds)
            self.since = asyncio.get_running_loop().time()
        except (
            kafka_errors.SaslAuthenticationFailed,
            kafka_errors.AuthenticationFailedError,
        ) as exc:
            raise errors.ConfigurationError(tls.SASL_REJECTED.format(errors.describe(exc))) from exc
        except (kafka_errors.KafkaError, OSError, TimeoutError) as exc:
            msg = (
                f"cannot reach Kafka at {connection.bootstrap_servers} "
                f"({errors.describe(exc)}): check OUTBOX_KAFKA_BOOTSTRAP_SERVERS and the broker"
            )
            raise errors.BrokerUnavailableError(msg) from exc
        except (ValueError, OverflowError) as exc:  # e.g. a port the socket layer refuses
            msg = (
                f"the Kafka client refused the settings ({errors.describe(exc)}): check the "
                "OUTBOX_KAFKA_* settings"
            )
            raise errors.ConfigurationError(msg) from exc

    async def _start_fresh(self, seconds: float | None) -> AIOKafkaProducer:
        """A new producer (a new producer id), started within `seconds` (None: aiokafka's own
        bound); one that fails to start, or whose start is cancelled (a shutdown, or an outbox
        let go, while its lanes open at once), is closed and its failure raised: kept by nobody,
        it would leak its connections and tasks."""
        fresh = self.factory(self._context)
        try:
            async with asyncio.timeout(seconds):
                await fresh.start()
        except BaseException:
            await close_bounded(fresh, "the fresh producer could not start")
            raise
        return fresh

    async def stop(self) -> None:
        """Flush and close (bounded, see close_bounded) the producer and any producer still being
        retired: the process is stopping, so what a partition still holds past the bound is
        failed and given back (a copy may then follow, as after a crash; docs/guarantees.md)."""
        reason = "the dispatcher stopped while the broker was away"
        if self._current is not None:
            producer, self._current = self._current, None
            self._close(producer, reason)
        for producer, _ in list(self._retiring.values()):
            self._close(producer, reason)
        if self._closing:
            await asyncio.wait(list(self._closing.values()))

    def note(self, outcome: BaseException | None) -> None:
        """An answer that says the producer's sequence state is lost marks it for replacement."""
        if failures.is_producer_state(outcome):
            self._broken = outcome

    def condemn(self, cause: BaseException, *, keep_earlier: bool = False) -> None:
        """A refused batch used up sequence numbers the broker never saw: replace the producer
        before the next send (`keep_earlier`: an earlier cause stays the one logged)."""
        if not (keep_earlier and self._broken is not None):
            self._broken = cause

    async def replace_if_broken(self) -> None:
        """An idempotent producer whose sequence state the broker no longer accepts (e.g. after
        the broker restarted and lost its producer state, or refused a batch whose sequence
        numbers were used up) fails every later send: start a fresh producer (new producer id).
        Its failed records are retried in order, never counted. The old producer is retired
        outside the lock and without waiting for it (see retire): what it still has in flight
        may be in the broker's log, and only its own retries are recognised as such. A producer
        whose sender died (internals.sender_failure) is replaced too, whether or not an answer
        said so: it would fail every later send."""
        if self._broken is None and self._current is not None:
            self._broken = internals.sender_failure(self._current)
        if self._broken is None:
            return
        async with self._replacing:
            if self._broken is None:
                return
            reason = errors.describe(self._broken)
            if self.before_start is not None:
                await self.before_start()
            try:
                fresh = await self._start_fresh(
                    max(self._config.connection.request_timeout_seconds, 10.0)
                )
            except (kafka_errors.KafkaError, OSError, TimeoutError) as exc:
                raise errors.BrokerUnavailableError(errors.describe(exc)) from exc
            old, self._current = self._current, fresh
            self.since = asyncio.get_running_loop().time()
            self._broken = None
            log.warning(
                "producer_replaced",
                reason=reason,
                old_producer_id=None if old is None else internals.producer_id(old),
                producer_id=internals.producer_id(fresh),
            )
        if old is not None:
            self.retire(old, "the producer was replaced; the broker did not take its records")

    def retire(self, producer: AIOKafkaProducer, reason: str) -> None:
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
        internals.read_drains(internals.held_batches(producer))  # a dead sender's failures
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
        """The producer's bounded close, started once however many callers ask; a producer
        being retired gets the bound too (the process is stopping)."""
        closing = self._closing.get(id(producer))
        if closing is None:
            retiring = self._retiring.get(id(producer))
            closing = asyncio.ensure_future(
                close_bounded(producer, reason, None if retiring is None else retiring[1])
            )
            self._closing[id(producer)] = closing
            closing.add_done_callback(lambda _: self._closing.pop(id(producer), None))
        return closing

    async def close_bounded(self, producers: Iterable[AIOKafkaProducer], reason: str) -> None:
        """Close `producers` within the bound, for a process that stops past its grace period."""
        closing = [self._close(p, reason) for p in dict.fromkeys(producers)]
        if closing:
            await asyncio.wait(closing)  # not gather: a cancelled caller must not cancel them

    def submit(
        self, producer: AIOKafkaProducer, builder: Any, topic: str, partition: int
    ) -> asyncio.Future[object]:
        """Hand a built batch to `producer` in a task of its own, which then waits for the
        broker's answer: one awaitable per batch from submission to ack. Registered before it
        runs: a retirement that comes first must find it (N11)."""
        submission: asyncio.Future[object] = asyncio.ensure_future(
            self._submit(producer, builder, topic, partition)
        )
        self._submitting[submission] = producer
        submission.add_done_callback(self._submitted)
        return submission

    def handing_over(self, submission: asyncio.Future[object]) -> bool:
        """The submission still waits to reach its producer: nothing of it was sent."""
        return submission in self._submitting

    async def _submit(
        self, producer: AIOKafkaProducer, builder: Any, topic: str, partition: int
    ) -> object:
        """A send_batch that raises (a producer being closed by another loop, an assertion on a
        partition its metadata no longer has) fails as NotSubmitted: nothing of the batch was
        sent."""
        try:
            delivery = await producer.send_batch(builder, topic, partition=partition)
        except (kafka_errors.KafkaError, errors.BrokerUnavailableError, AssertionError) as exc:
            raise NotSubmitted(exc) from exc
        finally:
            task = asyncio.current_task()
            if task is not None:
                self._submitting.pop(task, None)
        return await delivery

    def _submitted(self, submission: asyncio.Future[object]) -> None:
        self._submitting.pop(submission, None)


async def close_bounded(
    producer: AIOKafkaProducer, reason: str, stopping: asyncio.Future[None] | None = None
) -> None:
    """Flush and close a producer within STOP_FLUSH_SECONDS (`stopping`: its stop() already
    under way, see Producers.retire). aiokafka's stop() waits for every buffered record to be
    delivered, which never happens while a partition does not acknowledge: past the bound, fail
    what is left (its records are then given back, unmarked: once stopped, the producer sends
    nothing more). Only where the process stops or a producer never served."""
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
