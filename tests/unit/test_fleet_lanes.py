"""An outbox's exactly-once lanes among many (dispatch/fleet_delivery.py): made and opened at
its first batch (or a crash loop's progress read), closed once idle for `idle_seconds` with
nothing in flight, no transaction open and every batch marked, and opened again at its next
batch; a claim that opened them counts from the open unless the open took too long. The
publisher is a stand-in of our own seam (its lanes, holds, start and stop)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, cast

import pytest
from pydantic import SecretStr

from outbox_dispatcher import errors
from outbox_dispatcher.config.outboxes import Outbox, Source
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.fleet import FleetDispatcher
from outbox_dispatcher.dispatch.fleet_delivery import TOPIC_CHECK_SECONDS, OutboxLanes, TopicChecks
from outbox_dispatcher.dispatch.leases import InFlight
from outbox_dispatcher.dispatch.outboxes import OutboxRuntime, Shared
from outbox_dispatcher.kafka.exactly_once import lanes
from outbox_dispatcher.kafka.exactly_once.publisher import TransactionalPublisher
from outbox_dispatcher.kafka.producers import Producers
from outbox_dispatcher.retries import RetryPolicy

from .test_lanes import _made, _Registry

IDLE = 180.0
LEASE = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Lane:
    def __init__(self) -> None:
        self.unmarked: dict[str, list[tuple[int, int]]] = {}
        self.given: set[object] = set()
        self.turn = asyncio.Lock()


class Lanes(list[Lane]):
    def __init__(self) -> None:
        super().__init__([Lane(), Lane()])
        self.stopped = 0

    async def stop(self) -> None:
        self.stopped += 1


class Holds:
    def __init__(self) -> None:
        self.held: dict[object, object] = {}


class Publisher:
    """What OutboxLanes asks of a TransactionalPublisher."""

    def __init__(self, fail_start: BaseException | None = None) -> None:
        self.lanes = Lanes()
        self.holds = Holds()
        self.started = 0
        self.stopped = 0
        self.fail_start = fail_start
        self.stop_takes = 0.0
        self.events: list[str] = []
        self.topic_checked: list[bool] = []

    async def start(self, *, check_topic: bool = True) -> None:
        if self.fail_start is not None:
            raise self.fail_start
        self.started += 1
        self.events.append("start")
        self.topic_checked.append(check_topic)

    async def stop(self) -> None:
        self.events.append("stopping")
        await asyncio.sleep(self.stop_takes)
        self.stopped += 1
        self.events.append("stopped")

    async def committed_of(self, pairs: Any, owners: Any = ()) -> set[int]:
        return {i for i, _ in pairs}


def lanes_of(
    publisher: Publisher,
    clock: Clock,
    in_flight: InFlight | None = None,
    checks: TopicChecks | None = None,
) -> OutboxLanes:
    made: list[Publisher] = []

    async def make() -> TransactionalPublisher:
        made.append(publisher)
        assert len(made) == 1, "made once, kept across closes"
        return cast(TransactionalPublisher, publisher)

    return OutboxLanes(
        make,
        InFlight() if in_flight is None else in_flight,
        idle_seconds=IDLE,
        lease_seconds=LEASE,
        topic_checks=checks,
        clock=clock,
    )


async def test_lanes_are_opened_at_the_first_batch_only_and_counted_from_the_open() -> None:
    publisher, clock = Publisher(), Clock()
    lanes = lanes_of(publisher, clock)
    assert not lanes.open and lanes.publisher is None  # served, nothing made
    loop = asyncio.get_running_loop()
    claimed_at = loop.time()
    seen = await lanes.claimed(claimed_at)
    assert lanes.open and publisher.started == 1
    assert seen is not None and seen >= claimed_at  # the open's time: its producers' since
    assert await lanes.claimed(123.0) == 123.0  # open already: the claim's own time
    assert publisher.started == 1


async def test_the_outboxes_opening_within_a_minute_share_one_check_of_the_progress_topic() -> None:
    """The check is an admin client's round trips, half of an open; the fleet checked the topic
    at its start. One that fails is not counted: the next open checks again."""
    clock = Clock()
    checks = TopicChecks(clock)
    failing = Publisher(errors.BrokerUnavailableError("away"))
    assert await lanes_of(failing, clock, checks=checks).claimed(0.0) is None
    first, second, third = Publisher(), Publisher(), Publisher()
    await lanes_of(first, clock, checks=checks).claimed(0.0)
    clock.now += TOPIC_CHECK_SECONDS - 1
    await lanes_of(second, clock, checks=checks).claimed(0.0)
    clock.now += 1
    await lanes_of(third, clock, checks=checks).claimed(0.0)
    assert [p.topic_checked for p in (first, second, third)] == [[True], [False], [True]]


async def test_a_claim_whose_open_took_a_third_of_the_lease_keeps_its_own_time() -> None:
    """Its rows are then given back by the publisher (claimed before the producers started)."""
    publisher, clock = Publisher(), Clock()
    lanes = lanes_of(publisher, clock)
    claimed_at = asyncio.get_running_loop().time() - LEASE / 3 - 1
    assert await lanes.claimed(claimed_at) == claimed_at


async def test_an_open_that_fails_gives_the_batch_back() -> None:
    publisher, clock = Publisher(errors.BrokerUnavailableError("away")), Clock()
    lanes = lanes_of(publisher, clock)
    assert await lanes.claimed(0.0) is None
    assert not lanes.open
    (outcome,) = lanes.not_opened(1)
    assert isinstance(outcome, errors.OutboxDispatcherError) and outcome.retriable


async def test_idle_lanes_are_closed_after_idle_seconds_and_opened_again_at_the_next_batch() -> (
    None
):
    publisher, clock, in_flight = Publisher(), Clock(), InFlight()
    lanes = lanes_of(publisher, clock, in_flight)
    assert not await lanes.close_if_idle()  # never opened
    await lanes.claimed(asyncio.get_running_loop().time())
    clock.now += IDLE - 1
    assert not await lanes.close_if_idle()  # used within idle_seconds
    clock.now += 2
    token = uuid.uuid4()
    in_flight.add(token, [1, 2])
    assert not await lanes.close_if_idle()  # rows in flight
    in_flight.discard(token)
    publisher.lanes[1].unmarked["tag"] = [(1, 0)]
    assert not await lanes.close_if_idle()  # a committed batch not marked yet
    publisher.lanes[1].unmarked.clear()
    async with publisher.lanes[0].turn:
        assert not await lanes.close_if_idle()  # a transaction open
    publisher.holds.held["p"] = object()
    assert not await lanes.close_if_idle()  # a partition held
    publisher.holds.held.clear()
    assert await lanes.close_if_idle()
    assert not lanes.open and (publisher.started, publisher.stopped) == (1, 1)
    assert lanes.publisher is publisher  # kept: its generations outlive the close

    assert await lanes.claimed(asyncio.get_running_loop().time()) is not None
    assert lanes.open and (publisher.started, lanes.opened, lanes.closed) == (2, 2, 1)
    assert not await lanes.close_if_idle()  # just used


async def test_a_crash_loops_progress_read_opens_the_lanes_and_keeps_them_from_closing() -> None:
    publisher, clock = Publisher(), Clock()
    lanes = lanes_of(publisher, clock)
    assert await lanes.committed_of([(7, 0)], ["lost"]) == {7}
    assert lanes.open and publisher.started == 1
    clock.now += IDLE + 1
    assert await lanes.close_if_idle()


async def test_a_progress_read_that_cannot_open_the_lanes_says_the_broker_is_away() -> None:
    """The reclaimer then waits and dead-letters nothing (leases.read_crash_loops_first)."""
    lanes = lanes_of(Publisher(errors.DatabaseUnavailableError("down")), Clock())
    with pytest.raises(errors.BrokerUnavailableError):
        await lanes.committed_of([(7, 0)], [])


async def test_a_claim_during_a_close_waits_for_it_and_opens_the_lanes_again() -> None:
    publisher, clock = Publisher(), Clock()
    publisher.stop_takes = 0.05
    lanes = lanes_of(publisher, clock)
    await lanes.claimed(asyncio.get_running_loop().time())
    clock.now += IDLE + 1
    closing = asyncio.ensure_future(lanes.close_if_idle())
    await asyncio.sleep(0)  # the close has begun
    claimed = await lanes.claimed(asyncio.get_running_loop().time())
    assert await closing
    assert claimed is not None and lanes.open
    assert publisher.events == ["start", "stopping", "stopped", "start"]


async def test_stop_closes_open_lanes_and_the_producers_of_a_close_cut_short() -> None:
    publisher, clock = Publisher(), Clock()
    lanes = lanes_of(publisher, clock)
    await lanes.stop()  # never opened: nothing to stop
    assert publisher.stopped == 0
    await lanes.claimed(asyncio.get_running_loop().time())
    await lanes.stop()
    assert not lanes.open and publisher.stopped == 1
    await lanes.claimed(asyncio.get_running_loop().time())
    lanes.open = False  # a close cancelled within its farewell (it clears `open` first)
    await lanes.stop()
    assert publisher.lanes.stopped == 1


def test_exactly_once_with_sources_gives_each_outbox_lanes_of_its_own_made_at_its_first_batch() -> (
    None
):
    """Before issue 36's exactly-once per outbox, FleetDispatcher.run refused the mode
    (SourcesExactlyOnceError); now each outbox has its lanes, nothing made until they open, and
    their sweep and closer beside its upkeep. At-least-once outboxes have none."""
    url = SecretStr("postgresql://u:p@db:5432/app")
    settings = Settings(delivery="exactly-once", transaction_timeout_seconds=2.0)
    source = Source(url, "tenant_*", "outbox")
    fleet = FleetDispatcher(settings, [source])
    eo = fleet._exactly_once()
    assert eo is not None and eo.owner == fleet.owner
    shared = Shared(
        settings, fleet.owner, cast(Any, None), fleet.metrics, RetryPolicy(settings), 2.0, eo
    )
    runtime = OutboxRuntime(Outbox(source, "tenant_a"), cast(Any, None), 16, shared)
    assert runtime.lanes is not None and not runtime.lanes.open
    assert runtime.lanes.publisher is None and runtime.lanes.label == "tenant_a.outbox"
    loops = runtime.loops()
    for loop in loops.values():
        loop.close()  # (not run: their names are what is looked at)
    assert {"progress-sweep", "lanes-closer"} <= set(loops)

    plain = Settings(transaction_timeout_seconds=2.0)
    alo = FleetDispatcher(plain, [source])
    assert alo._exactly_once() is None
    shared = Shared(plain, alo.owner, cast(Any, None), alo.metrics, RetryPolicy(plain), 2.0)
    runtime = OutboxRuntime(Outbox(source, "tenant_a"), cast(Any, None), 16, shared)
    loops = runtime.loops()
    for loop in loops.values():
        loop.close()
    assert runtime.lanes is None and not {"progress-sweep", "lanes-closer"} & set(loops)


async def test_lanes_started_again_after_a_stop_start_no_second_producer_for_a_renewed_lane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lane renewed while the database was away stays unready; its outbox's lanes closed and
    opened again start its producer with every other lane's: its next `ready` starts none (a
    second start replaced the producer without closing it)."""
    events: list[str] = []

    async def start(self: Producers, seconds: float | None = None) -> None:
        events.append(f"start {self._config.transactional_id}")
        self.use(cast(Any, object()))

    async def stop(self: Producers) -> None:
        self.use(None)

    async def fence(config: Any, transactional_id: str, seconds: float) -> None:
        return None

    monkeypatch.setattr(Producers, "start", start)
    monkeypatch.setattr(Producers, "stop", stop)
    monkeypatch.setattr(lanes.progress, "fence", fence)
    registry = _Registry()
    made = _made(2, registry)
    await made.start()
    registry.fail = True
    made[0].producers.use(None)  # (its old producer closed: nothing of it to fail)
    await made.renew(made[0], "a test")  # unready: its id could not be recorded
    registry.fail = False
    await made.stop()  # the outbox's lanes closed (idle) ...
    events.clear()
    await made.start()  # ... and opened again
    assert events == ["start x.public.outbox.o.0.1", "start x.public.outbox.o.1"]
    await made.ready(made[0])
    assert events == ["start x.public.outbox.o.0.1", "start x.public.outbox.o.1"]
