"""What exactly-once asks of the database (the store seam): one Protocol, so that the publisher
and a takeover name what they need of the outbox table rather than take a closure for each.

The wing imports nothing of the database side (tests/unit/test_layers.py): the dispatcher's
adapter over store.DispatchStore (dispatch/progress_store.py) implements it, and unit tests fake
it. Every method may raise when the database does not answer; each caller says what then waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from outbox_dispatcher.kafka.exactly_once.lanes import Registered, Registry
from outbox_dispatcher.kafka.exactly_once.progress import Pair
from outbox_dispatcher.models import OutboxRecord


@dataclass(frozen=True)
class Silent:
    """A dispatcher that no longer beats and still lists transactional ids (store
    `transactional_ids_silent`)."""

    owner: str
    heartbeat: datetime  # as seen: its ids are forgotten only while it is unchanged
    ids: tuple[str, ...]
    named: bool  # a lease of its or a key's reconcile duty names it: a takeover fences it


class ProgressStore(Registry, Protocol):
    """The outbox table as one dispatcher's exactly-once wing reads and changes it: the registry
    (live, record, lost), and what a takeover and the retirement of progress records ask."""

    async def pending(self, pairs: list[Pair], identity: str) -> Sequence[OutboxRecord]:
        """The rows of these (id, replays) pairs still pending, while the outbox's identity is
        still `identity` (a takeover adopts those a lost claim committed beyond its batch)."""
        ...

    async def reconciled(self, keys: list[tuple[str, bool]]) -> int:
        """Clear the reconcile duty of these work keys (a row without a key is keyed by its id),
        under this dispatcher's live leases; how many keys it cleared. DatabaseUnavailableError
        when the database does not answer (the duty stays)."""
        ...

    async def needed(self, pairs: list[Pair]) -> tuple[str, set[int]]:
        """The outbox's identity now, and the ids among the pairs still needed (store
        `progress_needed`): what a progress record must keep listing."""
        ...

    async def beating(self) -> set[str]:
        """The transactional ids recorded by the dispatchers that beat lately (not the fence
        window's hour: a dispatcher killed a minute ago no longer beats, and cannot write under
        its ids), whose keys are not tombstoned."""
        ...

    async def unsettled(self) -> int:
        """How many keys are leased or hold the reconcile duty: a missing progress topic is
        then not made again at start (topic.py)."""
        ...

    async def running(self) -> Sequence[Registered]:
        """The dispatchers that beat lately (registry.LIVE_SECONDS, not the fence window's
        hour), with their delivery mode and the ids they recorded."""
        ...

    async def silent(self) -> Sequence[Silent]:
        """The dispatchers that no longer beat and still list transactional ids (the sweep of
        dead dispatchers' progress keys: orphans.py)."""
        ...

    async def forget(self, silent: Silent, ids: Sequence[str]) -> bool:
        """Forget these ids (fenced, their keys ended) of a silent dispatcher, unless it beat
        since it was seen; whether it forgot."""
        ...
