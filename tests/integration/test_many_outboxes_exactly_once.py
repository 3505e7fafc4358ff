"""Many outboxes served exactly-once (issue 36: OUTBOX_SOURCES with OUTBOX_DELIVERY=exactly-once;
dispatch/fleet_delivery.py), against real PostgreSQL and Kafka, verdicts by tests/checker.py with
read_committed consumers: one process serves tenant schemas and a second database, each row once
and in order per key, its lanes opened at an outbox's first batch, closed when it went idle and
opened again at its next; two processes, one killed -9 after its Kafka commit and before its
mark: the other takes its outboxes over and marks those rows without sending them again; an
outbox whose schema is too old for exactly-once is refused alone."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from outbox_dispatcher.store import migrations

from .helpers import (
    Services,
    consume,
    http_get,
    kill9,
    log_events,
    spawn,
    stop_all,
    wait_started,
    wait_until,
)
from .sources_helpers import migrate
from .test_many_outboxes import MakeTopic, Tenant, fleet_settings, members_seen, served_now
from .test_many_outboxes_faces import by_source, command, samples

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]


def eos_fleet(make_settings: Any, url: str, sources: list[dict[str, Any]], **more: Any) -> Any:
    """A fleet process's settings, exactly-once, with a progress topic of the test's own."""
    values: dict[str, Any] = {
        "delivery": "exactly-once",
        "progress_topic": f"progress-{uuid.uuid4().hex[:10]}",
        "lease_seconds": 6.0,
        "transaction_timeout_seconds": 2.0,
    }
    values.update(more)
    return fleet_settings(make_settings, url, sources, **values)


def by_label(log: Path, event: str) -> dict[str, int]:
    """How many times each outbox (its `source` label) logged `event`."""
    counted: dict[str, int] = {}
    for found in log_events(log, event):
        counted[found["source"]] = counted.get(found["source"], 0) + 1
    return counted


async def migrate_to(url: str, schema: str, version: int) -> None:
    """A tenant schema at an older version (the steps up to `version` applied)."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f'CREATE SCHEMA "{schema}"')
        for migration in migrations.load_migrations()[:version]:
            async with conn.transaction():
                sql = migrations.render(migration.path.read_text("utf-8"), schema, "outbox")
                await conn.execute(sql)
    finally:
        await conn.close()


async def assert_once_in_order(tenant: Tenant, services: Services, rows: int) -> None:
    verdict = await tenant.verdict(services)
    assert verdict.delivered == rows, (tenant.schema, verdict.summary())
    assert verdict.duplicates == 0, (tenant.schema, verdict.summary())
    assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], []), tenant.schema


async def test_one_process_serves_two_databases_tenants_exactly_once_and_closes_idle_lanes(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    a, b = databases
    await migrate(a, "tenant_a", "tenant_b")
    await migrate(b, "public")
    tenants = [Tenant(a, "tenant_a", await make_topic()), Tenant(a, "tenant_b", await make_topic())]
    tenants.append(Tenant(b, "public", await make_topic()))
    labels = ["tenant_a.outbox", "tenant_b.outbox", "shard_b"]
    for tenant in tenants:
        await tenant.insert(keys=10, per_key=20)  # a backlog before the start
    settings = eos_fleet(
        make_settings,
        a,
        [{"schema": "tenant_*"}, {"schema": "public", "database_url": b, "name": "shard_b"}],
        claim_tasks=2,
        batch_size=50,
        lanes_idle_seconds=2.0,
        metrics_interval_seconds=0.2,
    )
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:
        await wait_started([log])
        for tenant in tenants:  # and rows while it runs
            await tenant.insert(keys=10, per_key=20, first_seq=20)
        for tenant in tenants:
            await tenant.all_published()

        async def all_closed() -> bool:  # idle: every outbox's lanes closed
            closed = by_label(log, "lanes_closed")
            return set(closed) == set(labels) and closed == by_label(log, "lanes_opened")

        await wait_until(all_closed, 60, "every outbox's lanes closed once idle")
        before = by_label(log, "lanes_opened")
        await tenants[0].insert(keys=10, per_key=10, first_seq=40)  # its next batch opens them
        await tenants[0].all_published()
        opened = by_label(log, "lanes_opened")
        (listening,) = log_events(log, "http_listening")
        _, body = await http_get(listening["port"], "/metrics")
        ran = await command(settings, "status", "--json")
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    assert opened == before | {"tenant_a.outbox": before["tenant_a.outbox"] + 1}, opened
    await assert_once_in_order(tenants[0], services, 500)
    for tenant in tenants[1:]:
        await assert_once_in_order(tenant, services, 400)
    published = by_source(samples(body.decode(), "outbox_published_total"))
    assert published == {"tenant_a.outbox": 500, "tenant_b.outbox": 400, "shard_b": 400}
    found = json.loads(ran.out)
    for outbox in found["outboxes"]:
        assert outbox["status"]["totals"]["pending"] == 0, outbox
        modes = {d["delivery"] for d in outbox["status"]["dispatchers"]}
        assert modes == {"exactly-once"}, outbox


async def test_a_member_killed_between_commit_and_mark_is_taken_over_without_copies(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    """Two processes share four tenants; one of the victim's tenants is locked (SHARE) so that
    its rows are committed in Kafka but not marked when the victim is killed -9. The survivor
    serves every outbox once the victim's membership lapsed, takes the victim's leases over,
    reads its progress and marks those rows without sending them again."""
    a, _ = databases
    schemas = [f"tenant_{n}" for n in range(4)]
    await migrate(a, *schemas)
    tenants = {f"{s}.outbox": Tenant(a, s, await make_topic()) for s in schemas}
    settings = eos_fleet(make_settings, a, [{"schema": "tenant_*"}], batch_size=50)
    logs = [tmp_path / f"fleet{i}.log" for i in range(2)]
    processes = [spawn(settings, log) for log in logs]
    lock: asyncpg.Connection | None = None
    try:
        await wait_started(logs)

        async def shared_out() -> bool:
            first, second = (served_now(log) for log in logs)
            both_seen = all(members_seen(log) == 2 for log in logs)
            return both_seen and not first & second and first | second == set(tenants)

        await wait_until(shared_out, 60, "the outboxes shared out between the two members")
        victim = max((0, 1), key=lambda i: len(served_now(logs[i])))
        survivor = 1 - victim
        held = tenants[sorted(served_now(logs[victim]))[0]]
        lock = await asyncpg.connect(a, server_settings={"search_path": held.schema})
        # Its rows written and the table locked while the victim is frozen: it claims them
        # only once they cannot be marked (an insert waits for the lock, so it comes first).
        os.killpg(processes[victim].pid, signal.SIGSTOP)
        try:
            for tenant in tenants.values():
                await tenant.insert(keys=4, per_key=10)
            await lock.execute("BEGIN; LOCK TABLE outbox IN SHARE MODE")
        finally:
            os.killpg(processes[victim].pid, signal.SIGCONT)
        # Committed in Kafka (a read_committed consumer has them), the mark waits on the lock.
        await consume(services.kafka_bootstrap_servers, held.topic, 40, timeout=120)
        kill9(processes[victim])
        await lock.execute("ROLLBACK")
        assert await held.pending() == 40, "never marked"
        for tenant in tenants.values():
            await tenant.insert(keys=4, per_key=10, first_seq=10)

        async def taken_over() -> bool:
            return served_now(logs[survivor]) == set(tenants)

        await wait_until(taken_over, 60, "the survivor serving every outbox")
        for tenant in tenants.values():
            await tenant.all_published()
        alive = processes[survivor].poll() is None
    finally:
        if lock is not None:
            await lock.close()
        codes = stop_all(processes)
    assert alive and codes[survivor] == 0, logs[survivor].read_text()[-3000:]
    found = log_events(logs[survivor], "takeover_found_committed")
    assert sum(int(e["rows"]) for e in found) >= 40, found
    for tenant in tenants.values():
        await assert_once_in_order(tenant, services, 80)


async def test_an_outbox_too_old_for_exactly_once_is_refused_alone(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    """Its schema is behind PROGRESS_ID_VERSION: /readyz and `status` name it and why, the
    others are served exactly-once, and the process goes on."""
    a, _ = databases
    await migrate(a, "tenant_new")
    old = migrations.PROGRESS_ID_VERSION - 1
    await migrate_to(a, "tenant_old", old)
    new = Tenant(a, "tenant_new", await make_topic())
    settings = eos_fleet(make_settings, a, [{"schema": "tenant_*"}])
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:
        await wait_started([log])
        await new.insert(keys=4, per_key=10)
        await new.all_published()
        (listening,) = log_events(log, "http_listening")
        status, body = 0, b""

        async def named() -> bool:  # (the readiness is cached a moment)
            nonlocal status, body
            status, body = await http_get(listening["port"], "/readyz")
            return "source tenant_old.outbox" in json.loads(body)["checks"]

        await wait_until(named, 30, "the refused outbox named in /readyz")
        alive = process.poll() is None
    finally:
        codes = stop_all([process])
    assert alive and codes == [0], log.read_text()[-3000:]
    assert status == 200, body
    detail = json.loads(body)["checks"]
    assert (
        f"refused: schema version {migrations.PROGRESS_ID_VERSION - 1}"
        in detail["source tenant_old.outbox"]
    ), detail
    (refused,) = log_events(log, "outbox_refused")
    assert refused["source"] == "tenant_old.outbox"
    assert served_now(log) == {"tenant_new.outbox"}
    await assert_once_in_order(new, services, 40)
    ran = await command(settings, "status", "--json")  # `status` says so too
    refusals = {o["source"]: o["refused"] for o in json.loads(ran.out)["outboxes"]}
    assert refusals["tenant_new.outbox"] is None
    assert refusals["tenant_old.outbox"].startswith(f"schema version {old}: exactly-once")
    table = (await command(settings, "status", "--source", "tenant_old.outbox")).out
    assert "exactly-once delivery needs version" in table, table
