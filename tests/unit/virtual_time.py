"""An event loop on a virtual clock: a wait for a timer moves the clock to it at once, so an hour
of upkeep loops runs in a moment, and the times the loops saw are exact (no timing asserted)."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to its end on a new event loop whose clock starts at 0 and advances only
    while the loop waits for its next timer (by exactly that wait)."""
    clock = _Clock()

    class Selector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
        def select(self, timeout: float | None = None) -> list[Any]:
            if timeout:
                clock.now += timeout
            return super().select(0)  # type: ignore[no-any-return]

    loop = asyncio.SelectorEventLoop(Selector())
    loop.time = lambda: clock.now  # type: ignore[method-assign]
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()
