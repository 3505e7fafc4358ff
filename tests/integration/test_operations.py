"""Operator commands and table hygiene against real PostgreSQL and Kafka, with live dispatchers.

Each command runs at least once as a real `python -m outbox_dispatcher ...` process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiokafka import ConsumerRecord
from aiokafka.admin import AIOKafkaAdminClient

from outbox_dispatcher import cleanup
from outbox_dispatcher.cli import tables
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.operate import listings, reads
from outbox_dispatcher.operate.actions import DeadDiscard, Replay, perform
from outbox_dispatcher.operate.filters import Filters
from outbox_dispatcher.operate.pauses import Pause
from outbox_dispatcher.operate.session import Session
from outbox_dispatcher.store import DispatchStore, Statements, db, migrations
from tests.unit.test_console_extra import SITECUSTOMIZE

from .helpers import (
    Services,
    check,
    cli,
    consume,
    count,
    event_ids,
    insert_sequenced,
    running,
    sessions_waiting_on_a_lock,
    wait_all_settled,
    wait_until,
)

pytestmark = pytest.mark.integration

STATEMENTS = Statements.for_table("public", "outbox")


def session(conn: asyncpg.Connection) -> Session:
    return Session(conn, STATEMENTS, "public.outbox")


def settings_for(make_settings: Any, **overrides: Any) -> Settings:
    values: dict[str, Any] = {"http_port": 0, "batch_size": 10, "scan_factor": 2}
    values.update(overrides)
    settings: Settings = make_settings(**values)
    return settings


def per_key(records: list[ConsumerRecord[bytes, bytes]]) -> dict[bytes | None, list[str]]:
    """Event ids per key, in partition (delivery) order."""
    keys: dict[bytes | None, list[str]] = defaultdict(list)
    for record in sorted(records, key=lambda r: (r.partition, r.offset)):
        keys[record.key].append(dict(record.headers)["event-id"].decode())
    return keys


async def ids_by_key(conn: asyncpg.Connection, topic: str) -> dict[bytes | None, list[str]]:
    rows = await conn.fetch(
        "SELECT ordering_key, event_id FROM outbox WHERE topic = $1 ORDER BY id", topic
    )
    keys: dict[bytes | None, list[str]] = defaultdict(list)
    for row in rows:
        keys[row["ordering_key"].encode()].append(str(row["event_id"]))
    return keys


# --- pause / resume -------------------------------------------------------------------------------


async def test_pause_holds_a_topic_while_others_flow_and_resume_publishes_in_order(
    conn: asyncpg.Connection, services: Services, make_topic: Any, make_settings: Any
) -> None:
    paused_topic, other = await make_topic(), await make_topic()
    # Routed rows go to `other`; a window of 20 rows, far fewer than the paused backlog.
    settings = settings_for(make_settings, default_topic=other)
    async with running(settings):
        whole = await cli(settings, "pause", "--reason", "maintenance")
        assert whole.code == 0, whole.err
        assert "paused the whole table" in whole.out
        # The paused topic's backlog comes first in id order, then a key with rows in both
        # topics, then the other topic and a routed row.
        await insert_sequenced(conn, paused_topic, keys=10, per_key=10)
        shared_first = await conn.fetchval(
            'SELECT outbox_enqueue($1, \'shared\', \'{"key": "shared", "seq": 0}\')',
            paused_topic,
        )
        shared_second = await conn.fetchval(
            'SELECT outbox_enqueue($1, \'shared\', \'{"key": "shared", "seq": 1}\')', other
        )
        await conn.execute(
            "INSERT INTO outbox (topic, ordering_key, payload) "
            "SELECT $1, 'other-' || n % 5, 'o' FROM generate_series(1, 50) n",
            other,
        )
        await conn.fetchval("SELECT outbox_enqueue(NULL, 'routed', 'r'::bytea)")
        await asyncio.sleep(1.5)
        assert await count(conn, "published_at IS NOT NULL") == 0, "the whole table is paused"
        shown = await cli(settings, "status", "--json")
        assert shown.code == 0, shown.err
        report = json.loads(shown.out)
        assert report["table_paused"] is True
        assert report["pauses"][0]["reason"] == "maintenance"
        assert all(t["paused"] for t in report["topics"]), "routed rows too"

        topic_pause = await cli(settings, "pause", "--topic", paused_topic)
        assert topic_pause.code == 0, topic_pause.err
        lifted = await cli(settings, "resume")
        assert lifted.code == 0, lifted.err
        assert "resumed the whole table" in lifted.out
        assert f"still paused: {paused_topic}" in lifted.out

        async def others_published() -> bool:
            return await _published(conn, f"topic = '{other}' AND ordering_key LIKE 'other-%'")

        await wait_until(others_published, 30, "the other topic's rows")
        await wait_until(
            lambda: _published(conn, "topic IS NULL"), 30, "the routed row (whole-table pause)"
        )
        await asyncio.sleep(1.0)  # give the dispatcher every chance to break the pause
        assert await count(conn, f"topic = '{paused_topic}' AND published_at IS NOT NULL") == 0
        # The shared key's later row waits behind its earlier row in the paused topic.
        held = await conn.fetchval(
            "SELECT published_at FROM outbox WHERE event_id = $1", shared_second
        )
        assert held is None, "a key's row must not overtake its row in a paused topic"
        status_rows = {t["topic"]: t for t in json.loads(shown.out)["topics"]}
        assert status_rows[paused_topic]["pending"] == 101

        resumed = await cli(settings, "resume", "--topic", paused_topic)
        assert resumed.code == 0, resumed.err
        await wait_all_settled(conn, 60)

    assert await count(conn, "dead_at IS NOT NULL") == 0
    times = {
        r["event_id"]: r["published_at"]
        for r in await conn.fetch(
            "SELECT event_id, published_at FROM outbox WHERE event_id = ANY($1::uuid[])",
            [shared_first, shared_second],
        )
    }
    assert times[shared_first] <= times[shared_second]  # same batch at the earliest
    paused_ids = {
        str(r["event_id"])
        for r in await conn.fetch("SELECT event_id FROM outbox WHERE topic = $1", paused_topic)
    }
    verdict = check(
        await consume(services.kafka_bootstrap_servers, paused_topic, len(paused_ids)),
        paused_ids,
    )
    assert (verdict.lost, verdict.reordered, verdict.duplicates, verdict.unexpected) == (
        [],
        [],
        0,
        [],
    )


async def _published(conn: asyncpg.Connection, where: str) -> bool:
    return await count(conn, f"({where}) AND published_at IS NULL") == 0


# --- dead rows ----------------------------------------------------------------------------------


async def test_dead_rows_are_listed_requeued_in_order_under_block_and_discarded(
    conn: asyncpg.Connection, services: Services, topic: str, make_settings: Any
) -> None:
    settings = settings_for(make_settings, dead_letter_policy="block")
    await insert_sequenced(conn, topic, keys=3, per_key=5, interleave=False)
    # key-0's first row is dead: under "block" its four later rows wait for an operator.
    # key-1's head waits out a backoff. key-2 flows.
    await conn.execute(
        "UPDATE outbox SET dead_at = now(), attempts = 10, last_error = 'boom' "
        "WHERE id = (SELECT min(id) FROM outbox WHERE ordering_key = 'key-0')"
    )
    await conn.execute(
        "UPDATE outbox SET next_attempt_at = now() + interval '1 hour', attempts = 1 "
        "WHERE id = (SELECT min(id) FROM outbox WHERE ordering_key = 'key-1')"
    )
    extra = await conn.fetch(
        "INSERT INTO outbox (topic, ordering_key, payload, dead_at, last_error, created_at) "
        "SELECT $1, 'gone-' || n, 'x', now(), 'nope', $2 FROM generate_series(1, 3) n "
        "RETURNING id",
        topic,
        datetime(2020, 1, 1, tzinfo=UTC),
    )
    async with running(settings):
        await wait_until(
            lambda: _published(conn, "ordering_key = 'key-2'"), 30, "key-2 to be published"
        )
        shown = await cli(settings, "status", "--json")
        assert shown.code == 0, shown.err
        [row] = json.loads(shown.out)["topics"]
        assert (row["blocked_keys"], row["dead_blocked_keys"], row["dead"]) == (2, 1, 4)
        assert json.loads(shown.out)["totals"]["blocked_keys"] == 2
        topics = await reads.topics(session(conn), block_on_dead=True)
        assert tables.as_table(topics).splitlines()[1].endswith("2 (1 dead)")

        listed = await cli(settings, "dead", "list", "--topic", topic, "--json")
        assert listed.code == 0, listed.err
        dead = json.loads(listed.out)
        assert [d["ordering_key"] for d in dead] == ["key-0", "gone-1", "gone-2", "gone-3"]
        assert set(dead[0]) >= {"id", "event_id", "topic", "attempts", "dead_at", "last_error"}
        assert dead[0]["last_error"] == "boom" and dead[0]["attempts"] == 10
        plain = tables.dead_table(await listings.dead_list(session(conn), Filters(key="key-0"), 9))
        assert "boom" in plain and "gone-1" not in plain
        requeued = await cli(settings, "dead", "requeue", "--key", "key-0")
        assert requeued.code == 0, requeued.err
        assert requeued.out.strip() == "requeued 1 dead row"
        await wait_until(
            lambda: _published(conn, "ordering_key = 'key-0'"), 30, "key-0 after the requeue"
        )
        trace = await conn.fetchrow(
            "SELECT attempts, last_error FROM outbox WHERE id = (SELECT min(id) FROM outbox "
            "WHERE ordering_key = 'key-0')"
        )
        assert trace["attempts"] == 0
        assert trace["last_error"].startswith("requeued by operator at ")
        assert "boom" in trace["last_error"]

        # Filters by time and id, in-process; ids of rows that are not dead are left alone.
        recent = Filters(since=datetime.now(UTC) - timedelta(hours=1))
        assert await listings.dead_list(session(conn), recent, 100) == []
        old = Filters(until=datetime(2021, 1, 1, tzinfo=UTC))
        assert len(await listings.dead_list(session(conn), old, 100)) == 3
        published_id = await conn.fetchval(
            "SELECT min(id) FROM outbox WHERE published_at IS NOT NULL"
        )
        discarded = await cli(
            settings,
            "dead",
            "discard",
            "--id",
            str(extra[0]["id"]),
            "--id",
            str(extra[1]["id"]),
            "--id",
            str(published_id),
        )
        assert discarded.code == 0, discarded.err
        assert discarded.out.strip() == "discarded 2 dead rows"
        assert await count(conn, f"id = {published_id}") == 1
        gone = DeadDiscard(Filters(key="gone-3"), batch_size=1)
        assert (await perform(gone, session(conn))).rows == 1
        assert await count(conn, "dead_at IS NOT NULL") == 0

    verdict = check(
        await consume(services.kafka_bootstrap_servers, topic, 10),
        {
            str(r["event_id"])
            for r in await conn.fetch(
                "SELECT event_id FROM outbox WHERE ordering_key IN ('key-0', 'key-2')"
            )
        },
    )
    assert (verdict.lost, verdict.reordered, verdict.duplicates) == ([], [], 0)
    assert verdict.unexpected == []


# --- replay -------------------------------------------------------------------------------------


async def test_replay_sends_rows_again_in_order_before_newer_rows_of_their_keys(
    conn: asyncpg.Connection, services: Services, topic: str, make_settings: Any
) -> None:
    # Replay batches of 5: 80 transactions for 400 rows, while a writer keeps adding rows to the
    # same keys and a dispatcher polls every 10 ms.
    settings = settings_for(
        make_settings, cleanup_batch_size=5, poll_interval_seconds=0.01, batch_size=50
    )
    await insert_sequenced(conn, topic, keys=2, per_key=200)
    async with running(settings):
        await wait_all_settled(conn, 60)
        before = await ids_by_key(conn, topic)
        last_id = await conn.fetchval("SELECT max(id) FROM outbox")
        stop = asyncio.Event()

        async def writer() -> int:
            seq = 200
            while not stop.is_set():
                await insert_sequenced(conn, topic, keys=2, per_key=1, first_seq=seq)
                seq += 1
                await asyncio.sleep(0.005)
            return seq - 200

        async with _background(writer()) as written:
            await asyncio.sleep(0.05)
            replayed = await _replay_in_own_connection(
                settings, Filters(topic=topic, to_id=last_id)
            )
            await asyncio.sleep(0.3)
            stop.set()
        assert replayed == 400
        assert written.result() > 0
        await wait_all_settled(conn, 60)

        refused = await cli(settings, "replay")
        assert refused.code == 2 and "refusing to replay" in refused.err
        deleting = settings_for(make_settings, delete_on_publish=True)
        nothing = await cli(deleting, "replay", "--all")
        assert nothing.code == 1 and "nothing to replay" in nothing.err
        first, last = before[b"key-0"][0], before[b"key-0"][9]
        bounds = await conn.fetch(
            "SELECT id FROM outbox WHERE event_id = ANY($1::uuid[]) ORDER BY id", [first, last]
        )
        again = await cli(
            settings,
            "replay",
            "--key",
            "key-0",
            "--from-id",
            str(bounds[0]["id"]),
            "--to-id",
            str(bounds[1]["id"]),
        )
        assert again.code == 0, again.err
        assert "replayed 10 published rows" in again.out
        await wait_all_settled(conn, 60)
        row = await conn.fetchrow(
            "SELECT attempts, last_error FROM outbox WHERE event_id = $1", first
        )
        assert row["last_error"].startswith("replayed by operator at ")

    total = await count(conn)
    records = await consume(services.kafka_bootstrap_servers, topic, total + 400 + 10)
    delivered = per_key(records)
    for key, ids in before.items():
        log = delivered[key]
        assert log[: len(ids)] == ids, "first deliveries in order"
        rest = log[len(ids) :]
        replay_start = rest.index(ids[0])
        # The replayed copies form one block, in the original order: no newer row of the key
        # (written during the replay) slipped in between them.
        assert rest[replay_start : replay_start + len(ids)] == ids
    key0 = delivered[b"key-0"]
    assert key0[-10:] == before[b"key-0"][:10], "the second replay went out last"
    verdict = check(records, await event_ids(conn))
    assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], [])
    assert verdict.duplicates == 410


async def _replay_in_own_connection(settings: Settings, filters: Filters) -> int:
    conn = await asyncpg.connect(settings.database_url.get_secret_value())
    try:
        replay = Replay(filters, settings.cleanup_batch_size)
        return (await perform(replay, session(conn))).rows
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def _background(coro: Any) -> AsyncIterator[asyncio.Task[Any]]:
    task = asyncio.create_task(coro)
    try:
        yield task
    finally:
        await task


# --- without the console extra ------------------------------------------------------------------


async def test_the_operator_commands_run_without_the_console_extra(
    conn: asyncpg.Connection, make_settings: Any, tmp_path: Path
) -> None:
    """The web stack is the install extra outbox-dispatcher[console]: where its imports fail,
    as where it is not installed, status, dead list and dead requeue work as ever."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    without = {"PYTHONPATH": str(tmp_path)}
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, dead_at, attempts, last_error)"
        " VALUES ('orders', 'k', 'x', now(), 10, 'boom')"
    )
    settings = settings_for(make_settings)
    blocked = await cli(settings, "-c", "import starlette", env=without, module=False)
    assert blocked.code == 1 and "No module named 'starlette'" in blocked.err
    shown = await cli(settings, "status", "--json", env=without)
    assert shown.code == 0, shown.err
    assert json.loads(shown.out)["totals"]["dead"] == 1
    listed = await cli(settings, "dead", "list", "--json", env=without)
    assert listed.code == 0 and [r["ordering_key"] for r in json.loads(listed.out)] == ["k"]
    requeued = await cli(settings, "dead", "requeue", "--all", env=without)
    assert (requeued.code, requeued.out.strip()) == (0, "requeued 1 dead row")
    console = await cli(settings, "console", env=without)
    assert console.code == 2 and len(console.err.splitlines()) == 1
    assert "outbox-dispatcher[console]" in console.err


# --- cleanup and retention ----------------------------------------------------------------------


async def test_cleanup_deletes_only_old_published_rows_in_batches(
    conn: asyncpg.Connection, topic: str, make_settings: Any
) -> None:
    settings = settings_for(make_settings, cleanup_batch_size=7)
    hour_ago = datetime.now(UTC) - timedelta(hours=1)
    # In id order: old dead rows (a whole window without anything to delete), old published
    # rows, old pending rows, recent published rows.
    await conn.execute(
        "INSERT INTO outbox (topic, payload, created_at, dead_at, last_error) "
        "SELECT $1, 'd', $2, $2, 'x' FROM generate_series(1, 20)",
        topic,
        hour_ago,
    )
    await conn.execute(
        "INSERT INTO outbox (topic, payload, created_at, published_at) "
        "SELECT $1, 'p', $2, $2 FROM generate_series(1, 30)",
        topic,
        hour_ago,
    )
    await conn.execute(
        "INSERT INTO outbox (topic, payload, created_at) "
        "SELECT $1, 'q', $2 FROM generate_series(1, 5)",
        topic,
        hour_ago,
    )
    await conn.execute(
        "INSERT INTO outbox (topic, payload, published_at) "
        "SELECT $1, 'r', now() FROM generate_series(1, 8)",
        topic,
    )
    kept = await cli(settings_for(make_settings, retention_seconds=0), "cleanup")
    assert kept.code == 0, kept.err
    assert "nothing deleted" in kept.out
    swept = await cli(settings, "cleanup", "--older-than", "600")
    assert swept.code == 0, swept.err
    assert swept.out.strip() == "deleted 30 published rows older than 600s"
    assert await count(conn, "dead_at IS NOT NULL") == 20
    assert await count(conn, "published_at IS NULL AND dead_at IS NULL") == 5
    assert await count(conn, "published_at IS NOT NULL") == 8
    again = await cleanup.delete_published(DispatchStore(conn, STATEMENTS), 0, 3)
    assert again.deleted == 8
    assert await count(conn) == 25
    bad = await cli(settings, "cleanup", "--older-than", "soon")
    assert bad.code == 2


async def test_retention_keeps_the_table_size_bounded(
    conn: asyncpg.Connection, topic: str, make_settings: Any
) -> None:
    """10 cycles of 2k rows through a dispatcher whose retention loop deletes published rows
    (retention ~0): after VACUUM the table and its indexes stay the size they had after cycle 2,
    while 20k rows passed through; keeping them would take about ten times the size of 2k."""
    async with running(settings_for(make_settings, batch_size=500, retention_seconds=0)):
        await insert_sequenced(conn, topic, keys=20, per_key=100, first_seq=0)
        await wait_all_settled(conn, 60)
    kept_2k = await conn.fetchval("SELECT pg_total_relation_size('outbox')")
    settings = settings_for(
        make_settings,
        batch_size=500,
        retention_seconds=0.001,
        cleanup_interval_seconds=0.2,
        cleanup_batch_size=500,
    )
    sizes: list[int] = []
    async with running(settings):
        for cycle in range(10):
            await insert_sequenced(conn, topic, keys=20, per_key=100, first_seq=(cycle + 1) * 100)

            async def empty() -> bool:
                return await count(conn) == 0

            await wait_until(empty, 60, f"cycle {cycle}: rows published and deleted")
            await conn.execute("VACUUM outbox")
            sizes.append(await conn.fetchval("SELECT pg_total_relation_size('outbox')"))
        passed = await conn.fetchval("SELECT last_value FROM outbox_id_seq")
    assert passed == 22_000
    print(f"table+indexes: 2k rows kept {kept_2k}, after each cycle {sizes}")
    assert sizes[-1] <= 1.5 * sizes[1], sizes
    assert sizes[-1] < 3 * kept_2k, (kept_2k, sizes)


# --- check --------------------------------------------------------------------------------------


async def test_check_reports_ok_or_one_line_per_problem(
    conn: asyncpg.Connection,
    services: Services,
    topic: str,
    make_settings: Any,
    empty_database_url: str,
) -> None:
    await conn.fetchval("SELECT outbox_enqueue($1, 'k', 'v'::bytea)", topic)
    good = await cli(settings_for(make_settings, default_topic=topic), "check")
    assert good.code == 0, good.err
    assert good.err == ""
    assert "ok: broker" in good.out and "ok: the one topic the outbox needs exists" in good.out

    # A pending row for a topic that does not exist, and a routed row nothing routes. Listing
    # the cluster's topics names none of them, so even a broker that auto-creates topics on
    # metadata requests does not create it.
    missing = f"missing-{uuid.uuid4().hex[:12]}"
    await conn.fetchval("SELECT outbox_enqueue($1, 'k', 'v'::bytea)", missing)
    await conn.fetchval("SELECT outbox_enqueue(NULL, 'k', 'v'::bytea)")
    await perform(Pause(topic, reason="testing"), session(conn))
    bad_topic = await cli(settings_for(make_settings), "check")
    assert bad_topic.code == 1
    problems = bad_topic.err.strip().splitlines()
    assert len(problems) == 2, problems
    assert f"topic '{missing}' (pending rows) does not exist" in bad_topic.err
    assert "1 pending routed rows cannot be routed" in bad_topic.err
    assert f"note: topic {topic} is paused" in bad_topic.out
    client = AIOKafkaAdminClient(bootstrap_servers=services.kafka_bootstrap_servers)
    await client.start()
    try:
        assert missing not in await client.list_topics()
    finally:
        await client.close()

    # Nothing right: an unmigrated database and no broker at that port.
    broken = await cli(
        settings_for(
            make_settings,
            database_url=empty_database_url,
            kafka_bootstrap_servers="127.0.0.1:1",
        ),
        "check",
    )
    assert broken.code == 1
    lines = broken.err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("problem: schema:") and "outbox-dispatcher migrate" in lines[0]
    assert lines[1].startswith("problem: broker:")
    assert "ok: database is reachable" in broken.out


async def test_check_reports_rows_no_claim_will_find_and_repair_hands_them_over(
    conn: asyncpg.Connection, topic: str, make_settings: Any
) -> None:
    """Rows written with explicit ids below the claim cursor (a restore into a live table):
    `check` names them as a warning (not a failure: the sweep finds them), `check --repair`
    sweeps the whole table at once, and the claims then take them."""
    ids = await conn.fetch(
        "INSERT INTO outbox (topic, ordering_key, payload) SELECT $1, 'k' || g, 'x'"
        " FROM generate_series(1, 3) g RETURNING id",
        topic,
    )
    # As if a claim had looked at them and they were published since.
    await conn.execute("UPDATE outbox_cursor SET position = (SELECT max(id) FROM outbox)")
    await conn.execute("UPDATE outbox SET published_at = now()")
    await conn.execute("DELETE FROM outbox WHERE id = $1", ids[1]["id"])
    await conn.execute(
        "INSERT INTO outbox (id, topic, ordering_key, payload) OVERRIDING SYSTEM VALUE"
        " VALUES ($1, $2, 'restored', 'x')",
        ids[1]["id"],
        topic,
    )
    settings = settings_for(make_settings, default_topic=topic)
    found = await cli(settings, "check")
    assert found.code == 0, found.err
    assert f"warning: claim engine: 1 pending rows of 1 keys (first id {ids[1]['id']})" in found.err
    repaired = await cli(settings, "check", "--repair")
    assert repaired.code == 0, repaired.err
    assert "note: repair: the sweep registered 1 keys' rows" in repaired.out
    assert "ok: claim engine: every pending row is where a claim will look for it" in repaired.out
    assert (
        await conn.fetchval("SELECT head_id FROM outbox_work WHERE ordering_key = 'restored'")
        == ids[1]["id"]
    )


async def test_on_the_expanded_schema_operator_commands_wait_for_the_console_version(
    empty_database_url: str, topic: str, make_settings: Any
) -> None:
    """A rolling upgrade leaves the schema at version 10 while older dispatchers run (migrate
    applies 11 and 12 after them): dispatchers run there, `check` says what waits as a warning,
    and an operator command refuses with what to do instead of failing on a column of 12."""
    conn = await asyncpg.connect(empty_database_url)
    try:
        for migration in migrations.load_migrations()[:10]:
            sql = migrations.render(migration.path.read_text("utf-8"), "public", "outbox")
            async with conn.transaction():
                await conn.execute(sql)
    finally:
        await conn.close()
    settings = settings_for(make_settings, database_url=empty_database_url, default_topic=topic)
    found = await cli(settings, "check")
    assert found.code == 0, found.err
    assert "ok: schema public.outbox is at version 10" in found.out
    assert (
        "warning: schema: the operator commands and the console need version "
        f"{migrations.CONSOLE_VERSION}: run `outbox-dispatcher migrate`"
    ) in found.err
    status = await cli(settings, "status")
    assert status.code == 1, status.err
    assert (
        "is at version 10, the operator commands and the console need "
        f"{migrations.CONSOLE_VERSION} or later: run `outbox-dispatcher migrate`"
    ) in status.err


async def test_a_pause_counts_the_rows_a_claim_that_began_before_it_still_leases(
    conn: asyncpg.Connection, database_url: str, make_settings: Any
) -> None:
    """N13: a claim reads the pauses first. One that began before the pause committed may lease
    rows of the topic after the pause counted them: the pause waits for such claims and counts
    again, so "already claimed still go out" covers them."""
    ids = await conn.fetch(
        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ('n13', 'k', 'x'), "
        "('n13', 'k', 'y') RETURNING id"
    )
    # Work of the key is known; discovery of the rows above the cursor locks it FOR SHARE.
    await conn.execute(
        "INSERT INTO outbox_work (keyless, ordering_key, head_id) VALUES (false, 'k', $1)",
        ids[0]["id"],
    )
    holder = await asyncpg.connect(database_url)
    operator = await asyncpg.connect(database_url)
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2, init=db.init_connection)
    try:
        hold = holder.transaction()
        await hold.start()
        await holder.execute("SELECT 1 FROM outbox_work WHERE ordering_key = 'k' FOR UPDATE")
        claim = asyncio.create_task(
            Claimer(
                DispatchStore(pool, Statements.for_table("public", "outbox")), make_settings(), "c"
            ).claim()
        )
        await wait_until(lambda: _waiting_on_a_lock(conn, 1), 10, "the claim to wait")
        pausing = asyncio.create_task(perform(Pause("n13", count_waiting=True), session(operator)))
        await wait_until(lambda: _waiting_on_a_lock(conn, 2), 10, "the pause to wait for it")
        await hold.commit()
        batch = await asyncio.wait_for(claim, 10)
        paused = await asyncio.wait_for(pausing, 10)
    finally:
        await holder.close()
        await operator.close()
        await pool.close()
    assert batch is not None and len(batch.records) == 2
    assert "0 pending rows wait; 2 already claimed still go out" in paused.detail


async def _waiting_on_a_lock(conn: asyncpg.Connection, sessions: int) -> bool:
    return await sessions_waiting_on_a_lock(conn) >= sessions
