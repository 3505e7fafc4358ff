"""OUTBOX_DELIVERY=exactly-once through the incident runbook, black-box (issue 35): dispatchers die
on a topic between their Kafka commit and their mark, the operator pauses the topic, starts a
dispatcher, and resumes once things are fixed. Real processes, PostgreSQL and Kafka; verdicts by
tests/checker.py with a read_committed consumer."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiokafka.admin import AIOKafkaAdminClient

from outbox_dispatcher.config.settings import Settings
from tests.checker import consume, verdict_for

from .helpers import (
    Services,
    cli,
    count,
    insert_sequenced,
    kill9,
    log_events,
    spawn,
    wait_all_settled,
)
from .test_chaos import assert_sound, fleet, report
from .test_exactly_once_faults import eos, events

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]
FIXTURES = (eos,)  # test_exactly_once_faults.py's, used here by name


async def test_a_crash_before_the_mark_then_a_pause_and_a_resume_sends_nothing_again(
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    eos: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    """A dispatcher commits 4 keys x 10 rows in Kafka and is killed -9 before its mark (a SHARE
    lock on the outbox holds the mark until a read_committed consumer has every row). The
    operator pauses the topic and starts a dispatcher: once the lease expired, its claim parks
    the keys (no lease, the lost owner's outcome still unknown: the reconcile duty). After the
    resume the keys' claim is a takeover: it reads the progress and marks the 40 rows without
    sending them. Before issue 35 (review E1) the resumed claim was a plain one: 40 of 40 twice."""
    lease = 3.0
    rows = await insert_sequenced(conn, topic, keys=4, per_key=10)
    settings = eos(lease_seconds=lease, claim_tasks=1, batch_size=100)
    bootstrap = services.kafka_bootstrap_servers
    lock = await asyncpg.connect(database_url)
    lock_tx = lock.transaction()
    await lock_tx.start()
    await lock.execute("LOCK TABLE outbox IN SHARE MODE")
    async with fleet(settings, tmp_path, 1) as f:
        try:  # committed in Kafka, the mark waits on the lock
            await consume(bootstrap, topic, len(rows), timeout=120)
        except AssertionError as exc:
            raise AssertionError(f.tails()) from exc
        kill9(f.slots[0])
        await lock_tx.rollback()
        await lock.close()
        assert await count(conn, "published_at IS NULL") == len(rows), "never marked"
        paused = await cli(settings, "pause", "--topic", topic, "--yes")
        assert paused.code == 0, paused
        f.start(0)  # the operator's new dispatcher
        await f.wait_started()
        await asyncio.sleep(2 * lease)
        parked = await conn.fetchval(
            "SELECT count(*) FROM outbox_work WHERE state = 'p' AND claim_token IS NULL"
        )
        assert parked == 4, "the keys are parked, no lease"
        resumed = await cli(settings, "resume", "--topic", topic)
        assert resumed.code == 0, resumed
        await wait_all_settled(conn, 60)
    found = events(f, "takeover_found_committed")
    verdict = await verdict_for(database_url, bootstrap, [topic], timeout=60)
    report(
        "exactly_once_crash_pause_resume",
        verdict,
        record_property,
        takeovers_that_found_committed_rows=sum(int(e["rows"]) for e in found),
    )
    assert_sound(verdict)
    assert verdict.delivered == len(rows)
    assert verdict.duplicates == 0, verdict.summary()
    assert sum(int(e["rows"]) for e in found) == len(rows), found


async def test_a_progress_topic_deleted_while_no_dispatcher_runs_is_not_made_again(
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    eos: Callable[..., Settings],
    tmp_path: Path,
) -> None:
    """Review E10: a dispatcher commits 10 rows and is killed -9 before its mark; the progress
    topic is deleted while no dispatcher runs. The next dispatcher does not make it again (the
    table has leases whose batches were in it): it stops with ProgressTopicError and sends
    nothing. Before issue 35 it made the topic anew, took the leases over, found nothing and
    sent the 10 rows again."""
    rows = await insert_sequenced(conn, topic, keys=2, per_key=5)
    settings = eos(lease_seconds=3.0, claim_tasks=1, batch_size=100)
    bootstrap = services.kafka_bootstrap_servers
    lock = await asyncpg.connect(database_url)
    lock_tx = lock.transaction()
    await lock_tx.start()
    await lock.execute("LOCK TABLE outbox IN SHARE MODE")
    first = spawn(settings, tmp_path / "a.log")
    try:
        await consume(bootstrap, topic, len(rows), timeout=120)
    finally:
        kill9(first)
        await lock_tx.rollback()
        await lock.close()
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([settings.progress_topic])
    finally:
        await admin.close()
    await asyncio.sleep(4.0)  # the leases expire: a dispatcher would take them over
    log = tmp_path / "b.log"
    second = spawn(settings, log)
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):  # (it would take over meanwhile)
            await asyncio.to_thread(second.wait, 30)
        verdict = await verdict_for(database_url, bootstrap, [topic], timeout=60)
    finally:
        if second.poll() is None:
            kill9(second)
    assert verdict.delivered == len(rows) and verdict.duplicates == 0, verdict.summary()
    failed = log_events(log, "failed")
    assert second.returncode not in (0, -9) and failed, log.read_text()[-3000:]
    assert failed[-1]["error_type"] == "ProgressTopicError"
    assert "2 keys of the table are leased" in failed[-1]["error"]
    assert await count(conn, "published_at IS NULL") == len(rows), "left for an operator"
