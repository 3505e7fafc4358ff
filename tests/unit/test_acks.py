"""Waiting for a claim's answers (outbox_dispatcher/kafka/acks.py): when the keys answered so far
may be settled. Futures stand for the broker's answers; no producer needed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.kafka import acks as acks_module
from outbox_dispatcher.kafka.acks import Acks
from outbox_dispatcher.kafka.producers import Producers
from outbox_dispatcher.kafka.topics import TopicLookup


def waits() -> Acks:
    """A claim's waits whose publish_timeout never comes within a test."""
    configs = configs_of(Settings(publish_timeout_seconds=7200)).publisher
    producers = Producers(configs.producer)
    return Acks(
        producers,
        TopicLookup(producers, configs.topics),
        {},
        publish_timeout_seconds=7200,
        heartbeat=lambda: None,
    )


async def each_moment(moments: AsyncIterator[None], early: Callable[[], Awaitable[None]]) -> None:
    """Call `early` at each moment to settle, as the delivery yields a part there."""
    async for _ in moments:
        await early()


async def test_the_answered_keys_are_settled_soon_after_the_first_ack_not_at_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review F10, one partition silent: once another partition of the wave has answered, the
    answered keys are settled after EARLY_SETTLE_FACTOR times that answer's wait (at least
    EARLY_SETTLE_MIN_SECONDS), not after the EARLY_SETTLE_SECONDS cap (here an hour: a publisher
    that waited for the cap would never call `early` within the test)."""
    monkeypatch.setattr(acks_module, "EARLY_SETTLE_SECONDS", 3600.0)
    monkeypatch.setattr(acks_module, "EARLY_SETTLE_MIN_SECONDS", 0.01)
    loop = asyncio.get_running_loop()
    answered: asyncio.Future[object] = loop.create_future()
    silent: asyncio.Future[object] = loop.create_future()
    loop.call_soon(answered.set_result, "metadata")
    early_called = asyncio.Event()

    async def early() -> None:
        assert answered.done()
        assert not silent.done()
        early_called.set()
        silent.set_result("metadata")  # then the wave completes

    acks = waits()
    waiting = asyncio.ensure_future(each_moment(acks.wait({answered, silent}), early))
    await asyncio.wait_for(early_called.wait(), timeout=30)
    await waiting
    assert not acks.withdrew, "nothing given back"


async def test_partitions_answering_after_the_early_settle_are_settled_before_publish_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review F10, one partition silent and three slower than the first: the slower
    partitions' keys are settled soon after they answer (in one settle: answers are coalesced
    over EARLY_SETTLE_SECONDS), not after the silent one's publish_timeout and the close of its
    producer (make chaos, NotEnoughReplicas on one topic for 120 s: the other topic's partitions
    on the same broker answered after the retrying one's 100 ms backoff, just past the early
    settle; their keys waited 9 s and the other topic's p99 was 7.8 s)."""
    monkeypatch.setattr(acks_module, "EARLY_SETTLE_MIN_SECONDS", 0.01)
    monkeypatch.setattr(acks_module, "EARLY_SETTLE_SECONDS", 0.3)
    loop = asyncio.get_running_loop()
    first: asyncio.Future[object] = loop.create_future()
    slower = [loop.create_future() for _ in range(3)]
    silent: asyncio.Future[object] = loop.create_future()
    loop.call_soon(first.set_result, "metadata")
    calls: list[tuple[bool, list[bool], bool]] = []
    second_call = asyncio.Event()

    async def early() -> None:
        calls.append((first.done(), [f.done() for f in slower], silent.done()))
        if len(calls) == 1:
            for n, future in enumerate(slower):
                loop.call_later(0.02 * (n + 1), future.set_result, "metadata")
        else:
            second_call.set()

    acks = waits()
    waiting = asyncio.ensure_future(each_moment(acks.wait({first, *slower, silent}), early))
    try:
        await asyncio.wait_for(second_call.wait(), timeout=30)
    finally:
        silent.set_result("metadata")
    await waiting
    assert not acks.withdrew, "nothing given back"
    assert calls == [
        (True, [False, False, False], False),
        (True, [True, True, True], False),  # one settle for the three later answers
    ]
