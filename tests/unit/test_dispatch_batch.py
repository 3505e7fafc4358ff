"""One batch's run in the dispatcher (Dispatcher._process) against fakes of the publisher and
the settler: what is settled, and how often, when the run is cancelled."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime

from outbox_dispatcher.dispatcher import Dispatcher
from outbox_dispatcher.models import Batch, OutboxRecord, Result
from outbox_dispatcher.publisher import KafkaPublisher, Sent
from outbox_dispatcher.settings import Settings


def rec(i: int, key: str) -> OutboxRecord:
    return OutboxRecord(i, "t", key, b"x", {}, uuid.uuid4(), datetime.now(UTC), 0, False)


class OneKeyAnswered:
    """Acknowledges the first record, then waits for ever on the second: the early settle runs
    for the first key."""

    outcomes = staticmethod(KafkaPublisher.outcomes)

    def __init__(self) -> None:
        self.abandoned = False

    async def publish(
        self,
        records: Sequence[OutboxRecord],
        sent: Sent,
        heartbeat: Callable[[], None],
        early: Callable[[], Awaitable[None]],
    ) -> list[BaseException | None]:
        loop = asyncio.get_running_loop()
        acked: asyncio.Future[object] = loop.create_future()
        acked.set_result("metadata")
        sent.futures = [acked, loop.create_future()]
        await early()
        await asyncio.Event().wait()
        raise AssertionError  # never

    async def abandon(self, sent: Sent, reason: str) -> None:
        self.abandoned = True
        for future in sent.futures:
            if isinstance(future, asyncio.Future) and not future.done():
                future.cancel()

    async def broker_reachable(self, seconds: float = 5.0) -> bool:
        return True


class SlowSettler:
    """Records each settle; the first one takes a while (a cancel lands during it)."""

    def __init__(self) -> None:
        self.settled: list[list[int]] = []
        self.first_started = asyncio.Event()

    async def settle_shielded(self, batch: Batch, results: Sequence[Result]) -> int:
        self.settled.append([r.id for r in batch.records])
        if len(self.settled) == 1:
            self.first_started.set()
            await asyncio.shield(asyncio.sleep(0.2))
        return len(batch.records)


async def test_a_cancel_during_an_early_settle_settles_no_row_twice() -> None:
    """Review N12: a shutdown cancel that landed while an early settle ran let the shielded
    settle finish but skipped noting its rows, so the cancel path settled them a second time
    (0 rows changed: a false `lease_lost` for rows that were published)."""
    dispatcher = Dispatcher(Settings())
    publisher, settler = OneKeyAnswered(), SlowSettler()
    batch = Batch(uuid.uuid4(), [rec(1, "a"), rec(2, "b")])
    run = asyncio.ensure_future(
        dispatcher._process(batch, publisher, settler)  # type: ignore[arg-type]
    )
    await asyncio.wait_for(settler.first_started.wait(), 5)
    run.cancel()
    await asyncio.wait({run}, timeout=5)
    assert run.cancelled()
    assert publisher.abandoned
    assert settler.settled == [[1], [2]], "row 1 early, row 2 by the cancel path, once each"
