"""Upgrading a live table from schema version 4 to the claim engine of version 6 (and on to 7)
(`outbox-dispatcher migrate`): rows in every state end as they should, and a dispatcher of the
previous version still running when the migration commits stops with a clear message while
nothing is lost or reordered."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest

from outbox_dispatcher.config.settings import DeadLetterPolicy
from outbox_dispatcher.store import migrations

from .helpers import (
    Services,
    check,
    consume,
    count,
    event_ids,
    http_get,
    insert_sequenced,
    kill9,
    running,
    settings_env,
    spawn,
    stop_all,
    wait_all_settled,
    wait_started,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Versions 5 and 6 (the claim engine) and whatever came after them.
SINCE_V4 = list(range(5, migrations.latest_version() + 1))

ROOT = Path(__file__).resolve().parents[2]
# The last commit of schema version 4 (claim engine v1): the dispatcher users run before upgrading.
PREVIOUS_RELEASE = "3975be7"
# The last commit of schema version 9 (claim engine v2): the release before claim engine v3.
PREVIOUS_V9 = "68158b8"


@pytest.fixture
async def v4_url(empty_database_url: str) -> AsyncIterator[str]:
    """A database at schema version 4, as the previous release left it."""
    conn = await asyncpg.connect(empty_database_url)
    try:
        for migration in migrations.load_migrations()[:4]:
            sql = migrations.render(migration.path.read_text("utf-8"), "public", "outbox")
            async with conn.transaction():
                await conn.execute(sql)
        assert await migrations.current_version(conn, "public", "outbox") == 4
    finally:
        await conn.close()
    yield empty_database_url


async def migrate(url: str, *, contract: bool = False) -> migrations.Migrated:
    conn = await asyncpg.connect(url)
    try:
        return await migrations.migrate(conn, "public", "outbox", contract=contract)
    finally:
        await conn.close()


async def test_rows_in_every_state_end_as_they_should_after_the_upgrade(
    v4_url: str, services: Services, topic: str, make_settings: Any
) -> None:
    conn = await asyncpg.connect(v4_url)
    try:
        insert = (
            "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, $2, $3) RETURNING id"
        )
        ids: dict[str, list[int]] = {}
        for key, n in [("pending", 3), ("leased", 2), ("backoff", 2), ("blocked", 2), ("old", 1)]:
            ids[key] = [
                await conn.fetchval(insert, topic, key, f"{key}-{i}".encode()) for i in range(n)
            ]
        ids["keyless"] = [await conn.fetchval(insert, topic, None, b"x") for _ in range(2)]
        # A lease of a previous-version dispatcher that vanished, a head in backoff, a dead head
        # (holds its key under `block`) and a row published long ago.
        await conn.execute(
            "UPDATE outbox SET lease_owner = 'old-dispatcher', lease_token = $2, "
            "lease_expires_at = now() + interval '3 seconds' WHERE id = ANY($1)",
            ids["leased"],
            uuid.uuid4(),
        )
        await conn.execute(
            "UPDATE outbox SET attempts = 1, next_attempt_at = now() + interval '2 seconds', "
            "last_error = 'broker down' WHERE id = $1",
            ids["backoff"][0],
        )
        await conn.execute(
            "UPDATE outbox SET dead_at = now(), attempts = 5, last_error = 'poison' WHERE id = $1",
            ids["blocked"][0],
        )
        await conn.execute(
            "UPDATE outbox SET published_at = now() - interval '1 day' WHERE id = $1", ids["old"][0]
        )

        assert await migrate(v4_url) == SINCE_V4
        # The vanished owner's live lease became its key's claim; every other row waits above
        # the cursor for the first claim to look at it.
        work = [
            tuple(r)
            for r in await conn.fetch(
                "SELECT ordering_key, claim_owner, claim_first, claim_expires_at > now()"
                " FROM outbox_work"
            )
        ]
        assert work == [("leased", "old-dispatcher", ids["leased"][0], True)]
        position = await conn.fetchval("SELECT position FROM outbox_cursor")
        assert position < min(ids["pending"] + ids["backoff"] + ids["blocked"])

        settings = make_settings(database_url=v4_url, dead_letter_policy=DeadLetterPolicy.BLOCK)
        async with running(settings):

            async def drained() -> bool:
                return await count(conn, "published_at IS NULL AND dead_at IS NULL") == 1

            await wait_until(drained, 60, "every row but the blocked one to be published")
        rows = {
            r["id"]: r
            for r in await conn.fetch(
                "SELECT id, published_at IS NOT NULL AS published, dead_at IS NOT NULL AS dead, "
                "attempts, published_at < now() - interval '1 hour' AS long_ago FROM outbox"
            )
        }
    finally:
        await conn.close()
    for key in ("pending", "leased", "backoff", "keyless"):
        assert all(rows[i]["published"] for i in ids[key]), key
    # The vanished owner's rows were taken over once its lease expired: one counted attempt.
    assert [rows[i]["attempts"] for i in ids["leased"]] == [1, 1]
    assert rows[ids["blocked"][0]]["dead"] and not rows[ids["blocked"][1]]["published"]
    assert rows[ids["old"][0]]["long_ago"]
    records = await consume(services.kafka_bootstrap_servers, topic, 9, timeout=60)
    assert sorted(r.value for r in records if r.key == b"pending") == [
        b"pending-0",
        b"pending-1",
        b"pending-2",
    ]
    by_key: dict[bytes | None, list[bytes | None]] = {}
    for record in records:
        by_key.setdefault(record.key, []).append(record.value)
    for key in (b"pending", b"leased", b"backoff"):
        assert by_key[key] == sorted(by_key[key]), by_key[key]


def previous_release(tmp_path: Path, commit: str = PREVIOUS_RELEASE) -> Path:
    """The previous release's package and schema, from this repository's history."""
    if shutil.which("git") is None:
        pytest.skip("git is needed to run the previous release")
    target = tmp_path / f"previous-{commit}"
    target.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "outbox_dispatcher", "schema"],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        pytest.skip(f"commit {commit} is not in this clone's history (a shallow clone?)")
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


async def test_a_previous_release_running_through_the_migration_stops_and_loses_nothing(
    v4_url: str, services: Services, topic: str, make_settings: Any, tmp_path: Path
) -> None:
    old_code = previous_release(tmp_path)
    conn = await asyncpg.connect(v4_url)
    old: subprocess.Popen[bytes] | None = None
    new: subprocess.Popen[bytes] | None = None
    try:
        await insert_sequenced(conn, topic, keys=20, per_key=100)
        settings = make_settings(
            database_url=v4_url,
            batch_size=20,
            kafka_linger_ms=50,
            lease_seconds=3,
            log_format="json",
        )
        old_log = tmp_path / "old.log"
        old = spawn_previous(old_code, settings_env(settings), old_log)

        async def some_published() -> bool:
            return await count(conn, "published_at IS NOT NULL") >= 200

        await wait_until(some_published, 60, "the previous release to publish some rows")
        assert await migrate(v4_url) == SINCE_V4
        in_flight_at_migration = await count(
            conn, "published_at IS NULL AND lease_expires_at > now()"
        )
        code = await asyncio_wait_exit(old, 60)
        assert code not in (0, None), old_log.read_text()[-3000:]
        assert "upgrade outbox-dispatcher" in old_log.read_text()
        # The current release takes over: everything is delivered, in order per key.
        new = spawn(settings, tmp_path / "new.log")
        await wait_all_settled(conn, 120)
        records = await consume(services.kafka_bootstrap_servers, topic, 2000, timeout=120)
        verdict = check(records, await event_ids(conn))
        assert (len(verdict.lost), verdict.reordered, verdict.unexpected) == (0, [], [])
        assert (
            verdict.duplicates
            <= in_flight_at_migration + settings.batch_size * settings.claim_tasks
        )
        assert await count(conn, "dead_at IS NOT NULL") == 0
    finally:
        stop_all([p for p in (old, new) if p is not None])
        await conn.close()


def spawn_previous(code: Path, env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """The previous release's `outbox-dispatcher run`, its package first on the path."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "outbox_dispatcher", "run"],
            env=env | {"PYTHONPATH": str(code)},
            cwd=code,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


async def asyncio_wait_exit(process: subprocess.Popen[bytes], timeout: float) -> int | None:
    """The process's exit code once it ends by itself, or None after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        code = process.poll()
        if code is not None:
            return code
        await asyncio.sleep(0.2)
    return None


# --- A rolling upgrade from version 9 (review N8) ------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def readiness(port: int) -> tuple[int, dict[str, Any]]:
    status, body = await http_get(port, "/readyz")
    return status, orjson.loads(body) if body.startswith(b"{") else {}


async def wait_ready(port: int, what: str) -> dict[str, Any]:
    answer: dict[str, Any] = {}

    async def ready() -> bool:
        nonlocal answer
        with contextlib.suppress(OSError):
            status, answer = await readiness(port)
            return status == 200
        return False

    await wait_until(ready, 60, what)
    return answer


async def test_a_version_9_release_keeps_serving_and_restarting_through_the_upgrade(
    empty_database_url: str,
    services: Services,
    topic: str,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    """The upgrade order of docs/operations.md with the previous release (version 9, from this
    repository's history) running as users run it: `migrate` applies the expand step and leaves
    the contract step while the old dispatcher beats; the old one stays ready, is killed and
    restarts on the expanded schema; the new release runs (and beats) beside it; once the old one
    stopped, the new release alone publishes everything on the expanded schema; `migrate` again
    contracts and adds the later versions, after which the new release reports its mode. Writers
    write throughout: nothing is lost or reordered."""
    old_code = previous_release(tmp_path, PREVIOUS_V9)
    url = empty_database_url
    settings = make_settings(
        database_url=url, batch_size=20, lease_seconds=3, log_format="json", kafka_linger_ms=20
    )
    old_port = free_port()
    old_env = settings_env(settings) | {"OUTBOX_HTTP_PORT": str(old_port)}
    migrated = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "outbox_dispatcher", "migrate"],
        env=old_env | {"PYTHONPATH": str(old_code)},
        cwd=old_code,
        capture_output=True,
        text=True,
        check=False,
    )
    assert migrated.returncode == 0, migrated.stderr
    conn = await asyncpg.connect(url)
    processes: list[subprocess.Popen[bytes]] = []
    seq = 0

    async def write(per_key: int) -> None:
        nonlocal seq
        await insert_sequenced(conn, topic, keys=20, per_key=per_key, first_seq=seq)
        seq += per_key

    try:
        assert await migrations.current_version(conn, "public", "outbox") == 9
        old = spawn_previous(old_code, old_env, tmp_path / "old-1.log")
        processes.append(old)
        await wait_ready(old_port, "the version 9 dispatcher to be ready")
        await write(20)

        applied = await migrate(url)
        assert applied == [10] and applied.waiting == 11 and applied.older == 1
        answer = await wait_ready(old_port, "the version 9 dispatcher, after the expand step")
        assert answer["checks"]["schema"] == "ok"
        await write(20)

        # A restart of the old release on the expanded schema (a node drain, an OOM kill).
        kill9(old)
        old = spawn_previous(old_code, old_env, tmp_path / "old-2.log")
        processes.append(old)
        await wait_ready(old_port, "the version 9 dispatcher to start again after the expand")
        await write(20)

        # The new release beside it.
        port_of_new = free_port()
        # (No sweep: what it would repair a pass later must not hide rows the claim missed.)
        new_settings = settings.model_copy(update={"http_port": port_of_new, "sweep_rows": 0})
        new = spawn(new_settings, tmp_path / "new.log")
        processes.append(new)
        await wait_started([tmp_path / "new.log"])
        await wait_ready(port_of_new, "the new release beside the old one")

        async def beats_at(version: int, counted: bool) -> bool:
            found = await conn.fetchval(
                "SELECT count(*) FROM outbox_dispatchers WHERE version = $1"
                + (" AND published_total IS NOT NULL" if counted else ""),
                version,
            )
            return bool(found)

        # Its heartbeat on the expanded schema: the version it runs, no counters before 12.
        latest = migrations.latest_version()
        await wait_until(lambda: beats_at(latest, False), 30, "the new release's heartbeat")
        await write(20)

        old.send_signal(signal.SIGTERM)
        assert await asyncio_wait_exit(old, 60) == 0, (tmp_path / "old-2.log").read_text()[-3000:]
        # The two old processes' heartbeats are not stale yet (three missed beats; version 9
        # leaves its row when it stops): migrate still waits. The operator, who knows the old
        # release is gone, contracts now.
        applied = await migrate(url)
        assert (list(applied), applied.waiting, applied.older) == ([], 11, 2)
        # Still the expand step, the new release alone: it publishes (engine review 3, P2: a
        # NULL in version 10's compat test made it publish nothing until the contract).
        await write(20)
        await wait_all_settled(conn, 60)
        applied = await migrate(url, contract=True)
        assert applied == list(range(11, latest + 1))
        answer = await wait_ready(port_of_new, "the new release, after the contract step")
        assert answer["checks"]["schema"] == "ok"
        await write(20)
        await wait_all_settled(conn, 120)
        records = await consume(services.kafka_bootstrap_servers, topic, 20 * seq, timeout=120)
        verdict = check(records, await event_ids(conn))
        assert (len(verdict.lost), verdict.reordered, verdict.unexpected) == (0, [], [])
        assert await count(conn, "dead_at IS NOT NULL") == 0
        await wait_until(lambda: beats_at(latest, True), 30, "the new release's counters")

        async def reports_its_mode() -> bool:
            mode = await conn.fetchval(
                "SELECT delivery FROM outbox_dispatchers WHERE version = $1", latest
            )
            return bool(mode == "at-least-once")

        await wait_until(reports_its_mode, 30, "the new release's delivery mode")
        assert "Traceback" not in (tmp_path / "new.log").read_text()
    finally:
        stop_all(processes)
        await conn.close()
