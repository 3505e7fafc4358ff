"""Exactly-once's lanes (docs/design/exactly-once.md): a dispatcher's transactional producers.

A producer has one transaction open at a time; with one per process, its claim loops took
turns and a row waited for the other loop's whole transaction. A dispatcher has LANES
transactional ids (as many as it runs claim loops, up to LANES), each its own producer, so
that two claim loops' transactions are open at once. The number is fixed, not configured: a
takeover fences every lane id of every other dispatcher without knowing how it is set up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from outbox_dispatcher.kafka.producers import ProducerConfig, Producers
from outbox_dispatcher.kafka.progress import ProgressConfig
from outbox_dispatcher.kafka.topics import TopicConfig, TopicLookup

LANES = 2


def lane_names(owner: str) -> list[str]:
    """The names a dispatcher's lanes write progress under (and their transactional ids end
    with): the owner for the first, as before lanes; "<owner>.<n>" for the others."""
    return [owner] + [f"{owner}.{n}" for n in range(1, LANES)]


def fence_ids(progress: ProgressConfig, owners: Sequence[str]) -> list[str]:
    """Every transactional id the dispatchers `owners` may have used."""
    return [progress.transactional_id(name) for o in owners for name in lane_names(o)]


@dataclass
class Lane:
    """One transactional producer: its transactions one at a time, the batches it committed
    that are not seen marked yet (its progress records list them), the deliveries it was given."""

    name: str
    transactional_id: str
    producers: Producers
    topics: TopicLookup
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    unmarked: dict[str, list[int]] = field(default_factory=dict)  # tag: ids
    given: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)  # not yet transacted

    @classmethod
    def make(
        cls, name: str, producer: ProducerConfig, progress: ProgressConfig, topics: TopicConfig
    ) -> Lane:
        tid = progress.transactional_id(name)
        producers = Producers(dataclasses.replace(producer, transactional_id=tid))
        return cls(name, tid, producers, TopicLookup(producers, topics))


def lanes_for(
    owner: str, count: int, producer: ProducerConfig, progress: ProgressConfig, topics: TopicConfig
) -> list[Lane]:
    """The first `count` lanes of `owner` (1..LANES: one per claim loop)."""
    names = lane_names(owner)[: max(1, min(count, LANES))]
    return [Lane.make(name, producer, progress, topics) for name in names]


def least_busy(lanes: Sequence[Lane]) -> Lane:
    """The lane with the fewest deliveries given and not transacted yet (the first on a tie)."""
    return min(lanes, key=lambda lane: len(lane.given) + lane.turn.locked())
