"""A claim slot holds a claim only; the claimed batch's publish and settle run on their own
(dispatch/slots.py), bounded by the budget of batches in flight whose last grants are kept for
outboxes with nothing in flight (sources/fairness.py). Against scripted outboxes
(tests/unit/scripted_outboxes.py): runs held on a gate where a test wants them."""

from __future__ import annotations

import asyncio
import time
from typing import cast

from outbox_dispatcher.config.outboxes import Source
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.fleet import FleetDispatcher
from outbox_dispatcher.dispatch.outboxes import OutboxRuntime

from .scripted_outboxes import BATCH, URL, Scripted, serving, slots_of, until


def held(outbox: Scripted) -> Scripted:
    """Its runs wait until the test opens its run gate."""
    outbox.run_gate.clear()
    outbox.announced = 1  # announced already: a drained claim does not claim once more
    return outbox


async def test_a_slot_claims_for_others_while_batches_are_on_their_way() -> None:
    """Two slots, two outboxes whose batches wait for the broker: a third outbox is claimed and
    its batch settled meanwhile (a slot that held its batch to the settle left it waiting)."""
    a, b = held(Scripted("tenant_a", [0, 1])), held(Scripted("tenant_b", [0, 1]))
    c = held(Scripted("tenant_c", [0, 1]))
    c.run_gate.set()
    slots = slots_of(a, b, c, budget=8)
    async with serving(slots, count=2):
        await until(lambda: a.turns == b.turns == c.turns == 1)  # each looked at once, served
        slots.wake(a.key)
        slots.wake(b.key)
        await until(lambda: a.runs == 1 and b.runs == 1)
        slots.wake(c.key)
        await until(lambda: c.settled == 1)
        assert (a.settled, b.settled) == (0, 0)
        assert slots.runs == 2
        a.run_gate.set()
        b.run_gate.set()
        await until(lambda: slots.runs == 0)
    assert slots.scheduler.in_flight == 0


async def test_the_budget_bounds_batches_in_flight_and_keeps_the_reserve_for_others() -> None:
    """Budget 3, one slot (reserve 1): a backlog gets two batches in flight, not the third;
    a woken quiet outbox gets the reserved one; a second quiet one waits for a settle."""
    backlog = held(Scripted("tenant_big", [0] + [BATCH] * 1000))
    quiet = held(Scripted("tenant_quiet", [0, 1]))
    other = held(Scripted("tenant_other", [0, 1]))
    other.run_gate.set()
    slots = slots_of(backlog, quiet, other, budget=3, claims=1)
    async with serving(slots, count=1):
        await until(lambda: backlog.turns == quiet.turns == other.turns == 1)
        slots.wake(backlog.key)
        await until(lambda: backlog.runs == 2)
        slots.wake(quiet.key)
        await until(lambda: quiet.runs == 1)
        slots.wake(other.key)
        await asyncio.sleep(0.05)
        assert (backlog.turns, backlog.runs) == (3, 2)  # the reserve is not the backlog's
        assert other.turns == 1  # the budget is spent: three batches in flight
        assert slots.scheduler.in_flight == 3
        quiet.run_gate.set()  # a settle gives a grant back
        await until(lambda: other.settled == 1)
        assert backlog.runs == 2
        backlog.run_gate.set()
        await until(lambda: backlog.settled >= 10)


async def test_a_notification_during_a_run_brings_a_claim_now_and_one_after_its_settle() -> None:
    """Its row may be of another key (claimed at once) or of a key the batch holds (passed
    over by that claim, taken by the one after the settle)."""
    outbox = held(Scripted("tenant_a", [0, 1, 0, 0, 0]))
    slots = slots_of(outbox, budget=4, claims=1)
    async with serving(slots, count=1):
        await until(lambda: outbox.turns == 1)  # looked at once when served
        slots.wake(outbox.key)
        await until(lambda: outbox.runs == 1)
        slots.wake(outbox.key)  # notified while its batch is on its way
        await until(lambda: outbox.turns == 3)  # claimed at once: nothing (its key is held)
        await asyncio.sleep(0.05)
        assert outbox.turns == 3  # and not again until the batch is settled
        outbox.run_gate.set()
        await until(lambda: outbox.turns == 4)
        await asyncio.sleep(0.05)
    assert outbox.turns == 4


async def test_a_failing_run_backs_its_outbox_off_alone() -> None:
    """A run that fails (its table dropped under the settle) backs its outbox off, as a
    failing claim does; the other outbox is served meanwhile."""
    failing = Scripted("tenant_bad", [BATCH] * 1000, runs_fail=True)
    healthy = Scripted("tenant_ok", [BATCH] * 60)
    slots = slots_of(failing, healthy, budget=4)
    async with serving(slots):
        slots.wake(failing.key)
        slots.wake(healthy.key)
        await until(lambda: healthy.settled >= 60)
    assert failing.turns < 15, "a failing outbox waits out its backoff, not a claim per grant"


async def test_a_broker_outage_pauses_every_grant_but_not_the_settles() -> None:
    """A run that met an outage pauses the grants for every outbox; a batch already on its way
    is still settled meanwhile."""
    failing = held(Scripted("tenant_a", [0, 1], outage=30.0))
    failing.run_gate.set()
    on_its_way = held(Scripted("tenant_b", [0, 1]))
    later = held(Scripted("tenant_c", [0, 1]))
    slots = slots_of(failing, on_its_way, later, budget=4)
    async with serving(slots):
        await until(lambda: failing.turns == on_its_way.turns == later.turns == 1)
        slots.wake(on_its_way.key)
        await until(lambda: on_its_way.runs == 1)
        slots.wake(failing.key)
        await until(lambda: failing.settled == 1)
        await until(lambda: slots.scheduler.in_flight == 1)  # the outage run gave its grant back
        slots.wake(later.key)
        on_its_way.run_gate.set()
        await until(lambda: on_its_way.settled == 1)
        await asyncio.sleep(0.05)
        assert later.turns == 1  # paused: the broker is away
        assert later.key in slots.scheduler.active  # (the scheduler itself would grant it)
        assert slots._paused_until > time.monotonic()


async def test_shutdown_waits_for_the_batches_on_their_way_within_the_grace() -> None:
    outbox = held(Scripted("tenant_a", [1]))
    settings = Settings(shutdown_grace_seconds=30.0)
    fleet = FleetDispatcher(settings, [Source(URL, "tenant_*", "outbox")])
    fleet.slots.add(cast(OutboxRuntime, outbox))
    claims = [asyncio.create_task(fleet.slots.serve("claim-0", 0.01))]
    await until(lambda: outbox.runs == 1)
    fleet.stop()
    shutdown = asyncio.create_task(fleet._shutdown(claims))
    await until(lambda: all(task.done() for task in claims))  # no more claims
    await asyncio.sleep(0.05)
    assert not shutdown.done()  # the batch on its way is waited for
    outbox.run_gate.set()
    await asyncio.wait_for(shutdown, 5)
    assert (outbox.settled, outbox.cancelled) == (1, 0)
    assert fleet.slots.scheduler.in_flight == 0


async def test_shutdown_cancels_the_batches_still_on_their_way_after_the_grace() -> None:
    outbox = held(Scripted("tenant_a", [1]))
    slots = slots_of(outbox)
    async with serving(slots, count=1):
        await until(lambda: outbox.runs == 1)
    assert outbox.cancelled == 1  # serving's finish(0): the grace is over
    assert slots.scheduler.in_flight == 0
    assert slots.runs == 0
