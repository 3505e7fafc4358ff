"""Exactly-once needs its marks durable (exactly-once review E11, found wider here): a batch's
progress record forgets the batch once its mark committed, so a mark that a PostgreSQL crash
undoes leaves rows pending that nothing ties to the transaction that sent them. The next claim
sends them again, and a read_committed consumer gets a second copy. With synchronous_commit off,
the dispatcher's default for at-least-once, a crash loses the commits of the last moments.

The timing is forced: every process that flushes the WAL in the background is stopped (SIGSTOP,
WRITERS), so that a commit is on disk only if its own backend flushed it (synchronous_commit on);
once every row is marked, PostgreSQL is stopped immediately (pg-crash: no shutdown checkpoint) and
started again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.store import db
from tests.checker import verdict_for

from .helpers import Services, count, insert_sequenced, wait_all_settled, wait_until
from .test_chaos import assert_sound, control, fleet, report, restarts
from .test_exactly_once_faults import eos

pytestmark = pytest.mark.integration
FIXTURES = (eos,)  # test_exactly_once_faults.py's, used here by name


# Every process that flushes WAL other than a commit's own backend: the WAL writer, the
# background writer and checkpointer (a dirty page written out flushes the WAL before it), and
# autovacuum (an ANALYZE of the fresh table commits with the server's synchronous_commit, on).
WRITERS = ("walwriter", "background writer", "checkpointer", "autovacuum launcher")


async def _writers(conn: asyncpg.Connection) -> dict[int, str]:
    """The pids of WRITERS: the children of this connection's postmaster with those titles
    (none when PostgreSQL runs in a container)."""
    return _children_named(_parent(await conn.fetchval("SELECT pg_backend_pid()")))


def _children_named(postmaster: int | None) -> dict[int, str]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or postmaster is None or _parent(int(entry.name)) != postmaster:
            continue
        title = _title(int(entry.name))
        for name in WRITERS:
            if title.startswith(f"postgres: {name}"):
                found[int(entry.name)] = name
    return found


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@contextlib.contextmanager
def stopped(pids: dict[int, str]) -> Iterator[None]:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:  # gone after the crash; still there if the test failed before it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def test_a_database_crash_after_the_marks_sends_nothing_again(
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    eos: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    if not await _writers(conn):
        pytest.skip("needs PostgreSQL's background processes as local processes")
    # A restart first: shared buffers start empty, so no backend has to write out a dirty page
    # (and flush the WAL before it) to find a free one.
    await conn.close()
    await control(services, "pg-stop")
    await control(services, "pg-start")
    conn = await asyncpg.connect(database_url)
    writers = await _writers(conn)
    assert sorted(writers.values()) == sorted(WRITERS), writers
    # One lane, two batches: the second transaction's progress record no longer lists the first
    # batch (marked by then), as under any steady load.
    settings = eos(claim_tasks=1, batch_size=25, lease_seconds=4.0)
    bootstrap = services.kafka_bootstrap_servers
    async with restarts(services, "pg"), fleet(settings, tmp_path, 1) as f:
        with stopped(writers):
            # Written with synchronous_commit on: the rows are durable, what follows is not
            # unless its own commit flushes it.
            rows = await insert_sequenced(conn, topic, keys=10, per_key=5)

            async def all_marked() -> bool:
                return await count(conn, "published_at IS NULL") == 0

            try:
                await wait_until(all_marked, 60, "every row marked published")
            except AssertionError as exc:
                raise AssertionError(f.tails()) from exc
            await conn.close()
            await control(services, "pg-crash")
        await control(services, "pg-start")
        conn = await asyncpg.connect(database_url)
        lost = await count(conn, "published_at IS NULL")
        await wait_all_settled(conn, 60)
        await asyncio.sleep(2)  # a second copy, if any, is committed before the count
    verdict = await verdict_for(database_url, bootstrap, [topic], timeout=60)
    report(
        "exactly_once_database_crash_after_the_marks",
        verdict,
        record_property,
        events=verdict.delivered,
        marks_lost_in_the_crash=lost,
    )
    await conn.close()
    assert_sound(verdict)
    assert verdict.delivered == len(rows)
    assert verdict.duplicates == 0, verdict.summary()
    assert lost == 0, f"{lost} marks were lost in the crash"


async def test_sessions_whose_commits_may_be_lost_are_refused(conn: asyncpg.Connection) -> None:
    """Through a pooler the dispatcher's own synchronous_commit (on with exactly-once) is
    dropped and the role's or server's default applies (PgBouncer's guide sets the role's to
    off): exactly-once refuses to start on such sessions."""
    await conn.execute("SET synchronous_commit = off")
    with pytest.raises(errors.ConfigurationError, match="ALTER ROLE <role> SET synchronous_commit"):
        await db.require_durable_commits(conn)
    await conn.execute("SET synchronous_commit = local")
    await db.require_durable_commits(conn)
