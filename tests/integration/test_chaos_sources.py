"""Fault scenarios with several sources (issue 36): processes serving tenant schemas of two
databases through OUTBOX_SOURCES, writers on every tenant, members joining, leaving and killed
while they write, a tenant migrated mid-stream; each tenant judged by the checker. CI runs a
short version, `make chaos` (OUTBOX_CHAOS=full) the long one; figures as test_chaos.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.checker import Verdict, verdict_for

from .helpers import Services, kill9, spawn, stop_all, wait_started, wait_until
from .sources_helpers import migrate
from .test_chaos import Writer, assert_sound, report, scale
from .test_many_outboxes import served_now

FULL = os.environ.get("OUTBOX_CHAOS") == "full"

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600 if FULL else 420)]

MakeTopic = Callable[[], Awaitable[str]]
KEYS = 20


@dataclass
class Tenant:
    """One outbox of a scenario: its database (the URL sets its schema as search_path), schema
    and topic, and the writer committing rows into it."""

    url: str
    schema: str
    topic: str
    writer: Writer

    @property
    def label(self) -> str:
        return f"{self.schema}.outbox"

    async def pending(self) -> int:
        conn = await asyncpg.connect(self.url)
        try:
            n = await conn.fetchval(
                "SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_at IS NULL"
            )
        finally:
            await conn.close()
        return int(n)

    async def leased_by(self, pid: int) -> int:
        """Rows leased now by the process `pid` (its lease owner names it)."""
        conn = await asyncpg.connect(self.url)
        try:
            n = await conn.fetchval(
                "SELECT count(*) FROM outbox_leases WHERE split_part(lease_owner, ':', 2) = $1",
                str(pid),
            )
        finally:
            await conn.close()
        return int(n)

    async def verdict(self, services: Services) -> Verdict:
        return await verdict_for(
            self.url, services.kafka_bootstrap_servers, [self.topic], timeout=scale(120, 600)
        )


def in_schema(url: str, schema: str) -> str:
    """The database URL whose sessions use `schema` (asyncpg passes unknown query parameters on
    as server settings)."""
    return f"{url}?search_path={schema}"


async def tenant(url: str, schema: str, make_topic: MakeTopic, rate: float) -> Tenant:
    topic = await make_topic()
    keys = [f"{schema}-k{k}" for k in range(KEYS)]
    scoped = in_schema(url, schema)
    return Tenant(url=scoped, schema=schema, topic=topic, writer=Writer(scoped, topic, keys, rate))


@contextlib.asynccontextmanager
async def writing_all(tenants: list[Tenant]) -> AsyncIterator[list[asyncio.Task[None]]]:
    tasks = [asyncio.create_task(t.writer.run()) for t in tenants]
    try:
        yield tasks
    finally:
        for t in tenants:
            t.writer.stop.set()
        await asyncio.gather(*tasks)


async def all_published(tenants: list[Tenant], timeout: float) -> None:
    async def done() -> bool:
        return all([await t.pending() == 0 for t in tenants])

    await wait_until(done, timeout, "every tenant's rows published")


class Members:
    """Fleet processes in numbered slots, each with its log."""

    def __init__(self, settings: Any, logs: Path) -> None:
        self.settings = settings
        self.logs = logs
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.log_of: dict[int, Path] = {}
        self.started = 0

    async def start(self, slot: int) -> None:
        """Start a member and wait until it runs (a SIGTERM before its handlers exist would
        look like a crash)."""
        self.started += 1
        self.log_of[slot] = self.logs / f"member{slot}-{self.started}.log"
        self.processes[slot] = spawn(self.settings, self.log_of[slot])
        await wait_started([self.log_of[slot]])

    def alive(self) -> list[int]:
        return [s for s, p in self.processes.items() if p.poll() is None]

    def served(self) -> set[str]:
        return {label for s in self.alive() for label in served_now(self.log_of[s])}

    def stop(self, slot: int) -> int | None:
        (code,) = stop_all([self.processes[slot]])
        return code

    def tails(self) -> str:
        return "\n".join(f"{p.name}: {p.read_text()[-4000:]}" for p in self.log_of.values())


async def busy_member(members: Members, tenants: list[Tenant], rng: random.Random) -> int:
    """A random live member, preferring (for up to a second) one that holds leases."""
    for _ in range(20):
        alive = members.alive()
        counts = [
            sum([await t.leased_by(members.processes[s].pid) for t in tenants]) for s in alive
        ]
        busy = [s for s, n in zip(alive, counts, strict=True) if n]
        if busy:
            return rng.choice(busy)
        await asyncio.sleep(0.05)
    return rng.choice(members.alive())


async def scenario_tenants(
    home: str, second: str, make_topic: MakeTopic, rate: float
) -> list[Tenant]:
    """The scenarios' outboxes, migrated: tenant_0..3 of the pattern in the home database and
    shard_b in the second, each with its writer at `rate` rows/s."""
    await migrate(home, *(f"tenant_{n}" for n in range(4)))
    await migrate(second, "shard_b")
    tenants = [await tenant(home, f"tenant_{n}", make_topic, rate) for n in range(4)]
    tenants.append(await tenant(second, "shard_b", make_topic, rate))
    return tenants


def member_settings(make_settings: Any, home: str, second: str, **more: Any) -> Any:
    sources = [{"schema": "tenant_*"}, {"database_url": second, "schema": "shard_b"}]
    values: dict[str, Any] = {
        "database_url": home,
        "sources": json.dumps(sources),
        "log_format": "json",
        "http_port": 0,
        "batch_size": 50,
        "lease_seconds": 3.0,
        "kafka_linger_ms": 100,  # so that kills land with batches in flight
    }
    values.update(more)
    return make_settings(**values)


async def judge(
    name: str, tenants: list[Tenant], services: Services, record_property: Any, **figures: Any
) -> list[Verdict]:
    verdicts = [await t.verdict(services) for t in tenants]
    for t, v in zip(tenants, verdicts, strict=True):
        report(f"{name}:{t.schema}", v, record_property, writer_rows=t.writer.attempted, **figures)
    return verdicts


async def test_sources_members_joining_and_leaving_make_no_copy(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
    record_property: Any,
) -> None:
    """No crash: members stop gracefully, start, join; a tenant is migrated mid-stream. Every
    row of every tenant arrives once and in order per key."""
    home, second = databases
    rate = scale(40, 100)
    tenants = await scenario_tenants(home, second, make_topic, rate)
    members = Members(member_settings(make_settings, home, second), tmp_path)
    duration = scale(30, 180)
    changes: list[str] = []
    codes: list[int | None] = []
    try:
        for slot in range(3):
            await members.start(slot)
        async with writing_all(tenants):
            late = await tenant(home, "tenant_late", make_topic, rate)
            end = time.monotonic() + duration
            step = 0
            while time.monotonic() < end:
                await asyncio.sleep(duration / 6)
                step += 1
                if step == 1:  # a tenant schema migrated while the fleet runs and writes
                    await migrate(home, "tenant_late")
                    tenants.append(late)
                    late_task = asyncio.create_task(late.writer.run())
                    changes.append("tenant_late migrated")
                elif step % 2 == 0:  # a member leaves gracefully and comes back
                    slot = step // 2 % 3
                    codes.append(members.stop(slot))
                    await members.start(slot)
                    changes.append(f"member {slot} restarted")
                else:  # a fourth member joins, later leaves
                    if 3 in members.alive():
                        codes.append(members.stop(3))
                        changes.append("member 3 left")
                    else:
                        await members.start(3)
                        changes.append("member 3 joined")
            late.writer.stop.set()
            await late_task
        await all_published(tenants, scale(120, 600))
        served = members.served()
    finally:
        codes += stop_all([members.processes[s] for s in members.alive()])
    assert all(c == 0 for c in codes), (codes, members.tails())
    assert {t.label for t in tenants} <= served, served
    verdicts = await judge(
        "sources_membership", tenants, services, record_property, changes=changes
    )
    for v in verdicts:
        assert_sound(v)
        assert v.duplicates == 0, v.summary()
        assert v.dead == [], v.summary()
    assert sum(v.delivered for v in verdicts) == sum(t.writer.attempted for t in tenants)


@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
async def test_sources_members_killed_under_load_lose_and_reorder_nothing(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
    record_property: Any,
    delivery: str,
) -> None:
    """kill -9 of a member every few seconds while every tenant writes: the others take its
    outboxes over; nothing is lost or reordered, and copies are bounded by what the killed
    members had in flight (at-least-once); exactly-once (each outbox with its own lanes, the
    tenants' progress in one topic): a read_committed consumer gets no copy at all."""
    home, second = databases
    tenants = await scenario_tenants(home, second, make_topic, scale(100, 150))
    more: dict[str, Any] = {}
    if delivery == "exactly-once":
        more = {
            "delivery": delivery,
            "progress_topic": f"progress-{tenants[0].topic}",
            "transaction_timeout_seconds": 2.0,
            "kafka_linger_ms": 200,
        }
    settings = member_settings(make_settings, home, second, **more)
    members = Members(settings, tmp_path)
    duration = scale(30, 180)
    rng = random.Random(os.getpid())
    kills = orphaned = 0
    try:
        for slot in range(3):
            await members.start(slot)
        async with writing_all(tenants):
            end = time.monotonic() + duration
            while time.monotonic() < end:
                await asyncio.sleep(rng.uniform(1.5, 3.0))
                slot = await busy_member(members, tenants, rng)
                victim = members.processes[slot]
                await asyncio.to_thread(kill9, victim)
                orphaned += sum([await t.leased_by(victim.pid) for t in tenants])
                kills += 1
                await members.start(slot)
        await all_published(tenants, scale(120, 600))
        served = members.served()
    finally:
        codes = stop_all([members.processes[s] for s in members.alive()])
    assert all(c == 0 for c in codes), (codes, members.tails())
    assert {t.label for t in tenants} <= served, served
    name = "sources_kill_9" if delivery == "at-least-once" else "sources_kill_9_exactly_once"
    verdicts = await judge(name, tenants, services, record_property, kills=kills, orphaned=orphaned)
    for v in verdicts:
        assert_sound(v)
        assert v.dead == [], v.summary()
        if delivery == "exactly-once":
            assert v.duplicates == 0, v.summary()
    copies = sum(v.duplicates for v in verdicts)
    # Each kill can repeat at most what the victim had claimed: its claim slots' batches.
    slots = settings.claim_tasks + 2
    assert copies <= kills * slots * settings.batch_size, (copies, kills)
    assert copies <= orphaned, "only the killed members' leased rows repeat"
    assert kills >= 5
    assert orphaned > 0, "some kills must land with rows in flight"
