"""Exactly-once's lanes: the ids a dispatcher may use, the ids a takeover fences, which lane
a claim goes to."""

from __future__ import annotations

import gc

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.kafka import lanes
from outbox_dispatcher.kafka.lanes import Lane, lanes_for, least_busy
from outbox_dispatcher.kafka.progress import ProgressConfig

PROGRESS = ProgressConfig(
    topic="p", outbox="public.outbox", transactional_id_prefix="x.", timeout_seconds=2.0
)


def test_the_first_lane_keeps_the_owners_own_id_and_a_takeover_fences_every_lane() -> None:
    assert lanes.LANES == 2
    assert lanes.lane_names("h:1:a") == ["h:1:a", "h:1:a.1"]
    # The first lane's id is the one a dispatcher had before lanes: an older one is fenced too.
    assert lanes.fence_ids(PROGRESS, ["h:1:a", "h:2:b"]) == [
        "x.public.outbox.h:1:a",
        "x.public.outbox.h:1:a.1",
        "x.public.outbox.h:2:b",
        "x.public.outbox.h:2:b.1",
    ]


def _made(count: int) -> list[Lane]:
    publisher = configs_of(Settings(delivery="exactly-once")).publisher
    return lanes_for("o", count, publisher.producer, PROGRESS, publisher.topics)


def test_a_dispatcher_has_a_lane_per_claim_loop_up_to_the_fixed_number() -> None:
    assert [lane.name for lane in _made(1)] == ["o"]
    assert [lane.name for lane in _made(2)] == ["o", "o.1"]
    assert [lane.name for lane in _made(8)] == ["o", "o.1"], "more loops share the lanes"
    ids = ["x.public.outbox.o", "x.public.outbox.o.1"]
    assert [lane.transactional_id for lane in _made(2)] == ids
    # Each lane's producer is made under its own id.
    assert [lane.producers._config.transactional_id for lane in _made(2)] == ids


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
