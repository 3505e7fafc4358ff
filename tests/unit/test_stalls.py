"""Exactly-once's holds on partitions that did not acknowledge (kafka/exactly_once/stalls.py): how
long a partition's rows wait, who probes it, and what a held row's settle records."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.kafka.exactly_once.stalls import Holds, PartitionStalledError
from outbox_dispatcher.models import OutboxRecord, Outcome
from outbox_dispatcher.retries import RetryPolicy

A = ("strict", 0)
B = ("strict", 1)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_stalled_partition_is_held_and_each_stall_in_a_row_doubles_the_hold() -> None:
    clock = Clock()
    holds = Holds(first=2.0, most=5.0, clock=clock)
    lane, other = object(), object()
    assert holds.wait_for(A, lane) is None, "nothing held: send"
    assert holds.stalled([A]) == 2.0
    assert holds.wait_for(A, lane) == 2.0
    assert holds.wait_for(B, lane) is None, "only the partitions that stalled"
    clock.now += 2.0
    assert holds.wait_for(A, lane) is None, "past its hold: this lane probes it"
    assert holds.wait_for(A, lane) is None, "the probing lane's next rows of it go too"
    assert holds.wait_for(A, other) == 2.0, "the other lanes wait for the probe"
    assert holds.stalled([A]) == 4.0, "stalled again: twice as long"
    clock.now += 4.0
    assert holds.wait_for(A, other) is None
    assert holds.stalled([A]) == 5.0, "at most `most`"


def test_an_acknowledged_probe_ends_the_hold_and_an_inconclusive_one_frees_the_probe() -> None:
    clock = Clock()
    holds = Holds(first=1.0, clock=clock)
    lane, other = object(), object()
    holds.stalled([A, B])
    clock.now += 1.0
    assert holds.wait_for(A, lane) is None and holds.wait_for(B, lane) is None
    holds.ended(lane)  # its transaction aborted for another reason: no verdict
    assert holds.wait_for(A, other) is None, "another lane may probe it now"
    holds.acknowledged([A])
    assert A not in holds.held and holds.wait_for(A, lane) is None
    assert holds.held[B].stalls == 1, "B keeps its hold until a probe of it is acknowledged"
    holds.stalled([B])
    assert holds.held[B].stalls == 2


def test_a_held_row_waits_uncounted_and_says_why() -> None:
    policy = RetryPolicy(Settings(), random.Random(1))
    row = OutboxRecord(1, "strict", "k", b"{}", {}, uuid.uuid4(), datetime.now(UTC), 3, False)
    held = PartitionStalledError(A, 4.0, "did not acknowledge within 10 s")
    [result] = policy.results([row], [held])
    assert result.outcome is Outcome.RETRY and result.delay == 4.0 and not result.counted
    assert result.failure is None, "not a failed attempt: no outage pause, no streak"
    assert result.error is not None and "partition strict-0 did not acknowledge" in result.error
    assert policy.outage_streak == 0
