"""Exactly-once's reconcile duty (issue 35, review E1-E3, E13): once a key's lease expired, every
claim of the key is a takeover (its rows come back reclaimed) until a takeover read the progress,
whatever happened in between: a pause that parked the key, a takeover cancelled before it read,
a takeover claim whose reply was lost, the crash-loop reclaimer. Real PostgreSQL and Kafka,
staged with the publishers of named owners of test_exactly_once.py; the process-level scenario
(kill -9, pause, resume) is in test_exactly_once_faults.py."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.batch import BatchRun, Settling
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.leases import InFlight, settle_crash_loops
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.metrics import Metrics
from outbox_dispatcher.models import PUBLISHED, Batch, Outcome, Result
from outbox_dispatcher.retries import RetryPolicy
from outbox_dispatcher.store import DispatchStore
from outbox_dispatcher.store.arguments import ClaimArguments
from outbox_dispatcher.store.dispatch import Claimed

from .helpers import Services, count, insert_sequenced
from .test_exactly_once import (
    STATEMENTS,
    Owners,
    eos_settings,
    expire,
    owners,
    read_all,
    run,
)

pytestmark = pytest.mark.integration
FIXTURES = (eos_settings, owners)  # test_exactly_once.py's, used here by name

DUTY = "SELECT ordering_key, reconcile_owner FROM outbox_work ORDER BY ordering_key"


async def duties(conn: asyncpg.Connection) -> dict[str, str | None]:
    return {r["ordering_key"]: r["reconcile_owner"] for r in await conn.fetch(DUTY)}


async def committed_by_a_and_expired(
    conn: asyncpg.Connection, owners: Owners, topic: str, keys: int = 4, per_key: int = 5
) -> list[int]:
    """owner-a commits every row in Kafka and dies before its mark; its leases expire."""
    await insert_sequenced(conn, topic, keys=keys, per_key=per_key)
    a = await owners.publisher("owner-a")
    lost = await owners.claim("owner-a")
    assert (await run(a.publish(lost.records))).outcomes == [None] * (keys * per_key)
    await expire(conn)
    return [r.id for r in lost.records]


async def take_over_and_mark(owners: Owners, owner: str, rows: int) -> None:
    """`owner` claims (every row reclaimed), reconciles (nothing sent) and marks."""
    b = owners.publishers.get(owner) or await owners.publisher(owner)
    taken = await owners.claim(owner)
    assert len(taken.records) == rows
    assert all(r.reclaimed for r in taken.records), "the claim reads the progress first"
    delivery = b.publish(taken.records)
    part = await run(delivery)
    assert part.outcomes == [None] * rows and delivery.sent == [], "found committed, not sent"
    settled = await Settler(owners.store, retry_for=1.0, owner=owner).settle(
        Batch(taken.token, [delivery.records[i] for i in part.indices]), [PUBLISHED] * rows
    )
    assert settled == rows


async def test_a_paused_topic_keeps_the_duty_of_an_expired_lease(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    """E1: the claim that finds the expired keys parks them (their topic is paused); after the
    resume, their next claim is still a takeover: it finds the lost claim's rows committed."""
    ids = await committed_by_a_and_expired(conn, owners, topic)
    await conn.execute("INSERT INTO outbox_paused (topic, paused_by) VALUES ($1, 'test')", topic)
    assert await Claimer(owners.store, owners.settings, "owner-b").claim() is None
    assert await count(conn, "id IN (SELECT id FROM outbox_leases)") == 0, "parked, no lease"
    parked = await duties(conn)
    await conn.execute("DELETE FROM outbox_paused WHERE topic = $1", topic)
    await take_over_and_mark(owners, "owner-b", len(ids))
    assert parked == {f"key-{k}": "owner-a" for k in range(4)}, "kept while parked"
    assert await count(conn, "published_at IS NULL") == 0
    assert await duties(conn) == {}, "the keys drained: their work is gone"
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 20


async def test_a_takeover_cancelled_before_it_read_the_progress_keeps_the_duty(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    """E2: the takeover waits for its lanes' turns and is cancelled (a shutdown past its grace):
    the real BatchRun gives every row back (none was in a transaction of its own) and its keys
    are released; their next claim is a takeover still."""
    ids = await committed_by_a_and_expired(conn, owners, topic)
    b = await owners.publisher("owner-b")
    taken = await owners.claim("owner-b")
    assert all(r.reclaimed for r in taken.records)
    settler = Settler(owners.store, retry_for=1.0, owner="owner-b")
    settling = Settling(settler, RetryPolicy(owners.settings), Metrics())
    async with contextlib.AsyncExitStack() as turns:
        for lane in b.lanes:
            await turns.enter_async_context(lane.turn)
        running = asyncio.create_task(BatchRun(taken, b, settling, InFlight()).run())
        await asyncio.sleep(1.0)
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            async with asyncio.timeout(30):
                await running
    assert await count(conn, "id IN (SELECT id FROM outbox_leases)") == 0, "given back"
    released = await duties(conn)
    # (owner-b's producer was closed by the shutdown: another dispatcher claims next)
    await take_over_and_mark(owners, "owner-c", len(ids))
    assert released == {f"key-{k}": "owner-a" for k in range(4)}, "kept when given back"
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 20


class LosesOneReply(DispatchStore):
    """The real claim commits, then its reply is lost once (the connection drops)."""

    lose = True

    async def claim(self, **arguments: Any) -> Claimed:
        rows = await super().claim(**ClaimArguments(**arguments))
        if self.lose:
            self.lose = False
            raise asyncpg.ConnectionDoesNotExistError("connection was closed in the middle")
        return rows


async def test_a_takeover_claim_whose_reply_was_lost_keeps_the_duty(
    conn: asyncpg.Connection, owners: Owners, pool: Any, topic: str, services: Services
) -> None:
    """E3: the claim that took the expired keys committed, its reply was lost; the Claimer
    releases its token at the next claim (release_work) and claims again: a takeover still."""
    ids = await committed_by_a_and_expired(conn, owners, topic)
    b = await owners.publisher("owner-b")
    claimer = Claimer(LosesOneReply(pool, STATEMENTS), owners.settings, "owner-b")
    with pytest.raises(asyncpg.ConnectionDoesNotExistError):
        await claimer.claim()
    assert await count(conn, "attempts = 1") == len(ids), "that claim committed"
    again = await claimer.claim()
    assert again is not None and len(again.records) == len(ids)
    assert all(r.reclaimed for r in again.records), "released, then claimed as a takeover"
    delivery = b.publish(again.records)
    part = await run(delivery)
    assert part.outcomes == [None] * len(ids) and delivery.sent == []
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 20


async def test_the_duty_is_cleared_by_the_takeover_that_read_the_progress(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    """A takeover that read the progress clears its keys' duty under its live lease: the key's
    later claims are plain ones again (no fence, no read)."""
    await committed_by_a_and_expired(conn, owners, topic, keys=1, per_key=4)
    b = await owners.publisher("owner-b")
    taken = await owners.claim("owner-b", owners.settings.model_copy(update={"batch_size": 2}))
    assert await duties(conn) == {"key-0": "owner-a"}
    await run(b.publish(taken.records))  # found committed: all 4 (2 adopted)
    assert await duties(conn) == {"key-0": None}, "cleared once the progress was read"


async def test_the_steady_claim_never_takes_a_key_that_holds_the_duty(
    conn: asyncpg.Connection, owners: Owners, pool: Any, topic: str
) -> None:
    """The steady path's claim leases only keys without a work row, and a key keeps its work
    row while it holds the duty (here: waiting for a retry). New rows of that key are left to
    the claim function, which returns them as reclaimed; another key's new row goes steady."""
    await insert_sequenced(conn, topic, keys=1, per_key=2)
    await owners.claim("owner-a")
    await expire(conn)
    taken = await owners.claim("owner-b")  # takes the expired lease, then retries later
    assert all(r.reclaimed for r in taken.records)
    retry = Result(Outcome.RETRY, error="try later", delay=3600.0)
    await Settler(owners.store, retry_for=1.0, owner="owner-b").settle(
        taken, [retry] * len(taken.records)
    )
    assert await duties(conn) == {"key-0": "owner-a"}
    await insert_sequenced(conn, topic, keys=2, per_key=1, first_seq=2)  # key-0 and key-1
    steady = DispatchStore(pool, STATEMENTS, steady=True)
    claimer = Claimer(steady, owners.settings, "owner-c")
    fresh = await claimer.claim()
    assert fresh is not None and [r.ordering_key for r in fresh.records] == ["key-1"]
    assert not any(r.reclaimed for r in fresh.records)
    await conn.execute("UPDATE outbox SET next_attempt_at = now() WHERE ordering_key = 'key-0'")
    await conn.execute("UPDATE outbox_work SET not_before = now() WHERE ordering_key = 'key-0'")
    due = await claimer.claim()
    assert due is not None and not due.steady
    assert [r.ordering_key for r in due.records] == ["key-0"] * 3
    assert all(r.reclaimed for r in due.records), "the claim function: a takeover"


async def test_the_crash_loop_reclaimer_keeps_the_duty_of_the_key(
    conn: asyncpg.Connection, owners: Owners, eos_settings: Callable[..., Settings], topic: str
) -> None:
    """E13 (in part): the reclaimer dead-letters an expired claim's rows at their last attempt
    and the key goes on; its later rows' claim is a takeover (reads the progress first)."""
    settings = eos_settings(max_attempts=2)
    await insert_sequenced(conn, topic, keys=1, per_key=3)
    await owners.claim("owner-a", settings.model_copy(update={"batch_size": 2}))
    await conn.execute("UPDATE outbox SET attempts = 1 WHERE id IN (SELECT id FROM outbox_leases)")
    await expire(conn)
    dead = await owners.store.dead_letter_crash_loops(max_attempts=2, block_on_dead=False)
    assert len(dead) == 2
    assert await duties(conn) == {"key-0": "owner-a"}
    later = await owners.claim("owner-b", settings)
    assert len(later.records) == 1 and later.records[0].reclaimed
    assert uuid.UUID(str(later.token))


async def test_only_the_live_lease_holder_clears_the_duty(
    conn: asyncpg.Connection, owners: Owners, topic: str
) -> None:
    """`reconciled` clears a key's duty only under the caller's live lease: another owner, or
    the holder once its lease expired (its taker must read the progress again), clears nothing."""
    await insert_sequenced(conn, topic, keys=1, per_key=2)
    await owners.claim("owner-a")
    await expire(conn)
    await owners.claim("owner-b")
    clear = owners.store.reconciled
    assert await clear(owner="owner-c", keys=["key-0"], keyless=[False]) == 0, "not its lease"
    await expire(conn)
    assert await clear(owner="owner-b", keys=["key-0"], keyless=[False]) == 0, "expired"
    assert await duties(conn) == {"key-0": "owner-a"}
    await owners.claim("owner-c")
    assert await clear(owner="owner-c", keys=["key-0"], keyless=[False]) == 1
    assert await duties(conn) == {"key-0": None}


async def test_crash_loop_rows_a_lost_claim_committed_are_published_not_dead(
    conn: asyncpg.Connection,
    owners: Owners,
    eos_settings: Callable[..., Settings],
    topic: str,
    services: Services,
) -> None:
    """E13: owner-a committed key-0's rows and died before its mark, at their last attempt; it
    claimed key-1's too and sent nothing of them. The reclaimer dead-letters all of them (a
    crash loop); the exactly-once step after it fences, reads the progress and marks key-0's
    published (status no longer says dead, `dead requeue` has nothing to send again); key-1's
    stay dead, for good (their token cleared)."""
    settings = eos_settings(max_attempts=2)
    await insert_sequenced(conn, topic, keys=2, per_key=3)
    a = await owners.publisher("owner-a")
    b = await owners.publisher("owner-b")
    lost = await owners.claim("owner-a", settings)
    sent = [r for r in lost.records if r.ordering_key == "key-0"]
    assert (await run(a.publish(sent))).outcomes == [None] * 3
    await conn.execute("UPDATE outbox SET attempts = 1")
    await expire(conn)
    dead = await owners.store.dead_letter_crash_loops(max_attempts=2, block_on_dead=False)
    assert len(dead) == 6
    await settle_crash_loops(owners.store, settings, b.committed_of)
    published = "published_at IS NOT NULL AND dead_at IS NULL"
    assert await count(conn, f"ordering_key = 'key-0' AND {published}") == 3
    assert await count(conn, "ordering_key = 'key-1' AND dead_at IS NOT NULL") == 3
    assert await count(conn, "lease_token IS NOT NULL") == 0, "every one decided"
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 3


async def test_at_least_once_clears_the_duty_at_its_takeover(
    conn: asyncpg.Connection, pool: Any, make_settings: Callable[..., Settings], topic: str
) -> None:
    """At-least-once reads no progress: its takeover claim clears the key's duty at once, so the
    key's later claims are not reclaims again (outbox_lease_reclaims_total counted every claim
    of the key until it drained)."""
    settings = make_settings(batch_size=2)
    store = DispatchStore(pool, STATEMENTS)
    await insert_sequenced(conn, topic, keys=1, per_key=4)
    lost = await Claimer(store, settings, "owner-a").claim()
    assert lost is not None and len(lost.records) == 2
    await expire(conn)
    b = Claimer(store, settings, "owner-b")
    taken = await b.claim()
    assert taken is not None and all(r.reclaimed for r in taken.records)
    assert await duties(conn) == {"key-0": None}
    settled = await Settler(store, retry_for=1.0, owner="owner-b").settle(
        taken, [PUBLISHED] * len(taken.records)
    )
    assert settled == len(taken.records)
    after = await b.claim()
    assert after is not None and after.records
    assert not any(r.reclaimed for r in after.records)
