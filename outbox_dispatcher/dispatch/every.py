"""every(): the one loop of all upkeep.

The lease keeper, the reclaimer, retention, the heartbeat, the readiness refresh and the metrics
and console samples are each a step run forever at an interval. A failure the step tolerates
(the database away, a grant missing) is logged and the next step comes; any other error ends the
task, and with it the supervisor's task group, as a bug should.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from enum import Enum
from typing import Any, NoReturn


class Warn(Enum):
    """How often a tolerated failure is logged."""

    EACH = "each"  # every failed step
    PER_OUTAGE = "per_outage"  # the first failure after a success
    ONCE = "once"  # the first failure of the process's life


async def every(
    seconds: float,
    step: Callable[[], Awaitable[object]],
    *,
    log: Any,
    failed: str,
    tolerated: tuple[type[BaseException], ...],
    wait_first: bool = True,
    warn: Warn = Warn.EACH,
    describe: Callable[[BaseException], str] = repr,
    context: Callable[[], Mapping[str, object]] = dict,
    due: Callable[[], bool] | None = None,
) -> NoReturn:
    """Run `step` every `seconds` (after a first wait unless `wait_first` is false); log a
    tolerated failure as `failed` on the caller's logger, with `context()`'s fields. With `due`,
    a tick whose `due()` is false is skipped (an idle outbox's upkeep, dispatch/idle.py)."""
    warned = False
    if wait_first:
        await asyncio.sleep(seconds)
    while True:
        if due is not None and not due():
            await asyncio.sleep(seconds)
            continue
        try:
            await step()
        except tolerated as exc:
            if warn is Warn.EACH or not warned:
                log.warning(failed, error=describe(exc), **context())
            warned = True
        else:
            if warn is Warn.PER_OUTAGE:
                warned = False
        await asyncio.sleep(seconds)
