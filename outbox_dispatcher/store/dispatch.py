"""The dispatcher's face of the database: every statement the claim, settle, lease, wake-up and
upkeep paths run, one keyword-only method each, named like its statement in dispatch.sql.

The claim engine lives in the schema (schema/) and in these calls; the modules around them
(claimer, settler, leases, wakeup, metrics, registry, retention) decide when to call, never how
to talk SQL, so a change of the engine touches this file, the schema and their tests.
"""

from __future__ import annotations

import contextlib
import copy
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import Any, Unpack

import asyncpg

from outbox_dispatcher.store import db
from outbox_dispatcher.store.arguments import ClaimArguments, SettleArguments
from outbox_dispatcher.store.base import Row, StoreBase
from outbox_dispatcher.store.statements import Statements

# Raised by a claim when the server's lock table or memory is short (SQLSTATE 53200).
OutOfMemoryError = asyncpg.OutOfMemoryError


class Claimed(list[Row]):
    """A claim's rows; whether the steady path's claim took them (`steady`: only then may the
    batch be settled by the steady path's one statement), and whether that claim saw nothing
    left to take right after them (`drained`)."""

    def __init__(self, rows: list[Row], *, steady: bool = False, drained: bool = False) -> None:
        super().__init__(rows)
        self.steady = steady
        self.drained = drained


class DispatchStore(StoreBase):
    """The hot path and the upkeep of one outbox table. `steady` (schema version 16 on): the
    claim and the settle try the steady path's one statement first (dispatch.sql
    `claim_steady`, `settle_steady`), and run the engine's functions only when it says so.
    `replays` (version 16 on): the claim function returns each row's replay count (exactly-once
    lists it); below, the claim reads 0."""

    def __init__(
        self,
        executor: asyncpg.Pool | db.Executor,
        statements: Statements,
        *,
        steady: bool = False,
        replays: bool = True,
    ) -> None:
        super().__init__(executor, statements)
        self.steady = steady
        self.replays = replays

    async def claim(self, **arguments: Unpack[ClaimArguments]) -> Claimed:
        """The rows leased (ClaimArguments says what is asked)."""
        if self.steady:
            rows = await self._fetch(
                "claim_steady",
                limit=arguments["limit"],
                token=arguments["token"],
                owner=arguments["owner"],
                lease_seconds=arguments["lease_seconds"],
                block_on_dead=arguments["block_on_dead"],
            )
            if not rows:
                return Claimed(rows, drained=True)
            if rows[-1]["id"] is not None:
                return Claimed(rows, steady=True, drained=not rows[0]["more"])
            # Not steady: the marker row only, nothing was leased; the claim function's turn,
            # under the same token.
        claim = "claim" if self.replays else "claim_without_replays"
        return Claimed(await self._fetch(claim, **arguments))

    async def outbox_identity(self) -> str:
        """The outbox's identity in exactly-once's progress records: a uuid drawn at migrate
        time and again by every TRUNCATE (dispatch.sql)."""
        return str(await self._value("outbox_identity"))

    async def outbox_oid(self) -> str:
        """The database and the table's oid (exactly-once's transactional ids name it)."""
        return str(await self._value("outbox_oid"))

    async def pending_rows(
        self, *, ids: Sequence[int], replays: Sequence[int], identity: str
    ) -> list[Row]:
        """Those of the (id, replays) pairs still pending with that replay count, in a claim's
        columns (OutboxRecord's fields); none once the identity is no longer `identity`."""
        return await self._fetch(
            "pending_rows", ids=list(ids), replays=list(replays), identity=identity
        )

    async def progress_needed(self, *, ids: Sequence[int], replays: Sequence[int]) -> Row:
        """The outbox's identity now, and the ids of the (id, replays) pairs a progress record
        must still list (dispatch.sql `progress_needed`)."""
        return await self._row("progress_needed", ids=list(ids), replays=list(replays))

    async def unsettled_work(self) -> int:
        """Keys leased, or holding the reconcile duty (exactly-once's start: dispatch.sql)."""
        return int(await self._value("unsettled_work"))

    async def crash_loops_unsettled(self, *, limit: int) -> list[Row]:
        """Crash-loop dead rows whose lost claim's outcome nobody read (exactly-once)."""
        return await self._fetch("crash_loops_unsettled", limit=limit)

    async def crash_loop_candidates(self, *, max_attempts: int) -> list[Row]:
        """The rows the crash-loop reclaimer would dead-letter now, with the lost lease's owner
        (exactly-once reads their progress first)."""
        return await self._fetch("crash_loop_candidates", max_attempts=max_attempts)

    async def crash_loops_checked(self, *, ids: Sequence[int]) -> int:
        """These crash-loop rows are not in the progress: dead for good."""
        return int(await self._value("crash_loops_checked", ids=list(ids)))

    async def reconciled(self, *, owner: str, keys: Sequence[str], keyless: Sequence[bool]) -> int:
        """A takeover read the progress for these work keys under `owner`'s live leases: their
        reconcile duty is done (dispatch.sql `reconciled`); how many keys had it."""
        return int(
            await self._value("reconciled", owner=owner, keys=list(keys), keyless=list(keyless))
        )

    async def release_claim(self, *, token: uuid.UUID) -> int:
        """Give back what a claim under `token` leased; keys (and rows without one) released."""
        return int(await self._value("release_claim", token=token))

    async def settle(self, **arguments: Unpack[SettleArguments]) -> list[int]:
        """Record one batch's outcomes and release its keys; the ids of the rows that were still
        ours."""
        # (a batch of the claim function: its keys' work may have been passed by a discovery
        # that only share-locked it; the settle function reads their next rows in a snapshot
        # taken after its locks)
        arguments = arguments.copy()
        steady = arguments.pop("steady", False) and self.steady
        published = all(outcome == "published" for outcome in arguments["outcomes"])
        if not steady or not published or arguments["delete_published"]:
            return await self._settle(arguments)
        marked = [
            int(row[0])
            for row in await self._fetch(
                "settle_steady",
                token=arguments["token"],
                owner=arguments["owner"],
                ids=arguments["ids"],
                keys=arguments["keys"],
                counted=arguments["counted"],
            )
        ]
        if len(marked) == len(arguments["ids"]):
            return marked
        # Rows not marked: of keys no longer ours (nothing happens to them), or dead-lettered by
        # the reclaimer under this lease, whose publication the settle function records.
        done = set(marked)
        rest = [i for i, row_id in enumerate(arguments["ids"]) if row_id not in done]

        def only_rest(column: list[Any]) -> list[Any]:
            return [column[i] for i in rest]

        remaining = SettleArguments(
            token=arguments["token"],
            owner=arguments["owner"],
            ids=only_rest(arguments["ids"]),
            keys=only_rest(arguments["keys"]),
            outcomes=only_rest(arguments["outcomes"]),
            errors=only_rest(arguments["errors"]),
            delays=only_rest(arguments["delays"]),
            counted=only_rest(arguments["counted"]),
            delete_published=False,
            block_on_dead=arguments["block_on_dead"],
        )
        return marked + await self._settle(remaining)

    async def _settle(self, arguments: SettleArguments) -> list[int]:
        return [int(row[0]) for row in await self._fetch("settle", **arguments)]

    async def already_settled(
        self,
        *,
        ids: Sequence[int],
        owner: str,
        outcomes: Sequence[str],
        attempts: Sequence[int],
        delete_published: bool,
    ) -> int:
        """Of these rows, how many already show the outcome a settle by `owner` left (a settle
        whose reply was lost)."""
        rows = await self._value(
            "already_settled",
            ids=list(ids),
            owner=owner,
            outcomes=list(outcomes),
            attempts=list(attempts),
            delete_published=delete_published,
        )
        return int(rows)

    async def extend_leases(
        self, *, ids: Sequence[int], tokens: Sequence[uuid.UUID], seconds: float
    ) -> int:
        """Extend live leases of these rows' work under their tokens; rows still held."""
        held = await self._fetch(
            "extend_leases", ids=list(ids), tokens=list(tokens), seconds=seconds
        )
        return len(held)

    async def dead_letter_crash_loops(self, *, max_attempts: int, block_on_dead: bool) -> list[Row]:
        return await self._fetch(
            "dead_letter_crash_loops", max_attempts=max_attempts, block_on_dead=block_on_dead
        )

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[DispatchStore]:
        """This store over one connection in one transaction: the statements run through the
        store it yields commit together, or not at all when the block raises."""
        async with db.transaction(self.executor) as conn:
            inner = copy.copy(self)
            inner.executor = conn
            yield inner

    async def crash_loops_published(
        self, *, ids: Sequence[int], delete_published: bool
    ) -> list[int]:
        """These crash-loop rows (dead, their lease token kept) were committed by their lost
        claim: published as its late mark would record them (exactly-once, review E13)."""
        rows = await self._fetch(
            "crash_loops_published", ids=list(ids), delete_published=delete_published
        )
        return [int(r["id"]) for r in rows]

    async def count_expired_leases(self) -> int:
        return int(await self._value("count_expired_leases"))

    async def waiting_announce(self, *, owner: str, seconds: float) -> None:
        await self._fetch("waiting_announce", owner=owner, seconds=seconds)

    async def waiting_withdraw(self, *, owner: str) -> None:
        await self._fetch("waiting_withdraw", owner=owner)

    async def clock_tick(self) -> None:
        """Note the highest committed id at the database's time: lag is measured from these."""
        await self._fetch("clock_tick")

    async def clock_prune(self, *, first_pending_id: int | None) -> None:
        """Forget clock entries that no pending row needs any more."""
        await self._fetch("clock_prune", first_pending_id=first_pending_id)

    async def transactional_ids_record(self, *, owner: str, ids: Sequence[str]) -> bool:
        """Record the transactional ids `owner` may publish under (exactly-once, schema version
        15); False if its registry row is gone (its heartbeat writes it)."""
        return bool(await self._fetch("transactional_ids_record", owner=owner, ids=list(ids)))

    async def transactional_ids_live(self, *, live_seconds: float) -> list[Row]:
        """The dispatchers that beat within `live_seconds`: owner, delivery, transactional_ids."""
        return await self._fetch("transactional_ids_live", live_seconds=live_seconds)

    async def transactional_ids_silent(self, *, live_seconds: float, limit: int) -> list[Row]:
        """The dispatchers that no longer beat and still list transactional ids: owner,
        heartbeat_at, transactional_ids, and whether a lease or a reconcile duty names them
        (exactly-once's sweep of dead dispatchers' progress keys: dispatch.sql)."""
        return await self._fetch("transactional_ids_silent", live_seconds=live_seconds, limit=limit)

    async def transactional_ids_forget(
        self, *, owner: str, heartbeat_at: datetime, ids: Sequence[str]
    ) -> bool:
        """Forget these fenced and ended ids of `owner`, unless it beat since `heartbeat_at`;
        whether it forgot."""
        rows = await self._fetch(
            "transactional_ids_forget", owner=owner, heartbeat_at=heartbeat_at, ids=list(ids)
        )
        return bool(rows)

    async def lost_owners(
        self, *, keys: Sequence[str], keyless: Sequence[bool], owners: Sequence[str] = ()
    ) -> list[Row]:
        """The owners the reconcile duty of these work keys names, and `owners`, with their
        delivery and recorded transactional ids whatever their heartbeat's age (exactly-once's
        strict fence: dispatch.sql `lost_owners`)."""
        return await self._fetch(
            "lost_owners", keys=list(keys), keyless=list(keyless), owners=list(owners)
        )

    async def dispatcher_beat(
        self,
        *,
        owner: str,
        dead_letter_policy: str,
        version: int,
        totals: tuple[int, int] | None = None,
        delivery: str | None = None,
    ) -> None:
        """A heartbeat; `totals` (rows published, dead-lettered since the start) only on a
        schema that keeps them (migrations.CONSOLE_VERSION), and with them the `delivery` mode
        only on one that keeps it too (migrations.DELIVERY_VERSION)."""
        beat = {"owner": owner, "dead_letter_policy": dead_letter_policy, "version": version}
        if totals is None:
            await self._fetch("dispatcher_beat", **beat)
            return
        published, dead = totals
        if delivery is None:
            await self._fetch("dispatcher_beat_counted", **beat, published=published, dead=dead)
            return
        await self._fetch(
            "dispatcher_beat_moded", **beat, published=published, dead=dead, delivery=delivery
        )
