"""A failing database's or outbox's backoff (sources/backoff.py): doubling from the initial
delay, capped, jittered within [d/2, d], reset by a success."""

from __future__ import annotations

import random

from outbox_dispatcher.sources.backoff import Backoff


def test_doubles_to_the_cap_and_resets() -> None:
    backoff = Backoff(0.5, 4.0, jitter=False)
    assert backoff.due(0.0)
    delays = [backoff.failed(10.0) for _ in range(6)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert not backoff.due(13.9)
    assert backoff.due(14.0)
    backoff.succeeded()
    assert backoff.due(0.0)
    assert backoff.failed(0.0) == 0.5


def test_jitter_stays_within_half_and_whole_delay() -> None:
    backoff = Backoff(1.0, 8.0, rng=random.Random(7))
    for expected in (1.0, 2.0, 4.0, 8.0, 8.0):
        delay = backoff.failed(0.0)
        assert expected / 2 <= delay <= expected


def test_a_long_streak_neither_overflows_nor_grows_past_the_cap() -> None:
    backoff = Backoff(0.1, 30.0, jitter=False)
    for _ in range(5000):
        backoff.failed(0.0)
    assert backoff.delay() == 30.0
