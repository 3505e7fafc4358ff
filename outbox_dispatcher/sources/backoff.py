"""One failing thing's backoff (a database, an outbox): exponential from `initial`, capped at
`maximum`, with equal jitter, so that each backs off alone and a storm of retries cannot form."""

from __future__ import annotations

import random

# Past this exponent any initial delay is far beyond any cap (and 2**n stays a finite float).
MAX_EXPONENT = 62


class Backoff:
    """The failures in a row and when the next attempt is due (on the caller's clock)."""

    def __init__(
        self, initial: float, maximum: float, rng: random.Random | None = None, jitter: bool = True
    ) -> None:
        self.initial = initial
        self.maximum = max(initial, maximum)
        self.failures = 0
        self.due_at = 0.0
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        self._jitter = jitter

    def delay(self) -> float:
        """The wait after the current streak of failures: [d/2, d] with jitter, d without."""
        exponent = min(max(0, self.failures - 1), MAX_EXPONENT)
        delay = min(self.maximum, self.initial * float(2**exponent))
        return delay / 2 + self._rng.uniform(0, delay / 2) if self._jitter else delay

    def failed(self, now: float) -> float:
        """One more failure at `now`: the delay until the next attempt."""
        self.failures = min(self.failures + 1, MAX_EXPONENT + 1)
        delay = self.delay()
        self.due_at = now + delay
        return delay

    def succeeded(self) -> None:
        self.failures = 0
        self.due_at = 0.0

    def due(self, now: float) -> bool:
        return now >= self.due_at
