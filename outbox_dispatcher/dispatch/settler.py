"""Records the outcome of a published batch and releases its keys: one statement, fenced by the
lease token."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass

import structlog

from outbox_dispatcher.models import PUBLISHED, Batch, Result
from outbox_dispatcher.store import DispatchStore, db
from outbox_dispatcher.store.arguments import SettleArguments

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class Settler:
    store: DispatchStore
    retry_for: float  # how long a settle retries while the database is away
    _: KW_ONLY
    delete_on_publish: bool = False
    # dead_letter_policy = block: a key with a dead row stays blocked after this settle.
    block_on_dead: bool = False
    # Who claims (lease_owner): tells a mark whose reply was lost from a lease another
    # dispatcher took over. None: every shortfall is reported as a lost lease.
    owner: str | None = None

    def arguments(self, batch: Batch, results: Sequence[Result]) -> SettleArguments:
        """The settle's parameters: each row's outcome and key (the work the batch holds)."""
        records = batch.records
        outcomes, errors, delays, counted = _columns(results)
        return SettleArguments(
            token=batch.token,
            owner=self.owner or "",
            ids=[r.id for r in records],
            keys=[r.ordering_key for r in records],
            outcomes=outcomes,
            errors=errors,
            delays=delays,
            counted=counted,
            delete_published=self.delete_on_publish,
            block_on_dead=self.block_on_dead,
            steady=batch.steady,
        )

    async def settle(self, batch: Batch, results: Sequence[Result]) -> int:
        """Write every result in one statement; returns how many rows were still ours. Retries
        while the database is briefly away: a mark that never lands means a re-publish, not a
        loss."""
        arguments = self.arguments(batch, results)
        rows = len(batch.records)
        executed = await self._execute(arguments, rows)
        if executed is None:
            return 0  # settle_failed said what happens; the lease was not lost
        ids, retried = executed
        changed = len(ids)
        if changed < rows and retried and self.owner is not None:
            changed += await self._settled_before(batch, results, set(ids), self.owner)
        if changed < rows:
            log.warning(
                "lease_lost",
                rows=rows - changed,
                consequence=(
                    "another dispatcher took these rows over after the lease expired; they are "
                    "published again with the same event id"
                ),
            )
        return changed

    async def _settled_before(
        self, batch: Batch, results: Sequence[Result], changed: set[int], owner: str
    ) -> int:
        """Rows an earlier, unanswered attempt of this mark settled. It may have committed with
        its reply lost (review F13): its rows no longer carry the token, so the retry changed
        nothing, and they are not lost; rows that show this mark's outcome, last leased by this
        dispatcher, with the attempts this mark set, are those."""
        missed = [
            (r, res) for r, res in zip(batch.records, results, strict=True) if r.id not in changed
        ]
        try:
            found = await self.store.already_settled(
                ids=[r.id for r, _ in missed],
                owner=owner,
                outcomes=[res.outcome.value for _, res in missed],
                attempts=[r.attempts + int(res.counted) for r, res in missed],
                delete_published=self.delete_on_publish,
            )
        except db.RETRIABLE_ERRORS as exc:
            log.warning("settle_check_failed", rows=len(missed), error=repr(exc))
            return 0
        if found:
            log.info(
                "settle_reply_lost",
                rows=found,
                consequence="an earlier attempt of this mark committed; nothing is published again",
            )
        return found

    async def _execute(
        self, arguments: SettleArguments, rows: int
    ) -> tuple[list[int], bool] | None:
        """The ids changed, and whether an earlier try failed without an answer (it may have
        committed); None if the database stayed away past the retry window."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_for
        pause = 0.1
        retried = False
        while True:
            try:
                return await self.store.settle(**arguments), retried
            except db.RETRIABLE_ERRORS as exc:
                if loop.time() + pause > deadline:
                    log.error(
                        "settle_failed",
                        rows=rows,
                        error=repr(exc),
                        consequence="the leases will expire and the rows be published again",
                    )
                    return None
                log.warning("settle_retrying", rows=rows, error=repr(exc))
                retried = True
                await asyncio.sleep(pause)
                pause = min(pause * 2, 2.0)

    async def settle_shielded(self, batch: Batch, results: Sequence[Result]) -> int:
        """Settle even if the caller is cancelled: a dropped mark after an ack is a duplicate."""
        task = asyncio.ensure_future(self.settle(batch, results))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await task
            raise


def _columns(
    results: Sequence[Result],
) -> tuple[list[str], list[str | None], list[float], list[int]]:
    """The results as the settle's four columns: outcome, error, retry delay, counted."""
    n = len(results)
    if all(res is PUBLISHED for res in results):  # the common case: one pass, not four
        return [PUBLISHED.outcome.value] * n, [None] * n, [0.0] * n, [0] * n
    return (
        [res.outcome.value for res in results],
        [res.error for res in results],
        [res.delay for res in results],
        [int(res.counted) for res in results],
    )
