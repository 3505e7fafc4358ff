"""Fault scenarios against real processes, PostgreSQL and Kafka, each ending in the checker's
verdict (tests/checker.py). CI runs a short version; `make chaos` (OUTBOX_CHAOS=full) the long
one. Figures are printed and, with OUTBOX_CHAOS_REPORT=<file>, appended to it as JSON lines
(docs/guarantees.md quotes them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.store import migrations
from tests.checker import Verdict, verdict_for

from .helpers import (
    Services,
    count,
    kill9,
    log_events,
    settings_env,
    spawn,
    wait_all_settled,
    wait_until,
)

FULL = os.environ.get("OUTBOX_CHAOS") == "full"

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600 if FULL else 300)]


def scale(ci: float, full: float) -> float:
    return full if FULL else ci


def report(name: str, verdict: Verdict, record_property: Any, **figures: Any) -> None:
    """Print the verdict and the figures; append them to OUTBOX_CHAOS_REPORT if set."""
    line = {
        "scenario": name,
        "scale": "full" if FULL else "ci",
        "verdict": {k: v for k, v in verdict.summary().items() if k != "examples"},
        **figures,
    }
    text = json.dumps(line, default=str)
    print(f"\nCHAOS {text}")
    record_property("chaos", text)
    path = os.environ.get("OUTBOX_CHAOS_REPORT")
    if path:
        with Path(path).open("a") as out:
            out.write(text + "\n")


DELIVERIES = ["at-least-once", "exactly-once"]


def delivery_settings(delivery: str, topic: str) -> dict[str, Any]:
    """The settings of a delivery mode for a scenario that runs in both."""
    if delivery == "at-least-once":
        return {}
    return {
        "delivery": delivery,
        "progress_topic": f"progress-{topic}",
        "transaction_timeout_seconds": 2.0,
    }


def assert_no_copy_in_exactly_once(delivery: str, verdict: Verdict) -> None:
    if delivery == "exactly-once":
        assert verdict.duplicates == 0, verdict.summary()


def assert_sound(verdict: Verdict) -> None:
    summary = verdict.summary()
    assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], []), summary
    assert verdict.duplicates_without_event_id == 0, summary


# --- processes -----------------------------------------------------------------------------


class Fleet:
    """Dispatcher processes in numbered slots; a slot can be killed and restarted."""

    def __init__(self, settings: Settings, logs: Path) -> None:
        self.settings = settings
        self.logs = logs
        self.slots: dict[int, subprocess.Popen[bytes]] = {}
        self.log_of: dict[int, Path] = {}
        self.started = 0

    def start(self, slot: int, settings: Settings | None = None) -> subprocess.Popen[bytes]:
        self.started += 1
        log = self.logs / f"d{slot}-{self.started}.log"
        self.log_of[slot] = log
        self.slots[slot] = spawn(settings or self.settings, log)
        return self.slots[slot]

    async def wait_started(self, timeout: float = 60) -> None:
        async def started() -> bool:
            return all(p.exists() and '"started"' in p.read_text() for p in self.log_of.values())

        await wait_until(started, timeout, "the dispatchers to start")

    def stop(self) -> list[int | None]:
        for p in self.slots.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for p in self.slots.values():
            try:
                codes.append(p.wait(timeout=60))
            except subprocess.TimeoutExpired:
                kill9(p)
                codes.append(None)
        return codes

    def tails(self) -> str:
        return "\n".join(f"{p.name}: {p.read_text()[-6000:]}" for p in self.log_of.values())


@contextlib.asynccontextmanager
async def fleet(settings: Settings, logs: Path, n: int) -> AsyncIterator[Fleet]:
    f = Fleet(settings, logs)
    for slot in range(n):
        f.start(slot)
    try:
        await f.wait_started()
        yield f
    finally:
        with contextlib.suppress(AssertionError):  # a process restarted just now: SIGTERM
            await f.wait_started()  # before its handlers exist would look like a crash
        for p in f.slots.values():  # a SIGSTOPped process must be able to hear SIGTERM
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGCONT)
        codes = f.stop()
        assert all(c == 0 for c in codes), (codes, f.tails())


def http_port(log: Path) -> int | None:
    events = log_events(log, "http_listening")
    return int(events[-1]["port"]) if events else None


def readyz(port: int) -> tuple[int, dict[str, Any]]:
    """GET /readyz: (status, JSON body); (0, {}) when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=3) as r:
            return r.status, orjson.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read() or b"{}")
    except (OSError, orjson.JSONDecodeError):
        return 0, {}


@contextlib.asynccontextmanager
async def restarts(services: Services, service: str) -> AsyncIterator[None]:
    """The test stops `service` ("pg" or "kafka"); whatever happens, it is started again."""
    try:
        yield
    finally:
        await control(services, f"{service}-start")


async def control(services: Services, action: str) -> None:
    """deploy/local/services.sh pg-stop|pg-start|kafka-stop|kafka-start, off the event loop."""
    if services.control is None:
        pytest.skip("needs the local services script to stop and start a service")
    command = ["bash", str(services.control), action]
    await asyncio.to_thread(subprocess.run, command, check=True, timeout=180)


# --- load ------------------------------------------------------------------------------------


@dataclass
class Writer:
    """Commits rows continuously in small transactions, payload {"key", "seq"} with seq rising
    per key; rides out database outages (a commit of unknown outcome just leaves a gap in seq)."""

    url: str
    topic: str
    keys: list[str]
    rate: float  # rows per second
    per_tx: int = 20
    attempted: int = 0
    failures: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    _seq: dict[str, int] = field(default_factory=dict)

    async def finish(self) -> None:
        """Stop writing and wait until the transaction in flight has committed or failed. A test
        that then waits for every row to be settled must not look before that commit lands: CI
        once saw 20 rows (one transaction) committed after such a check, never claimed before
        the dispatchers stopped, and counted as lost."""
        self.stop.set()
        await self.finished.wait()

    async def run(self) -> None:
        conn: asyncpg.Connection | None = None
        cursor = 0
        try:
            while not self.stop.is_set():
                rows = []
                for _ in range(self.per_tx):
                    key = self.keys[cursor % len(self.keys)]
                    cursor += 1
                    seq = self._seq.get(key, 0)
                    self._seq[key] = seq + 1
                    rows.append((self.topic, key, orjson.dumps({"key": key, "seq": seq})))
                try:
                    if conn is None or conn.is_closed():
                        conn = await asyncpg.connect(self.url, timeout=5)
                    await conn.executemany(
                        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, $2, $3)",
                        rows,
                    )
                    self.attempted += len(rows)
                except (
                    OSError,
                    TimeoutError,
                    asyncpg.PostgresError,
                    asyncpg.InterfaceError,
                    asyncpg.InternalClientError,  # a connection broken mid-statement
                ):
                    self.failures += 1
                    if conn is not None:
                        conn.terminate()
                        conn = None
                    await asyncio.sleep(0.5)
                    continue
                await asyncio.sleep(self.per_tx / self.rate)
        finally:
            self.finished.set()
            if conn is not None:
                conn.terminate()


@contextlib.asynccontextmanager
async def writing(writer: Writer) -> AsyncIterator[Writer]:
    task = asyncio.create_task(writer.run())
    try:
        yield writer
    finally:
        writer.stop.set()
        await task


AUDIT = """
CREATE TABLE outbox_audit (
    id bigint, at timestamptz NOT NULL DEFAULT now(), what text,
    old_owner text, new_owner text, old_expires timestamptz,
    attempts integer, next_attempt_at timestamptz, dead boolean
);
-- A claim leases a key's work (outbox_work): every pending row the lease covers is recorded.
CREATE FUNCTION outbox_audit_claim_fn() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v_old_token uuid;
    v_old_owner text;
    v_old_expires timestamptz;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        v_old_token := OLD.claim_token;
        v_old_owner := OLD.claim_owner;
        v_old_expires := OLD.claim_expires_at;
    END IF;
    INSERT INTO outbox_audit (id, what, old_owner, new_owner, old_expires, attempts)
    SELECT o.id, CASE WHEN v_old_token IS NULL THEN 'claim' ELSE 'takeover' END,
           v_old_owner, NEW.claim_owner, v_old_expires, o.attempts
      FROM outbox o
     WHERE o.published_at IS NULL AND o.dead_at IS NULL
       AND ((NOT NEW.keyless AND o.ordering_key = NEW.ordering_key
             AND o.id >= NEW.claim_first
             AND o.id <= greatest(NEW.head_id - 1, NEW.claim_last))
            OR (NEW.keyless AND o.id = NEW.claim_first));
    RETURN NULL;
END $$;
CREATE FUNCTION outbox_audit_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO outbox_audit (id, what, attempts, next_attempt_at, dead)
    VALUES (NEW.id, 'failed', NEW.attempts, NEW.next_attempt_at, NEW.dead_at IS NOT NULL);
    RETURN NULL;
END $$;
"""


async def install_audit(conn: asyncpg.Connection, *, claims: bool) -> None:
    """A test-only trigger recording, by the database clock, every lease takeover (and every
    claim and failed attempt if `claims`)."""
    await conn.execute(AUDIT)
    taken = "NEW.claim_token IS NOT NULL AND OLD.claim_token IS DISTINCT FROM NEW.claim_token" + (
        "" if claims else " AND OLD.claim_token IS NOT NULL"
    )
    await conn.execute(
        f"CREATE TRIGGER outbox_audit_claim AFTER UPDATE ON outbox_work FOR EACH ROW"
        f" WHEN ({taken}) EXECUTE FUNCTION outbox_audit_claim_fn()"
    )
    if claims:
        await conn.execute(
            "CREATE TRIGGER outbox_audit_first_claim AFTER INSERT ON outbox_work FOR EACH ROW"
            " WHEN (NEW.claim_token IS NOT NULL) EXECUTE FUNCTION outbox_audit_claim_fn()"
        )
        await conn.execute(
            "CREATE TRIGGER outbox_audit AFTER UPDATE ON outbox FOR EACH ROW"
            " WHEN (NEW.attempts <> OLD.attempts OR NEW.dead_at IS DISTINCT FROM OLD.dead_at)"
            " EXECUTE FUNCTION outbox_audit_fn()"
        )


@pytest.fixture
async def cleanup() -> AsyncIterator[contextlib.AsyncExitStack]:
    async with contextlib.AsyncExitStack() as stack:
        yield stack


@pytest.fixture
def chaos_settings(make_settings: Any) -> Callable[..., Settings]:
    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {"log_format": "json", "http_port": 0}
        values.update(overrides)
        settings: Settings = make_settings(**values)
        return settings

    return make


# --- 1. concurrency --------------------------------------------------------------------------


async def test_concurrency_four_processes_no_faults(
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    chaos_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    events, keys = int(scale(10_000, 100_000)), int(scale(200, 1_000))
    per_key = events // keys
    # Fewer keys per claim than keys in the table, so that there is work for more than one
    # process at a time (a claim takes at most batch_size keys; one owner per key).
    settings = chaos_settings(claim_tasks=2, batch_size=int(scale(50, 200)), lease_seconds=15)
    async with fleet(settings, tmp_path, 4):
        started = time.monotonic()
        for first in range(0, per_key, 10):  # ten rows per key per transaction
            rows = [
                (topic, f"key-{k}", orjson.dumps({"key": f"key-{k}", "seq": s}))
                for s in range(first, min(first + 10, per_key))
                for k in range(keys)
            ]
            await conn.executemany(
                "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, $2, $3)", rows
            )
        await wait_all_settled(conn, scale(240, 1800))
        elapsed = time.monotonic() - started
    shares = await conn.fetch("SELECT lease_owner, count(*) AS n FROM outbox GROUP BY 1")
    verdict = await verdict_for(
        database_url, services.kafka_bootstrap_servers, [topic], timeout=scale(120, 600)
    )
    report(
        "concurrency",
        verdict,
        record_property,
        events=events,
        keys=keys,
        processes=4,
        seconds=round(elapsed, 1),
        rows_per_process=sorted(r["n"] for r in shares),
    )
    assert_sound(verdict)
    assert verdict.delivered == events
    assert verdict.duplicates == 0, "no faults, no duplicates"
    assert verdict.dead == []
    assert len(shares) >= 2, "the processes shared the work"


# --- 2. crashes ------------------------------------------------------------------------------


async def test_crashes_kill_9_under_load(
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    chaos_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    await install_audit(conn, claims=False)
    batch_size, lease, poll = 50, 3.0, 0.2
    settings = chaos_settings(
        claim_tasks=2,
        batch_size=batch_size,
        lease_seconds=lease,
        poll_interval_seconds=poll,
        kafka_linger_ms=200,  # so that kills land with batches in flight
    )
    duration = scale(30, 180)
    rng = random.Random(os.getpid())
    writer = Writer(database_url, topic, [f"key-{k}" for k in range(100)], rate=scale(300, 500))
    kills: list[dict[str, Any]] = []
    async with fleet(settings, tmp_path, 3) as f, writing(writer):
        end = time.monotonic() + duration
        while time.monotonic() < end:
            await asyncio.sleep(rng.uniform(2.0, 4.0))
            slot = await busy_slot(conn, f, rng)
            victim = f.slots[slot]
            await asyncio.to_thread(kill9, victim)
            orphans = await conn.fetch(
                "SELECT id, lease_expires_at, now() AS killed_at FROM outbox_leases"
                " WHERE split_part(lease_owner, ':', 2) = $1",
                str(victim.pid),
            )
            killed_at = await conn.fetchval("SELECT now()")
            kills.append(
                {"pid": victim.pid, "killed_at": killed_at, "orphans": [dict(r) for r in orphans]}
            )
            f.start(slot)
        await writer.finish()
        await wait_all_settled(conn, scale(120, 300))
    orphan_ids = {
        o["id"]: (k["killed_at"], o["lease_expires_at"]) for k in kills for o in k["orphans"]
    }
    published = {
        r["id"]: r["published_at"]
        for r in await conn.fetch(
            "SELECT id, published_at FROM outbox WHERE id = ANY($1::bigint[])", list(orphan_ids)
        )
    }
    since_kill = [
        (published[i] - k).total_seconds() for i, (k, _) in orphan_ids.items() if published[i]
    ]
    since_expiry = [
        (published[i] - e).total_seconds() for i, (_, e) in orphan_ids.items() if published[i]
    ]
    takeover_delay = await conn.fetchval(
        "SELECT extract(epoch FROM max(at - old_expires)) FROM outbox_audit WHERE what = 'takeover'"
    )
    early = await count_early_takeovers(conn)
    dead = await count(conn, "dead_at IS NOT NULL")
    verdict = await verdict_for(
        database_url, services.kafka_bootstrap_servers, [topic], timeout=scale(120, 600)
    )
    orphaned = len(orphan_ids)
    report(
        "crashes",
        verdict,
        record_property,
        events=verdict.delivered,
        seconds=duration,
        kills=len(kills),
        orphaned_rows=orphaned,
        batch_size=batch_size,
        lease_seconds=lease,
        poll_interval_seconds=poll,
        max_republish_after_kill_s=round(max(since_kill, default=0), 2),
        max_republish_after_lease_expiry_s=round(max(since_expiry, default=0), 2),
        max_takeover_after_expiry_s=round(float(takeover_delay or 0), 2),
        writer_rows=writer.attempted,
    )
    assert_sound(verdict)
    assert dead == 0
    assert len(kills) >= 5
    assert orphaned > 0, "some kills must land with rows in flight"
    assert verdict.duplicates <= len(kills) * batch_size
    assert verdict.duplicates <= orphaned, "only the killed processes' in-flight rows repeat"
    assert early == 0, "no takeover before the lease expired"
    # Every orphan was published again within one lease and one poll interval of the kill,
    # plus slack for a loaded CI machine.
    assert max(since_kill, default=0) <= lease + poll + 5.0, sorted(since_kill)[-5:]


@pytest.mark.parametrize("outboxes", [1, 2], ids=["one_outbox", "two_sharing_the_progress"])
async def test_exactly_once_kill_9_under_load(
    outboxes: int,
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    make_topic: Callable[[], Awaitable[str]],
    chaos_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    """The crash scenario above in OUTBOX_DELIVERY=exactly-once: no row reaches a
    read_committed consumer twice; a read_uncommitted one sees the killed processes' aborted
    copies (the same checker finds them: the check can fail). With two outboxes (a second
    table in schema `second`, its own fleet, writer and data topic) both write to one progress
    topic, as the docs allow: each one's takeovers read the other's records and must take none
    of them for their own."""
    lease, poll = 3.0, 0.2
    common: dict[str, Any] = {
        "delivery": "exactly-once",
        "progress_topic": f"progress-{topic}",
        "transaction_timeout_seconds": 2.0,
        "claim_tasks": 2,
        "batch_size": 50,
        "lease_seconds": lease,
        "poll_interval_seconds": poll,
        "kafka_linger_ms": 200,
    }
    duration = scale(30, 180)
    rng = random.Random(os.getpid())
    rate = scale(300, 500) / outboxes
    tables = [Table(database_url, topic, tmp_path / "public", chaos_settings(**common))]
    if outboxes == 2:
        await migrations.migrate(conn, "second", "outbox")
        url = f"{database_url}?search_path=second"
        settings = chaos_settings(**common, db_schema="second")
        tables.append(Table(url, await make_topic(), tmp_path / "second", settings))
    kills = 0
    async with contextlib.AsyncExitStack() as stack:
        fleets = [
            await stack.enter_async_context(t.fleet(3 if i == 0 else 2))
            for i, t in enumerate(tables)
        ]
        writers = [
            await stack.enter_async_context(writing(Writer(t.url, t.topic, t.keys(), rate)))
            for t in tables
        ]
        end = time.monotonic() + duration
        while time.monotonic() < end:
            await asyncio.sleep(rng.uniform(2.0, 4.0))
            which = rng.randrange(len(tables))
            f, table_conn = fleets[which], await tables[which].connect()
            try:
                slot = await busy_slot(table_conn, f, rng)
            finally:
                await table_conn.close()
            await asyncio.to_thread(kill9, f.slots[slot])
            kills += 1
            f.start(slot)
        for w in writers:
            await w.finish()
        for t in tables:
            await t.settled(scale(120, 300))
    for t, w in zip(tables, writers, strict=True):
        verdict = await t.verdict(services, "read_committed")
        uncommitted = await t.verdict(services, "read_uncommitted")
        logs = await asyncio.to_thread(t.logs_of)
        found_committed = sum(len(log_events(path, "takeover_found_committed")) for path in logs)
        report(
            "exactly_once_crashes" + ("" if outboxes == 1 else f"_two_outboxes:{t.logs.name}"),
            verdict,
            record_property,
            events=verdict.delivered,
            seconds=duration,
            kills=kills,
            read_uncommitted_copies=uncommitted.duplicates,
            takeovers_that_found_committed_batches=found_committed,
            writer_rows=w.attempted,
        )
        assert_sound(verdict)
        assert verdict.duplicates == 0, verdict.summary()
        assert verdict.dead == [], verdict.summary()
    assert kills >= 5


@dataclass
class Table:
    """One outbox of a scenario: its URL (search_path set for a second schema), data topic,
    log folder and dispatcher settings."""

    url: str
    topic: str
    logs: Path
    settings: Settings

    def keys(self) -> list[str]:
        return [f"key-{k}" for k in range(100)]

    def logs_of(self) -> list[Path]:
        return sorted(self.logs.glob("d*.log"))

    def fleet(self, n: int) -> contextlib.AbstractAsyncContextManager[Fleet]:
        self.logs.mkdir(exist_ok=True)
        return fleet(self.settings, self.logs, n)

    async def connect(self) -> asyncpg.Connection:
        return await asyncpg.connect(self.url)

    async def settled(self, timeout: float) -> None:
        conn = await self.connect()
        try:
            await wait_all_settled(conn, timeout)
        except AssertionError as exc:
            work = await conn.fetch(
                "SELECT state, claim_token IS NOT NULL AS leased, claim_expires_at < now()"
                " AS expired, reconcile_owner IS NOT NULL AS duty, count(*) AS keys"
                " FROM outbox_work GROUP BY 1, 2, 3, 4"
            )
            raise AssertionError(f"{self.logs.name}: {[dict(r) for r in work]}") from exc
        finally:
            await conn.close()

    async def verdict(self, services: Services, isolation: str) -> Verdict:
        return await verdict_for(
            self.url,
            services.kafka_bootstrap_servers,
            [self.topic],
            timeout=scale(120, 600),
            isolation=isolation,
        )


async def busy_slot(conn: asyncpg.Connection, f: Fleet, rng: random.Random) -> int:
    """A random slot, preferring (for up to a second) one whose process holds leases."""
    for _ in range(50):
        owners = {
            r["pid"]
            for r in await conn.fetch(
                "SELECT DISTINCT split_part(lease_owner, ':', 2) AS pid FROM outbox_leases"
            )
        }
        busy = [slot for slot, p in f.slots.items() if str(p.pid) in owners]
        if busy:
            return rng.choice(busy)
        await asyncio.sleep(0.02)
    return rng.choice(list(f.slots))


async def count_early_takeovers(conn: asyncpg.Connection) -> int:
    value: int = await conn.fetchval(
        "SELECT count(*) FROM outbox_audit WHERE what = 'takeover' AND at < old_expires"
    )
    return value


# --- 3. broker restart -----------------------------------------------------------------------


@pytest.mark.parametrize("delivery", DELIVERIES)
async def test_broker_restart_under_load(
    delivery: str,
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    chaos_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    settings = chaos_settings(
        claim_tasks=2,
        batch_size=100,
        lease_seconds=5,
        publish_timeout_seconds=5,
        max_attempts=2,
        **delivery_settings(delivery, topic),
    )
    outage = scale(10, 60)
    writer = Writer(database_url, topic, [f"key-{k}" for k in range(50)], rate=200)
    async with restarts(services, "kafka"), fleet(settings, tmp_path, 2) as f, writing(writer):
        await asyncio.sleep(3)
        await control(services, "kafka-stop")
        await asyncio.sleep(outage)
        assert all(p.poll() is None for p in f.slots.values()), f.tails()
        # Read before the start: the dispatchers may drain the outage's backlog while the
        # start command still waits for the broker to answer.
        back = await conn.fetchval("SELECT now()")
        backlog = await conn.fetchval("SELECT max(id) FROM outbox")
        await control(services, "kafka-start")

        async def resumed() -> bool:
            return bool(
                await conn.fetchval(
                    "SELECT count(*) FROM outbox WHERE published_at > $1 AND id <= $2",
                    back,
                    backlog,
                )
            )

        try:
            await wait_until(resumed, 60, "publishing to resume after the broker came back")
        except AssertionError as exc:
            raise AssertionError(await diagnose(conn, f)) from exc
        resumed_at = await conn.fetchval(
            "SELECT min(published_at) FROM outbox WHERE published_at > $1", back
        )

        async def backlog_done() -> bool:
            return (
                await count(
                    conn, f"id <= {int(backlog)} AND published_at IS NULL AND dead_at IS NULL"
                )
                == 0
            )

        try:
            await wait_until(backlog_done, 60, "the outage's backlog to drain")
        except AssertionError as exc:
            raise AssertionError(await diagnose(conn, f)) from exc
        drained_at = await conn.fetchval(
            "SELECT max(published_at) FROM outbox WHERE id <= $1", backlog
        )
        await asyncio.sleep(3)  # some load after the recovery
        await writer.finish()
        await wait_all_settled(conn, 120)
        same = all(p.poll() is None for p in f.slots.values())
    dead = await count(conn, "dead_at IS NOT NULL")
    dead_reasons = await conn.fetch(
        "SELECT left(last_error, 200) AS error, count(*) AS n FROM outbox"
        " WHERE dead_at IS NOT NULL GROUP BY 1"
    )
    verdict = await verdict_for(
        database_url, services.kafka_bootstrap_servers, [topic], timeout=120
    )
    resume_s = (resumed_at - back).total_seconds()
    report(
        f"broker_restart_{delivery}" if delivery != "at-least-once" else "broker_restart",
        verdict,
        record_property,
        events=verdict.delivered,
        outage_s=outage,
        resume_after_broker_start_s=round(resume_s, 2),
        backlog_drained_after_broker_start_s=round((drained_at - back).total_seconds(), 2),
        dead_lettered=dead,
        dead_reasons=[dict(r) for r in dead_reasons],
    )
    assert_sound(verdict)
    assert_no_copy_in_exactly_once(delivery, verdict)
    assert dead == 0, "an outage dead-letters nothing"
    assert same, "no dispatcher exited"
    assert resume_s <= 30


async def diagnose(conn: asyncpg.Connection, f: Fleet) -> str:
    """Where the unpublished rows stand, and what the dispatchers said."""
    state = await conn.fetch(
        "SELECT count(*) AS n, o.attempts, l.lease_token IS NOT NULL AS leased,"
        " l.lease_expires_at > now() AS live, o.next_attempt_at > now() AS backing_off,"
        " left(o.last_error, 200) AS error, min(o.id) AS first,"
        " max(coalesce(l.lease_owner, o.lease_owner)) AS owner"
        " FROM outbox o LEFT JOIN outbox_leases l ON l.id = o.id"
        " WHERE o.published_at IS NULL AND o.dead_at IS NULL GROUP BY 2, 3, 4, 5, 6"
    )
    return f"{[dict(r) for r in state]}\n{f.tails()}"


# --- 4. database restart ---------------------------------------------------------------------


@pytest.mark.parametrize("delivery", DELIVERIES)
async def test_database_restart_under_load(
    delivery: str,
    database_url: str,
    services: Services,
    topic: str,
    chaos_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    settings = chaos_settings(
        claim_tasks=2, batch_size=100, lease_seconds=5, **delivery_settings(delivery, topic)
    )
    outage = scale(8, 30)
    writer = Writer(database_url, topic, [f"key-{k}" for k in range(50)], rate=200)
    readiness: dict[str, Any] = {}
    async with restarts(services, "pg"), fleet(settings, tmp_path, 2) as f, writing(writer):
        pids = {slot: p.pid for slot, p in f.slots.items()}

        async def listening() -> bool:
            return all(http_port(f.log_of[slot]) for slot in f.slots)

        await wait_until(listening, 30, "each dispatcher to log http_listening with its port")
        probes = [http_port(f.log_of[slot]) or 0 for slot in sorted(f.slots)]

        async def all_status(code: int) -> bool:
            answers = await asyncio.gather(*(asyncio.to_thread(readyz, p) for p in probes))
            return all(status == code for status, _ in answers)

        async def all_ready() -> bool:
            return await all_status(200)

        async def none_ready() -> bool:
            return await all_status(503)

        await wait_until(all_ready, 30, "/readyz to report 200 at start")
        await asyncio.sleep(3)
        await control(services, "pg-stop")
        stopped = time.monotonic()
        await wait_until(none_ready, 30, "/readyz to report 503 without the database")
        readiness["not_ready_after_db_stop_s"] = round(time.monotonic() - stopped, 2)
        readiness["body_while_down"] = (await asyncio.to_thread(readyz, probes[0]))[1]
        await asyncio.sleep(max(0.0, outage - (time.monotonic() - stopped)))
        assert all(p.poll() is None for p in f.slots.values()), f.tails()
        assert await none_ready(), "still not ready while the database is down"
        await control(services, "pg-start")
        back_wall = time.time()
        back = time.monotonic()
        conn = await asyncpg.connect(database_url)
        try:

            async def published_again() -> bool:
                n: int = await conn.fetchval(
                    "SELECT count(*) FROM outbox WHERE published_at > to_timestamp($1)", back_wall
                )
                return n > 0

            await wait_until(published_again, 60, "publishing after the database came back")
            recovered_s = time.monotonic() - back
            await wait_until(all_ready, 60, "/readyz to report 200 again")
            readiness["ready_again_after_db_back_s"] = round(time.monotonic() - back, 2)
            await asyncio.sleep(3)
            await writer.finish()
            await wait_all_settled(conn, 120)
            crashes = [
                (slot, p.pid, p.poll()) for slot, p in f.slots.items() if p.poll() is not None
            ]
            same_pids = {slot: p.pid for slot, p in f.slots.items()} == pids
        finally:
            await conn.close()
    verdict = await verdict_for(
        database_url, services.kafka_bootstrap_servers, [topic], timeout=120
    )
    report(
        f"database_restart_{delivery}" if delivery != "at-least-once" else "database_restart",
        verdict,
        record_property,
        events=verdict.delivered,
        outage_s=outage,
        publishing_after_db_back_s=round(recovered_s, 2),
        writer_failed_transactions=writer.failures,
        **readiness,
    )
    assert_sound(verdict)
    assert_no_copy_in_exactly_once(delivery, verdict)
    assert crashes == [] and same_pids, "no crash loop: the same processes stay up"
    assert recovered_s <= 10
    assert readiness["ready_again_after_db_back_s"] <= 10


# --- 6. a live but stuck owner ---------------------------------------------------------------


async def test_stuck_owner_is_fenced_after_its_lease_expires(
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    chaos_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    await install_audit(conn, claims=False)
    lease = 3.0
    keys, per_key = int(scale(20, 100)), int(scale(50, 200))
    rows = [
        (topic, f"key-{k}", orjson.dumps({"key": f"key-{k}", "seq": s}))
        for s in range(per_key)
        for k in range(keys)
    ]
    await conn.executemany(
        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, $2, $3)", rows
    )
    # The victim holds each batch a second in the producer, so that it is stopped mid-batch.
    slow = chaos_settings(claim_tasks=2, batch_size=100, lease_seconds=lease, kafka_linger_ms=1000)
    f = Fleet(slow, tmp_path)
    victim = f.start(0)
    try:

        async def holding() -> bool:
            return bool(
                await conn.fetchval(
                    "SELECT count(*) FROM outbox_leases WHERE split_part(lease_owner, ':', 2) = $1",
                    str(victim.pid),
                )
            )

        await wait_until(holding, 60, "the victim to hold leases", interval=0.02)
        os.killpg(victim.pid, signal.SIGSTOP)
        stopped_at = await conn.fetchval("SELECT now()")
        await asyncio.sleep(0.5)  # a claim the victim sent may still commit
        held = await conn.fetch(
            "SELECT l.id, l.lease_token, l.lease_expires_at, o.ordering_key"
            " FROM outbox_leases l JOIN outbox o USING (id)"
            " WHERE split_part(l.lease_owner, ':', 2) = $1",
            str(victim.pid),
        )
        assert held
        rescuer = f.start(1, chaos_settings(claim_tasks=2, batch_size=100, lease_seconds=lease))
        await wait_all_settled(conn, scale(120, 300))
        ids = [r["id"] for r in held]
        before = await conn.fetch(
            "SELECT id, published_at, lease_owner FROM outbox WHERE id = ANY($1::bigint[])"
            " ORDER BY id",
            ids,
        )
        takeovers = await conn.fetch(
            "SELECT id, at, old_expires, old_owner FROM outbox_audit WHERE what = 'takeover'"
            " AND id = ANY($1::bigint[])",
            ids,
        )
        os.killpg(victim.pid, signal.SIGCONT)

        async def fenced() -> bool:
            reported: int = sum(e["rows"] for e in log_events(f.log_of[0], "lease_lost"))
            return reported >= len(held)

        await wait_until(fenced, 60, "the stale owner to find its leases lost")
        await asyncio.sleep(1)
        after = await conn.fetch(
            "SELECT id, published_at, lease_owner FROM outbox WHERE id = ANY($1::bigint[])"
            " ORDER BY id",
            ids,
        )
        lost_rows = sum(e["rows"] for e in log_events(f.log_of[0], "lease_lost"))
    finally:
        for p in f.slots.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
        codes = f.stop()
    assert codes == [0, 0], f.tails()
    verdict = await verdict_for(
        database_url, services.kafka_bootstrap_servers, [topic], timeout=120
    )
    early = [(t["id"], t["at"], t["old_expires"]) for t in takeovers if t["at"] < t["old_expires"]]
    waited = [(t["at"] - stopped_at).total_seconds() for t in takeovers]
    report(
        "stuck_owner",
        verdict,
        record_property,
        events=verdict.delivered,
        rows_held_by_stopped_owner=len(held),
        taken_over=len(takeovers),
        takeovers_before_lease_expiry=len(early),
        min_takeover_after_stop_s=round(min(waited, default=0), 2),
        lease_seconds=lease,
        stale_rows_reported_lost_by_owner=lost_rows,
        rows_changed_by_stale_marks=sum(
            1 for b, a in zip(before, after, strict=True) if tuple(b) != tuple(a)
        ),
    )
    assert_sound(verdict)
    # Every held key was taken over from its first held row on (a takeover sends the held rows
    # first, as far as the rescuer's batch goes; any others follow in its next claims).
    key_of = {r["id"]: r["ordering_key"] for r in held}
    first_held = {key: min(i for i in ids if key_of[i] == key) for key in set(key_of.values())}
    taken = {t["id"] for t in takeovers}
    assert taken <= set(ids)
    assert {key_of[i] for i in taken} == set(first_held), "every held key was taken over"
    assert set(first_held.values()) <= taken, "each from its first held row"
    assert all(t["old_owner"] and str(victim.pid) in t["old_owner"] for t in takeovers)
    assert early == [], "taken over only after the lease expired, by the database clock"
    assert [tuple(r) for r in before] == [tuple(r) for r in after], (
        "the stale owner's marks changed nothing (fencing)"
    )
    assert all(str(rescuer.pid) in r["lease_owner"] for r in after)
    assert lost_rows == len(held)
    assert verdict.max_copies <= 2, "at most one extra copy per affected row"
    assert verdict.duplicates <= len(held)


async def test_exactly_once_stuck_owner_cannot_commit_late(
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    chaos_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    """exactly-once: the owner is stopped (SIGSTOP) with its transaction open, past its lease;
    the rescuer's takeover fences it, so what the owner sends or commits when it is continued
    never reaches a read_committed consumer."""
    lease = 3.0
    keys, per_key = int(scale(20, 100)), int(scale(50, 200))
    rows = [
        (topic, f"key-{k}", orjson.dumps({"key": f"key-{k}", "seq": s}))
        for s in range(per_key)
        for k in range(keys)
    ]
    await conn.executemany(
        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, $2, $3)", rows
    )
    eos = {
        "delivery": "exactly-once",
        "progress_topic": f"progress-{topic}",
        "transaction_timeout_seconds": 2.0,
        "lease_seconds": lease,
        "claim_tasks": 2,
        "batch_size": 100,
    }
    # Each of the victim's batches waits 50 ms in the producer, so that it is stopped with
    # records sent (in the log, uncommitted) or about to be.
    f = Fleet(chaos_settings(kafka_linger_ms=50, **eos), tmp_path)
    victim = f.start(0)
    try:

        async def holding() -> bool:
            return bool(
                await conn.fetchval(
                    "SELECT count(*) FROM outbox_leases WHERE split_part(lease_owner, ':', 2) = $1",
                    str(victim.pid),
                )
            )

        await wait_until(holding, 60, "the victim to hold leases", interval=0.02)
        os.killpg(victim.pid, signal.SIGSTOP)
        await asyncio.sleep(0.5)
        f.start(1, chaos_settings(**eos))
        await wait_all_settled(conn, scale(120, 300))
        os.killpg(victim.pid, signal.SIGCONT)
        await asyncio.sleep(5)  # its late sends and commit, refused
    finally:
        for p in f.slots.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
        codes = f.stop()
    assert codes == [0, 0], f.tails()
    verdict = await verdict_for(
        database_url, services.kafka_bootstrap_servers, [topic], timeout=120
    )
    uncommitted = await verdict_for(
        database_url,
        services.kafka_bootstrap_servers,
        [topic],
        timeout=120,
        isolation="read_uncommitted",
    )
    report(
        "exactly_once_stuck_owner",
        verdict,
        record_property,
        events=verdict.delivered,
        read_uncommitted_copies=uncommitted.duplicates,
        lease_seconds=lease,
    )
    assert_sound(verdict)
    assert verdict.duplicates == 0, verdict.summary()


# --- 7. poison rows --------------------------------------------------------------------------


@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
@pytest.mark.parametrize("policy", ["skip", "block"])
async def test_poison_row_dead_letters_after_max_attempts(
    policy: str,
    delivery: str,
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    make_topic: Callable[[], Any],
    chaos_settings: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
    cleanup: contextlib.AsyncExitStack,
) -> None:
    """A row whose topic the broker never creates retries with backoff and is dead-lettered
    after max_attempts while every other key flows; then its key's later rows go on (skip) or
    wait for the operator's requeue (block). In exactly-once the row is refused before its
    transaction (its key's later rows not attempted) and the other rows of the claim commit:
    the same backoff, the same dead letter, 0 copies."""
    topic: str = await make_topic()
    # A valid name the broker never creates: it collides with `topic` ('.' and '_' clash), so
    # every publish fails with "topic missing", a row error that counts towards max_attempts.
    poison_topic = topic.replace("-", ".") + "x"
    clash = contextlib.AsyncExitStack()
    await clash.enter_async_context(extra_topic(services, topic.replace("-", "_") + "x"))
    cleanup.push_async_callback(clash.aclose)
    max_attempts, initial, cap = 4, 1.0, 4.0
    settings = chaos_settings(
        **delivery_settings(delivery, topic),
        claim_tasks=2,
        batch_size=50,
        max_attempts=max_attempts,
        backoff_initial_seconds=initial,
        backoff_max_seconds=cap,
        publish_timeout_seconds=2,
        dead_letter_policy=policy,
    )
    await install_audit(conn, claims=True)

    def row(key: str, seq: int, to: str = topic) -> tuple[str, str, bytes]:
        return (to, key, orjson.dumps({"key": key, "seq": seq}))

    insert = "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, $2, $3)"
    await conn.executemany(insert, [row("poison", 0), row("poison", 1, poison_topic)])
    poison_id = await conn.fetchval("SELECT id FROM outbox WHERE topic = $1", poison_topic)
    await conn.executemany(insert, [row("poison", s) for s in range(2, 5)])
    writer = Writer(database_url, topic, [f"key-{k}" for k in range(20)], rate=100)
    async with fleet(settings, tmp_path, 1), writing(writer):

        async def poison_dead() -> bool:
            return bool(await count(conn, f"id = {poison_id} AND dead_at IS NOT NULL"))

        await wait_until(poison_dead, 120, "the poison row to be dead-lettered")
        dead_at = await conn.fetchval("SELECT dead_at FROM outbox WHERE id = $1", poison_id)
        # While it retried, the other keys flowed: everything written before it died is out.
        others_late = await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE ordering_key <> 'poison'"
            " AND created_at < $1::timestamptz - interval '4 seconds'"
            " AND (published_at IS NULL OR published_at > $1)",
            dead_at,
        )
        latency = await conn.fetchrow(
            "SELECT extract(epoch FROM max(published_at - created_at)) AS max,"
            " extract(epoch FROM percentile_cont(0.99) WITHIN GROUP"
            " (ORDER BY published_at - created_at)) AS p99"
            " FROM outbox WHERE ordering_key <> 'poison' AND created_at < $1",
            dead_at,
        )
        assert latency is not None
        later = f"ordering_key = 'poison' AND id > {poison_id} AND published_at IS NOT NULL"
        if policy == "skip":

            async def key_continued() -> bool:
                return await count(conn, later) == 3

            await wait_until(key_continued, 30, "the poison key's later rows to be published")
        else:
            await asyncio.sleep(5)
            held_back = await count(conn, later)
            assert held_back == 0, "block: nothing later of the key is published"
            # The operator fixes the row's topic and requeues it with the dead-letter command.
            await conn.execute("UPDATE outbox SET topic = $2 WHERE id = $1", poison_id, topic)
            requeue = await asyncio.to_thread(
                subprocess.run,
                [
                    sys.executable,
                    "-m",
                    "outbox_dispatcher",
                    "dead",
                    "requeue",
                    "--id",
                    str(poison_id),
                ],
                env=settings_env(settings),
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert requeue.returncode == 0, requeue.stderr

            async def key_resumed() -> bool:
                return await count(conn, "ordering_key = 'poison' AND published_at IS NULL") == 0

            await wait_until(key_resumed, 30, "the key to resume after the requeue")
        await writer.finish()
        await wait_all_settled(conn, 60)
    history = await conn.fetch(
        "SELECT what, at, attempts, next_attempt_at, dead FROM outbox_audit WHERE id = $1"
        " ORDER BY at, what",
        poison_id,
    )
    failed = [h for h in history if h["what"] == "failed"][:max_attempts]
    claims = [h for h in history if h["what"] == "claim"]
    spacing = check_backoff(failed, claims, initial, cap)
    verdict = await verdict_for(database_url, services.kafka_bootstrap_servers, [topic], timeout=60)
    dead = await conn.fetch("SELECT id FROM outbox WHERE dead_at IS NOT NULL")
    report(
        f"poison_{policy}_{delivery}" if delivery != "at-least-once" else f"poison_{policy}",
        verdict,
        record_property,
        events=verdict.delivered,
        max_attempts=max_attempts,
        attempts_recorded=[h["attempts"] for h in failed],
        backoff_s=[round(s, 2) for s in spacing],
        other_keys_latency_max_s=round(float(latency["max"] or 0), 2),
        other_keys_latency_p99_s=round(float(latency["p99"] or 0), 2),
        poison_lifetime_s=round((dead_at - claims[0]["at"]).total_seconds(), 2),
        rows_dead_at_the_end=len(dead),
    )
    assert_sound(verdict)
    assert_no_copy_in_exactly_once(delivery, verdict)
    assert [h["attempts"] for h in failed] == list(range(1, max_attempts + 1))
    assert [h["dead"] for h in failed] == [False] * (max_attempts - 1) + [True]
    assert others_late == 0, "other keys were published while the poison row retried"
    if policy == "skip":
        assert [r["id"] for r in dead] == [poison_id]
    else:
        assert dead == [], "requeued and published"


def check_backoff(
    failed: list[asyncpg.Record], claims: list[asyncpg.Record], initial: float, cap: float
) -> list[float]:
    """Each retry waited its backoff: next_attempt_at - failure time within [d/2, d] for
    d = min(cap, initial * 2^(n-1)); and the next claim came no earlier than next_attempt_at."""
    spacing = []
    for f in failed[:-1]:
        n = f["attempts"]
        d = min(cap, initial * 2 ** (n - 1))
        delay = (f["next_attempt_at"] - f["at"]).total_seconds()
        assert d / 2 - 0.05 <= delay <= d + 0.05, (n, delay, d)
        spacing.append(delay)
        next_claim = next(c for c in claims if c["at"] > f["at"])
        assert next_claim["at"] >= f["next_attempt_at"], (n, next_claim["at"], f["next_attempt_at"])
    return spacing


@contextlib.asynccontextmanager
async def extra_topic(services: Services, name: str) -> AsyncIterator[None]:
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka_bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])
        yield
        with contextlib.suppress(Exception):
            await admin.delete_topics([name])
    finally:
        await admin.close()
