"""Fault scenarios on the three-broker KRaft cluster (deploy/local/services.sh cluster-start): a
partition loses its leader, or its in-sync replicas, while the rest of the cluster answers,
which the single-broker rig cannot show. Real dispatcher processes, verdicts by tests/checker.py.

Topics here use message.timestamp.type=LogAppendTime, so that the checker's per-key order across
topics compares the brokers' append times. The findings of the review
(/work/shared/research/claim-and-publish-review.md, issue 10) that these tests showed against the
publisher of version 0.x (F2, F3, F4, F10 there) are fixed; each test names its finding. CI runs a
short version; OUTBOX_CHAOS=full the long one (`make chaos`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.partitioner import murmur2

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.kafka.publisher import KafkaPublisher, all_outcomes
from outbox_dispatcher.models import OutboxRecord
from tests.checker import EVENT_ID_HEADER, Verdict, verdict_for
from tests.faultproxy import FaultProxy

from .cluster import Cluster, LogBatch
from .helpers import (
    LEASED,
    count,
    insert_sequenced,
    kill9,
    log_events,
    spawn,
    wait_all_settled,
    wait_started,
    wait_until,
)
from .test_chaos import FULL, Fleet, Writer, delivery_settings, fleet, report, scale, writing

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600 if FULL else 300)]

APPEND_TIME = {"message.timestamp.type": "LogAppendTime"}


@pytest.fixture
def cluster_settings(make_settings: Any, cluster: Cluster) -> Callable[..., Settings]:
    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "log_format": "json",
            "http_port": 0,
            "kafka_bootstrap_servers": cluster.bootstrap,
            "claim_tasks": 2,
            "batch_size": 100,
            "lease_seconds": 15.0,
            "publish_timeout_seconds": 4.0,
        }
        values.update(overrides)
        settings: Settings = make_settings(**values)
        return settings

    return make


def assert_nothing_lost(verdict: Verdict, dead: int) -> None:
    summary = verdict.summary()
    assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], []), summary
    assert verdict.duplicates_without_event_id == 0, summary
    assert dead == 0, "nothing dead-lettered"


async def latency_p99(conn: asyncpg.Connection, topic: str, since: float, until: float) -> float:
    """p99 of published_at - created_at over the rows of `topic` created in [since, until)
    (epoch seconds); rows not yet published count from now."""
    value = await conn.fetchval(
        "SELECT extract(epoch FROM percentile_cont(0.99) WITHIN GROUP"
        " (ORDER BY coalesce(published_at, now()) - created_at))"
        " FROM outbox WHERE topic = $1 AND created_at >= to_timestamp($2)"
        " AND created_at < to_timestamp($3)",
        topic,
        since,
        until,
    )
    return round(float(value or 0), 2)


class ReadTimes:
    """When each row of a topic became readable to a read_committed consumer (review D1: the
    mark is not what a consumer sees: an open transaction on a partition hides later committed
    records there until it ends). Consumes from the start in the background."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.seen: dict[str, float] = {}  # event id: wall clock when first read
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ReadTimes:
        consumer = AIOKafkaConsumer(
            self.topic,
            bootstrap_servers=self.bootstrap,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            isolation_level="read_committed",
        )
        await consumer.start()
        self._task = asyncio.create_task(self._read(consumer))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _read(self, consumer: AIOKafkaConsumer) -> None:
        try:
            while True:
                batch = await consumer.getmany(timeout_ms=200)
                now = time.time()
                for records in batch.values():
                    for r in records:
                        event_id = dict(r.headers or ()).get(EVENT_ID_HEADER)
                        if event_id is not None:
                            self.seen.setdefault(event_id.decode(), now)
        finally:
            await consumer.stop()

    async def p99(self, conn: asyncpg.Connection, since: float, until: float) -> float:
        """p99 of (first read - created_at) over the topic's rows created in [since, until)
        (epoch seconds); a row never read counts from now."""
        rows = await conn.fetch(
            "SELECT event_id::text AS event_id, extract(epoch FROM created_at) AS created"
            " FROM outbox WHERE topic = $1 AND created_at >= to_timestamp($2)"
            " AND created_at < to_timestamp($3)",
            self.topic,
            since,
            until,
        )
        now = time.time()
        waits = sorted(self.seen.get(r["event_id"], now) - float(r["created"]) for r in rows)
        return round(waits[int(0.99 * (len(waits) - 1))], 2) if waits else 0.0


# --- a. leader failover ----------------------------------------------------------------------


_RUNS: dict[str, dict[str, Any] | Exception] = {}


def once(
    run: Callable[..., Awaitable[dict[str, Any]]],
) -> Callable[..., Awaitable[dict[str, Any]]]:
    """A scenario run shared by several tests (each judges one property of it): the first test
    that asks runs it; the others get its figures, or learn that it failed."""

    @functools.wraps(run)
    async def shared(*args: Any, delivery: str = "at-least-once") -> dict[str, Any]:
        name = f"{run.__name__}[{delivery}]"
        if name not in _RUNS:
            try:
                given = {} if delivery == "at-least-once" else {"delivery": delivery}
                _RUNS[name] = await run(*args, **given)
            except Exception as exc:
                _RUNS[name] = exc
                raise
        found = _RUNS[name]
        if isinstance(found, Exception):
            msg = f"the shared run {name} failed in an earlier test: {found!r}"
            raise AssertionError(msg) from found
        return found

    return shared


@once
async def failover_run(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
    *,
    delivery: str = "at-least-once",
) -> dict[str, Any]:
    """One run shared by the tests below: the leader of partition 0 of a busy topic is killed
    (SIGKILL: it is fenced after the session timeout, 6 s, longer than publish_timeout, 4 s, and
    exactly-once's transaction timeout, 2 s), stays down a while, and returns."""
    topic = await cluster.create_topic(config=APPEND_TIME)
    settings = cluster_settings(kafka_linger_ms=50, **delivery_settings(delivery, topic))
    writer = Writer(database_url, topic, [f"key-{k}" for k in range(60)], rate=scale(400, 800))
    down = scale(12, 60)
    async with fleet(settings, tmp_path, 2) as f, writing(writer):
        await wait_until(
            lambda: _published_some(conn), 30, "publishing to start on the cluster", interval=0.2
        )
        await asyncio.sleep(scale(3, 15))
        victim = await cluster.leader(topic, 0)
        assert victim in (1, 2, 3)
        await cluster.kill(victim)
        killed = time.monotonic()

        async def moved() -> bool:
            leader = await cluster.leader(topic, 0)
            return leader not in (victim, -1)

        await wait_until(moved, 60, "partition 0 to get a new leader", interval=0.2)
        moved_after = time.monotonic() - killed
        await asyncio.sleep(max(0.0, down - (time.monotonic() - killed)))
        await cluster.start(victim)
        await cluster.wait_fully_replicated(topic)
        rejoined_after = time.monotonic() - killed
        await asyncio.sleep(scale(3, 15))
        await writer.finish()
        await wait_all_settled(conn, scale(120, 600))
    dead = await count(conn, "dead_at IS NOT NULL")
    verdict = await verdict_for(database_url, cluster.bootstrap, [topic], timeout=scale(120, 600))
    figures = {
        "events": verdict.delivered,
        "killed_broker": victim,
        "new_leader_after_s": round(moved_after, 2),
        "broker_down_s": round(down, 1),
        "back_in_sync_after_kill_s": round(rejoined_after, 2),
        "writer_rows": writer.attempted,
        "rows_given_back_after_publish_timeout": given_back(f),
        "dead_lettered": dead,
    }
    report(scenario("cluster_leader_failover", delivery), verdict, record_property, **figures)
    return {"verdict": verdict, "dead": dead, **figures}


async def test_leader_failover_kill_9_under_load(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    run = await failover_run(
        conn, database_url, cluster, cluster_settings, tmp_path, record_property
    )
    verdict = run["verdict"]
    assert_nothing_lost(verdict, run["dead"])
    assert verdict.reordered_across_topics == []
    assert verdict.delivered == run["writer_rows"]
    # The idempotent producer's own retries to the new leader add no copy, and a row is given
    # back only once its producer is closed (F4): any duplicate is bounded by those rows.
    assert verdict.duplicates <= run["rows_given_back_after_publish_timeout"], verdict.summary()


async def test_leader_failover_makes_no_duplicates(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    run = await failover_run(
        conn, database_url, cluster, cluster_settings, tmp_path, record_property
    )
    assert run["verdict"].duplicates == 0, run["verdict"].summary()


async def test_exactly_once_leader_failover_loses_nothing_and_makes_no_duplicates(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    """The same failover with OUTBOX_DELIVERY=exactly-once: transactions caught by the kill
    outlive their timeout and are aborted; read_committed consumers see every row once."""
    run = await failover_run(
        conn,
        database_url,
        cluster,
        cluster_settings,
        tmp_path,
        record_property,
        delivery="exactly-once",
    )
    verdict = run["verdict"]
    assert_nothing_lost(verdict, run["dead"])
    assert verdict.reordered_across_topics == []
    assert verdict.delivered == run["writer_rows"]
    assert verdict.duplicates == 0, verdict.summary()


def scenario(name: str, delivery: str) -> str:
    return name if delivery == "at-least-once" else f"{name}_{delivery.replace('-', '_')}"


async def _published_some(conn: asyncpg.Connection) -> bool:
    return await count(conn, "published_at IS NOT NULL") > 0


def given_back(f: Fleet) -> int:
    """Rows the dispatchers gave back after publish_timeout with the broker answering (F4)."""
    return sum(
        int(e.get("unacknowledged", 0))
        for log in f.log_of.values()
        for e in log_events(log, "publish_timed_out")
    )


def logged(f: Fleet, event: str) -> int:
    """How many times the dispatchers logged `event`."""
    return sum(len(log_events(log, event)) for log in f.log_of.values())


# --- b. NotEnoughReplicas for a while, then recovery ------------------------------------------


@once
async def not_enough_replicas_run(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
    *,
    delivery: str = "at-least-once",
) -> dict[str, Any]:
    """One run shared by the tests below (each judges one property of it): topic `strict`
    (RF=3, min.insync.replicas=3) loses a replica for a while, topic `other` (min ISR 2) does
    not notice; separate keys."""
    strict = await cluster.create_topic(
        config={**APPEND_TIME, "min.insync.replicas": "3"}, prefix="strict"
    )
    other = await cluster.create_topic(config=APPEND_TIME, prefix="other")
    # With the claim engine of schema version 4 this run needed a claim window larger than the
    # strict topic's backlog (scan_factor=100): its keys' rows in backoff filled the window and no
    # other key was claimed at all (F1; 0 rows of `other` in 18 s). Version 6 claims ready keys,
    # so the defaults hold; this test is about the publisher.
    settings = cluster_settings(**delivery_settings(delivery, strict))
    strict_writer = Writer(database_url, strict, [f"s-{k}" for k in range(20)], rate=scale(100, 50))
    other_writer = Writer(database_url, other, [f"o-{k}" for k in range(20)], rate=100)
    outage = scale(20, 120)
    async with (
        fleet(settings, tmp_path, 2) as f,
        ReadTimes(cluster.bootstrap, other) as other_read,
        writing(strict_writer),
        writing(other_writer),
    ):
        await wait_until(lambda: _published_some(conn), 30, "publishing to start", interval=0.2)
        warm = time.time()
        await asyncio.sleep(scale(5, 15))
        await cluster.stop(3)
        stopped = time.time()
        await cluster.wait_for(
            strict, "the ISR to shrink below 3", lambda ps: all(len(p.isr) < 3 for p in ps.values())
        )
        await asyncio.sleep(max(0.0, outage - (time.time() - stopped)))
        ended = time.time()
        strict_stuck = await count(
            conn, f"topic = '{strict}' AND published_at IS NULL AND dead_at IS NULL"
        )
        other_flowed = await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE topic = $1 AND created_at > to_timestamp($2)"
            " AND published_at < to_timestamp($3)",
            other,
            stopped + 2,
            ended,
        )
        other_p99_before = await latency_p99(conn, other, warm, stopped)
        other_p99_during = await latency_p99(conn, other, stopped + 2, ended - 5)
        other_read_p99_before = await other_read.p99(conn, warm, stopped)
        other_read_p99_during = await other_read.p99(conn, stopped + 2, ended - 5)
        await cluster.start(3)
        await cluster.wait_fully_replicated(strict)
        recovered = time.time()
        await asyncio.sleep(3)
        await strict_writer.finish()
        await other_writer.finish()
        await wait_all_settled(conn, scale(120, 600))
    dead = await count(conn, "dead_at IS NOT NULL")
    verdicts = {
        name: await verdict_for(database_url, cluster.bootstrap, [t], timeout=scale(120, 600))
        for name, t in (("strict", strict), ("other", other))
    }
    figures = {
        "strict_copies_in_log": await copies_in_log(cluster, verdicts["strict"]),
        "outage_s": round(ended - stopped, 1),
        "strict_rows_waiting_at_outage_end": strict_stuck,
        "other_rows_published_during_outage": other_flowed,
        "other_p99_latency_before_s": other_p99_before,
        "other_p99_latency_during_s": other_p99_during,
        "other_read_committed_p99_before_s": other_read_p99_before,
        "other_read_committed_p99_during_s": other_read_p99_during,
        "in_sync_again_after_restart_s": round(recovered - ended, 2),
        "dead_lettered": dead,
        "rows_given_back_after_publish_timeout": given_back(f),
        "transactions_given_up": logged(f, "transaction_stalled"),
        "lanes_renewed": logged(f, "lane_renewed"),
        "strict_duplicates": verdicts["strict"].duplicates,
        "other_duplicates": verdicts["other"].duplicates,
    }
    report(
        scenario("cluster_not_enough_replicas", delivery),
        verdicts["strict"],
        record_property,
        **figures,
    )
    return {"verdicts": verdicts, "dead": dead, **figures}


async def copies_in_log(cluster: Cluster, verdict: Verdict, most: int = 10) -> list[str]:
    """For each duplicate (the first `most`), the batches that hold its two copies in the
    partition leader's log: the broker's view of who wrote each (producer id, epoch, base
    sequence). Two producer ids: a row given back and sent again; one producer id with two
    sequence numbers: the dispatcher sent it twice through one producer."""
    found: list[str] = []
    logs: dict[tuple[str, int], list[LogBatch]] = {}
    for duplicate in verdict.duplicate_details[:most]:
        described = []
        for where in (duplicate.first, duplicate.copy):
            place, _, offset = where.rpartition("@")
            topic, _, partition = place.rpartition("/")
            key = (topic, int(partition))
            if key not in logs:
                leader = (await cluster.partitions(topic))[int(partition)].leader
                logs[key] = await cluster.log_batches(leader, topic, int(partition))
            batch = next(
                (b for b in logs[key] if b.base_offset <= int(offset) <= b.last_offset), None
            )
            described.append(f"{where} in {batch}")
        found.append(f"{duplicate.event_id}: " + "; ".join(described))
    return found


async def test_not_enough_replicas_then_recovery_loses_nothing(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    run = await not_enough_replicas_run(
        conn, database_url, cluster, cluster_settings, tmp_path, record_property
    )
    for verdict in run["verdicts"].values():
        assert_nothing_lost(verdict, run["dead"])
    assert run["strict_rows_waiting_at_outage_end"] > 0, "the fault held the strict topic back"
    assert run["other_rows_published_during_outage"] > 0, "the other topic flowed meanwhile"


async def test_not_enough_replicas_makes_no_duplicates(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    run = await not_enough_replicas_run(
        conn, database_url, cluster, cluster_settings, tmp_path, record_property
    )
    assert run["strict_duplicates"] == 0, run


async def test_exactly_once_not_enough_replicas_loses_nothing_and_makes_no_duplicates(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    """NotEnoughReplicas on `strict` in exactly-once: a transaction holding a strict record
    waits (the broker retries the append; its markers cannot be written either) until the
    replica returns; read_committed consumers then see every row of both topics once."""
    run = await not_enough_replicas_run(
        conn,
        database_url,
        cluster,
        cluster_settings,
        tmp_path,
        record_property,
        delivery="exactly-once",
    )
    for verdict in run["verdicts"].values():
        assert_nothing_lost(verdict, run["dead"])
        assert verdict.duplicates == 0, verdict.summary()
    assert run["strict_rows_waiting_at_outage_end"] > 0, "the fault held the strict topic back"


async def test_exactly_once_not_enough_replicas_leaves_other_topics_flowing(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    """A transaction with a record of the strict topic can neither commit nor end (its
    markers cannot be written to the short partition either, so its id cannot begin another
    transaction): it is given up after the transaction timeout, its lane goes on under a new
    id, and the strict partitions are held (kafka/exactly_once/stalls.py), so the other topic's rows
    flow while writers keep writing both topics' keys. With one producer a process had, every key
    waited (0 rows of `other` in 20 s); with two lanes and no give-up, as soon as both claim loops
    of a process met a strict row (a CI run: 0 rows)."""
    run = await not_enough_replicas_run(
        conn,
        database_url,
        cluster,
        cluster_settings,
        tmp_path,
        record_property,
        delivery="exactly-once",
    )
    assert run["transactions_given_up"] > 0 and run["lanes_renewed"] > 0, run
    assert run["other_rows_published_during_outage"] > 0, "the other topic flowed meanwhile"


async def test_not_enough_replicas_leaves_other_topics_latency_alone(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    run = await not_enough_replicas_run(
        conn, database_url, cluster, cluster_settings, tmp_path, record_property
    )
    normal = max(run["other_p99_latency_before_s"], 0.5)
    assert run["other_p99_latency_during_s"] <= 2 * normal, run


# --- c2. a record in the log before the broker says NotEnoughReplicas (issue 25) ---------------


async def after_append_run(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
) -> dict[str, Any]:
    """The way the 6 copies of issue 25 were made, on purpose: the leader appends a produce
    request and then answers it with an error, so the producer does not know that its records
    are in the log.

    Topic `appended` has one partition on the three brokers, min.insync.replicas=3. A follower
    freezes (SIGSTOP, as in a long GC pause; never the quorum's leader), so an acks=all request
    waits in the leader's purgatory after its append. The request times out
    (REQUEST_TIMED_OUT); once the controller fences the frozen broker, the ISR shrinks to two,
    the high watermark passes the records (they are committed) and every retry is refused
    NOT_ENOUGH_REPLICAS (or a request still waiting is answered
    NOT_ENOUGH_REPLICAS_AFTER_APPEND): that is what a controlled shutdown of a follower did to
    the requests in flight in CI. The follower thaws after several publish_timeouts. A retry by
    the same producer is then recognised by the broker as a duplicate (same producer id, epoch
    and sequence) and answered with the first append's offset; a row given back and sent again
    under another producer id is appended a second time."""
    quorum = await cluster.quorum_leader()
    follower = next(b for b in (3, 2, 1) if b != quorum)
    leader = next(b for b in (1, 2, 3) if b != follower)
    third = next(b for b in (1, 2, 3) if b not in (leader, follower))
    config = {**APPEND_TIME, "min.insync.replicas": "3"}
    topic = await cluster.create_topic(
        config=config, assignments={0: [leader, follower, third]}, prefix="appended"
    )
    publish_timeout = 4.0
    settings = cluster_settings(claim_tasks=1, publish_timeout_seconds=publish_timeout)
    keys, per_key = 10, 3
    async with fleet(settings, tmp_path, 1) as f:
        await insert_sequenced(conn, topic, keys=keys, per_key=1)  # warm: metadata, connections
        await wait_all_settled(conn, 30)
        await cluster.pause(follower)
        try:
            await insert_sequenced(conn, topic, keys=keys, per_key=per_key, first_seq=1)

            async def claimed() -> bool:
                return await count(conn, LEASED) > 0

            await wait_until(claimed, 10, "the rows to be claimed", interval=0.02)
            # Appended, timed out, refused; the code before issue 25 gave the rows back after
            # publish_timeout and sent them again under a fresh producer id.
            await asyncio.sleep(3 * publish_timeout)
            waiting = await count(conn, "published_at IS NULL AND dead_at IS NULL")
        finally:
            await cluster.resume(follower)
        await wait_all_settled(conn, 60)
    verdict = await verdict_for(database_url, cluster.bootstrap, [topic], timeout=60)
    batches = await cluster.log_batches(leader, topic, 0)
    return {
        "verdict": verdict,
        "rows": keys * (per_key + 1),
        "rows_waiting_while_frozen": waiting,
        "leader_log": [str(b) for b in batches],
        "producer_ids_in_log": sorted({b.producer_id for b in batches}),
        "records_in_log": sum(b.last_offset - b.base_offset + 1 for b in batches),
        "producer_errors": sorted(
            {
                str(e["event"]).rpartition("Error: ")[2][:80]
                for e in log_events(f.log_of[0])
                if str(e.get("event", "")).startswith("Got error produce response")
            }
        ),
        "producer_replaced": len(log_events(f.log_of[0], "producer_replaced")),
    }


async def test_a_record_appended_before_not_enough_replicas_is_not_sent_twice(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    """Issue 25 (review N10): no copy without a crash when the broker appends a record and then
    answers with an error. The rows stay with the producer that sent them until the broker
    answers them for good; the checker finds each row once, and the leader's log holds one
    record per row, all from one producer id."""
    run = await after_append_run(conn, database_url, cluster, cluster_settings, tmp_path)
    verdict = run.pop("verdict")
    report("cluster_after_append", verdict, record_property, **run)
    assert run["rows_waiting_while_frozen"] > 0, ("the fault held the rows back", run)
    assert_nothing_lost(verdict, 0)
    assert verdict.duplicates == 0, (verdict.summary(), run)
    assert run["records_in_log"] == run["rows"], run
    assert len(run["producer_ids_in_log"]) == 1, run


# --- d. a leaderless partition past publish_timeout, a hot key spanning producer batches -----


@once
async def leaderless_run(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> dict[str, Any]:
    """One run shared by the tests below. Topic `lonely` has 8 partitions whose only replica is
    on broker 3, one hot key per partition, each key's claim spanning several producer batches
    (1 KB rows, 32 KB batches). Broker 3 is away from before the dispatcher's first send (so the
    broker keeps no state for its producer id) until the first batches have expired unsent."""
    partitions = 8
    lonely = await cluster.create_topic(
        config=APPEND_TIME, assignments={p: [3] for p in range(partitions)}, prefix="lonely"
    )
    keys = keys_on_distinct_partitions(partitions)
    per_key, pad = int(scale(180, 600)), "x" * 1000
    await cluster.stop(3)
    await cluster.wait_for(lonely, "no leader", lambda ps: all(p.leader == -1 for p in ps.values()))
    await conn.executemany(
        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, $2, $3)",
        [
            (lonely, key, orjson.dumps({"key": key, "seq": s, "pad": pad}))
            for s in range(per_key)
            for key in keys
        ],
    )
    publish_timeout = 5.0
    settings = cluster_settings(
        claim_tasks=1,
        batch_size=per_key * partitions,
        kafka_max_batch_bytes=32_768,
        publish_timeout_seconds=publish_timeout,
    )
    async with fleet(settings, tmp_path, 1) as f:

        async def claimed() -> bool:
            return await count(conn, LEASED) > 0

        await wait_until(claimed, 60, "the first claim", interval=0.05)
        # The first batch of each partition expires unsent after publish_timeout (consuming its
        # sequence numbers); the broker returns while later batches of the claim still wait.
        await asyncio.sleep(publish_timeout + 1)
        await cluster.start(3)
        await cluster.wait_fully_replicated(lonely)
        await wait_all_settled(conn, scale(120, 600))
    dead = await count(conn, "dead_at IS NOT NULL")
    verdict = await verdict_for(database_url, cluster.bootstrap, [lonely], timeout=scale(120, 600))
    figures = {
        "rows": per_key * partitions,
        "hot_keys": partitions,
        "publish_timeout_s": publish_timeout,
        "rows_given_back_after_publish_timeout": given_back(f),
        "keys_reordered": len({r.split(":", 1)[0] for r in verdict.reordered}),
        "dead_lettered": dead,
    }
    report("cluster_leaderless_hot_keys", verdict, record_property, **figures)
    return {"verdict": verdict, "dead": dead, **figures}


def keys_on_distinct_partitions(partitions: int) -> list[str]:
    """One key per partition under the producer's default partitioner (murmur2, as Java's)."""
    found: dict[int, str] = {}
    n = 0
    while len(found) < partitions:
        key = f"hot-{n}"
        found.setdefault((murmur2(key.encode()) & 0x7FFFFFFF) % partitions, key)
        n += 1
    return [found[p] for p in range(partitions)]


async def test_leaderless_partition_past_publish_timeout_loses_nothing(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    run = await leaderless_run(
        conn, database_url, cluster, cluster_settings, tmp_path, record_property
    )
    verdict = run["verdict"]
    summary = verdict.summary()
    assert (verdict.lost, verdict.unexpected) == ([], []), summary
    assert verdict.duplicates_without_event_id == 0, summary
    assert run["dead"] == 0, "nothing dead-lettered"
    # Batches that expire unsent fail their rows, which are retried: no copy is left behind.
    # Copies could only come from rows given back after publish_timeout, and those are given
    # back only once their producer is closed (F4).
    assert verdict.duplicates <= run["rows_given_back_after_publish_timeout"], summary


async def test_leaderless_partition_past_publish_timeout_keeps_a_hot_key_in_order(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    run = await leaderless_run(
        conn, database_url, cluster, cluster_settings, tmp_path, record_property
    )
    verdict = run["verdict"]
    assert verdict.reordered == [], (verdict.reordered[:5], verdict.summary())


# --- c. a key alternating between two topics, one of them failing asynchronously --------------


@pytest.mark.parametrize("policy", ["skip", "block"])
async def test_a_key_across_topics_keeps_its_order_when_one_topic_fails(
    policy: str,
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    # `fragile` has one partition whose only replica is on broker 3; `healthy` is replicated.
    fragile = await cluster.create_topic(config=APPEND_TIME, assignments={0: [3]}, prefix="fragile")
    healthy = await cluster.create_topic(config=APPEND_TIME, partitions=1, prefix="healthy")
    keys, per_key = 10, int(scale(6, 20))
    await cluster.stop(3)
    await cluster.wait_for(fragile, "no leader", lambda ps: ps[0].leader == -1)
    rows = [
        (fragile if s % 2 == 0 else healthy, f"k-{k}", orjson.dumps({"key": f"k-{k}", "seq": s}))
        for s in range(per_key)
        for k in range(keys)
    ]
    await conn.executemany(
        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, $2, $3)", rows
    )
    settings = cluster_settings(dead_letter_policy=policy, batch_size=50)
    outage = scale(15, 60)
    async with fleet(settings, tmp_path, 1):
        await asyncio.sleep(outage)
        healthy_out = await count(conn, f"topic = '{healthy}' AND published_at IS NOT NULL")
        await cluster.start(3)
        await cluster.wait_fully_replicated(fragile)
        await wait_all_settled(conn, scale(120, 600))
    dead = await count(conn, "dead_at IS NOT NULL")
    verdict = await verdict_for(
        database_url, cluster.bootstrap, [fragile, healthy], timeout=scale(120, 600)
    )
    report(
        f"cluster_cross_topic_{policy}",
        verdict,
        record_property,
        events=verdict.delivered,
        outage_s=outage,
        healthy_rows_published_during_outage=healthy_out,
        keys_reordered_across_topics=len(
            {r.split(":", 1)[0] for r in verdict.reordered_across_topics}
        ),
        dead_lettered=dead,
    )
    assert_nothing_lost(verdict, dead)
    assert verdict.reordered_across_topics == [], verdict.reordered_across_topics[:5]


# --- e. SIGTERM past the grace period while acks cannot come ----------------------------------


@pytest.mark.parametrize("recovery", ["while_closing", "after_exit"])
async def test_sigterm_past_the_grace_period_makes_no_duplicates(
    recovery: str,
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    """Issue 10: a row is given back only once no copy of it can still be delivered by this
    process, on SIGTERM past the grace period too (F4).

    Topic `strict` (RF=3, min.insync.replicas=3) with broker 3 stopped: every produce is refused
    with NotEnoughReplicas, which the idempotent producer retries by itself, for ever. Dispatcher
    A (a real `outbox-dispatcher run`, grace period 2 s) claims every row and sends it; SIGTERM;
    the grace period expires with nothing acknowledged. Then the topic recovers
    (min.insync.replicas back to 2), so that whatever A's producer still holds is delivered:

    * while_closing: 1 s after the grace period expired, inside the bounded flush of the
      producer's close (STOP_FLUSH_SECONDS, 5 s). A closes its producer before it gives anything
      back, so each row is acknowledged and marked, or failed for good and given back uncopied.
      A dispatcher that gave the rows back first and flushed its producer afterwards (the
      regression this catches) would deliver them after giving them back: they would be pending
      and in Kafka, and B would publish every one again.
    * after_exit: once A has exited (its close gave up on the flush and failed what was left).

    Then dispatcher B publishes what is pending; the checker: 0 lost, 0 duplicated, 0 reordered.
    """
    config = {**APPEND_TIME, "min.insync.replicas": "3"}
    strict = await cluster.create_topic(config=config, prefix="strict")
    await cluster.stop(3)
    await cluster.wait_for(
        strict, "the ISR to shrink below 3", lambda ps: all(len(p.isr) < 3 for p in ps.values())
    )
    total = 200
    await insert_sequenced(conn, strict, keys=20, per_key=total // 20)
    grace = 2.0
    settings_a = cluster_settings(
        claim_tasks=1,
        batch_size=total,
        shutdown_grace_seconds=grace,
        publish_timeout_seconds=120.0,  # no give-back by timeout before the SIGTERM
        lease_seconds=60.0,
    )
    log_a = tmp_path / "a.log"
    a = spawn(settings_a, log_a)
    try:
        await wait_started([log_a])

        async def all_claimed() -> bool:
            return await count(conn, LEASED) == total

        await wait_until(all_claimed, 30, "A to claim every row")
        await asyncio.sleep(3)  # sent, refused, retried by the producer
        assert await count(conn, "published_at IS NOT NULL") == 0, "nothing can be acknowledged"
        a.send_signal(signal.SIGTERM)
        sigterm = time.monotonic()

        async def grace_expired() -> bool:
            return bool(log_events(log_a, "shutdown_grace_expired"))

        await wait_until(grace_expired, 30, "A's grace period to expire")
        expired_after = time.monotonic() - sigterm
        if recovery == "while_closing":
            await asyncio.sleep(1.0)
        else:
            code = await asyncio.to_thread(a.wait, 60)
        await cluster.set_topic_config(strict, {**APPEND_TIME, "min.insync.replicas": "2"})
        recovered_after = time.monotonic() - sigterm
        code = await asyncio.to_thread(a.wait, 60)
    finally:
        if a.poll() is None:
            kill9(a)
    exited_after = time.monotonic() - sigterm
    assert code == 0, log_a.read_text()[-4000:]
    published_by_a = await count(conn, "published_at IS NOT NULL")
    given_back = await count(conn, "published_at IS NULL AND dead_at IS NULL")
    assert await count(conn, LEASED) == 0, "A gave back or marked every row"
    # The broker returns before the topic is deleted (Kafka 4.1.1's controller could not
    # register broker 3 again after a topic was deleted while 3 was out of its ISR).
    await cluster.start(3)
    await cluster.wait_fully_replicated(strict)
    async with fleet(cluster_settings(), tmp_path, 1):
        await wait_all_settled(conn, 120)
    dead = await count(conn, "dead_at IS NOT NULL")
    verdict = await verdict_for(database_url, cluster.bootstrap, [strict], timeout=120)
    report(
        f"cluster_sigterm_past_grace_{recovery}",
        verdict,
        record_property,
        rows=total,
        grace_s=grace,
        grace_expired_after_sigterm_s=round(expired_after, 2),
        topic_recovered_after_sigterm_s=round(recovered_after, 2),
        a_exited_after_sigterm_s=round(exited_after, 2),
        published_by_a=published_by_a,
        given_back_by_a=given_back,
        dead_lettered=dead,
    )
    assert_nothing_lost(verdict, dead)
    assert verdict.delivered == total
    assert verdict.duplicates == 0, verdict.summary()
    if recovery == "after_exit":
        assert given_back == total, "A's close failed what it held; B published it"


# --- f. one partition blackholed while the others are healthy ----------------------------------


# Below this, "2x normal" would be a bound tighter than the scheduling noise of a shared 2-core
# machine: a normal p99 of 30 ms must not make 60 ms the limit. 0.25 s is also the longest a
# healthy key that shares a claim with a partition that does not answer waits by design before its
# rows are settled on their own (EARLY_SETTLE_SECONDS in kafka/acks.py; usually
# EARLY_SETTLE_FACTOR times the first partition's ack time, at least EARLY_SETTLE_MIN_SECONDS).
LATENCY_FLOOR = 0.25
LOOKUPS = 10


def keys_per_partition(partitions: int, per_partition: int) -> dict[int, list[str]]:
    """`per_partition` keys for each partition under the producer's default partitioner."""
    found: dict[int, list[str]] = {p: [] for p in range(partitions)}
    n = 0
    while any(len(keys) < per_partition for keys in found.values()):
        key = f"bh-{n}"
        keys = found[(murmur2(key.encode()) & 0x7FFFFFFF) % partitions]
        if len(keys) < per_partition:
            keys.append(key)
        n += 1
    return found


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


async def keys_p99(conn: asyncpg.Connection, keys: list[str], since: float, until: float) -> float:
    """p99 of published_at - created_at (commit to mark, which comes after the ack) over the rows
    of `keys` created in [since, until); rows not yet published count from now."""
    value = await conn.fetchval(
        "SELECT extract(epoch FROM percentile_cont(0.99) WITHIN GROUP"
        " (ORDER BY coalesce(published_at, now()) - created_at))"
        " FROM outbox WHERE ordering_key = ANY($1::text[]) AND created_at >= to_timestamp($2)"
        " AND created_at < to_timestamp($3)",
        keys,
        since,
        until,
    )
    return round(float(value or 0), 3)


async def test_one_blackholed_partition_leaves_the_others_at_normal_latency(
    conn: asyncpg.Connection,
    database_url: str,
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    """Issue 10: one partition blackholed while 4 others are healthy; p99 commit-to-ack of keys
    on the healthy partitions stays within 2x of normal.

    Topic of 5 partitions, RF=1: partition 0 on broker 3, partitions 1-4 on brokers 1 and 2. The
    dispatcher reaches each broker only through a fault proxy of its own (the brokers' PROXIED
    listeners advertise the proxies, deploy/local/services.sh). A steady writer over 4 keys per
    partition; the normal p99 is measured first, in this test; then broker 3's proxy
    blackholes (connections stay open, every byte is dropped: the client sees a hang, never a
    reset, like a network partition that drops packets; broker 3 itself stays in the cluster,
    so partition 0 keeps its leader and nothing moves). The healthy keys' p99 during the
    blackhole must stay within 2x normal (normal floored at LATENCY_FLOOR). Then the proxy is
    restored and the checker sees every row: 0 lost, 0 reordered."""
    listening = [
        await asyncio.to_thread(_listening, proxied) for proxied, _ in cluster.proxied.values()
    ]
    if not listening or not all(listening):
        pytest.skip(
            "the cluster runs without PROXIED listeners (started by an older "
            "deploy/local/services.sh: cluster-stop, then cluster-start)"
        )
    partitions = 5
    topic = await cluster.create_topic(
        config=APPEND_TIME,
        assignments={0: [3], 1: [1], 2: [2], 3: [1], 4: [2]},
        prefix="blackhole",
    )
    by_partition = keys_per_partition(partitions, 4)
    healthy = [k for p in range(1, partitions) for k in by_partition[p]]
    every = [k for p in range(partitions) for k in by_partition[p]]
    proxies = {
        node: FaultProxy("127.0.0.1", proxied, listen_port=proxy)
        for node, (proxied, proxy) in cluster.proxied.items()
    }
    for proxy in proxies.values():
        await proxy.start()
    try:
        settings = cluster_settings(
            kafka_bootstrap_servers=",".join(
                f"127.0.0.1:{proxy}" for _, (_, proxy) in sorted(cluster.proxied.items())
            ),
            claim_tasks=2,
        )
        writer = Writer(database_url, topic, every, rate=200)
        phase = scale(20, 60)
        async with fleet(settings, tmp_path, 1), writing(writer):
            await wait_until(
                lambda: _published_some(conn), 30, "publishing through the proxies", interval=0.2
            )
            await asyncio.sleep(3)  # warm-up
            assert all(p.accepted for p in proxies.values()), "every broker reached via its proxy"
            normal_from = time.time()
            await asyncio.sleep(phase)
            normal_to = time.time()
            proxies[3].blackhole()
            await asyncio.sleep(phase)
            blackholed_to = time.time()
            # Rows written in the last 3 s of each phase have had at least that long.
            normal = await keys_p99(conn, healthy, normal_from, normal_to - 3)
            during = await keys_p99(conn, healthy, normal_to, blackholed_to - 3)
            stuck = await conn.fetchval(
                "SELECT count(*) FROM outbox WHERE ordering_key = ANY($1::text[])"
                " AND published_at IS NULL",
                by_partition[0],
            )
            healthy_during = await conn.fetchval(
                "SELECT count(*) FROM outbox WHERE ordering_key = ANY($1::text[])"
                " AND created_at >= to_timestamp($2) AND created_at < to_timestamp($3)",
                healthy,
                normal_to,
                blackholed_to - 3,
            )
            await proxies[3].restore()
            restored = time.monotonic()
            await writer.finish()
            await wait_all_settled(conn, scale(120, 600))
            drained_after = time.monotonic() - restored
    finally:
        for proxy in proxies.values():
            await proxy.stop()
    dead = await count(conn, "dead_at IS NOT NULL")
    verdict = await verdict_for(database_url, cluster.bootstrap, [topic], timeout=scale(120, 600))
    bound = 2 * max(normal, LATENCY_FLOOR)
    report(
        "cluster_one_partition_blackholed",
        verdict,
        record_property,
        phase_s=phase,
        healthy_p99_normal_s=normal,
        healthy_p99_blackholed_s=during,
        healthy_p99_ratio=round(during / normal, 1) if normal else None,
        bound_s=bound,
        healthy_rows_during=healthy_during,
        blackholed_partition_rows_waiting=stuck,
        drained_after_restore_s=round(drained_after, 2),
        writer_rows=writer.attempted,
        dead_lettered=dead,
    )
    assert stuck > 0, "the blackhole held partition 0 back"
    assert during <= bound, (normal, during)
    assert_nothing_lost(verdict, dead)
    assert verdict.delivered == writer.attempted


async def test_a_topic_lookup_does_not_wait_for_a_blackholed_broker(
    cluster: Cluster,
    cluster_settings: Callable[..., Settings],
    record_property: Any,
) -> None:
    """Issue 10, found by CI in the test above (healthy p99 4.04 s once in about 7 runs): a
    producer that does not know a topic yet (every start, every producer replacement) looks it
    up before the topic's keys can go, and aiokafka asks the brokers one at a time in random
    order, each within the request timeout. With one broker blackholed, about one lookup in
    three waited a whole request timeout. Broker 3's proxy blackholes; a topic with partitions
    on brokers 1 and 2 only; LOOKUPS fresh publishers each publish one row to it. Every publish
    must take well under the request timeout (half of it): a lookup that asked broker 3 alone
    fails that bound, and all LOOKUPS avoiding it by chance is about (2/3)**10."""
    listening = [
        await asyncio.to_thread(_listening, proxied) for proxied, _ in cluster.proxied.values()
    ]
    if not listening or not all(listening):
        pytest.skip("the cluster runs without PROXIED listeners (cluster-stop, cluster-start)")
    topic = await cluster.create_topic(assignments={0: [1], 1: [2]}, prefix="lookup")
    proxies = {
        node: FaultProxy("127.0.0.1", proxied, listen_port=proxy)
        for node, (proxied, proxy) in cluster.proxied.items()
    }
    for proxy in proxies.values():
        await proxy.start()
    settings = cluster_settings(
        kafka_bootstrap_servers=",".join(
            f"127.0.0.1:{proxy}" for _, (_, proxy) in sorted(cluster.proxied.items())
        )
    )
    seconds: list[float] = []
    try:
        proxies[3].blackhole()
        for n in range(LOOKUPS):
            publisher = KafkaPublisher(configs_of(settings).publisher)
            await publisher.start()  # its producer id may be asked of broker 3: not timed
            try:
                record = OutboxRecord(
                    n, topic, f"k{n}", b"x", {}, uuid.uuid4(), datetime.now(UTC), 0, False
                )
                started = time.monotonic()
                outcomes = await all_outcomes(publisher.publish([record]))
                seconds.append(round(time.monotonic() - started, 3))
                assert outcomes == [None], outcomes
            finally:
                await publisher.stop()
    finally:
        for proxy in proxies.values():
            await proxy.stop()
    text = orjson.dumps({"scenario": "cluster_lookup_blackholed_broker", "seconds": seconds})
    print(f"\nCHAOS {text.decode()}")
    record_property("chaos", text.decode())
    assert max(seconds) < settings.publish_timeout_seconds / 2, seconds
