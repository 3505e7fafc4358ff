"""Fleet membership against real PostgreSQL with real OS processes (issue 36): three members
share the outboxes by rendezvous hashing; one killed with SIGKILL loses its outboxes to the
others within its lease (not before), a member added takes only its share, a member stopped with
SIGTERM leaves at once; and a member whose home database stops keeps its last view and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from structlog.testing import capture_logs

from outbox_dispatcher.sources.fleet import FleetMember, outbox_key
from outbox_dispatcher.sources.registry import SourceRegistry
from outbox_dispatcher.store.fleet import FleetStore

from .helpers import Services
from .sources_helpers import execute, fresh_database, migrate, plain_connect, source

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
LEASE = 3.0
BEAT = LEASE / 3
KEYS = 60


class Member:
    """A member process and the last view it printed."""

    def __init__(self, name: str, process: asyncio.subprocess.Process) -> None:
        self.name = name
        self.process = process
        self.members: list[str] = []
        self.mine: set[str] = set()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            view = json.loads(line)
            self.members, self.mine = view["members"], set(view["mine"])

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signum)


@pytest.fixture
async def home(services: Services) -> AsyncIterator[str]:
    async with fresh_database(services.database_url) as url:
        conn = await asyncpg.connect(url)
        try:
            assert await FleetStore(conn).create()
            assert not await FleetStore(conn).create()  # idempotent
        finally:
            await conn.close()
        yield url


@contextlib.asynccontextmanager
async def fleet(home: str) -> AsyncIterator[dict[str, Member]]:
    members: dict[str, Member] = {}
    try:
        yield members
    finally:
        for member in members.values():
            member.signal(signal.SIGKILL)
            await member.process.wait()
            member.reader.cancel()


async def start(members: dict[str, Member], home: str, name: str) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.integration.fleet_member", home, name, str(LEASE), str(KEYS),
        cwd=ROOT, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    members[name] = Member(name, process)


async def agreed(members: dict[str, Member], names: list[str], timeout: float) -> float:
    """Seconds until each of `names` sees exactly `names` as the fleet and their outboxes are a
    partition of all of them."""
    started = time.monotonic()
    while True:
        views = [members[n] for n in names]
        shares = [m.mine for m in views]
        if (
            all(m.members == sorted(names) for m in views)
            and sum(len(s) for s in shares) == KEYS
            and len(set().union(*shares)) == KEYS
        ):
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            state = {n: (members[n].members, len(members[n].mine)) for n in names}
            msg = f"no agreement on {names} within {timeout}s: {state}"
            raise AssertionError(msg)
        await asyncio.sleep(0.02)


async def test_members_share_outboxes_and_survive_a_kill(home: str) -> None:
    async with fleet(home) as members:
        for name in ("m1", "m2", "m3"):
            await start(members, home, name)
        await agreed(members, ["m1", "m2", "m3"], timeout=20)
        before = {n: set(members[n].mine) for n in members}
        assert all(before.values())

        # SIGKILL: no goodbye; its row ages out after the lease, then the others take over.
        members["m3"].signal(signal.SIGKILL)
        killed = time.monotonic()
        took = await agreed(members, ["m1", "m2"], timeout=LEASE + BEAT + 5)
        print(f"\nkill -9: outboxes served again after {took:.2f}s (lease {LEASE}s)")
        assert LEASE - BEAT - 0.5 <= time.monotonic() - killed <= LEASE + BEAT + 1.5
        for n in ("m1", "m2"):  # each kept its own and gained only the dead member's
            assert before[n] <= members[n].mine
            assert members[n].mine - before[n] <= before["m3"]

        # A member added: it takes its share, from both, and nothing else moves.
        survivors = {n: set(members[n].mine) for n in ("m1", "m2")}
        await start(members, home, "m4")
        joined = await agreed(members, ["m1", "m2", "m4"], timeout=15)
        print(f"m4 joined and the fleet agreed in {joined:.2f}s")
        for n in ("m1", "m2"):
            assert members[n].mine <= survivors[n]
        assert 0 < len(members["m4"].mine) < KEYS

        # SIGTERM: the member deletes its row, the others take over at their next beat.
        members["m2"].signal(signal.SIGTERM)
        assert await asyncio.wait_for(members["m2"].process.wait(), 10) == 0
        left = await agreed(members, ["m1", "m4"], timeout=LEASE)
        print(f"m2 left; the others agreed {left:.2f}s after it exited")
        assert left <= BEAT + 0.5


async def test_a_member_keeps_its_last_view_while_the_home_database_is_away(
    services: Services, home: str
) -> None:
    name = home.rpartition("/")[2]
    one = FleetMember(home, plain_connect, lease_seconds=LEASE, member_id="one")
    two = FleetMember(home, plain_connect, lease_seconds=LEASE, member_id="two")
    assert (await one.beat()).members == ("one",)
    assert (await two.beat()).members == ("one", "two")
    stopping = asyncio.Event()
    with capture_logs() as logged:
        task = asyncio.create_task(two.run(stopping))
        await execute(services.database_url, f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        await execute(
            services.database_url,
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'",
        )
        await asyncio.sleep(3 * BEAT)
        view = two.view()
        assert view.members == ("one", "two")  # the last view it read
        assert view.stale_since is not None
        assert "not currently accepting connections" in (view.reason or "")
        await execute(services.database_url, f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        for _ in range(100):
            if two.view().stale_since is None and two.view().members == ("two",):
                break
            await asyncio.sleep(0.1)
        # `one` stopped beating when the database went away: it aged out meanwhile.
        assert two.view().members == ("two",)
        stopping.set()
        await asyncio.wait_for(task, 10)
    events = [e["event"] for e in logged]
    assert events.count("fleet_view_stale") == 1
    assert events.count("fleet_view_fresh") == 1
    conn = await asyncpg.connect(home)
    try:  # `two` left: its row is gone
        owners = await conn.fetch("SELECT owner FROM outbox_fleet.member")
        assert [r["owner"] for r in owners] == ["one"]
    finally:
        await conn.close()
    await one.leave()


async def test_two_members_each_with_its_registry_serve_every_outbox_once(
    services: Services, home: str
) -> None:
    """Two members in one process, each with its own registry and connections, over tenant
    schemas of two databases: their shares partition the ready outboxes, a tenant added is
    served by exactly one of them, and when one leaves the other serves everything."""
    async with (
        fresh_database(services.database_url) as a,
        fresh_database(services.database_url) as b,
    ):
        await migrate(a, *(f"tenant_{n}" for n in range(6)))
        await migrate(b, "tenant_x", "tenant_y")
        sources = [source(a, "tenant_*"), source(b, "tenant_*", name="shard_b")]
        members = {
            n: FleetMember(home, plain_connect, lease_seconds=LEASE, member_id=n)
            for n in ("left", "right")
        }
        registries = {
            n: SourceRegistry(sources, plain_connect, interval=0.2, jitter=False) for n in members
        }
        stopping = {n: asyncio.Event() for n in members}
        tasks = [
            asyncio.create_task(task)
            for n in members
            for task in (members[n].run(stopping[n]), registries[n].run(stopping[n]))
        ]

        def shares(names: tuple[str, ...]) -> dict[str, set[str]]:
            return {
                n: {outbox_key(o) for o in members[n].view().mine(registries[n].view().ready())}
                for n in names
            }

        async def partition(names: tuple[str, ...], total: int) -> dict[str, set[str]]:
            for _ in range(200):
                got = shares(names)
                if (
                    all(members[n].view().members == names for n in names)
                    and sum(map(len, got.values())) == total
                    and len(set().union(*got.values())) == total
                ):
                    return got
                await asyncio.sleep(0.05)
            msg = f"no partition of {total} outboxes among {names}: {shares(names)}"
            raise AssertionError(msg)

        try:
            both = await partition(("left", "right"), 8)
            assert all(both.values())
            await migrate(b, "tenant_z")
            after = await partition(("left", "right"), 9)
            [owner] = [n for n in after if any(k.endswith("/tenant_z.outbox") for k in after[n])]
            assert after[owner] - both[owner] == {next(k for k in after[owner] if "tenant_z" in k)}
            stopping["right"].set()
            await asyncio.sleep(0)
            alone = await partition(("left",), 9)
            assert len(alone["left"]) == 9
        finally:
            for event in stopping.values():
                event.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 15)
