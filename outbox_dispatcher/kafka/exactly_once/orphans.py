"""Exactly-once's sweep of dead dispatchers' progress keys (docs/design/exactly-once.md,
"Bounds"; issue 35, E9).

A key of the progress topic (a lane's transactional id) ends with a tombstone: at a graceful
stop, for a given-up id, and for the keys a takeover read. A dispatcher killed while it held no
lease leaves its keys to none of those: no takeover of its keys ever comes. So every running
dispatcher sweeps, every OUTBOX_PROGRESS_SWEEP_SECONDS (jittered), the keys of the table's
dispatchers that no longer beat:

1. **Which ids.** The live keys of this outbox in the progress topic that no dispatcher that
   beats records (a given-up id of a dead dispatcher is recorded by nobody), and the ids recorded
   by dispatchers that no longer beat; less those of a dispatcher a lease or a key's reconcile
   duty names (its keys' takeover fences it strictly and reads them).
2. **Fenced.** A producer starts under each id: its open transaction is aborted (a commit in
   progress finished first) and the old producer is refused from now on.
3. **Read, after every fence, to the end**; a key whose last record lists a pair still needed
   (`progress_needed`: pending with that replay count, or a crash loop's row not checked yet) is
   left for a later sweep (a takeover after the lease needs it).
4. **Ended in a transaction of the id's own producer** (the one that fenced it), not of a lane:
   a dispatcher that was only paused can write under the id again only with a fresh producer (a
   commit without an answer keeps its id), whose start either fences this one first (then its
   tombstone does not commit) or comes after the tombstone's commit (then its records follow the
   tombstone in the log). A tombstone written under another id could land after a record of the
   id that commits later, and end a key a takeover needs.
5. **Forgotten** in the registry, only while the dispatcher's heartbeat is the one seen in 1.
   A paused dispatcher that comes back records its ids again before a fresh producer starts
   under one (lanes.py), or renews a fenced lane under a new id recorded first; so a takeover
   still fences every id it may commit under.

Two dispatchers sweeping at once: the later fence refuses the earlier one's producer, whose
tombstone then fails (logged, nothing written); or both tombstones commit (the same end), and
the second forget finds nothing to forget. A tombstone only removes knowledge of commits: at
worst a takeover then sends a row again; the needed check (3), after the fence, keeps every key
that lists a row someone may still decide.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import structlog

from outbox_dispatcher import errors
from outbox_dispatcher.kafka import internals
from outbox_dispatcher.kafka.exactly_once import lanes, progress
from outbox_dispatcher.kafka.exactly_once.lanes import Lane
from outbox_dispatcher.kafka.exactly_once.progress import ProgressConfig, Record
from outbox_dispatcher.kafka.exactly_once.store import ProgressStore
from outbox_dispatcher.kafka.exactly_once.takeover import FENCES_AT_ONCE, KAFKA_TROUBLE, Takeover
from outbox_dispatcher.kafka.producers import ProducerConfig, Producers

log = structlog.get_logger(__name__)

# Ids fenced per sweep at most (the rest wait for the next sweeps).
IDS_AT_ONCE = 32


@dataclass(frozen=True)
class Orphans:
    """One dispatcher's sweep of the keys its table's dead dispatchers left."""

    progress: ProgressConfig
    producer: ProducerConfig  # the lanes' (a fence starts one under another id)
    store: ProgressStore
    takeover: Takeover  # its read of the progress (the topic checked, to its end)
    own: Sequence[Lane]  # this dispatcher's lanes (whose producer knows the topic's partitions)

    async def sweep(self) -> int:
        """One sweep; how many keys it ended. Whatever does not answer (the database, the
        broker) ends the sweep: the next one tries again."""
        try:
            return await self._sweep()
        except Exception as exc:  # noqa: BLE001 - the database or the broker away: next sweep
            log.info("progress_sweep_skipped", error=errors.describe(exc))
            return 0

    async def _sweep(self) -> int:
        running = await self.store.running()
        silent = await self.store.silent()
        keep = set(lanes.fence_ids(self.progress, running, me=""))
        keep.update(lane.transactional_id for lane in self.own)  # (a late heartbeat of its own)
        keep.update(t for s in silent if s.named for t in s.ids)
        mine = self.progress.transactional_id("")
        identity, _ = await self.store.needed([])
        live = own_live_keys(self.progress, identity, await self.takeover.read(self.own))
        found = {k for k in live if k.startswith(mine)} | {
            t for s in silent if not s.named for t in s.ids
        }
        candidates = sorted(found - keep)[:IDS_AT_ONCE]
        if not candidates:
            return 0
        fenced: dict[str, Producers] = {}
        try:
            await self._fence(candidates, fenced)
            tombstoned, ended = await self._end(fenced, identity)
        finally:  # (also when the dispatcher stops meanwhile)
            await asyncio.gather(*(p.stop() for p in fenced.values()), return_exceptions=True)
        forgotten = 0
        for s in silent:
            done = [t for t in s.ids if t in ended]
            if done and not s.named and await self.store.forget(s, done):
                forgotten += len(done)
        log.info(
            "progress_keys_swept",
            candidates=len(candidates),
            fenced=len(fenced),
            tombstoned=tombstoned,
            forgotten=forgotten,
        )
        return tombstoned

    async def _fence(self, ids: Sequence[str], fenced: dict[str, Producers]) -> None:
        """A producer started under each id (the fence), within the fence bound, into `fenced`;
        an id whose markers cannot be written yet (a partition short of replicas) is left for
        a later sweep."""
        limit = asyncio.Semaphore(FENCES_AT_ONCE)
        seconds = self.takeover.fence_seconds

        async def fence(tid: str) -> None:
            producers = Producers(dataclasses.replace(self.producer, transactional_id=tid))
            async with limit:
                try:
                    await producers.start(seconds)
                except (*KAFKA_TROUBLE, errors.OutboxDispatcherError) as exc:
                    log.info("progress_key_not_fenced", transactional_id=tid, error=repr(exc))
                    return
            fenced[tid] = producers

        await asyncio.gather(*(fence(t) for t in ids))

    async def _end(self, fenced: dict[str, Producers], identity: str) -> tuple[int, set[str]]:
        """Read after the fences; tombstone each fenced id whose last record lists nothing
        needed, in a transaction of its own producer. The keys tombstoned, and the ids ended
        (tombstoned, or without a live record); none when the outbox's identity is no longer
        `identity` (a TRUNCATE since the sweep began)."""
        if not fenced:
            return 0, set()
        records = await self.takeover.read(self.own)
        last = progress.last_batches(self.progress, identity, records)
        listed = {t: [p for ps in last.get(t, {}).values() for p in ps] for t in fenced}
        pairs = sorted({p for ps in listed.values() for p in ps})
        now, needed = await self.store.needed(pairs)
        if now != identity:  # a TRUNCATE in between: the next sweep reads again
            return 0, set()
        live = live_keys(records)
        tombstoned, ended = 0, set()
        for tid, producers in fenced.items():
            if any(i in needed for i, _ in listed[tid]):
                continue  # a takeover after its lease may still need the record
            if tid in live:
                try:
                    await self._tombstone(producers, tid)
                except (*KAFKA_TROUBLE, errors.OutboxDispatcherError) as exc:
                    # Fenced meanwhile (another sweep, or its dispatcher came back): kept.
                    log.info("progress_key_kept", transactional_id=tid, error=repr(exc))
                    continue
                tombstoned += 1
            ended.add(tid)
        return tombstoned, ended

    async def _tombstone(self, producers: Producers, key: str) -> None:
        """The key's tombstone, in one transaction of the producer that fenced it; a
        transaction that did not commit is aborted now (unless fenced), not at its timeout."""
        producer = producers.current()
        try:
            async with asyncio.timeout(self.progress.timeout_seconds):
                await producer.begin_transaction()
                await producer.send_and_wait(self.progress.topic, None, key=key.encode())
                await producer.commit_transaction()
        except BaseException:
            if internals.read_fatal_error(producer) is None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(self.progress.timeout_seconds):
                        await producer.abort_transaction()
            raise


def own_live_keys(config: ProgressConfig, identity: str, records: Iterable[Record]) -> set[str]:
    """The keys whose last value (in log order) is a record of this outbox under its identity.
    Another database's outbox can have the same name, oid and so the same transactional-id
    prefix (two clusters migrated the same way, one Kafka cluster and progress topic): its live
    dispatchers' keys are not ours to fence or end, and they are told apart by the identity
    their records carry. An id of ours whose last record is of an older identity (a TRUNCATE)
    or release is swept through the registry of silent dispatchers instead."""
    last: dict[str, bool] = {}
    for key, value in records:
        ours = value is not None and progress.last_batches(config, identity, [(key, value)])
        last[(key or b"").decode(errors="replace")] = bool(ours)
    return {k for k, is_ours in last.items() if is_ours}


def live_keys(records: Iterable[Record]) -> set[str]:
    """The keys whose last value (in log order) is a record, not a tombstone."""
    last: dict[str, bool] = {}
    for key, value in records:
        last[(key or b"").decode(errors="replace")] = value is not None
    return {k for k, is_live in last.items() if is_live}


async def sweep_every(orphans: Orphans, seconds: float) -> NoReturn:
    """Sweep every `seconds`, each wait jittered by half either way (dispatchers started
    together do not sweep together)."""
    while True:
        await asyncio.sleep(seconds * random.uniform(0.5, 1.5))  # noqa: S311 - not a secret
        await orphans.sweep()
