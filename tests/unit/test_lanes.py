"""Exactly-once's lanes: the ids a dispatcher may use, the ids a takeover fences, which lane
a claim goes to, and a lane that gives its id up."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.kafka.exactly_once import lanes
from outbox_dispatcher.kafka.exactly_once.lanes import Lane, Lanes, least_busy
from outbox_dispatcher.kafka.exactly_once.progress import ProgressConfig
from outbox_dispatcher.kafka.producers import Producers

PROGRESS = ProgressConfig(
    topic="p", outbox="public.outbox", transactional_id_prefix="x.", timeout_seconds=2.0
)


def test_a_lane_is_named_by_its_owner_number_and_generation() -> None:
    assert lanes.LANES == 2
    # The first lane's first id is the one a dispatcher had before lanes.
    assert lanes.lane_name("h:1:a", 0) == "h:1:a"
    assert lanes.lane_name("h:1:a", 1) == "h:1:a.1"
    assert lanes.lane_name("h:1:a", 0, 1) == "h:1:a.0.1"
    assert lanes.lane_name("h:1:a", 1, 3) == "h:1:a.1.3"


def test_a_takeover_fences_the_ids_each_other_dispatcher_recorded() -> None:
    registered: list[lanes.Registered] = [
        ("me", "exactly-once", ["x.public.outbox.me"]),  # itself: never
        ("b", "exactly-once", ["x.public.outbox.b.0.4", "x.public.outbox.b.1"]),  # as recorded
        ("c", "exactly-once", None),  # an older release: the ids it used
        ("d", None, None),  # older still, no mode reported: the same
        ("e", "at-least-once", None),  # no transactions
    ]
    assert lanes.fence_ids(PROGRESS, registered, "me") == [
        "x.public.outbox.b.0.4",
        "x.public.outbox.b.1",
        "x.public.outbox.c",
        "x.public.outbox.c.1",
        "x.public.outbox.d",
        "x.public.outbox.d.1",
    ]


class _Registry:
    def __init__(self) -> None:
        self.recorded: list[list[str]] = []
        self.fail = False

    async def live(self) -> Sequence[lanes.Registered]:
        return []

    async def record(self, ids: Sequence[str]) -> None:
        if self.fail:
            raise ConnectionError("the database is away")
        self.recorded.append(list(ids))

    async def lost(self, keys: Any, owners: Sequence[str]) -> Sequence[lanes.Registered]:
        return []


def _made(count: int, registry: _Registry | None = None) -> Lanes:
    publisher = configs_of(Settings(delivery="exactly-once")).publisher
    made = registry or _Registry()
    return Lanes(
        "o",
        count,
        publisher.producer,
        PROGRESS,
        publisher.topics,
        made,
    )


def test_a_dispatcher_has_a_lane_per_claim_loop_up_to_the_fixed_number() -> None:
    assert [lane.name for lane in _made(1)] == ["o"]
    assert [lane.name for lane in _made(2)] == ["o", "o.1"]
    assert [lane.name for lane in _made(8)] == ["o", "o.1"], "more loops share the lanes"
    ids = ["x.public.outbox.o", "x.public.outbox.o.1"]
    assert _made(2).ids() == ids
    # Each lane's producer is made under its own id.
    assert [lane.producers._config.transactional_id for lane in _made(2)] == ids


async def test_a_lane_gives_its_id_up_recording_the_new_one_before_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The new id is recorded (the given-up one dropped, the other lane's kept) before its
    producer starts, and the given-up id is fenced; while the database is away the lane stays
    unready and nothing starts."""
    events: list[str] = []
    fenced: list[str] = []

    async def start(self: Producers, seconds: float | None = None) -> None:
        events.append(f"start {self._config.transactional_id}")
        self.since = asyncio.get_running_loop().time()

    async def fence(config: Any, transactional_id: str, seconds: float) -> None:
        fenced.append(transactional_id)

    monkeypatch.setattr(Producers, "start", start)
    monkeypatch.setattr(lanes.progress, "fence", fence)
    registry = _Registry()
    made = _made(2, registry)
    await made.start()
    assert registry.recorded == [["x.public.outbox.o", "x.public.outbox.o.1"]]
    first: Lane = made[0]
    registry.fail = True
    await made.renew(first, "a test")
    assert first.name == "o.0.1" and first.generation == 1
    assert not first.producers.serving, "not started before its id is recorded"
    registry.fail = False
    events.clear()
    await made.ready(first)
    assert registry.recorded[-1] == ["x.public.outbox.o.0.1", "x.public.outbox.o.1"]
    assert events == ["start x.public.outbox.o.0.1"]
    await made.ready(first)
    assert events == ["start x.public.outbox.o.0.1"], "ready once"
    await asyncio.sleep(0)
    assert fenced == ["x.public.outbox.o"]


class _Claim:
    pass


async def test_a_claim_goes_to_the_lane_with_the_fewest_claims_waiting_or_transacting() -> None:
    first, second = _made(2)
    assert least_busy([first, second]) is first, "a tie: the first"
    waiting = _Claim()
    first.given.add(waiting)
    assert least_busy([first, second]) is second
    dropped = _Claim()
    second.given.add(dropped)
    assert least_busy([first, second]) is first, "a tie again"
    del dropped  # a claim never transacted (a shutdown): forgotten once dropped
    gc.collect()
    assert least_busy([first, second]) is second
    first.given.discard(waiting)
    async with first.turn:  # transacting: the lane is busy though nothing waits
        assert least_busy([first, second]) is second
    assert least_busy([first, second]) is first


class _SlowFirstRecord(_Registry):
    """The first record is held until the second one completed (two pool connections, the
    first behind the heartbeat's row lock) or, when the second waits for it, a while."""

    def __init__(self) -> None:
        super().__init__()
        self.second_done = asyncio.Event()
        self.calls = 0

    async def record(self, ids: Sequence[str]) -> None:
        self.calls += 1
        if self.calls == 1:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.second_done.wait(), 0.5)
            self.recorded.append(list(ids))
            return
        self.recorded.append(list(ids))
        if self.calls == 2:
            self.second_done.set()


async def test_two_lanes_renewing_at_once_leave_every_serving_id_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review E12: both lanes give their ids up at once; the registry's last list names every id
    a lane serves under (a list read before the other lane's renewal, written last, lacked it)."""

    async def start(self: Producers, seconds: float | None = None) -> None:
        self.since = asyncio.get_running_loop().time()

    async def fence(config: Any, transactional_id: str, seconds: float) -> None:
        pass

    monkeypatch.setattr(Producers, "start", start)
    monkeypatch.setattr(lanes.progress, "fence", fence)
    made = _made(2)
    await made.start()
    registry = _SlowFirstRecord()
    made._registry = registry
    await asyncio.gather(made.renew(made[0], "a test"), made.renew(made[1], "a test"))
    serving = made.ids()
    assert serving == ["x.public.outbox.o.0.1", "x.public.outbox.o.1.1"]
    assert registry.recorded[-1] == serving


async def test_a_fresh_producer_under_a_lane_s_id_records_the_ids_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 35 (E9): a lane whose commit went unanswered keeps its id and starts a fresh
    producer under it. A sweep of dead dispatchers' keys (orphans.py) may have forgotten the
    ids of this dispatcher while it was paused; they are recorded again before the fresh
    producer starts, so that a takeover fences every id it may commit under. While the database
    is away, no fresh producer starts (IdUnrecordedError, a broker outage's kind)."""
    events: list[str] = []

    async def start(self: Producers, seconds: float | None = None) -> None:
        self.since = asyncio.get_running_loop().time()

    async def fresh(self: Producers, seconds: float | None) -> Any:
        events.append(f"start {self._config.transactional_id}")
        return SimpleNamespace(_txn_manager=None)

    monkeypatch.setattr(Producers, "start", start)
    monkeypatch.setattr(Producers, "_start_fresh", fresh)
    monkeypatch.setattr(Producers, "retire", lambda self, producer, reason: None)
    registry = _Registry()
    made = _made(2, registry)
    await made.start()
    registry.recorded.clear()
    first: Lane = made[0]
    first.producers.condemn(TimeoutError("the commit went unanswered"))
    registry.fail = True
    with pytest.raises(lanes.IdUnrecordedError):
        await first.producers.replace_if_broken()
    assert events == [], "nothing starts under an id not recorded"
    registry.fail = False
    await first.producers.replace_if_broken()
    assert registry.recorded == [["x.public.outbox.o", "x.public.outbox.o.1"]]
    assert events == ["start x.public.outbox.o"]
    monkeypatch.setattr(lanes.progress, "fence", _no_fence)
    first.producers.use(None)  # (nothing to close)
    await made.renew(first, "a test")  # a renewed lane's producers record too
    first.producers.condemn(TimeoutError("again"))
    registry.recorded.clear()
    await first.producers.replace_if_broken()
    assert registry.recorded[-1] == ["x.public.outbox.o.0.1", "x.public.outbox.o.1"]


async def _no_fence(config: Any, transactional_id: str, seconds: float) -> None:
    pass


async def test_the_lanes_producers_start_at_once_and_all_stop_when_one_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An outbox's first event (with many outboxes, after every idle spell) waits for the
    lanes' start: one producer's start, not one a lane. A start that fails stops the others."""
    made = _made(2)
    running = 0
    most = 0
    stopped: list[Producers] = []

    async def start(self: Producers, seconds: float | None = None) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.01)
        running -= 1
        if self is made[1].producers and fail:
            raise ConnectionError("the broker is away")

    async def stop(self: Producers) -> None:
        stopped.append(self)

    monkeypatch.setattr(Producers, "start", start)
    monkeypatch.setattr(Producers, "stop", stop)
    fail = False
    await made.start()
    assert most == 2, "the starts overlap"
    assert stopped == []
    fail = True
    with pytest.raises(ConnectionError):
        await made.start()
    assert stopped == [made[0].producers, made[1].producers], "the one started is stopped too"


async def test_a_producer_whose_start_is_cancelled_is_closed() -> None:
    """The lanes start their producers at once: a shutdown (or the outbox let go) meanwhile
    cancels every lane mid-start, and a producer cancelled there is kept by nobody: closed, or
    its connections and tasks leak."""
    starting = asyncio.Event()
    closed: list[object] = []

    class Blocked:
        async def start(self) -> None:
            starting.set()
            await asyncio.Event().wait()

        async def stop(self) -> None:
            closed.append(self)

    made: list[Blocked] = []

    def factory(context: object) -> Any:
        made.append(Blocked())
        return made[-1]

    producers = Producers(configs_of(Settings()).publisher.producer, factory)
    task = asyncio.ensure_future(producers._start_fresh(None))
    await starting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed == made, "the producer cancelled mid-start was closed"
