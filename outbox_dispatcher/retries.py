"""Turns publish outcomes into what is recorded: published, retry later, or dead-lettered."""

from __future__ import annotations

import random
from collections.abc import Sequence

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.kafka import failures
from outbox_dispatcher.models import PUBLISHED, Failure, OutboxRecord, Outcome, Result

# 2**62 times any initial backoff is far past any cap, and still a finite float: without this
# bound, float(2 ** 1024) raises OverflowError at the 1025th failure (review finding F8), in the
# middle of a batch (between publish and mark).
MAX_EXPONENT = 62
# The outage streak only sets the exponent: counting past it changes nothing but the risk.
MAX_OUTAGE_STREAK = MAX_EXPONENT + 1


class RetryPolicy:
    def __init__(self, settings: Settings, rng: random.Random | None = None) -> None:
        self._initial = settings.backoff_initial_seconds
        self._max = settings.backoff_max_seconds
        self._max_attempts = settings.max_attempts
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        self._outage_streak = 0

    def backoff(self, attempt: int) -> float:
        """Exponential backoff for the n-th failure (n >= 1), with equal jitter: [d/2, d]."""
        exponent = min(max(0, attempt - 1), MAX_EXPONENT)
        delay = min(self._max, self._initial * float(2**exponent))
        return delay / 2 + self._rng.uniform(0, delay / 2)

    def outage_delay(self) -> float:
        """The claim loop's pause after a broker outage hit a batch; grows while it lasts."""
        return self.backoff(self._outage_streak)

    @property
    def outage_streak(self) -> int:
        """Consecutive batches an outage hit (bounded by MAX_OUTAGE_STREAK)."""
        return self._outage_streak

    def results(
        self, records: Sequence[OutboxRecord], outcomes: Sequence[BaseException | None]
    ) -> list[Result]:
        if any(o is not None and _is_outage(o) for o in outcomes):
            self._outage_streak = min(self._outage_streak + 1, MAX_OUTAGE_STREAK)
        elif any(o is None for o in outcomes):
            self._outage_streak = 0
        return [self.result(r, o) for r, o in zip(records, outcomes, strict=True)]

    def result(self, record: OutboxRecord, outcome: BaseException | None) -> Result:
        if outcome is None:
            return PUBLISHED
        reason = failures.describe(outcome)
        if isinstance(outcome, errors.NotAttempted):
            if outcome.delay > 0:  # it waits: say why
                return Result(Outcome.RETRY, reason, delay=outcome.delay)
            return Result(Outcome.RETRY)
        if isinstance(outcome, errors.TopicMissingError):
            failure = Failure.ROW
        else:
            failure = failures.classify(outcome)
        if failure is Failure.PERMANENT:
            return Result(
                Outcome.DEAD,
                f"permanent error, not retried: {reason}",
                counted=True,
                failure=failure,
            )
        if failure is Failure.TRANSIENT:
            # Not the row's fault: wait for the broker, never dead-letter for it.
            return Result(
                Outcome.RETRY, reason, delay=self.outage_delay(), counted=False, failure=failure
            )
        attempt = record.attempts + 1
        if attempt >= self._max_attempts:
            return Result(
                Outcome.DEAD,
                f"gave up after {attempt} failed attempts: {reason}",
                counted=True,
                failure=failure,
            )
        return Result(
            Outcome.RETRY, reason, delay=self.backoff(attempt), counted=True, failure=failure
        )


def _is_outage(outcome: BaseException) -> bool:
    return not isinstance(outcome, errors.NotAttempted | errors.TopicMissingError) and (
        failures.classify(outcome) is Failure.TRANSIENT
    )
