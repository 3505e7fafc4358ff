"""Exactly-once's partitions that do not acknowledge (docs/design/exactly-once.md, "A partition
that does not acknowledge").

A transaction with a record for a partition that does not acknowledge (NotEnoughReplicas: the
broker refuses the append while the partition is short of in-sync replicas) can neither commit
nor end: its abort markers cannot be written to that partition either, so its transactional id
cannot begin another transaction until the partition recovers. Its lane gives it up and takes a
new id (lanes.py); these holds keep the partition's rows out of the transactions that
follow, so that one short partition costs one lane a stall, not every lane its own. Past its
hold, one transaction at a time (a probe) may carry the partition's rows again: acknowledged,
the hold ends; stalled again, it lasts twice as long (up to HOLD_MOST_SECONDS).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from outbox_dispatcher import errors

HELD = "did not acknowledge a recent transaction"
HOLD_FIRST_SECONDS = 2.0
HOLD_MOST_SECONDS = 30.0

TopicPartition = tuple[str, int]


class PartitionStalledError(errors.NotAttempted):
    """The record's partition did not acknowledge a transaction in time (a partition short of
    in-sync replicas, its leader unreachable): the row was not published and waits, uncounted,
    until the partition is tried again. Check the partition's replicas (kafka-topics.sh
    --describe --under-min-isr-partitions)."""

    def __init__(self, partition: TopicPartition, delay: float, why: str) -> None:
        topic, number = partition
        super().__init__(f"partition {topic}-{number} {why}; its rows wait {delay:.1f} s")
        self.delay = delay


@dataclass
class Hold:
    until: float  # when a probe may carry the partition's rows again
    stalls: int  # stalls in a row: the next hold is twice as long
    probe: object | None = None  # the lane whose open transaction carries them meanwhile


@dataclass
class Holds:
    """The partitions whose rows wait, and which lane probes each."""

    first: float = HOLD_FIRST_SECONDS
    most: float = HOLD_MOST_SECONDS
    clock: Callable[[], float] = time.monotonic
    held: dict[TopicPartition, Hold] = field(default_factory=dict)

    def wait_for(self, partition: TopicPartition, lane: object) -> float | None:
        """How long a row of `partition` must wait (None: `lane` may send it now). Past its
        hold, the first lane that asks probes the partition, and the other lanes wait for it."""
        hold = self.held.get(partition)
        if hold is None or hold.probe is lane:
            return None
        now = self.clock()
        if hold.probe is None and now >= hold.until:
            hold.probe = lane
            return None
        return max(hold.until - now, self.first)

    def why(self, lane: object) -> Callable[[TopicPartition], BaseException | None]:
        """Why a row of a partition must wait before `lane` sends it, if it must (the check
        kafka/batches.py makes of each row it hands to a producer batch)."""

        def held(partition: TopicPartition) -> BaseException | None:
            delay = self.wait_for(partition, lane)
            return None if delay is None else PartitionStalledError(partition, delay, HELD)

        return held

    def stalled(self, partitions: Iterable[TopicPartition]) -> float:
        """A transaction stalled on `partitions`: each is held, twice as long as after its last
        stall; returns the longest hold."""
        now = self.clock()
        longest = 0.0
        for partition in partitions:
            previous = self.held.get(partition)
            stalls = 1 if previous is None else previous.stalls + 1
            seconds = min(self.most, self.first * 2.0 ** (stalls - 1))
            self.held[partition] = Hold(now + seconds, stalls)
            longest = max(longest, seconds)
        return longest

    def acknowledged(self, partitions: Iterable[TopicPartition]) -> None:
        """Every record of a transaction for `partitions` was acknowledged: their holds end."""
        for partition in partitions:
            self.held.pop(partition, None)

    def ended(self, lane: object) -> None:
        """`lane`'s transaction ended without a verdict on what it probed (aborted for another
        reason): another transaction may probe it."""
        for hold in self.held.values():
            if hold.probe is lane:
                hold.probe = None
