"""Exactly-once's progress lists against real PostgreSQL and Kafka (issue 35, review E5, E8,
E9): a stale record never marks a replayed row, a row of a truncated table or another
database's row unsent; batches nobody needs leave a lane's list; keys end with tombstones, so
that the progress topic stops growing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.kafka.exactly_once import retirement
from outbox_dispatcher.kafka.exactly_once.delivery import (
    OutboxTruncatedError,
    TransactionAbortedError,
)
from outbox_dispatcher.kafka.exactly_once.lanes import LANES
from outbox_dispatcher.models import PUBLISHED, Batch
from outbox_dispatcher.store import db, migrations

from .helpers import Services, cli, count, insert_sequenced, running, wait_all_settled
from .test_exactly_once import Owners, eos_settings, expire, owners, read_all, run

pytestmark = pytest.mark.integration

__all__ = ["eos_settings", "owners"]  # fixtures


async def mark(owners: Owners, owner: str, batch: Batch, rows: list[Any]) -> int:
    """The owner's settle of these rows as published (as the claim loop settles a batch)."""
    settler = Settler(owners.store, retry_for=1.0, owner=owner)
    return int(await settler.settle(Batch(batch.token, rows), [PUBLISHED] * len(rows)))


async def progress_records(bootstrap: str, topic: str) -> list[tuple[bytes, bytes | None, float]]:
    """Every committed record of the progress topic, in order: key, value, when it was
    written (the broker's timestamp, seconds)."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level="read_committed",
    )
    await consumer.start()
    found: list[tuple[bytes, bytes | None, float]] = []
    try:
        quiet = 0
        while quiet < 4:
            batch = await consumer.getmany(timeout_ms=500)
            got = [(r.key or b"", r.value, r.timestamp / 1000) for rs in batch.values() for r in rs]
            found.extend(got)
            quiet = 0 if got else quiet + 1
    finally:
        await consumer.stop()
    return found


async def latest_values(bootstrap: str, topic: str) -> dict[bytes, bytes | None]:
    """The progress topic's last committed value of each key (None: a tombstone)."""
    return {key: value for key, value, _ in await progress_records(bootstrap, topic)}


# --- E5: pairs and the identity -------------------------------------------------------------------


async def test_a_row_replayed_while_a_stale_record_lists_it_is_sent_again_by_a_takeover(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    """E5(a): 10 rows published and marked; owner-a's last progress record still lists them.
    An operator replays them (`outbox-dispatcher replay`): the same ids are pending again. The
    claim of owner-c (which then dies) is taken over by owner-b: the replayed rows must reach
    read_committed consumers a second time. Before pairs, the stale record marked all 10
    published without sending them."""
    await insert_sequenced(conn, topic, keys=1, per_key=10)
    a = await owners.publisher("owner-a")
    first = await owners.claim("owner-a")
    sent = a.publish(first.records)
    assert (await run(sent)).outcomes == [None] * 10
    assert await mark(owners, "owner-a", first, first.records) == 10
    a.marked(sent, every_row=True)  # owner-a goes on, idle: its last record lists the 10 rows
    replayed = await cli(owners.settings, "replay", "--key", "key-0")
    assert replayed.code == 0 and "replayed 10 published rows" in replayed.out, replayed.err
    lost = await owners.claim("owner-c")  # then it hung, and was killed
    assert [r.replays for r in lost.records] == [1] * 10
    await expire(conn)
    b = await owners.publisher("owner-b")
    taken = await owners.claim("owner-b")
    assert len(taken.records) == 10 and all(r.reclaimed for r in taken.records)
    delivery = b.publish(taken.records)
    assert (await run(delivery)).outcomes == [None] * 10
    assert sorted(delivery.sent) == sorted((r.id, 1) for r in first.records), "sent again"
    assert await mark(owners, "owner-b", taken, taken.records) == 10
    delivered = await read_all(services.kafka_bootstrap_servers, topic, "read_committed")
    assert len(delivered) == 20, "each row twice: once, and once more for the replay"
    assert await count(conn, "published_at IS NULL") == 0


async def test_a_table_truncated_with_restart_identity_never_takes_its_old_records(
    conn: asyncpg.Connection,
    owners: Owners,
    topic: str,
    services: Services,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """E5(b): owner-a committed rows 1-4 and never marked them; then `TRUNCATE outbox RESTART
    IDENTITY` and 4 new rows (ids 1-4 again). owner-b, started before the TRUNCATE (its
    identity in memory is the old one), takes over owner-c's claim of the new rows: it reads the
    identity again, the old record is another's, and the 4 new rows are sent. Before, the
    identity (database and table oid) survived the TRUNCATE and the rows were marked unsent.
    Its first try is aborted: a claim made while the old identity was known is never sent
    under the new one."""
    await insert_sequenced(conn, topic, keys=2, per_key=2)
    b = await owners.publisher("owner-b")
    # owner-b's periodic check read the identity just now: only the takeover reads it again
    monkeypatch.setattr(retirement, "RETIRE_EVERY_SECONDS", 3600.0)
    await b.retire.check(b.lanes, force=True)
    a = await owners.publisher("owner-a")
    old = await owners.claim("owner-a")
    assert (await run(a.publish(old.records))).outcomes == [None] * 4  # committed, not marked
    before = await owners.store.outbox_identity()
    await conn.execute("TRUNCATE outbox RESTART IDENTITY")
    assert await owners.store.outbox_identity() != before, "a TRUNCATE draws a new identity"
    await insert_sequenced(conn, topic, keys=2, per_key=2, first_seq=100)
    lost = await owners.claim("owner-c")
    assert sorted(r.id for r in lost.records) == [1, 2, 3, 4]
    await expire(conn)
    taken = await owners.claim("owner-b")
    assert all(r.reclaimed for r in taken.records)
    # Claimed while owner-b knew the old identity: once its takeover reads the new one, nothing
    # of the claim is sent (its rows may be the old table's; which, the claim cannot tell),
    # and they are retried at once, not counted.
    first = b.publish(taken.records)
    assert all(isinstance(o, OutboxTruncatedError) for o in (await run(first)).outcomes)
    await expire(conn)
    taken = await owners.claim("owner-b")
    delivery = b.publish(taken.records)
    assert (await run(delivery)).outcomes == [None] * 4
    assert sorted(i for i, _ in delivery.sent) == [1, 2, 3, 4], "the new rows are sent"
    delivered = await read_all(services.kafka_bootstrap_servers, topic, "read_committed")
    assert len(delivered) == 8


async def test_two_databases_migrated_the_same_way_never_take_each_others_records(
    conn: asyncpg.Connection,
    empty_database_url: str,
    eos_settings: Callable[..., Settings],
    owners: Owners,
    topic: str,
    services: Services,
) -> None:
    """E5(c): two databases migrated the same way, one progress topic and one outbox name. Each
    draws its own identity at migrate time; owner-x's record of rows 1-4 of the second is not
    taken for rows 1-4 of the first, which owner-q sends after owner-p's claim was lost."""
    other_conn = await asyncpg.connect(empty_database_url)
    await migrations.migrate(other_conn, "public", "outbox")
    other_pool = await asyncpg.create_pool(empty_database_url, init=db.init_connection)
    other = Owners(eos_settings(database_url=empty_database_url), other_pool)
    try:
        identities = {await owners.store.outbox_identity(), await other.store.outbox_identity()}
        assert len(identities) == 2, "each database its own identity"
        await insert_sequenced(other_conn, topic, keys=2, per_key=2)
        x = await other.publisher("owner-x")
        claimed = await other.claim("owner-x")
        assert sorted(r.id for r in claimed.records) == [1, 2, 3, 4]
        assert (await run(x.publish(claimed.records))).outcomes == [None] * 4  # never marked
        await insert_sequenced(conn, topic, keys=2, per_key=2, first_seq=100)
        await owners.claim("owner-p")  # and it died
        await expire(conn)
        q = await owners.publisher("owner-q")
        taken = await owners.claim("owner-q")
        assert sorted(r.id for r in taken.records) == [1, 2, 3, 4]
        delivery = q.publish(taken.records)
        assert (await run(delivery)).outcomes == [None] * 4
        assert sorted(i for i, _ in delivery.sent) == [1, 2, 3, 4]
        delivered = await read_all(services.kafka_bootstrap_servers, topic, "read_committed")
        assert len(delivered) == 8
    finally:
        await other.stop()
        await other_pool.close()
        await other_conn.close()


# --- E8: what a lane lists ------------------------------------------------------------------------


async def test_a_batch_whose_mark_failed_leaves_the_list_once_its_rows_are_settled(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    """E8: owner-a's mark of a committed batch is taken for failed (its reply lost: the claim
    loop never learns it changed the rows); the batch stays listed. Its next transaction finds
    none of the batch's rows pending and no longer lists it, in memory or in its progress
    record. Before, the batch stayed listed for the life of the process, in every record."""
    await insert_sequenced(conn, topic, keys=2, per_key=2)
    a = await owners.publisher("owner-a", lanes=1)
    stuck = await owners.claim("owner-a")
    failed = a.publish(stuck.records)
    assert (await run(failed)).outcomes == [None] * 4
    a.marked(failed, every_row=False)  # the mark seemed to fail
    assert set(a.unmarked) == {failed.tag}
    assert await mark(owners, "owner-a", stuck, stuck.records) == 4  # it had gone through
    await insert_sequenced(conn, topic, keys=1, per_key=2, first_seq=100)
    later = await owners.claim("owner-a")
    a.retire.soon()  # (its check runs at most every 5 s: now, for the test)
    after = a.publish(later.records)
    assert (await run(after)).outcomes == [None] * 2
    assert set(a.unmarked) == {after.tag}, "the settled batch left the list"
    batches = owners.last_batches(a, await a.read_progress())
    assert set(batches["owner-a"]) == {after.tag}, "and the record"
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 6


async def test_a_batch_whose_rows_are_still_pending_stays_listed(
    conn: asyncpg.Connection, owners: Owners, topic: str
) -> None:
    """The other side of the rule: while a row of the batch is pending (its lease not yet taken
    over), the batch stays listed, however often the check runs."""
    await insert_sequenced(conn, topic, keys=1, per_key=4)
    a = await owners.publisher("owner-a", lanes=1)
    stuck = await owners.claim("owner-a")
    failed = a.publish(stuck.records)
    assert (await run(failed)).outcomes == [None] * 4
    a.marked(failed, every_row=False)
    await insert_sequenced(conn, topic, keys=2, per_key=1, first_seq=100)  # key-1 is free
    later = await owners.claim("owner-a")
    a.retire.soon()
    after = a.publish(later.records)
    assert (await run(after)).outcomes == [None]
    batches = owners.last_batches(a, await a.read_progress())
    assert set(batches["owner-a"]) == {failed.tag, after.tag}


async def test_an_oversized_progress_record_is_an_outage_of_the_lane_until_retired(
    conn: asyncpg.Connection,
    eos_settings: Callable[..., Settings],
    pool: Any,
    topic: str,
    services: Services,
) -> None:
    """E8: a lane lists a stuck batch of 300 rows still pending (as when its marks failed and
    the leases have not been taken over yet), more than OUTBOX_KAFKA_MAX_REQUEST_BYTES takes.
    Its next transaction is aborted as in an outage: the rows retried, none refused, the
    producer kept, nothing handed to the broker. Once the stuck rows are settled (a takeover
    marked them), the check retires the batch and the rows go. Before, the broker's refusal of
    the record was the rows' refusal and replaced the producer, at every claim."""
    await insert_sequenced(conn, topic, keys=2, per_key=1)
    made = Owners(eos_settings(batch_size=10, kafka_max_request_bytes=2048), pool)
    try:
        a = await made.publisher("owner-a", lanes=1)
        lane = a.lanes[0]
        claimed = await made.claim("owner-a")
        await insert_sequenced(conn, topic, keys=1, per_key=300, first_seq=100)  # key-0's: leased
        lane.unmarked["stuck"] = [(i, 0) for i in range(3, 303)]
        since, name = lane.producers.since, lane.name
        aborted = await run(a.publish(claimed.records, claimed_at=since))
        assert [type(o) for o in aborted.outcomes] == [TransactionAbortedError] * 2, aborted
        assert (lane.producers.since, lane.name) == (since, name), "the producer is kept"
        handed = await read_all(services.kafka_bootstrap_servers, topic, "read_uncommitted")
        assert handed == [], "nothing was handed to the broker"
        await conn.execute("UPDATE outbox SET published_at = now() WHERE id >= 3")  # taken over
        again = await run(a.publish(claimed.records, claimed_at=since))
        assert again.outcomes == [None] * 2 and "stuck" not in lane.unmarked
    finally:
        await made.stop()
    assert len(await read_all(services.kafka_bootstrap_servers, topic, "read_committed")) == 2


# --- E9: keys end ---------------------------------------------------------------------------------


async def test_graceful_starts_and_stops_leave_no_live_key_in_the_progress_topic(
    conn: asyncpg.Connection,
    eos_settings: Callable[..., Settings],
    topic: str,
    services: Services,
) -> None:
    """E9: 5 dispatchers in turn, each publishing 20 rows and stopping gracefully. Each lane
    tombstones its id at the stop: the compacted topic keeps no key whose last value is a
    record. Before, each start left its lanes' keys for ever (10 here)."""
    settings = eos_settings(claim_tasks=LANES, batch_size=5)
    for cycle in range(5):
        await insert_sequenced(conn, topic, keys=4, per_key=5, first_seq=100 * cycle)
        async with running(settings):
            await wait_all_settled(conn, 60)
    last = await latest_values(services.kafka_bootstrap_servers, settings.progress_topic)
    live = [key for key, value in last.items() if value is not None]
    assert len(last) >= 5, "every dispatcher wrote progress"
    assert live == [], f"{len(live)} of {len(last)} keys live"
    delivered = await read_all(services.kafka_bootstrap_servers, topic, "read_committed")
    assert len(delivered) == 100


async def test_a_takeover_tombstones_the_dead_owners_key_once_its_rows_are_settled(
    conn: asyncpg.Connection, owners: Owners, topic: str, services: Services
) -> None:
    """E9: owner-a committed and died before its mark; owner-b takes over and marks the rows.
    owner-a's key (its record lists only settled rows now, and it no longer beats) gets a
    tombstone in owner-b's next transaction; owner-b's own keys stay (it runs)."""
    await insert_sequenced(conn, topic, keys=2, per_key=2)
    a = await owners.publisher("owner-a", lanes=1)
    b = await owners.publisher("owner-b", lanes=1)
    lost = await owners.claim("owner-a")
    assert (await run(a.publish(lost.records))).outcomes == [None] * 4  # then it died
    await expire(conn)
    taken = await owners.claim("owner-b")
    delivery = b.publish(taken.records)
    assert (await run(delivery)).outcomes == [None] * 4 and delivery.sent == []
    assert await mark(owners, "owner-b", taken, taken.records) == 4
    b.marked(delivery, every_row=True)
    await insert_sequenced(conn, topic, keys=1, per_key=1, first_seq=100)
    later = await owners.claim("owner-b")
    b.retire.soon()
    assert (await run(b.publish(later.records))).outcomes == [None]
    last = await latest_values(services.kafka_bootstrap_servers, owners.settings.progress_topic)
    key_a = a.lanes[0].transactional_id.encode()
    key_b = b.lanes[0].transactional_id.encode()
    assert last[key_a] is None, "the dead owner's key ended"
    assert last[key_b] is not None
