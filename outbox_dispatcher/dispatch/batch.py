"""One claimed batch's run: published part by part (kafka/delivery.py), each part settled as it
comes, and on a shutdown cancel what the broker acknowledged is marked and the rest given back.

If acks are still missing after EARLY_SETTLE_SECONDS (sooner once other partitions answered: see
kafka/acks.py), the keys whose rows are all acknowledged are settled at once (their keys
released), then those of later answers, and `stalled` is set when other partitions answer, so that
the claim loop goes on while this batch waits for a partition that does not acknowledge (review
F10): only the keys that map to it wait.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from outbox_dispatcher import errors
from outbox_dispatcher.dispatch.leases import InFlight
from outbox_dispatcher.metrics import OutboxMetrics
from outbox_dispatcher.models import Batch, Failure, OutboxRecord, Outcome, Part, Result
from outbox_dispatcher.retries import RetryPolicy

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SettleConfig:
    """What the settler (dispatch/settler.py) is made with."""

    # How long a settle retries while the database is away before it leaves the rows to their
    # lease (settle_failed).
    retry_for_seconds: float
    delete_on_publish: bool
    # dead_letter_policy = block: a settle that dead-letters a row leaves its key blocked.
    block_on_dead: bool = False


class Settles(Protocol):
    """What settles a batch's rows (dispatch/settler.py): one statement, fenced by the lease token,
    finished even if its caller is cancelled; returns the rows it changed."""

    async def settle_shielded(self, batch: Batch, results: Sequence[Result]) -> int: ...


class Deliveries(Protocol):
    """One claim on its way (kafka/delivery.py, kafka/exactly_once/publisher.py): its parts as the
    broker answers, the final one last."""

    records: Sequence[OutboxRecord]

    @property
    def parked(self) -> bool: ...
    def __aiter__(self) -> AsyncGenerator[Part, None]: ...
    def not_settled(self) -> list[int]: ...
    def outcomes(self, *, stopped: BaseException) -> list[BaseException | None]: ...
    def unsettled(self) -> list[int]: ...


class Publishing(Protocol):
    """What a batch run publishes through: KafkaPublisher (at-least-once) or
    TransactionalPublisher (exactly-once)."""

    def publish(
        self,
        records: Sequence[OutboxRecord],
        heartbeat: Callable[[], None],
        claimed_at: float | None = None,
    ) -> Any: ...
    async def abandon(self, delivery: Any, reason: str) -> None: ...
    async def reachable(self, seconds: float = 5.0) -> bool: ...
    def marked(self, delivery: Any, *, every_row: bool, final: bool = True) -> None: ...


class Settling:
    """What every batch of a dispatcher settles through: its retry policy (the outage streak is
    the dispatcher's), its settler, its metrics and logs, and its count of published rows."""

    def __init__(self, settler: Settles, retry_policy: RetryPolicy, metrics: OutboxMetrics) -> None:
        self.settler = settler
        self.retry_policy = retry_policy
        self.metrics = metrics
        self.published = 0

    async def settle(
        self,
        batch: Batch,
        outcomes: Sequence[BaseException | None],
        claimed_at: float,
        acked_at: float,
        *,
        early: bool = False,
    ) -> tuple[list[Result], int]:
        """Settle (part of) a batch, then its metrics and logs; its results, and how many of its
        rows the settle changed (the others were no longer ours)."""
        m = self.metrics
        records = batch.records
        loop = asyncio.get_running_loop()
        m.publish_duration.observe(loop.time() - claimed_at)
        results = self.retry_policy.results(records, outcomes)
        started = loop.time()
        settled = await self.settler.settle_shielded(batch, results)
        m.mark_duration.observe(loop.time() - started)
        published = sum(1 for o in outcomes if o is None)
        self.published += published
        if settled:
            m.record_batch(records, results, acked_at)
        log_failures(records, results)
        log.debug(
            "batch_settled",
            rows=len(records),
            published=published,
            settled=settled,
            early=early,
            reclaimed=sum(r.reclaimed for r in records),
            duration_ms=round((loop.time() - claimed_at) * 1000, 1),
            first_id=records[0].id,
            last_id=records[-1].id,
        )
        return results, settled

    async def settle_stopped(self, batch: Batch, outcomes: Sequence[BaseException | None]) -> None:
        """The rows of a run cancelled at shutdown: marked or given back, nothing else."""
        await self.settler.settle_shielded(
            batch, self.retry_policy.results(batch.records, outcomes)
        )


class BatchRun:
    def __init__(
        self,
        batch: Batch,
        publisher: Publishing,
        settling: Settling,
        in_flight: InFlight,
        heartbeat: Callable[[], None] = lambda: None,
        stalled: asyncio.Event | None = None,
        claimed_at: float | None = None,
    ) -> None:
        self.batch = batch
        # claimed_at: when the claim began (the loop's clock; exactly-once sends it only with a
        # producer that served before then: kafka/exactly_once/publisher.py).
        self.delivery: Deliveries = publisher.publish(batch.records, heartbeat, claimed_at)
        self._publisher = publisher
        self._settling = settling
        self._in_flight = in_flight
        self._stalled = asyncio.Event() if stalled is None else stalled
        self._claimed_at = 0.0
        self._transient = False  # an early part met an outage: pause before the next claim

    @property
    def parked(self) -> bool:
        """It waits only for requests in flight that the broker refuses for now."""
        return self.delivery.parked

    async def run(self) -> float:
        """Publish the batch and settle it; returns how long to pause for a broker outage."""
        batch = self.batch
        self._in_flight.add(batch.token, [r.id for r in batch.records])
        self._claimed_at = asyncio.get_running_loop().time()
        try:
            try:
                final = await self._settle_parts()
            except asyncio.CancelledError:
                await self._stopped()
                raise
            rest = self._rows(final)
            results: list[Result] = []
            if rest.records:
                results, changed = await self._settling.settle(
                    rest, final.outcomes, self._claimed_at, time.time()
                )
                self._publisher.marked(self.delivery, every_row=changed == len(rest.records))
        finally:
            self._in_flight.discard(batch.token)
        if self._transient or any(res.failure is Failure.TRANSIENT for res in results):
            return self._settling.retry_policy.outage_delay()
        return 0.0

    async def _settle_parts(self) -> Part:
        """Settle each part before the final one as it comes; returns the final one."""
        final: Part | None = None
        async with aclosing(aiter(self.delivery)) as parts:
            async for part in parts:
                if part.final:
                    final = part
                else:
                    await self._settle_early(part)
        assert final is not None  # noqa: S101 (a delivery always ends with its final part)
        return final

    async def _settle_early(self, part: Part) -> None:
        batch = self.batch
        if part.indices:
            rows = self._rows(part)
            results, changed = await self._settling.settle(
                rows, part.outcomes, self._claimed_at, time.time(), early=True
            )
            self._publisher.marked(
                self.delivery, every_row=changed == len(rows.records), final=False
            )
            self._transient = self._transient or any(
                res.failure is Failure.TRANSIENT for res in results
            )
            waiting = set(self.delivery.not_settled())
            self._in_flight.add(
                batch.token, [r.id for i, r in enumerate(batch.records) if i in waiting]
            )
        if not self._stalled.is_set() and (part.indices or await self._publisher.reachable(1.0)):
            self._stalled.set()

    async def _stopped(self) -> None:
        """Shutdown past the grace period: close the producer first (bounded), so that no copy
        of a row given back can still be delivered by it after another dispatcher re-claimed
        the row; then mark what was acknowledged, give back the rest (never what a part already
        settled: review N12)."""
        delivery = self.delivery
        await self._publisher.abandon(delivery, "the dispatcher stopped")
        outcomes = delivery.outcomes(stopped=errors.NotAttempted("dispatcher shut down"))
        rest = delivery.unsettled()
        if rest:
            await self._settling.settle_stopped(
                self._rows(Part(rest, [])), [outcomes[i] for i in rest]
            )

    def _rows(self, part: Part) -> Batch:
        # The delivery's records: the batch's, and in exactly-once the rows a lost claim
        # committed beyond a takeover's batch (kafka/exactly_once/publisher.py adopts them).
        records = self.delivery.records
        return Batch(self.batch.token, [records[i] for i in part.indices], steady=self.batch.steady)


def log_failures(records: list[OutboxRecord], results: list[Result]) -> None:
    """One line per dead-lettered row (each needs an operator's eye); one line per reason for
    rows that will be retried, so that an outage does not flood the log."""
    retried: dict[str, list[OutboxRecord]] = defaultdict(list)
    for record, result in zip(records, results, strict=True):
        if result.outcome is Outcome.DEAD:
            log.error(
                "dead_lettered",
                id=record.id,
                event_id=str(record.event_id),
                topic=record.topic,
                ordering_key=record.ordering_key,
                attempts=record.attempts + int(result.counted),
                reason=result.error,
            )
        elif result.error:
            retried[result.error].append(record)
    for reason, failed in retried.items():
        log.warning(
            "publish_failed_will_retry",
            rows=len(failed),
            reason=reason,
            topics=sorted({r.topic or "(routed)" for r in failed}),
            first_event_ids=[str(r.event_id) for r in failed[:3]],
        )
