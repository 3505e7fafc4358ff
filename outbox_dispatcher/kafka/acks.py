"""Waiting for the broker's answers to a claim's records: when the keys answered so far may be
settled (early, while others are still missing), and what publish_timeout does.

Past publish_timeout with the broker answering, only what no produce request has carried is given
back (withdraw); what a request carried stays with its producer until the broker answers for
good, and the claim is parked (issue 25). The waits yield a moment (None) each time the keys
answered so far may be settled; the delivery turns it into a part.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer

from outbox_dispatcher import errors
from outbox_dispatcher.kafka import internals, producers
from outbox_dispatcher.kafka.producers import Producers
from outbox_dispatcher.kafka.topics import TopicLookup

log = structlog.get_logger(__name__)

# A wave whose acks are missing this long after it was sent settles the keys already acknowledged
# and lets the claim loop go on, so that one partition that does not acknowledge holds back only
# its own keys (review F10). Sooner once one partition has answered: the others normally answer
# within EARLY_SETTLE_FACTOR times as long (they share the broker's round trip), so a wave still
# waiting after that (at least EARLY_SETTLE_MIN_SECONDS) has a partition that does not answer.
EARLY_SETTLE_SECONDS = 0.25
EARLY_SETTLE_MIN_SECONDS = 0.05
EARLY_SETTLE_FACTOR = 3.0

UNACKNOWLEDGED = "the broker did not acknowledge within OUTBOX_PUBLISH_TIMEOUT_SECONDS"
_IN_FLIGHT = (
    "the broker answers but refuses or does not confirm records a request carried (e.g. "
    "NotEnoughReplicas); they may be in its log already, so they are retried by the same "
    "producer until it answers, never given back to be sent twice"
)

Pending = set[asyncio.Future[object]]


class Acks:
    """The waits of one claim."""

    def __init__(
        self,
        producers: Producers,
        lookup: TopicLookup,
        submitted: Mapping[asyncio.Future[object], tuple[AIOKafkaProducer, Any]],
        *,
        publish_timeout_seconds: float,
        heartbeat: Callable[[], None],
    ) -> None:
        self._producers = producers
        self._lookup = lookup
        self._submitted = submitted  # each submission's producer and builder (Batches)
        self._timeout = publish_timeout_seconds
        self._heartbeat = heartbeat
        # Past publish_timeout, waiting only for requests in flight (the broker answers, refusing
        # them for now): nothing the claim loop could do would help (dispatch/claim_loop.py).
        self.parked = False
        self.withdrew = False  # the last wait gave records back unsent (see wait)

    async def wait(self, pending: Pending, *, early: bool = True) -> AsyncGenerator[None, None]:
        """Wait for the answers of `pending`, with a moment to settle for the keys answered
        meanwhile (`early`; see _first_answers). Sets `withdrew` once publish_timeout has
        passed with the broker answering and some of them withdrawn unsent (see withdraw): the
        rest of the claim is not attempted, and what is in flight is waited for (drain). While
        the broker is unreachable, keep waiting: the producer retries by itself and the lease
        keeper keeps the rows ours, so an outage ends in delivery, not in duplicates. Requests in
        flight are never failed: a request the broker appended and then answered with an error
        (a follower out of the ISR: NOT_ENOUGH_REPLICAS_AFTER_APPEND, REQUEST_TIMED_OUT) is
        committed once the ISR shrinks, and only its producer's own retry is recognised by the
        broker as that append; a row given back would be sent again under another producer id
        and appended twice (issue 25)."""
        self.withdrew = False
        if pending and early:
            pending = await self._first_answers(pending)
            if pending:
                yield None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        while pending:
            self._heartbeat()  # waiting for a broker is not being stuck
            remaining = deadline - loop.time()
            if remaining > 0:
                # With `early`, the answers that came meanwhile are settled every
                # EARLY_SETTLE_SECONDS while others are missing: a partition that answers after
                # the early settle (e.g. behind another partition's retries on the same broker)
                # must not wait for the silent one. Coalesced, not one settle per answer: a wave
                # of many partitions that lingers past the early settle would otherwise add a
                # statement per partition.
                step = min(remaining, EARLY_SETTLE_SECONDS) if early else remaining
                done, pending = await asyncio.wait(pending, timeout=step)
                if early and done and pending:
                    yield None
                continue
            if not await self._lookup.reachable():
                log.warning("broker_unreachable_waiting", unacknowledged=len(pending))
            elif withdrawn := self.withdraw(pending):
                log.warning(
                    "publish_timed_out",
                    given_back=len(withdrawn),
                    in_flight=len(pending - withdrawn),
                )
                await asyncio.wait(withdrawn, timeout=producers.STOP_FLUSH_SECONDS)
                self.withdrew = True
                return
            else:
                self.parked = True
                log.warning("publish_waiting_for_broker", in_flight=len(pending), why=_IN_FLIGHT)
            deadline = loop.time() + self._timeout

    async def _first_answers(self, pending: Pending) -> Pending:
        """The early settle (review F10): wait until EARLY_SETTLE_SECONDS have passed, or less
        once one partition answered (EARLY_SETTLE_FACTOR times its wait, at least
        EARLY_SETTLE_MIN_SECONDS); returns what is still pending."""
        loop = asyncio.get_running_loop()
        self._heartbeat()
        limit = min(EARLY_SETTLE_SECONDS, self._timeout)
        started = loop.time()
        done, pending = await asyncio.wait(
            pending, timeout=limit, return_when=asyncio.FIRST_COMPLETED
        )
        if pending and done:
            first = loop.time() - started
            wait = min(limit, max(EARLY_SETTLE_MIN_SECONDS, EARLY_SETTLE_FACTOR * first))
            if wait > first:
                _, pending = await asyncio.wait(pending, timeout=wait - first)
        return pending

    def withdraw(self, pending: Pending) -> Pending:
        """The pending submissions that never reached the broker, ended now: those still
        waiting to be handed to their producer, and batches the producer still queues behind a
        request in flight on the same partition (internals.withdraw_unsent). Their rows can be
        given back with no copy left anywhere."""
        withdrawn: Pending = set()
        unsent = errors.BrokerUnavailableError(UNACKNOWLEDGED)
        for future in pending:
            if self._producers.handing_over(future):
                future.cancel()
                withdrawn.add(future)
                continue
            producer, builder = self._submitted.get(future, (None, None))
            if producer is not None and internals.withdraw_unsent(producer, unsent, [builder]):
                withdrawn.add(future)
        return withdrawn

    async def drain(self, pending: Pending) -> AsyncGenerator[None, None]:
        """Once the claim was given up on: wait for every request still in flight, however long
        the broker refuses it (see wait), with a moment to settle whenever some answered."""
        loop = asyncio.get_running_loop()
        warned = loop.time()
        while pending:
            self.parked = True
            self._heartbeat()
            done, pending = await asyncio.wait(pending, timeout=EARLY_SETTLE_SECONDS)
            if done:
                yield None
            if pending and loop.time() - warned >= self._timeout:
                warned = loop.time()
                log.warning("publish_waiting_for_broker", in_flight=len(pending), why=_IN_FLIGHT)
