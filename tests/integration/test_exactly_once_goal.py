"""Issue 35's goal row (review E8, E9): the progress topic's live keys and what each lane lists
stay bounded after many dispatcher restarts (graceful and kill -9) and many failed marks.
Real PostgreSQL and Kafka; in-process dispatchers (the faithful cheaper form of 1,000 process
restarts) and real processes. CI runs a short version; OUTBOX_CHAOS=full the goal's (`make
chaos`): 1,000 in-process restarts with 10,000 failed marks, and 50 process restarts."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest

from outbox_dispatcher import registry
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.progress_store import TableProgressStore
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.kafka.exactly_once.lanes import LANES
from outbox_dispatcher.kafka.exactly_once.publisher import TransactionalPublisher
from outbox_dispatcher.kafka.exactly_once.retirement import RETIRE_EVERY_SECONDS
from outbox_dispatcher.models import PUBLISHED, Batch
from outbox_dispatcher.store import DispatchStore
from tests.checker import verdict_for

from .helpers import Services, count, kill9, log_events, wait_all_settled, wait_until
from .test_chaos import FULL, Writer, assert_sound, fleet, report, scale, writing
from .test_exactly_once import STATEMENTS, expire, read_all, run
from .test_exactly_once_bounds import eos, live_of, owner_of, recorded, write
from .test_exactly_once_lists import latest_values, progress_records

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600 if FULL else 300)]
FIXTURES = (eos,)  # test_exactly_once_bounds.py's, used here by name


def listed(value: bytes) -> int:
    """How many batches a progress record lists (its lane's `unmarked`, and its own)."""
    batches = orjson.loads(value).get("batches") or {}
    return len(batches)


# --- the goal row: many restarts, many failed marks ---------------------------------------------


class Dispatchers:
    """Exactly-once publishers of named owners over the real table and registry, as the
    supervisor makes them (a heartbeat first, the registry's rows, the outbox named by its oid).
    A kill stops the lanes' producers without the graceful stop's tombstones, and its heartbeat
    ages as a dead dispatcher's does (fast-forwarded: it never beats again)."""

    def __init__(self, settings: Settings, pool: asyncpg.Pool) -> None:
        self.settings = settings
        self.store = DispatchStore(pool, STATEMENTS)

    async def start(self, owner: str) -> TransactionalPublisher:
        s = self.settings
        await registry.Heartbeat(self.store, s, owner).beat()
        configs = configs_of(s)
        progress = configs.progress
        outbox = f"{progress.outbox}@{await self.store.outbox_oid()}"
        made = TransactionalPublisher(
            configs.publisher,
            dataclasses.replace(progress, outbox=outbox),
            owner,
            TableProgressStore(self.store, owner),
            await self.store.outbox_identity(),
            lane_count=LANES,
        )
        await made.start()
        return made

    async def kill(self, conn: asyncpg.Connection, made: TransactionalPublisher) -> None:
        await made.lanes.stop()
        await self.age(conn, made.owner)

    async def age(self, conn: asyncpg.Connection, owner: str) -> None:
        """The owner's last heartbeat an hour ago (past the fence window's hour, too)."""
        await conn.execute(
            "UPDATE outbox_dispatchers SET heartbeat_at = now() - interval '61 minutes'"
            " WHERE owner = $1",
            owner,
        )

    async def claim(self, owner: str) -> Batch | None:
        return await Claimer(self.store, self.settings, owner).claim()

    async def mark(self, owner: str, batch: Batch, rows: Sequence[Any]) -> int:
        settler = Settler(self.store, retry_for=1.0, owner=owner)
        return int(await settler.settle(Batch(batch.token, list(rows)), [PUBLISHED] * len(rows)))


async def publish_claim(
    d: Dispatchers, made: TransactionalPublisher, *, mark: bool
) -> tuple[int, bool]:
    """One claim of `made`'s owner, published; marked, or its mark failed (the settle changed
    nothing: what the Settler reports when the database refuses, and the publisher hears). How
    many rows, and whether it was a takeover."""
    batch = await d.claim(made.owner)
    if batch is None:
        return 0, False
    delivery = made.publish(batch.records)
    part = await run(delivery)
    done = [
        delivery.records[i] for i, o in zip(part.indices, part.outcomes, strict=True) if o is None
    ]
    takeover = any(r.reclaimed for r in batch.records)
    if mark and done:
        changed = await d.mark(made.owner, batch, done)
        made.marked(delivery, every_row=changed == len(done))
    else:
        made.marked(delivery, every_row=False)
    return len(done), takeover


async def test_the_progress_stays_bounded_over_many_restarts_and_failed_marks(
    conn: asyncpg.Connection,
    pool: asyncpg.Pool,
    services: Services,
    topic: str,
    eos: Callable[..., Settings],
    record_property: Any,
) -> None:
    """The goal row, in-process against the real services (the faithful cheaper form of 1,000
    process restarts: each restart is a new dispatcher's publisher with a new owner, registered,
    its lanes' producers started under new ids; a kill stops them without the graceful stop's
    tombstones, its heartbeat then aged). Dispatcher i publishes a claim; every second one's mark
    fails and it is killed (the rows wait, leased, for a takeover), the others mark, half of
    them then stop gracefully and half are killed. A survivor runs throughout: its marks fail
    too, FAILED_MARKS times in all, and every 10 restarts the leases expire, it takes the keys
    over and sweeps. Bounded: the progress topic's live keys end at the survivor's lanes (its
    current ids) and at most 2 more; what the survivor's lanes list at most the batches whose
    marks failed since its last takeover (never growing with the total)."""
    restarts = int(scale(40, 1000))
    failed_marks = int(scale(400, 10_000))
    per_restart = failed_marks // restarts
    settings = eos(batch_size=2, lease_seconds=30.0)
    d = Dispatchers(settings, pool)
    bootstrap = services.kafka_bootstrap_servers
    survivor = await d.start("survivor")
    rng = random.Random(7)
    rows = failed = listed_max = since_takeover_max = since_takeover = kills = 0
    try:
        for i in range(restarts):
            await registry.Heartbeat(d.store, settings, "survivor").beat()  # it runs
            await write(conn, topic, f"r{i}", 1)
            made = await d.start(f"d{i}")
            sent, _ = await publish_claim(d, made, mark=i % 2 == 1)
            rows += sent
            if i % 2 == 0 or rng.random() < 0.5:
                await d.kill(conn, made)
                kills += 1
            else:
                await made.stop()
                await d.age(conn, made.owner)  # it never beats again
            failed += i % 2 == 0
            for _ in range(per_restart):
                await write(conn, topic, f"s{i}-{failed}", 1)
                sent, _ = await publish_claim(d, survivor, mark=False)
                rows += sent
                failed += 1
                since_takeover += 1
                listed_max = max(listed_max, *(len(lane.unmarked) for lane in survivor.lanes))
            since_takeover_max = max(since_takeover_max, since_takeover)
            if i % 10 == 9 or i == restarts - 1:
                await expire(conn)
                while (await publish_claim(d, survivor, mark=True))[0]:
                    pass
                since_takeover = 0
                survivor.retire.soon()
                await survivor.orphans.sweep()
        for _ in range(10):  # what a takeover gave back (it waited) goes at the next one
            if await count(conn, "published_at IS NULL AND dead_at IS NULL") == 0:
                break
            await expire(conn)
            while (await publish_claim(d, survivor, mark=True))[0]:
                pass
        await wait_all_settled(conn, 10)
        await survivor.retire.check(survivor.lanes, force=True)
        for _ in range(restarts // 8 + 2):  # (IDS_AT_ONCE per sweep)
            await survivor.orphans.sweep()
        last = await latest_values(bootstrap, settings.progress_topic)
        mine = survivor.lanes.ids()
        live = live_of(last)
        unmarked = [len(lane.unmarked) for lane in survivor.lanes]
        still_listed = await conn.fetchval(
            "SELECT count(*) FROM outbox_dispatchers"
            " WHERE cardinality(transactional_ids) > 0 AND owner <> 'survivor'"
        )
    finally:
        await survivor.stop()
    copies = await read_all(bootstrap, topic, "read_committed")
    figures = {
        "restarts": restarts,
        "kills": kills,
        "failed_marks": failed,
        "keys_ever": len(last),
        "live_keys_at_end": len(live),
        "survivor_lanes_listed_max": listed_max,
        "failed_marks_between_takeovers_max": since_takeover_max,
        "survivor_unmarked_at_end": unmarked,
        "dead_dispatchers_still_listing_ids": still_listed,
        "rows": await count(conn),
        "copies_read_committed": len(copies),
    }
    print(f"\nBOUNDS {orjson.dumps(figures).decode()}")
    record_property("bounds", orjson.dumps(figures).decode())
    assert len(last) >= restarts, "every dispatcher wrote progress"
    assert live - set(mine) == set(), f"{len(live - set(mine))} keys of dead dispatchers live"
    assert len(live) <= LANES + 2
    assert listed_max <= since_takeover_max + 2, "listed more than the failed marks not taken over"
    assert unmarked == [0] * LANES
    assert still_listed == 0, "the registry still lists dead dispatchers' ids (fenced by takeovers)"
    assert len(copies) == await count(conn) == await count(conn, "published_at IS NOT NULL")


# --- the goal row with real processes ------------------------------------------------------------


REFUSE_MARKS = """
CREATE TABLE refuse_marks (on_ boolean NOT NULL);
INSERT INTO refuse_marks VALUES (false);
CREATE FUNCTION refuse_marks() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (SELECT on_ FROM refuse_marks) THEN
        RAISE EXCEPTION 'marks refused for a while (a test)' USING ERRCODE = 'lock_not_available';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_marks BEFORE UPDATE ON outbox FOR EACH ROW
    WHEN (OLD.published_at IS NULL AND NEW.published_at IS NOT NULL)
    EXECUTE FUNCTION refuse_marks();
"""


@contextlib.asynccontextmanager
async def refused_marks(conn: asyncpg.Connection) -> AsyncIterator[Callable[[bool], Any]]:
    await conn.execute(REFUSE_MARKS)

    async def refuse(on: bool) -> None:
        await conn.execute("UPDATE refuse_marks SET on_ = $1", on)

    try:
        yield refuse
    finally:
        await refuse(False)


async def test_the_progress_stays_bounded_over_process_restarts_and_refused_marks(
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    eos: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    """The goal row with real processes: two dispatchers under a steady writer, restarted in
    turn (kill -9 or SIGTERM, at random), while the database refuses every mark for a lease and
    a second or two at a time (a trigger raising lock_not_available on the mark's UPDATE:
    settles give up, leases expire, the takeovers' marks fail too until it ends). A killed
    dispatcher's heartbeat is aged at once (fast-forwarded: it never beats again) so that the
    sweep need not wait registry.LIVE_SECONDS for it. At the end: the live keys are the running
    dispatchers' lanes' and at most 2 more; records written once the last refusal ended (past
    its settles, their leases and the retirement's pace) list at most the batches in flight; a
    read_committed consumer sees every row once."""
    restarts = int(scale(6, 50))
    settings = eos(lease_seconds=3.0, batch_size=20)
    bootstrap = services.kafka_bootstrap_servers
    rng = random.Random(os.getpid())
    kills = refusals = 0
    last_refusal = time.time()
    async with refused_marks(conn) as refuse, fleet(settings, tmp_path, 2) as f:
        writer = Writer(database_url, topic, [f"key-{k}" for k in range(20)], rate=200.0)
        async with writing(writer):
            for n in range(restarts):
                await asyncio.sleep(rng.uniform(1.0, 2.0))
                if n % 2 == 0:
                    await refuse(True)
                    refusals += 1
                    # Longer than a lease: settles give up, leases expire, takeovers' marks
                    # are refused too until it ends.
                    await asyncio.sleep(settings.lease_seconds + rng.uniform(1.0, 2.0))
                    await refuse(False)
                    last_refusal = time.time()
                slot = rng.randrange(2)
                owner = owner_of(f.log_of[slot])
                if rng.random() < 0.5:
                    await asyncio.to_thread(kill9, f.slots[slot])
                    await conn.execute(
                        "UPDATE outbox_dispatchers SET heartbeat_at = now() - interval '1 hour'"
                        " WHERE owner = $1",
                        owner,
                    )
                    kills += 1
                else:
                    f.slots[slot].send_signal(signal.SIGTERM)
                    assert await asyncio.to_thread(f.slots[slot].wait, 60) == 0
                f.start(slot)
                await f.wait_started()
            # Past the last refusal: the settles that gave up, their leases' expiry, the
            # takeovers' marks and the retirement's pace; records written later list only
            # batches in flight.
            calm = last_refusal + 2 * settings.lease_seconds + RETIRE_EVERY_SECONDS + 3
            await asyncio.sleep(max(0.0, calm - time.time()) + 3)
            await writer.finish()
        await wait_all_settled(conn, 120)
        running = {i for p in f.log_of.values() for i in await recorded(conn, owner_of(p))}

        async def bounded() -> bool:
            live = live_of(await latest_values(bootstrap, settings.progress_topic))
            return len(live - running) <= 2

        await wait_until(bounded, 60, "the dead dispatchers' keys to end")
        last = await latest_values(bootstrap, settings.progress_topic)
        live = live_of(last)
    verdict = await verdict_for(database_url, bootstrap, [topic], timeout=60)
    logs = await asyncio.to_thread(lambda: list(tmp_path.glob("d*.log")))

    def logged(event: str) -> int:
        return sum(len(log_events(p, event)) for p in logs)

    records = await progress_records(bootstrap, settings.progress_topic)
    listed_all = [listed(v) for _, v, _ in records if v is not None]
    listed_calm = [listed(v) for _, v, at in records if v is not None and at >= calm]
    report(
        "exactly_once_bounds_process_restarts",
        verdict,
        record_property,
        restarts=restarts,
        kills=kills,
        refusals=refusals,
        marks_failed=logged("settle_failed"),
        marks_retried=logged("settle_retrying"),
        takeovers_that_found_committed=logged("takeover_found_committed"),
        keys_swept=sum(
            int(e["tombstoned"]) for p in logs for e in log_events(p, "progress_keys_swept")
        ),
        keys_ever=len(last),
        live_keys_at_end=len(live),
        running_lanes=len(running),
        records=len(listed_all),
        batches_listed_max=max(listed_all, default=0),
        records_after_calm=len(listed_calm),
        batches_listed_after_calm_max=max(listed_calm, default=0),
    )
    assert_sound(verdict)
    assert verdict.duplicates == 0, verdict.summary()
    assert logged("settle_failed") > 0, "no mark failed: the refusals did not bite"
    assert logged("failed") == 0, "a dispatcher died"
    assert len(live - running) <= 2, sorted(live - running)
    assert len(live) <= len(running) + 2
    assert len(last) > len(running), "restarts left keys to end"
    assert listed_calm, "records were written after the last refusal"
    assert max(listed_calm) <= settings.claim_tasks + 2, "batches stuck in the lists"
