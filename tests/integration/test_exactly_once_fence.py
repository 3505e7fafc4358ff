"""Exactly-once's fences (issue 35, review E6, E7): a takeover fences the owners whose claims it
stands in for whatever their heartbeat's age, and a takeover that cannot fence them or read the
progress gives its rows back uncounted (never a crash-loop dead-letter), their keys keeping the
duty. Real PostgreSQL and Kafka; the registry is the real table (`<table>_dispatchers`), as the
supervisor reads it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import pytest
from aiokafka import errors as kafka_errors

from outbox_dispatcher import registry
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.leases import reclaim_step, settle_crash_loops
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.kafka.exactly_once import takeover
from outbox_dispatcher.kafka.exactly_once.lanes import Registry
from outbox_dispatcher.kafka.exactly_once.publisher import TransactionalPublisher
from outbox_dispatcher.kafka.exactly_once.takeover import TakeoverWaitingError
from outbox_dispatcher.metrics import Metrics
from outbox_dispatcher.models import PUBLISHED, Batch
from outbox_dispatcher.retries import RetryPolicy
from outbox_dispatcher.store import DispatchStore, migrations

from .helpers import Services, cli, count, insert_sequenced
from .test_exactly_once import Owners, eos_settings, expire, read_all, run

pytestmark = pytest.mark.integration
FIXTURES = (eos_settings,)  # test_exactly_once.py's, used here by name


class Registered(Owners):
    """Owners whose registry is the real table: each beats (as the supervisor does before it
    records its ids) and a takeover reads the rows as the supervisor's registry does."""

    def registry(self, owner: str) -> Registry:
        return registry.transactional_registry(self.store, owner)

    async def publisher(self, owner: str, lanes: int = 2) -> TransactionalPublisher:
        await self.store.dispatcher_beat(
            owner=owner,
            dead_letter_policy="skip",
            version=migrations.latest_version(),
            totals=(0, 0),
            delivery="exactly-once",
        )
        return await super().publisher(owner, lanes)


@pytest.fixture
async def owners(eos_settings: Callable[..., Settings], pool: Any) -> AsyncIterator[Registered]:
    made = Registered(eos_settings(max_attempts=2), pool)
    try:
        yield made
    finally:
        await made.stop()


async def test_a_zombie_paused_past_the_fence_window_is_fenced_by_the_takeover(
    conn: asyncpg.Connection, owners: Registered, topic: str, services: Services
) -> None:
    """E6: owner-a claims and pauses before its transaction; its heartbeat ages 2 hours (past
    the one-hour window of live dispatchers), its lease expires, owner-b takes over and sends.
    owner-a resumes and sends its old claim: its producer was fenced (the duty names it), so
    read_committed consumers have each row once (before: twice)."""
    await insert_sequenced(conn, topic, keys=4, per_key=3)
    a = await owners.publisher("owner-a")
    b = await owners.publisher("owner-b")
    began = asyncio.get_running_loop().time()
    claimed = await owners.claim("owner-a")  # then it pauses
    await conn.execute(
        "UPDATE outbox_dispatchers SET heartbeat_at = now() - interval '2 hours'"
        " WHERE owner = 'owner-a'"
    )
    await expire(conn)
    taken = await owners.claim("owner-b")
    assert all(r.reclaimed for r in taken.records)
    delivery = b.publish(taken.records)
    assert (await run(delivery)).outcomes == [None] * 12 and len(delivery.sent) == 12
    late = await run(a.publish(claimed.records, claimed_at=began))  # owner-a resumes
    copies = await read_all(services.kafka_bootstrap_servers, topic, "read_committed")
    assert len(copies) == 12, "owner-a's old claim committed again"
    assert None not in late.outcomes, late


@pytest.mark.parametrize("fault", ["fence", "read"])
async def test_a_takeover_that_cannot_fence_or_read_counts_no_attempt(
    conn: asyncpg.Connection,
    owners: Registered,
    topic: str,
    services: Services,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
) -> None:
    """E7: owner-a committed its claim and died before the mark. owner-b's takeover cannot fence
    owner-a's ids (their markers cannot be written: faked at our seam, kafka/exactly_once/progress's
    fence) or cannot read the progress, 4 times with max_attempts 2: each time its rows go back
    uncounted (their wait skipped here), the key keeping the duty; none is dead-lettered by the
    reclaimer (before: kept leased, every try counted an attempt, and the second dead-lettered the
    rows as a crash loop). Once the fault is gone the takeover finds them committed and sends none
    again."""
    await insert_sequenced(conn, topic, keys=2, per_key=3)
    a = await owners.publisher("owner-a")
    lost = await owners.claim("owner-a")
    assert (await run(a.publish(lost.records))).outcomes == [None] * 6
    await a.stop()  # killed before its mark
    a_ids = set(owners.ids.get("owner-a") or [])
    await expire(conn)
    b = await owners.publisher("owner-b")
    real_fence = takeover.progress.fence
    real_read = takeover.progress.read_committed

    async def fence(config: Any, transactional_id: str, seconds: float) -> None:
        if transactional_id in a_ids or not a_ids:
            raise kafka_errors.KafkaTimeoutError("its markers cannot be written")
        await real_fence(config, transactional_id, seconds)

    async def unread(*_: Any, **__: Any) -> list[bytes | None]:
        raise kafka_errors.KafkaConnectionError("the broker is away")

    if fault == "fence":
        monkeypatch.setattr(takeover.progress, "fence", fence)
    else:
        monkeypatch.setattr(takeover.progress, "read_committed", unread)
    policy = RetryPolicy(owners.settings)
    settler = Settler(owners.store, retry_for=1.0, owner="owner-b")
    for _ in range(4):
        taken = await Claimer(owners.store, owners.settings, "owner-b").claim()
        assert taken is not None, "the key was left to the crash-loop reclaimer"
        assert all(r.reclaimed for r in taken.records)
        delivery = b.publish(taken.records)
        part = await run(delivery)
        assert delivery.sent == [] and not delivery.begun
        if part.indices:
            results = policy.results([delivery.records[i] for i in part.indices], part.outcomes)
            assert not any(r.counted for r in results)
            await settler.settle(Batch(taken.token, delivery.records), results)
        await conn.execute("UPDATE outbox SET next_attempt_at = now()")
        await conn.execute("UPDATE outbox_work SET not_before = now()")
        await expire(conn)  # (a lease still held: as if it ran out)
        await owners.store.dead_letter_crash_loops(max_attempts=2, block_on_dead=False)
    assert await count(conn, "dead_at IS NOT NULL") == 0
    assert await count(conn, "attempts > 1") == 0, "the lost owner's death counted once"
    duty = await conn.fetch("SELECT DISTINCT reconcile_owner FROM outbox_work")
    assert [r["reconcile_owner"] for r in duty] == ["owner-a"]
    monkeypatch.setattr(takeover.progress, "fence", real_fence)
    monkeypatch.setattr(takeover.progress, "read_committed", real_read)
    taken = await Claimer(owners.store, owners.settings, "owner-b").claim()
    assert taken is not None and len(taken.records) == 6
    delivery = b.publish(taken.records)
    assert (await run(delivery)).outcomes == [None] * 6 and delivery.sent == []
    await settler.settle(taken, [PUBLISHED] * 6)
    assert await count(conn, "published_at IS NULL") == 0
    copies = await read_all(services.kafka_bootstrap_servers, topic, "read_committed")
    assert len(copies) == 6


async def test_a_crash_loop_at_one_attempt_publishes_what_the_lost_claim_committed(
    conn: asyncpg.Connection,
    owners: Registered,
    eos_settings: Callable[..., Settings],
    topic: str,
    services: Services,
) -> None:
    """E13 with max_attempts 1 (the review's check): owner-a commits its claim and is killed
    before the mark, its heartbeat hours old. The reclaimer's step dead-letters the rows (the
    lease expired at their last attempt), then, in exactly-once, fences owner-a strictly (the
    lost claim's owner, whatever its heartbeat's age) and reads the progress: the rows are
    published, not dead, and `dead requeue --all` has nothing to send again."""
    settings = eos_settings(max_attempts=1)
    await insert_sequenced(conn, topic, keys=2, per_key=3)
    a = await owners.publisher("owner-a")
    b = await owners.publisher("owner-b")
    lost = await owners.claim("owner-a", settings)
    assert (await run(a.publish(lost.records))).outcomes == [None] * 6
    await a.stop()  # killed before its mark
    await conn.execute(
        "UPDATE outbox_dispatchers SET heartbeat_at = now() - interval '2 hours'"
        " WHERE owner = 'owner-a'"
    )
    await expire(conn)
    dead = await owners.store.dead_letter_crash_loops(max_attempts=1, block_on_dead=False)
    assert len(dead) == 6
    await settle_crash_loops(owners.store, settings, b.committed_of)
    assert await count(conn, "published_at IS NOT NULL AND dead_at IS NULL") == 6
    assert (await cli(settings, "dead", "requeue", "--all")).code == 0
    assert await count(conn, "published_at IS NULL") == 0
    copies = await read_all(services.kafka_bootstrap_servers, topic, "read_committed")
    assert len(copies) == 6


async def test_a_takeover_whose_lease_expired_before_it_cleared_the_duty_sends_nothing(
    conn: asyncpg.Connection, owners: Registered, topic: str, services: Services
) -> None:
    """owner-b takes owner-a's keys over and is slow: its leases expire before it clears their
    duty, which still names owner-a. Had it sent, the next taker, fencing only owner-a, would
    not have fenced owner-b (a zombie then). So it sends nothing; its rows go back uncounted."""
    await insert_sequenced(conn, topic, keys=2, per_key=3)
    await owners.publisher("owner-a")
    await owners.claim("owner-a")  # never sent
    await expire(conn)
    b = await owners.publisher("owner-b")
    taken = await owners.claim("owner-b")
    await expire(conn)  # owner-b was slow
    delivery = b.publish(taken.records)
    part = await run(delivery)
    assert delivery.sent == [] and not delivery.begun, "sent under a duty it left standing"
    assert all(isinstance(o, TakeoverWaitingError) for o in part.outcomes), part
    assert await read_all(services.kafka_bootstrap_servers, topic, "read_committed") == []


async def key_0_committed_by_a_lost_claim(
    conn: asyncpg.Connection, owners: Registered, settings: Settings, topic: str
) -> Any:
    """owner-a claimed 2 keys x 3 rows, committed key-0's in Kafka, sent none of key-1's and
    was killed before its mark; its lease has expired. owner-b's publisher (which reads the
    progress for the reclaimer) is returned."""
    await insert_sequenced(conn, topic, keys=2, per_key=3)
    a = await owners.publisher("owner-a")
    b = await owners.publisher("owner-b")
    lost = await owners.claim("owner-a", settings)
    sent = [r for r in lost.records if r.ordering_key == "key-0"]
    assert (await run(a.publish(sent))).outcomes == [None] * 3
    await a.stop()  # killed before its mark
    await expire(conn)
    return b


async def assert_key_0_published_and_key_1_dead(
    conn: asyncpg.Connection, services: Services, topic: str
) -> None:
    published = "published_at IS NOT NULL AND dead_at IS NULL"
    assert await count(conn, f"ordering_key = 'key-0' AND {published}") == 3
    assert await count(conn, "ordering_key = 'key-1' AND dead_at IS NOT NULL") == 3
    assert await count(conn, "lease_token IS NOT NULL") == 0, "every one decided"
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 3


async def test_the_reclaimer_dead_letters_nothing_while_the_progress_cannot_be_read(
    conn: asyncpg.Connection,
    owners: Registered,
    eos_settings: Callable[..., Settings],
    topic: str,
    services: Services,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """E13: with max_attempts 1, owner-a committed key-0's rows, claimed key-1's and sent none,
    and was killed before its mark. While the progress cannot be read, the reclaimer's step
    dead-letters nothing (before: all 6 rows dead, and `dead requeue` in that window sent key-0's
    again once its work was gone); once it can, it reads first: key-0's rows are published,
    key-1's dead."""
    settings = eos_settings(max_attempts=1)
    b = await key_0_committed_by_a_lost_claim(conn, owners, settings, topic)
    real_read = takeover.progress.read_committed

    async def unread(*_: Any, **__: Any) -> list[bytes | None]:
        raise kafka_errors.KafkaConnectionError("the broker is away")

    monkeypatch.setattr(takeover.progress, "read_committed", unread)
    await reclaim_step(owners.store, settings, Metrics(), b.committed_of)
    assert await count(conn, "dead_at IS NOT NULL") == 0, "dead before their progress was read"
    monkeypatch.setattr(takeover.progress, "read_committed", real_read)
    await reclaim_step(owners.store, settings, Metrics(), b.committed_of)
    await assert_key_0_published_and_key_1_dead(conn, services, topic)


class _DiesAfterTheDeadLetter(DispatchStore):
    """The database goes away right after the crash-loop dead-letter statement (once): the
    next statement fails as a dropped connection does."""

    def __init__(self, store: DispatchStore, fault: dict[str, bool]) -> None:
        super().__init__(store.executor, store.statements)
        self.fault = fault  # shared with copies of the store

    async def _fetch(self, name: str, **values: object) -> list[Any]:
        if self.fault["armed"] and self.fault["dead_lettered"]:
            self.fault["armed"] = False
            raise asyncpg.ConnectionDoesNotExistError("the database went away")
        rows = await super()._fetch(name, **values)
        if name == "dead_letter_crash_loops":
            self.fault["dead_lettered"] = True
        return rows


async def test_a_database_failure_right_after_the_dead_letter_shows_no_committed_row_dead(
    conn: asyncpg.Connection,
    owners: Registered,
    eos_settings: Callable[..., Settings],
    topic: str,
    services: Services,
) -> None:
    """E13's last gap: owner-a committed key-0's rows, claimed key-1's and sent none, and was
    killed before its mark (max_attempts 1). The reclaimer reads the progress, dead-letters, and
    the database fails right after the dead-letter statement. The dead-letter, the publish of
    what the lost claim committed and the checked mark of the rest are one transaction: nothing
    is dead-lettered (before: key-0's 3 committed rows stayed dead until a later step read
    them, and a `dead requeue` meanwhile sent them again). The next step decides them all."""
    settings = eos_settings(max_attempts=1)
    b = await key_0_committed_by_a_lost_claim(conn, owners, settings, topic)
    fault = {"armed": True, "dead_lettered": False}
    failing = _DiesAfterTheDeadLetter(owners.store, fault)
    with pytest.raises(asyncpg.ConnectionDoesNotExistError):
        await reclaim_step(failing, settings, Metrics(), b.committed_of)
    assert fault["dead_lettered"], "the fault came after the dead-letter"
    shown_dead = await count(conn, "ordering_key = 'key-0' AND dead_at IS NOT NULL")
    assert shown_dead == 0, "committed rows shown dead"
    await reclaim_step(failing, settings, Metrics(), b.committed_of)
    await assert_key_0_published_and_key_1_dead(conn, services, topic)
