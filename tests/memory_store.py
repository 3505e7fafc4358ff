"""An in-memory DispatchStore for unit tests: the claim engine's contract in miniature, so that the
claimer, the settler, the lease keeper, a batch's run and a claim loop can be tested without
PostgreSQL (tests/unit/test_claim_loop_memory.py). Like tests/fakes.py it lives with the tests.

It keeps what those components rely on: one owner per key at a time, a key's rows in id order,
a run that stops at the first row not due, the takeover of an expired lease (the lost claim's
rows first; an attempt for each row it takes), the settle fenced by the lease token, the
dead-letter policy. It keeps none of how the engine gets there (schema/schema.sql): no discovery
cursor, holes or change log (a row added is visible at once), no pauses, no version 9 row
leases, no transactions or snapshots. Every statement it does
not model raises NotImplementedError rather than pretend. Its methods keep DispatchStore's
keyword-only signatures (a unit test pins them), so the seam cannot drift from its stand-in.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import takewhile
from typing import TYPE_CHECKING, Literal, Unpack, cast

from outbox_dispatcher.models import OutboxRecord, Outcome
from outbox_dispatcher.store.arguments import ClaimArguments, SettleArguments
from outbox_dispatcher.store.dispatch import Claimed, DispatchStore

if TYPE_CHECKING:
    from outbox_dispatcher.store.base import Row

State = Literal["pending", "published", "dead"]
# A unit of ownership: a key's work is its ordering key; a row without one is its own (its id).
Work = str | int


class ManualClock:
    """The store's clock, moved by the test: leases expire and backoffs end when it says so."""

    def __init__(self, start: datetime | None = None) -> None:
        self.now = start or datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@dataclass
class MemoryRow:
    """One outbox row: the writer's columns and what the dispatcher writes."""

    id: int
    topic: str | None
    ordering_key: str | None
    payload: bytes | None
    headers: dict[str, str]
    event_id: uuid.UUID
    created_at: datetime
    next_attempt_at: datetime
    attempts: int = 0
    state: State = "pending"
    last_error: str | None = None
    lease_owner: str | None = None  # who settled it last: already_settled reads it

    @property
    def work(self) -> Work:
        return self.id if self.ordering_key is None else self.ordering_key


@dataclass
class Lease:
    """A claim's hold on one key (or keyless row), as the engine's work row keeps it."""

    token: uuid.UUID
    owner: str
    expires_at: datetime
    held: set[int] = field(default_factory=set)  # the rows the claim took (orphans if it dies)


class ClaimedRow:
    """A claim's result row as the dispatcher reads an asyncpg.Record: by column name (the
    claimer's `row["ordering_key"]`) or position, iterated in OutboxRecord's order (from_row)."""

    __slots__ = ("_values",)

    def __init__(self, values: tuple[object, ...]) -> None:
        self._values = values

    def __getitem__(self, key: int | str) -> object:
        return self._values[OutboxRecord._fields.index(key) if isinstance(key, str) else key]

    def __iter__(self) -> Iterator[object]:
        return iter(self._values)


class InMemoryDispatchStore(DispatchStore):
    """Rows and leases in two dicts; every call runs without awaiting, so it is atomic between
    the coroutines of one event loop, as a statement's transaction is."""

    def __init__(self, clock: Callable[[], datetime] | None = None) -> None:
        # No executor and no statements: _fetch refuses whatever is not modelled here.
        self.clock = clock or (lambda: datetime.now(UTC))
        self.rows: dict[int, MemoryRow] = {}
        self.leases: dict[Work, Lease] = {}
        self._last_id = 0

    async def _fetch(self, name: str, **values: object) -> list[Row]:
        raise NotImplementedError(f"InMemoryDispatchStore does not model statement {name!r}")

    def add(
        self,
        key: str | None,
        payload: bytes | None = b"x",
        *,
        topic: str | None = "t",
        headers: dict[str, str] | None = None,
        delay: float = 0.0,
    ) -> int:
        """A writer's insert (committed, and seen by the next claim); `delay` holds it back."""
        self._last_id += 1
        now = self.clock()
        row = MemoryRow(
            self._last_id,
            topic,
            key,
            payload,
            dict(headers or {}),
            uuid.uuid4(),
            now,
            next_attempt_at=now + timedelta(seconds=delay),
        )
        self.rows[row.id] = row
        return row.id

    def pending(self) -> dict[Work, list[MemoryRow]]:
        """Each work's pending rows in id order, works by their first pending row (head)."""
        runs: dict[Work, list[MemoryRow]] = {}
        for row in sorted(self.rows.values(), key=lambda r: r.id):
            if row.state == "pending":
                runs.setdefault(row.work, []).append(row)
        return runs

    def _blocked(self, work: Work) -> bool:
        """dead_letter_policy = block: a dead row of the key holds its later rows."""
        return isinstance(work, str) and any(
            r.ordering_key == work and r.state == "dead" for r in self.rows.values()
        )

    async def claim(self, **arguments: Unpack[ClaimArguments]) -> Claimed:
        """Up to `limit` rows of at most `max_keys` keys that can go, oldest head first; each
        key its share of the batch, the room left to the oldest heads, a takeover's orphans before
        all (the engine's sharing, minus its candidate queues and discovery, which can lease more
        keys). `scan` is unused:
        there is no discovery cursor. A takeover whose first row is at its last attempt is left
        alone (the engine leaves it to the reclaimer, which is not modelled)."""
        limit, max_keys, owner = arguments["limit"], arguments["max_keys"], arguments["owner"]
        token, max_attempts = arguments["token"], arguments["max_attempts"]
        lease_seconds, block_on_dead = arguments["lease_seconds"], arguments["block_on_dead"]
        now = self.clock()
        # Each key's run, the rows its lost claim held (a takeover's orphans), whether a takeover.
        runs: list[tuple[list[MemoryRow], set[int], bool]] = []
        for work, rows in self.pending().items():
            if len(runs) >= max_keys:
                break
            lease = self.leases.get(work)
            if (lease is not None and lease.expires_at > now) or (
                block_on_dead and self._blocked(work)
            ):
                continue
            old = lease is not None  # its owner died or hung: taking it over is an attempt
            orphans = lease.held if lease is not None else set()
            if run := _run(rows, now, max_attempts if old else math.inf):
                runs.append((run, orphans, old))
        share = max(1, limit // len(runs)) if runs else 0
        ranked = [
            (run[i].id not in orphans, i >= share, n, i)
            for n, (run, orphans, _) in enumerate(runs)
            for i in range(len(run))
        ]
        took: list[tuple[MemoryRow, bool]] = []
        fresh: dict[Work, Lease] = {}
        for *_, n, i in sorted(ranked)[:limit]:
            run, _, old = runs[n]
            row = run[i]
            expires = now + timedelta(seconds=lease_seconds)
            fresh.setdefault(row.work, Lease(token, owner, expires)).held.add(row.id)
            row.attempts += int(old)
            took.append((row, old))
        self.leases.update(fresh)
        fields = OutboxRecord._fields[:-2]  # the claim's columns before `reclaimed`, `replays`
        claimed = [
            ClaimedRow((*(getattr(r, f) for f in fields), old, 0))
            for r, old in sorted(took, key=lambda t: t[0].id)
        ]
        # (read by name, position and iteration, as a Record is; never `drained`: the fake has no
        # steady path)
        return Claimed(cast("list[Row]", claimed))

    async def reconciled(self, *, owner: str, keys: Sequence[str], keyless: Sequence[bool]) -> int:
        """No reconcile duty is modelled here: a claim flags rows reclaimed at its takeover only."""
        return 0

    async def release_claim(self, *, token: uuid.UUID) -> int:
        """Give back the keys (and keyless rows) a claim with a lost reply holds: uncounted."""
        mine = [work for work, lease in self.leases.items() if lease.token == token]
        for work in mine:
            del self.leases[work]
        return len(mine)

    async def settle(self, **arguments: Unpack[SettleArguments]) -> list[int]:
        """Only rows whose key `token` still holds change (an expired lease nobody took over
        still counts as held, as in the engine); those keys are released. `block_on_dead` is
        unused: the block is read from the key's dead rows at each claim."""
        token, owner, ids = arguments["token"], arguments["owner"], arguments["ids"]
        keys = arguments["keys"]
        outcomes, errors, delays = arguments["outcomes"], arguments["errors"], arguments["delays"]
        counted, delete_published = arguments["counted"], arguments["delete_published"]
        now = self.clock()
        works: list[Work] = [i if k is None else k for i, k in zip(ids, keys, strict=True)]
        held = {w for w in works if (lease := self.leases.get(w)) and lease.token == token}
        changed: list[int] = []
        for i, work, outcome, error, delay, count in zip(
            ids, works, map(Outcome, outcomes), errors, delays, counted, strict=True
        ):
            row = self.rows.get(i)
            if work not in held or row is None or row.state == "dead":
                continue
            changed.append(i)
            if outcome is Outcome.PUBLISHED and delete_published:
                del self.rows[i]
                continue
            row.attempts += count
            row.lease_owner = owner
            if outcome is Outcome.PUBLISHED:
                row.state = "published"
                continue
            row.last_error = row.last_error if error is None else error
            if outcome is Outcome.DEAD:
                row.state = "dead"
            else:
                row.next_attempt_at = now + timedelta(seconds=delay)
        for work in held:
            del self.leases[work]
        return changed

    async def already_settled(
        self,
        *,
        ids: Sequence[int],
        owner: str,
        outcomes: Sequence[str],
        attempts: Sequence[int],
        delete_published: bool,
    ) -> int:
        """Rows that show the outcome a settle by `owner` left: settled by it last, with the
        attempts it set (a takeover counts one more); under delete-on-publish a published row
        is gone."""
        return sum(
            _shows(self.rows.get(i), Outcome(outcome), owner, tries, delete_published)
            for i, outcome, tries in zip(ids, outcomes, attempts, strict=True)
        )

    async def extend_leases(
        self, *, ids: Sequence[int], tokens: Sequence[uuid.UUID], seconds: float
    ) -> int:
        """Extend live leases of these tokens; an expired one is never revived (it may be
        another's by now). The rows whose token still holds work."""
        now = self.clock()
        wanted = set(tokens)
        live = [x for x in self.leases.values() if x.token in wanted and x.expires_at > now]
        for lease in live:
            lease.expires_at = now + timedelta(seconds=seconds)
        held = {lease.token for lease in live}
        return sum(1 for token in tokens if token in held)

    async def count_expired_leases(self) -> int:
        return sum(1 for lease in self.leases.values() if lease.expires_at <= self.clock())


def _run(rows: list[MemoryRow], now: datetime, last: float) -> list[MemoryRow]:
    """A key's run: its rows up to the first not due, or the first at its `last` attempt (a
    takeover's max_attempts: the engine's crash loop); a prefix, never with a gap."""
    return list(takewhile(lambda r: r.next_attempt_at <= now and r.attempts + 1 < last, rows))


def _shows(
    row: MemoryRow | None, outcome: Outcome, owner: str, attempts: int, deleted: bool
) -> bool:
    """Whether a row shows the outcome a settle by `owner` that set `attempts` left."""
    if row is None:
        return outcome is Outcome.PUBLISHED and deleted
    state = {Outcome.PUBLISHED: "published", Outcome.DEAD: "dead"}.get(outcome, "pending")
    return row.lease_owner == owner and row.attempts == attempts and row.state == state
