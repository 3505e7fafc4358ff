"""One `outbox-dispatcher run` process serving many outboxes (issue 36, OUTBOX_SOURCES),
at-least-once, against real PostgreSQL and Kafka: three tenant schemas of a pattern in one
database and a table in a second database, each row published once and in order per key (the
checker's verdict per outbox); a tenant schema created and migrated while it runs is served
without a restart; a schema dropped mid-stream is let go while the process goes on; a 50k-row
backlog does not starve a quiet source; connections stay within OUTBOX_MAX_CONNECTIONS."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from outbox_dispatcher.store import db

from .helpers import (
    Services,
    check,
    consume,
    http_get,
    insert_sequenced,
    kill9,
    log_events,
    spawn,
    stop_all,
    wait_started,
    wait_until,
)
from .sources_helpers import execute, migrate

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MakeTopic = Callable[[], Awaitable[str]]


@dataclass(frozen=True)
class Tenant:
    """One outbox of the test: its database, schema and topic."""

    url: str
    schema: str
    topic: str

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[asyncpg.Connection]:
        conn = await asyncpg.connect(self.url, server_settings={"search_path": self.schema})
        try:
            yield conn
        finally:
            await conn.close()

    async def insert(self, keys: int, per_key: int, first_seq: int = 0) -> None:
        async with self.connect() as conn:
            await insert_sequenced(conn, self.topic, keys, per_key, first_seq=first_seq)

    async def count(self, where: str = "true") -> int:
        async with self.connect() as conn:
            return int(await conn.fetchval(f"SELECT count(*) FROM outbox WHERE {where}"))

    async def pending(self) -> int:
        return await self.count("published_at IS NULL AND dead_at IS NULL")

    async def event_ids(self) -> set[str]:
        async with self.connect() as conn:
            return {str(r["event_id"]) for r in await conn.fetch("SELECT event_id FROM outbox")}

    async def all_published(self, timeout: float = 120) -> None:
        async def done() -> bool:
            return await self.pending() == 0

        await wait_until(done, timeout, f"every row of {self.schema} published")

    async def verdict(self, services: Services) -> Any:
        """The checker's verdict on this outbox's topic against its table."""
        expected = await self.count()
        records = await consume(services.kafka_bootstrap_servers, self.topic, expected)
        return check(records, await self.event_ids())


def fleet_settings(make_settings: Any, url: str, sources: list[dict[str, Any]], **more: Any) -> Any:
    """Settings of a process serving `sources` (the first database is OUTBOX_DATABASE_URL)."""
    return make_settings(database_url=url, sources=json.dumps(sources), log_format="json", **more)


async def dispatcher_connections(admin_url: str, *urls: str) -> list[str]:
    """The dispatcher's sessions (application_name: db.APPLICATION_NAME) in the databases of
    `urls`, each as its database and last statement."""
    names = [url.rpartition("/")[2] for url in urls]
    conn = await asyncpg.connect(admin_url)
    try:
        rows = await conn.fetch(
            "SELECT datname, left(query, 60) AS query FROM pg_stat_activity"
            " WHERE application_name = $1 AND datname = ANY($2::text[])",
            db.APPLICATION_NAME,
            names,
        )
    finally:
        await conn.close()
    return [f"{r['datname']}: {r['query']}" for r in rows]


async def test_one_process_serves_three_tenant_schemas_and_a_second_database_in_order(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    a, b = databases
    await migrate(a, "tenant_a", "tenant_b", "tenant_c")
    await migrate(b, "public")
    tenants = [Tenant(a, f"tenant_{t}", await make_topic()) for t in "abc"]
    tenants.append(Tenant(b, "public", await make_topic()))
    for tenant in tenants:
        await tenant.insert(keys=20, per_key=25)  # a backlog before the start
    # membership 1; two databases: discovery + the idle probe + LISTEN + a pool of 2 each
    budget = 11
    settings = fleet_settings(
        make_settings,
        a,
        [{"schema": "tenant_*"}, {"schema": "public", "database_url": b, "name": "shard_b"}],
        claim_tasks=2,
        batch_size=50,
        max_connections=budget,
    )
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    most: list[str] = []
    try:
        await wait_started([log])
        for tenant in tenants:  # and rows while it runs, after the backlog's
            await tenant.insert(keys=20, per_key=25, first_seq=25)
        for tenant in tenants:

            async def published(t: Tenant = tenant) -> bool:
                nonlocal most
                most = max(most, await dispatcher_connections(services.database_url, a, b), key=len)
                return await t.pending() == 0

            await wait_until(published, 120, f"every row of {tenant.schema} published")
        most = max(most, await dispatcher_connections(services.database_url, a, b), key=len)
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    for tenant in tenants:
        verdict = await tenant.verdict(services)
        assert verdict.delivered == 1000, (tenant.schema, verdict.summary())
        assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], [])
        assert verdict.duplicates == 0, (tenant.schema, verdict.summary())
    served = {e["source"] for e in log_events(log, "outbox_served")}
    assert served == {"tenant_a.outbox", "tenant_b.outbox", "tenant_c.outbox", "shard_b"}
    assert 0 < len(most) <= budget, "\n".join(sorted(most))


async def test_notifications_reach_their_outbox_through_one_listen_connection_per_database(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    """With polling all but off (a minute), rows are published because each table's trigger
    notifies its channel and the database's one LISTEN connection wakes that outbox."""
    a, b = databases
    await migrate(a, "tenant_a", "tenant_b")
    await migrate(b, "public")
    tenants = [Tenant(a, s, await make_topic()) for s in ("tenant_a", "tenant_b")]
    tenants.append(Tenant(b, "public", await make_topic()))
    settings = fleet_settings(
        make_settings,
        a,
        [{"schema": "tenant_*"}, {"schema": "public", "database_url": b, "name": "shard_b"}],
        poll_interval_seconds=60,
    )
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:
        await wait_started([log])

        async def listening() -> bool:
            return {e["database"].rpartition("/")[2] for e in log_events(log, "listening")} == {
                a.rpartition("/")[2],
                b.rpartition("/")[2],
            }

        await wait_until(listening, 30, "a LISTEN connection to each database")
        for rounds in range(3):  # each round's rows wait for a notification (never a poll)
            for tenant in tenants:
                await tenant.insert(keys=2, per_key=5, first_seq=5 * rounds)
            for tenant in tenants:
                await tenant.all_published(timeout=30)
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    for tenant in tenants:
        verdict = await tenant.verdict(services)
        assert (verdict.delivered, verdict.lost, verdict.reordered) == (30, [], [])
    sessions = [e for e in log_events(log, "listening")]
    assert {e["channels"] for e in sessions} <= {1, 2}, sessions


async def test_a_tenant_schema_migrated_while_it_runs_is_served_without_a_restart(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    a, _ = databases
    await migrate(a, "tenant_a")
    first = Tenant(a, "tenant_a", await make_topic())
    settings = fleet_settings(make_settings, a, [{"schema": "tenant_*"}])
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:
        await wait_started([log])
        await first.insert(keys=5, per_key=10)
        await first.all_published()
        await execute(a, "CREATE SCHEMA tenant_new")  # created, not migrated: not an outbox yet
        await migrate(a, "tenant_new")
        new = Tenant(a, "tenant_new", await make_topic())
        await new.insert(keys=10, per_key=30)
        await new.all_published()
        assert process.poll() is None, "the same process, never restarted"
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    verdict = await new.verdict(services)
    assert (verdict.delivered, verdict.lost, verdict.reordered) == (300, [], [])
    assert len(log_events(log, "started")) == 1


async def test_a_schema_dropped_mid_stream_is_let_go_and_the_others_go_on(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    a, _ = databases
    await migrate(a, "tenant_a", "tenant_b")
    kept, dropped = [Tenant(a, s, await make_topic()) for s in ("tenant_a", "tenant_b")]
    await dropped.insert(keys=50, per_key=200)  # 10k rows, published slowly (linger)
    settings = fleet_settings(
        make_settings, a, [{"schema": "tenant_*"}], batch_size=50, kafka_linger_ms=50
    )
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:

        async def some_published() -> bool:
            return await dropped.count("published_at IS NOT NULL") > 0

        await wait_until(some_published, 60, "some rows of tenant_b published")
        assert await dropped.pending() > 0, "dropped mid-stream"
        await execute(a, "DROP SCHEMA tenant_b CASCADE")

        async def let_go() -> bool:
            return bool(log_events(log, "outbox_stopped"))

        await wait_until(let_go, 60, "tenant_b let go")
        await kept.insert(keys=10, per_key=20)
        await kept.all_published()
        assert process.poll() is None, "the process goes on"
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    verdict = await kept.verdict(services)
    assert (verdict.delivered, verdict.lost, verdict.reordered) == (200, [], [])
    stopped = log_events(log, "outbox_stopped")
    assert [e["source"] for e in stopped] == ["tenant_b.outbox"]
    # No error storm: a failure of the dropped table is one line per streak, per loop.
    complaints = [
        e
        for e in log_events(log)
        if e.get("level") in ("warning", "error") and e.get("source") == "tenant_b.outbox"
    ]
    assert len(complaints) <= 6, complaints
    assert not log_events(log, "loop_died")


async def test_a_50k_row_backlog_does_not_starve_a_quiet_source(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    a, _ = databases
    await migrate(a, "tenant_big", "tenant_quiet")
    big, quiet = [Tenant(a, s, await make_topic()) for s in ("tenant_big", "tenant_quiet")]
    await big.insert(keys=500, per_key=100)
    settings = fleet_settings(make_settings, a, [{"schema": "tenant_*"}], batch_size=100)
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:

        async def draining() -> bool:
            return await big.count("published_at IS NOT NULL") > 0

        await wait_until(draining, 60, "the backlog draining")
        for seq in range(10):  # ten small transactions, one row per key each
            await quiet.insert(keys=3, per_key=1, first_seq=seq)
        await quiet.all_published()
        backlog_left = await big.pending()
        await big.all_published(300)
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    assert backlog_left > 0, "the quiet source waited for the whole backlog"
    verdict = await quiet.verdict(services)
    assert (verdict.delivered, verdict.lost, verdict.reordered) == (30, [], [])


async def test_a_database_that_refuses_connections_delays_no_other_and_is_served_again(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    a, b = databases
    await migrate(a, "tenant_a")
    await migrate(b, "public")
    kept, away = Tenant(a, "tenant_a", await make_topic()), Tenant(b, "public", await make_topic())
    settings = fleet_settings(
        make_settings,
        a,
        [{"schema": "tenant_*"}, {"schema": "public", "database_url": b, "name": "shard_b"}],
    )
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    name_b = b.rpartition("/")[2]
    try:
        await wait_started([log])
        await away.insert(keys=5, per_key=10)
        await away.all_published()
        await execute(
            services.database_url,
            f'ALTER DATABASE "{name_b}" WITH ALLOW_CONNECTIONS false; '
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{name_b}'",
        )

        async def unreachable() -> bool:
            return bool(log_events(log, "source_database_unreachable"))

        await wait_until(unreachable, 60, "database b found unreachable")
        await kept.insert(keys=10, per_key=20)
        await kept.all_published()
        (listening,) = log_events(log, "http_listening")
        status, body = await http_get(listening["port"], "/readyz")
        assert process.poll() is None, "the process goes on"
        await execute(
            services.database_url, f'ALTER DATABASE "{name_b}" WITH ALLOW_CONNECTIONS true'
        )
        await away.insert(keys=5, per_key=10, first_seq=10)
        await away.all_published()
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    assert status == 200, body  # an outbox is served: ready, and the detail says what is not
    checks = json.loads(body)["checks"]
    assert any(k.startswith("database ") and name_b in k for k in checks), checks
    assert checks["source shard_b"].startswith("unreachable"), checks
    for tenant, rows in ((kept, 200), (away, 100)):
        verdict = await tenant.verdict(services)
        assert (verdict.delivered, verdict.lost, verdict.reordered) == (rows, [], []), tenant
    assert "postgresql://" not in log.read_text()
    # One line per loop and per change, not per attempt: a handful over the outage.
    complaints = [
        line
        for line in log.read_text().splitlines()
        if name_b in line and ('"level":"warning"' in line or '"level":"error"' in line)
    ]
    assert 1 <= len(complaints) <= 6, complaints


async def test_sigterm_while_a_backlog_drains_exits_0_and_leaves_nothing_leased(
    databases: tuple[str, str], make_topic: MakeTopic, make_settings: Any, tmp_path: Path
) -> None:
    a, _ = databases
    await migrate(a, "tenant_a", "tenant_b")
    tenants = [Tenant(a, s, await make_topic()) for s in ("tenant_a", "tenant_b")]
    for tenant in tenants:
        await tenant.insert(keys=100, per_key=100)
    settings = fleet_settings(
        make_settings, a, [{"schema": "tenant_*"}], batch_size=100, kafka_linger_ms=100
    )
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:

        async def busy() -> bool:
            return all([await t.count("published_at IS NOT NULL") > 0 for t in tenants])

        await wait_until(busy, 60, "both tenants publishing")
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    assert [await t.pending() > 0 for t in tenants] == [True, True], "stopped mid-stream"
    for tenant in tenants:
        assert await tenant.count("id IN (SELECT id FROM outbox_leases)") == 0, tenant.schema


def served_now(log: Path) -> set[str]:
    """The outboxes a process serves now, by its log: served and not stopped since."""
    served: set[str] = set()
    for event in log_events(log):
        if event.get("event") == "outbox_served":
            served.add(event["source"])
        elif event.get("event") == "outbox_stopped":
            served.discard(event["source"])
    return served


def members_seen(log: Path) -> int:
    """How many members a process saw at its last change of the fleet's membership."""
    changes = log_events(log, "fleet_members_changed")
    return len(changes[-1]["members"]) if changes else 0


async def test_two_processes_share_the_outboxes_through_the_fleet_membership(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    """Each outbox ends up served by one of the two members (rendezvous hashing over the home
    database's membership table), every outbox by one of them, and every row arrives in order
    (for a moment, before a member's first beat, both may serve one: safe, as for several
    single-table dispatchers)."""
    a, _ = databases
    schemas = [f"tenant_{n}" for n in range(6)]
    await migrate(a, *schemas)
    tenants = [Tenant(a, s, await make_topic()) for s in schemas]
    settings = fleet_settings(make_settings, a, [{"schema": "tenant_*"}], batch_size=20)
    logs = [tmp_path / f"fleet{i}.log" for i in range(2)]
    processes = [spawn(settings, log) for log in logs]
    labels = {f"{s}.outbox" for s in schemas}
    try:
        await wait_started(logs)

        async def shared_out() -> bool:
            first, second = (served_now(log) for log in logs)
            both_seen = all(members_seen(log) == 2 for log in logs)
            return both_seen and not first & second and first | second == labels

        await wait_until(shared_out, 60, "the outboxes shared out between the two members")
        for tenant in tenants:
            await tenant.insert(keys=20, per_key=20)
        for tenant in tenants:
            await tenant.all_published()
        shares = [served_now(log) for log in logs]
    finally:
        codes = stop_all(processes)
    assert codes == [0, 0], [log.read_text()[-3000:] for log in logs]
    assert not shares[0] & shares[1] and shares[0] | shares[1] == labels, shares
    for tenant in tenants:
        verdict = await tenant.verdict(services)
        assert verdict.delivered == 400, verdict.summary()
        assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], [])
        async with tenant.connect() as conn:
            owners = await conn.fetchval("SELECT count(DISTINCT lease_owner) FROM outbox")
        assert owners == 1, f"{tenant.schema}'s rows (inserted once shared) by its one member"


async def test_a_member_killed_loses_its_outboxes_to_the_other_which_publishes_every_row(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    a, _ = databases
    schemas = [f"tenant_{n}" for n in range(6)]
    await migrate(a, *schemas)
    tenants = [Tenant(a, s, await make_topic()) for s in schemas]
    settings = fleet_settings(
        make_settings, a, [{"schema": "tenant_*"}], batch_size=20, kafka_linger_ms=50
    )
    logs = [tmp_path / f"fleet{i}.log" for i in range(2)]
    processes = [spawn(settings, log) for log in logs]
    labels = {f"{s}.outbox" for s in schemas}
    try:
        await wait_started(logs)

        async def shared_out() -> bool:
            first, second = (served_now(log) for log in logs)
            both_seen = all(members_seen(log) == 2 for log in logs)
            return both_seen and not first & second and first | second == labels

        await wait_until(shared_out, 60, "the outboxes shared out between the two members")
        victim = max((0, 1), key=lambda i: len(served_now(logs[i])))  # the one serving more
        survivor = 1 - victim
        for tenant in tenants:
            await tenant.insert(keys=20, per_key=20)
        kill9(processes[victim])

        async def taken_over() -> bool:
            return served_now(logs[survivor]) == labels

        await wait_until(taken_over, 60, "the survivor serving every outbox")
        for tenant in tenants:
            await tenant.insert(keys=20, per_key=20, first_seq=20)
        for tenant in tenants:
            await tenant.all_published()
        alive = processes[survivor].poll() is None
    finally:
        codes = stop_all(processes)
    assert alive and codes[survivor] == 0, logs[survivor].read_text()[-3000:]
    for tenant in tenants:
        verdict = await tenant.verdict(services)
        assert verdict.delivered >= 800, verdict.summary()  # copies: the victim's lost marks
        assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], [])


async def test_a_hot_outbox_is_served_by_a_second_member_until_its_backlog_ends(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    """A tenant whose backlog lasts OUTBOX_FLEET_HOT_SECONDS is listed as hot by its owner, and
    the other member serves it too (its rows settled by both), until a claim sees the end of
    it; then the other member lets it go. Every row once, in order per key."""
    a, _ = databases
    schemas = [f"tenant_{n}" for n in range(4)]
    await migrate(a, *schemas)
    tenants = [Tenant(a, s, await make_topic()) for s in schemas]
    settings = fleet_settings(
        make_settings,
        a,
        [{"schema": "tenant_*"}],
        batch_size=50,
        lease_seconds=6,  # a beat every 2 s
        fleet_hot_seconds=1,
        # One member alone drains at most 2 batches of 50 per 50 ms (2k rows/s): 20 s, enough
        # for the other to join whatever the machine's pace.
        fleet_in_flight_batches=2,
        kafka_linger_ms=50,
    )
    logs = [tmp_path / f"fleet{i}.log" for i in range(2)]
    processes = [spawn(settings, log) for log in logs]
    labels = {f"{s}.outbox" for s in schemas}
    try:
        await wait_started(logs)

        async def shared_out() -> bool:
            first, second = (served_now(log) for log in logs)
            both_seen = all(members_seen(log) == 2 for log in logs)
            return both_seen and not first & second and first | second == labels

        await wait_until(shared_out, 60, "the outboxes shared out between the two members")
        hot = tenants[0]
        label = f"{hot.schema}.outbox"
        helper = next(i for i in (0, 1) if label not in served_now(logs[i]))
        await hot.insert(keys=200, per_key=200)  # 40k rows, 800 claims of 50

        async def served_by_both() -> bool:
            return all(label in served_now(log) for log in logs)

        await wait_until(served_by_both, 90, "the other member serving the hot outbox too")
        assert log_events(logs[helper], "outbox_hot_served_too")[0]["source"] == label
        await hot.all_published(timeout=300)

        async def let_go() -> bool:
            return label not in served_now(logs[helper])

        await wait_until(let_go, 60, "the other member letting the drained outbox go")
    finally:
        codes = stop_all(processes)
    assert codes == [0, 0], [log.read_text()[-3000:] for log in logs]
    async with hot.connect() as conn:
        owners = await conn.fetchval("SELECT count(DISTINCT lease_owner) FROM outbox")
    assert owners == 2, "the hot outbox's rows settled by both members"
    verdict = await hot.verdict(services)
    assert verdict.delivered >= 40_000, verdict.summary()
    assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], [])


async def test_exactly_once_with_sources_opens_lanes_only_for_an_outbox_with_rows(
    services: Services,
    make_settings: Any,
    make_topic: MakeTopic,
    tmp_path: Path,
    databases: tuple[str, str],
) -> None:
    """Exactly-once with OUTBOX_SOURCES (refused at start before issue 36's exactly-once per
    outbox): served, ready, and the transactional producers of an outbox are opened at its
    first batch only: idle tenants hold none (test_many_outboxes_exactly_once.py has the
    rest)."""
    a, _ = databases
    await migrate(a, "tenant_a", "tenant_b", "tenant_c")
    busy = Tenant(a, "tenant_a", await make_topic())
    settings = fleet_settings(
        make_settings,
        a,
        [{"schema": "tenant_*"}],
        delivery="exactly-once",
        progress_topic=f"progress-{busy.topic}",
        lease_seconds=6.0,
        transaction_timeout_seconds=2.0,
    )
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:
        await wait_started([log])

        async def all_served() -> bool:
            return served_now(log) == {"tenant_a.outbox", "tenant_b.outbox", "tenant_c.outbox"}

        await wait_until(all_served, 60, "every tenant served")
        await busy.insert(keys=4, per_key=5)
        await busy.all_published()
        (listening,) = log_events(log, "http_listening")

        async def ready() -> bool:  # once its first pass over the outboxes is done
            status, _ = await http_get(listening["port"], "/readyz")
            return status == 200

        await wait_until(ready, 30, "/readyz to say ready")
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    assert not log_events(log, "configuration_error")
    assert [e["source"] for e in log_events(log, "lanes_opened")] == ["tenant_a.outbox"]
    assert any(e.get("delivery") == "exactly-once" for e in log_events(log, "started"))
    verdict = await busy.verdict(services)
    assert (verdict.delivered, verdict.duplicates, verdict.lost) == (20, 0, []), verdict.summary()
