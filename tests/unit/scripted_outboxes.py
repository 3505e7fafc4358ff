"""Scripted outboxes for the claim slots' unit tests (dispatch/slots.py): our own seam,
OutboxRuntime's claim, run and idle, with gates to hold a claim or a run where a test wants it."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

from pydantic import SecretStr

from outbox_dispatcher.config.outboxes import Outbox, Source
from outbox_dispatcher.dispatch.outboxes import Claim, OutboxRuntime, Ran, key_of
from outbox_dispatcher.dispatch.slots import ClaimSlots
from outbox_dispatcher.health import Heartbeats
from outbox_dispatcher.models import Batch

BATCH = 10
ORDER: list[str] = []  # the schemas of the claims taken, in order
URL = SecretStr("postgresql://u:p@db:5432/app")


@dataclass
class Scripted:
    """An outbox whose claims return the rows of `script` in order (then 0); a negative entry
    is a failure of the outbox (retry_in set). A partial batch's claim saw nothing left after it
    (drained, as the steady claim says) unless `more_after_partial`. Its runs wait for
    `run_gate`, then end with `outage` (a broker outage) or, with `runs_fail`, a failure of the
    outbox."""

    schema: str
    script: list[int]
    weight: int = 1
    turns: int = 0  # claims
    announced: int = 0
    more_after_partial: bool = False
    outage: float = 0.0
    runs_fail: bool = False
    runs: int = 0  # runs started
    settled: int = 0  # runs ended (not cancelled)
    cancelled: int = 0  # runs cancelled
    gate: asyncio.Event = field(default_factory=asyncio.Event)  # holds its claims
    run_gate: asyncio.Event = field(default_factory=asyncio.Event)  # holds its runs

    def __post_init__(self) -> None:
        self.outbox = Outbox(Source(URL, "tenant_*", "outbox", weight=self.weight), self.schema)
        self.key = key_of(self.outbox)
        self.label = self.outbox.label
        self.gate.set()
        self.run_gate.set()

    async def claim(self) -> Claim:
        await self.gate.wait()
        await asyncio.sleep(0)  # a real claim waits for the database
        ORDER.append(self.schema)
        rows = self.script[self.turns] if self.turns < len(self.script) else 0
        self.turns += 1
        if rows < 0:
            return Claim(retry_in=0.05)
        if rows == 0:
            return Claim()
        batch = Batch(uuid.uuid4(), [cast(Any, None)] * rows)
        drained = rows < BATCH and not self.more_after_partial
        return Claim(batch, 0.0, rows >= BATCH, drained)

    async def run(self, claim: Claim, heartbeat: Any) -> Ran:
        self.runs += 1
        heartbeat()
        try:
            await self.run_gate.wait()
            await asyncio.sleep(0)  # a real run waits for the broker and the database
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.settled += 1
        return Ran(retry_in=0.05) if self.runs_fail else Ran(self.outage)

    async def idle(self) -> bool:
        self.announced += 1
        return self.announced == 1  # the first announcement is fresh: claim once more


@contextlib.asynccontextmanager
async def serving(slots: ClaimSlots, count: int = 2) -> AsyncIterator[list[asyncio.Task[None]]]:
    """`count` slot loops until the block ends (then stopped, and the runs finished)."""
    stopping = slots._stopping
    tasks = [asyncio.create_task(slots.serve(f"claim-{i}", 0.01)) for i in range(count)]
    try:
        yield tasks
    finally:
        stopping.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        await slots.finish(0.0)


def slots_of(*outboxes: Scripted, budget: int = 2, claims: int = 2) -> ClaimSlots:
    slots = ClaimSlots(budget, BATCH, asyncio.Event(), Heartbeats(60), claims=claims)
    for outbox in outboxes:
        slots.add(cast(OutboxRuntime, outbox))
    return slots


async def until(check: Any, seconds: float = 5.0) -> None:
    async with asyncio.timeout(seconds):
        while not check():  # noqa: ASYNC110 - polls a fake's counters, no event to wait on
            await asyncio.sleep(0.005)
