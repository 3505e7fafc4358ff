"""Claims batches of pending rows: one claim statement, its key count fitted to the backlog."""

from __future__ import annotations

import time
import uuid

import structlog

from outbox_dispatcher.config.settings import DeadLetterPolicy, DeliveryMode, Settings
from outbox_dispatcher.models import Batch, OutboxRecord, work_keys
from outbox_dispatcher.store import DispatchStore, OutOfMemoryError, Row, db
from outbox_dispatcher.store.arguments import ClaimArguments

log = structlog.get_logger(__name__)


class Claimer:
    """Leases batches through the claim function; keeps the claim's key count fitted to how many
    rows a key has waiting, and gives back what a claim with a lost reply may have leased."""

    def __init__(self, store: DispatchStore, settings: Settings, owner: str) -> None:
        self._store = store
        s = settings
        self._limit = s.batch_size
        self._owner = owner
        self._lease = s.lease_seconds
        self._block = s.dead_letter_policy is DeadLetterPolicy.BLOCK
        self._max_attempts = s.max_attempts
        # exactly-once reads the progress of a key whose lease expired (the reconcile duty, kept
        # in its work row until then); at-least-once has nothing to read and clears it at once.
        self._clears_duty = s.delivery is DeliveryMode.AT_LEAST_ONCE
        # Keys asked for per claim, fitted by _fit: batch_size while keys are shallow, a few under
        # a backlog of deep keys (one hot key: one).
        self._max_keys = s.batch_size
        # New rows a claim looks at (when it holds the discovery cursor): twice a batch, so that
        # under a backlog of few keys the rows past this batch's keys are registered as work.
        self._scan = max(2 * s.batch_size, 100)
        # Tokens of claims that may have committed although their reply never arrived, each
        # until its lease could have expired (review N14: a claim still running on the server
        # commits after the first release found nothing).
        self._unsure: list[tuple[uuid.UUID, float]] = []

    async def claim(self) -> Batch | None:
        """Lease up to batch_size rows; one round trip, one short transaction."""
        if self._unsure:
            await self._release_unsure()
        token = uuid.uuid4()
        try:
            rows = await self._store.claim(**self.arguments(token))
        except OutOfMemoryError as exc:
            # The lock table or memory of the server is short: ask for fewer keys next time
            # rather than die and restart into the same state.
            self._max_keys = max(1, self._max_keys // 2)
            log.warning("claim_shrunk", error=repr(exc), max_keys=self._max_keys)
            return None
        except db.RETRIABLE_ERRORS:
            self._unsure.append((token, time.monotonic() + self._lease))
            raise
        if not rows:
            self._max_keys = self._limit  # the next rows may be anyone's
            return None
        self._fit(rows)
        records = list(map(OutboxRecord.from_row, rows))
        if self._clears_duty and any(r.reclaimed for r in records):
            await self._clear_duty([r for r in records if r.reclaimed])
        return Batch(token, records, drained=rows.drained, steady=rows.steady)

    async def _clear_duty(self, records: list[OutboxRecord]) -> None:
        """At-least-once: the keys taken over need no progress read; without this their later
        claims would keep returning their rows as reclaimed (outbox_lease_reclaims_total)."""
        keys = work_keys(records)
        try:
            await self._store.reconciled(
                owner=self._owner, keys=[k for k, _ in keys], keyless=[kl for _, kl in keys]
            )
        except db.RETRIABLE_ERRORS as exc:  # only the metric overcounts until the next takeover
            log.debug("reconcile_duty_kept", keys=len(keys), error=repr(exc))

    def arguments(self, token: uuid.UUID) -> ClaimArguments:
        """The claim's parameters for a claim under `token`."""
        return ClaimArguments(
            limit=self._limit,
            max_keys=self._max_keys,
            owner=self._owner,
            lease_seconds=self._lease,
            token=token,
            block_on_dead=self._block,
            max_attempts=self._max_attempts,
            scan=self._scan,
        )

    def _fit(self, rows: list[Row]) -> None:
        """Keys for the next claim. A full batch means its keys had at least their share of the
        batch each: ask for half as many (deeper runs, fewer keys to lease and release per row);
        a batch that is not full asks for twice as many (keys are shallow, or work is scarce)."""
        if len(rows) >= self._limit:
            keys = len({row["ordering_key"] for row in rows if row["ordering_key"] is not None})
            self._max_keys = max(1, min(self._max_keys, keys) // 2)
        else:
            self._max_keys = min(self._limit, self._max_keys * 2)

    async def _release_unsure(self) -> None:
        """Give back what claims with a lost reply may hold. A token whose release found nothing
        is tried again at every claim until its lease could have expired: the claim may still be
        running on the server. The claim loops share this claimer: each takes the tokens it
        releases, and puts back those it could not."""
        tokens, self._unsure = self._unsure, []
        now = time.monotonic()
        for i, (token, until) in enumerate(tokens):
            try:
                rows = await self._store.release_claim(token=token)
            except BaseException:
                self._unsure.extend(tokens[i:])
                raise
            if rows:
                log.info("lost_claim_released", rows=rows, token=str(token))
            elif until > now:
                self._unsure.append((token, until))
