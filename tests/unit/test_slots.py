"""The claim slots shared by many outboxes (dispatch/slots.py) against scripted outboxes (our
own seam: OutboxRuntime's claim, run and idle; tests/unit/scripted_outboxes.py), and the
connection budget's split. The batches' runs apart from the slots: test_slots_pipeline.py."""

from __future__ import annotations

import asyncio
import functools
from typing import Any, cast

import asyncpg
import pytest

from outbox_dispatcher import errors
from outbox_dispatcher.config.outboxes import Outbox, Source
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.databases import pool_size_of
from outbox_dispatcher.dispatch.outboxes import OutboxRuntime, Shared
from outbox_dispatcher.metrics import Metrics
from outbox_dispatcher.retries import RetryPolicy
from outbox_dispatcher.store import listen

from .scripted_outboxes import BATCH, ORDER, URL, Scripted, serving, slots_of, until


async def test_a_backlog_is_claimed_while_full_then_idles_after_one_more_claim() -> None:
    busy = Scripted("tenant_a", [BATCH, BATCH, BATCH, 3])
    slots = slots_of(busy)
    async with serving(slots):
        await until(lambda: busy.announced >= 2)
        settled = busy.turns
        await asyncio.sleep(0.2)
        # idle: no slot claims it again (two slots must not wake each other for ever)
        assert busy.turns == settled
    # the script's four claims, one empty claim after the fresh announcement, and at most one
    # empty claim of the other slot that ran beside the last
    assert 5 <= busy.turns <= 6
    assert slots.scheduler.active == []


async def test_a_partial_batch_whose_claim_saw_more_is_followed_by_a_claim_at_once() -> None:
    """A claim function's batch under a backlog can be partial (each key's share, keys another
    claim holds) without the backlog being over: the outbox stays active, as a claim loop claims
    again, instead of waiting for a poll (a 200k-row drain beside idle tenants ran at 1.6k/s)."""
    busy = Scripted("tenant_a", [3, 3, 3, 3], more_after_partial=True)
    slots = slots_of(busy)
    async with serving(slots):
        await until(lambda: busy.turns >= 5)  # the four, then the empty claim that ends it
    assert busy.turns >= 5


async def test_a_quiet_outbox_is_claimed_while_another_has_a_backlog() -> None:
    ORDER.clear()
    endless = Scripted("tenant_big", [BATCH] * 10_000)
    slots = slots_of(endless)
    async with serving(slots):
        await until(lambda: endless.turns >= 20)
        quiet = Scripted("tenant_quiet", [2])
        at = len(ORDER)
        slots.add(cast(OutboxRuntime, quiet))  # served (claimed once, in the lane of polls)
        slots.wake(quiet.key)  # and notified while the backlog drains
        await until(lambda: quiet.turns >= 1)
    # the quiet one is claimed within a round of the ring (two slots: at most one claim of the
    # backlog started before it, and one in flight)
    assert ORDER.index("tenant_quiet") - at <= 2, ORDER[at - 2 : at + 10]


async def test_a_notified_outbox_goes_before_the_polls_of_idle_ones() -> None:
    """500 idle tenants polled at once (the fallback for lost notifications) queue behind
    nothing: a quiet tenant notified meanwhile takes the next free slot (the polls wait in the
    scheduler's lane of their own)."""
    ORDER.clear()
    idle = [Scripted(f"tenant_{i:03d}", []) for i in range(60)]
    for outbox in idle:
        outbox.announced = 1  # announced already: a poll that finds nothing does not re-claim
    quiet = Scripted("tenant_quiet", [1])
    quiet.announced = 1
    slots = slots_of(*idle, quiet)
    async with serving(slots):
        await until(lambda: sum(o.turns for o in idle) >= 60)  # the first claim of each (add)
        ORDER.clear()
        slots.poll(slots.idle())
        slots.wake(quiet.key)
        await until(lambda: quiet.turns >= 1)
        await until(lambda: sum(o.turns for o in idle) >= 120)
    assert ORDER.index("tenant_quiet") <= 2, ORDER[:6]


async def test_outboxes_served_at_once_do_not_hold_up_a_notified_one() -> None:
    """60 outboxes served at once (a process's start, a registry read) are each claimed once,
    but after a quiet tenant notified meanwhile, which takes one of the next free slots."""
    ORDER.clear()
    quiet = Scripted("tenant_quiet", [1])
    quiet.announced = 1  # announced already: its drained claim does not claim once more
    slots = slots_of(quiet)
    new = [Scripted(f"tenant_{i:03d}", []) for i in range(60)]
    async with serving(slots):
        await until(lambda: quiet.turns >= 1)
        ORDER.clear()
        for outbox in new:
            slots.add(cast(OutboxRuntime, outbox))
        slots.wake(quiet.key)
        await until(lambda: quiet.turns >= 2)
        await until(lambda: all(o.turns >= 1 for o in new))
    assert ORDER.index("tenant_quiet") <= 2, ORDER[:6]


async def test_a_failing_outbox_backs_off_alone() -> None:
    failing = Scripted("tenant_bad", [-1] * 1000)
    healthy = Scripted("tenant_ok", [BATCH] * 50)
    slots = slots_of(failing, healthy)
    async with serving(slots):
        await until(lambda: healthy.turns >= 50)
    assert failing.turns < 10, "a failing outbox waits out its backoff, not a claim per slot"


async def test_a_notification_during_its_claim_brings_one_more_claim() -> None:
    outbox = Scripted("tenant_a", [2, 0])
    outbox.announced = 1  # announced already: its next idle() is not fresh
    slots = slots_of(outbox)
    outbox.gate.clear()
    async with serving(slots, count=1):
        await until(lambda: slots.scheduler.flows[outbox.key].in_flight == 1)
        slots.wake(outbox.key)  # a notification while its claim runs
        outbox.gate.set()
        await until(lambda: outbox.turns >= 2)


async def test_an_outbox_let_go_during_its_claim_is_never_granted_again() -> None:
    outbox = Scripted("tenant_a", [BATCH] * 100)
    slots = slots_of(outbox)
    outbox.gate.clear()
    async with serving(slots, count=1):
        await until(lambda: slots.scheduler.in_flight == 1)
        slots.forget(outbox.key)
        outbox.gate.set()
        await until(lambda: slots.scheduler.in_flight == 0)
        slots.wake(outbox.key)  # a late notification for it: ignored
        await asyncio.sleep(0.05)
    assert outbox.turns == 1


def test_the_connection_budget_is_split_between_databases() -> None:
    settings = Settings(max_connections=10, claim_tasks=2)
    assert pool_size_of(settings, 1) == 4  # pool_size: claim_tasks + 2, under 10 - 1 - 3
    # membership 1; 4 each: discovery, the idle probe, LISTEN, 1 pooled
    assert pool_size_of(settings, 2) == 1
    assert pool_size_of(Settings(max_connections=0), 7) == Settings().effective_pool_size
    with pytest.raises(errors.ConfigurationError, match="OUTBOX_MAX_CONNECTIONS=10 is too few"):
        pool_size_of(settings, 4)


def test_a_database_listen_channels_route_each_notification_to_its_outbox() -> None:
    woken: list[str] = []
    channels = listen.Channels("db:5432/app")
    channels.set({"tenant_a.outbox": lambda: woken.append("a")})
    assert channels.changed.is_set()
    channels.changed.clear()
    channels.set({"tenant_a.outbox": lambda: woken.append("a2")})  # same channels: no change
    assert not channels.changed.is_set()
    channels.set(
        {"tenant_a.outbox": lambda: woken.append("a"), "b.outbox": lambda: woken.append("b")}
    )
    assert channels.changed.is_set()
    channels.wake(None, 1, "b.outbox", "")
    channels.wake(None, 1, "gone.outbox", "")  # an outbox let go: nothing
    channels.wake(None, 1, "tenant_a.outbox", "")
    assert woken == ["b", "a"]


class DroppedTable:
    """A connection to a database whose outbox schema was just dropped."""

    async def fetch(self, query: str, *args: object) -> list[object]:
        raise asyncpg.UndefinedTableError("relation does not exist")


async def test_a_table_dropped_under_an_outbox_is_its_failure_never_the_process() -> None:
    settings = Settings(backoff_initial_seconds=0.1)
    shared = Shared(settings, "me", cast(Any, None), Metrics(), RetryPolicy(settings), 2.0)
    outbox = Outbox(Source(URL, "tenant_*", "outbox"), "tenant_gone")
    runtime = OutboxRuntime(outbox, cast(Any, DroppedTable()), 16, shared)
    claim = await runtime.claim()
    assert claim.batch is None
    assert claim.retry_in is not None  # backs off alone
    assert await runtime.idle() is True  # claim once more: that claim backs it off


async def test_outboxes_served_for_the_probe_are_not_claimed_until_it_answers() -> None:
    """At a fleet's start each outbox the idle probe reads is looked at by the probe, not by a
    claim of its own (dispatch/fleet_health.py, the first pass): until the probe (or a claim)
    answers for every one, `all_looked` is unset."""
    ORDER.clear()
    new = [Scripted(f"tenant_{i:03d}", []) for i in range(20)]
    polled = Scripted("tenant_old", [])
    slots = slots_of()
    async with serving(slots):
        for outbox in new:
            slots.add(cast(OutboxRuntime, outbox), probed=True)
        slots.add(cast(OutboxRuntime, polled))  # not probed: claimed once, as before
        await until(lambda: polled.turns >= 1)
        await asyncio.sleep(0.05)
        assert [o.turns for o in new] == [0] * 20, "no claim of a probed outbox"
        assert not slots.all_looked.is_set()
        assert slots.unlooked == {o.key for o in new}
        slots.looked(o.key for o in new[:10])
        assert not slots.all_looked.is_set()
        slots.looked(o.key for o in new[10:])
        assert slots.all_looked.is_set()


def test_a_reconnected_listen_connection_asks_the_probe_rather_than_waking_every_outbox() -> None:
    """Rows may have come while nobody listened: with `missed` set (the fleet's probe), that is
    asked once, instead of 500 outboxes woken for a claim each ahead of notified ones."""
    woken: list[str] = []
    missed: list[int] = []
    channels = listen.Channels("db")
    channels.set({f"s{i}.outbox": functools.partial(woken.append, f"s{i}") for i in range(3)})
    channels.wake_all()
    assert woken == ["s0", "s1", "s2"]  # the single-table default: every route
    woken.clear()
    channels.missed = lambda: missed.append(1)
    channels.wake_all()
    assert (woken, missed) == ([], [1])
