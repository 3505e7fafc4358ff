"""every(): the one loop of all upkeep. A tolerated failure is logged (as often as asked) and the
next step comes; any other error ends the loop."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from outbox_dispatcher.dispatch.every import Warn, every


class Recorded:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append((event, fields))


class AwayError(Exception):
    pass


class BugError(Exception):
    pass


def steps(outcomes: list[BaseException | None]) -> tuple[list[int], Any]:
    """A step that fails or succeeds as `outcomes` say, then raises BugError (ending the loop)."""
    ran: list[int] = []

    async def step() -> None:
        ran.append(len(ran))
        if len(ran) > len(outcomes):
            raise BugError
        outcome = outcomes[len(ran) - 1]
        if outcome is not None:
            raise outcome

    return ran, step


@pytest.mark.parametrize(
    ("warn", "logged"),
    [(Warn.EACH, 4), (Warn.PER_OUTAGE, 2), (Warn.ONCE, 1)],
)
async def test_tolerated_failures_are_logged_as_asked_and_the_loop_goes_on(
    warn: Warn, logged: int
) -> None:
    # Two outages of two failed steps each, with a success between them.
    ran, step = steps([AwayError(), AwayError(), None, AwayError(), AwayError(), None])
    log = Recorded()
    with pytest.raises(BugError):
        await every(
            0,
            step,
            log=log,
            failed="thing_failed",
            tolerated=(AwayError,),
            warn=warn,
            context=lambda: {"rows": 3},
        )
    assert len(ran) == 7, "every step ran; the untolerated error ended the loop"
    assert len(log.warnings) == logged
    assert all(event == "thing_failed" and f["rows"] == 3 for event, f in log.warnings)
    assert log.warnings[0][1]["error"] == "AwayError()"


async def test_the_first_step_waits_for_the_interval_unless_asked_not_to() -> None:
    for wait_first, ran_at_once in ((True, 0), (False, 1)):
        ran, step = steps([None] * 10)
        task = asyncio.ensure_future(
            every(60, step, log=Recorded(), failed="x", tolerated=(), wait_first=wait_first)
        )
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(ran) == ran_at_once
