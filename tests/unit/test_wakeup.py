from __future__ import annotations

import asyncio

from outbox_dispatcher.dispatch.wakeup import Wakeup


async def test_a_hint_wakes_one_waiting_loop_not_all() -> None:
    wakeup = Wakeup()
    stop = asyncio.Event()
    waiters = [asyncio.create_task(wakeup.wait(stop, 30)) for _ in range(3)]
    await asyncio.sleep(0)
    wakeup.notify()
    done, pending = await asyncio.wait(waiters, timeout=0.2)
    assert (len(done), len(pending)) == (1, 2)
    stop.set()  # a shutdown wakes everyone
    done, pending = await asyncio.wait(pending, timeout=1)
    assert not pending


async def test_a_hint_with_nobody_waiting_is_kept_for_the_next_loop() -> None:
    wakeup = Wakeup()
    wakeup.notify()
    await asyncio.wait_for(wakeup.wait(asyncio.Event(), 30), 0.2)
    # ... once: the next wait falls back to polling.
    loop = asyncio.get_running_loop()
    started = loop.time()
    await wakeup.wait(asyncio.Event(), 0.05)
    assert loop.time() - started >= 0.04
