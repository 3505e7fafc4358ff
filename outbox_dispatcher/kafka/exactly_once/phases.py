"""Where an exactly-once claim's time goes (issue 35: its p99 at 1k/s): each phase of its cycle
timed, and one debug line per claim (`eo_batch_phases`) once its mark is in.

The phases, in the order they come (a claim split for its lookups runs the middle ones once per
transaction; their times add up): `claim` (the claim statement), `fence` (a takeover's fences),
`turn` (waiting for the lane, or for every lane in a takeover), `retire` (the retirement check,
at most every few seconds), `reconcile` (a takeover's read of the progress), `ready` (a lane
that took a new id, or a producer replaced), `lookup` (topics not known yet), `begin`, `hand`
(the records and the progress record handed to the producer), `acks` (until the last one
answered), `commit` (EndTxn), `after` (the bookkeeping before the turn is let go) and `mark`
(the settle). A stall in one of them shows in the line of every claim it held up; `at` is when
the claim began, on the system's monotonic clock (the clock of the bench's timeline).
"""

from __future__ import annotations

import logging
import time

import structlog

log = structlog.get_logger(__name__)


class Phases:
    """One claim's phases: each lap charges the time since the last one to a phase."""

    def __init__(self, began: float) -> None:
        """`began`: when the claim began, on time.monotonic()."""
        self.began = began
        self._last = began
        self.ms: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.ms[phase] = self.ms.get(phase, 0.0) + (now - self._last) * 1000
        self._last = now

    def report(self, lane: str, rows: int, first_id: int) -> None:
        """The debug line, the time since the last lap charged to `mark` (the settle)."""
        self.lap("mark")
        if not logging.getLogger(__name__).isEnabledFor(logging.DEBUG):
            return
        log.debug(
            "eo_batch_phases",
            lane=lane,
            rows=rows,
            first_id=first_id,
            at=round(self.began, 4),
            total_ms=round(self._last * 1000 - self.began * 1000, 2),
            **{phase: round(ms, 2) for phase, ms in self.ms.items()},
        )
