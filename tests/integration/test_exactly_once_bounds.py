"""Exactly-once's state stays bounded (issue 35, review E9): the keys of a dispatcher killed (or
paused) while it held no lease are ended by the sweep of the running dispatchers
(kafka/exactly_once/orphans.py), within the stated bound; and the claim function returns each
row's replay count. Real PostgreSQL, Kafka and processes. The goal row (many restarts, many
failed marks): test_exactly_once_goal.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest

from outbox_dispatcher import registry
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.kafka.exactly_once.lanes import LANES
from outbox_dispatcher.store import DispatchStore
from tests.checker import verdict_for

from .helpers import Services, kill9, log_events, wait_all_settled, wait_until
from .test_chaos import FULL, assert_sound, fleet, report
from .test_exactly_once import STATEMENTS, expire
from .test_exactly_once_faults import eos_of
from .test_exactly_once_lists import latest_values

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600 if FULL else 300)]

# A silent dispatcher is swept once its heartbeat is this old (registry.LIVE_SECONDS), at the
# next sweep of a running one (jittered up to 1.5 x OUTBOX_PROGRESS_SWEEP_SECONDS), which fences
# (within max(transaction timeout, 10 s)) and reads (a few seconds here) first.
SWEEP = 2.0


def sweep_bound(settings: Settings) -> float:
    """How long after its last heartbeat a dead dispatcher's keys may stay live (the bound
    docs/design/exactly-once.md states)."""
    fence = max(settings.transaction_timeout_seconds, 10.0)
    return registry.LIVE_SECONDS + 1.5 * settings.progress_sweep_seconds + fence + 15.0


@pytest.fixture
def eos(make_settings: Any, topic: str) -> Callable[..., Settings]:
    bounded = {"progress_sweep_seconds": SWEEP, "claim_tasks": LANES, "batch_size": 10}
    return eos_of(make_settings, topic, lease_seconds=4.0, **bounded)


def live_of(last: dict[bytes, bytes | None], prefix: str = "") -> set[str]:
    return {k.decode() for k, v in last.items() if v is not None and k.decode().startswith(prefix)}


def owner_of(log: Path) -> str:
    return str(log_events(log, "started")[0]["owner"])


async def recorded(conn: asyncpg.Connection, owner: str) -> list[str]:
    ids = await conn.fetchval(
        "SELECT transactional_ids FROM outbox_dispatchers WHERE owner = $1", owner
    )
    return list(ids or [])


# --- a dispatcher killed (or paused) while it held no lease ------------------------------------


@pytest.mark.parametrize("how", ["kill_9", "paused_and_back"])
async def test_a_dispatcher_silent_while_it_held_no_lease_has_its_keys_ended(
    how: str,
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    eos: Callable[..., Settings],
    tmp_path: Path,
    record_property: Any,
) -> None:
    """E9's open case: two dispatchers publish; every row is settled (no lease held); one is
    killed -9 (or SIGSTOPped), the other keeps running and writes go on. The running one's sweep
    fences the silent one's ids, reads the progress, ends its keys (their last value is a
    tombstone) within the stated bound after its last heartbeat, and forgets its ids. Before,
    no takeover ever came for them and they stayed live for ever. `paused_and_back`: the paused
    dispatcher resumes afterwards: its fenced lanes take new ids (recorded again) and go on.
    A read_committed consumer of the rows written before and after sees each once."""
    settings = eos()
    bootstrap = services.kafka_bootstrap_servers
    progress_topic = settings.progress_topic
    waves = 0
    async with fleet(settings, tmp_path, 2) as f:
        victim = owner_of(f.log_of[1])
        ids = await recorded(conn, victim)
        assert ids, "the victim recorded its lanes' ids"
        while True:  # until the victim wrote progress (its lanes have live keys)
            await write(conn, topic, f"wave-{waves}", 12)
            waves += 1
            await wait_all_settled(conn, 60)
            if live_of(await latest_values(bootstrap, progress_topic)) & set(ids):
                break
            assert waves < 20, "the victim never published"
        assert (
            await conn.fetchval("SELECT count(*) FROM outbox_work WHERE claim_token IS NOT NULL")
            == 0
        ), "no lease held"
        silent_at = time.monotonic()
        if how == "kill_9":
            kill9(f.slots.pop(1))
            f.log_of.pop(1)
        else:
            os.killpg(f.slots[1].pid, signal.SIGSTOP)
        await write(conn, topic, "after", 12)

        async def ended() -> bool:
            last = await latest_values(bootstrap, progress_topic)
            return not (live_of(last) & set(ids)) and await recorded(conn, victim) == []

        await wait_until(ended, sweep_bound(settings) + 30, "the silent dispatcher's keys end")
        took = time.monotonic() - silent_at
        if how == "paused_and_back":
            os.killpg(f.slots[1].pid, signal.SIGCONT)
            for wave in range(20):  # until it published again: its fenced lanes took new ids
                await write(conn, topic, f"resumed-{wave}", 12)
                await wait_all_settled(conn, 60)
                if await recorded(conn, victim):
                    break
            assert await recorded(conn, victim), "the resumed dispatcher recorded its new ids"
        await wait_all_settled(conn, 60)
    verdict = await verdict_for(database_url, bootstrap, [topic], timeout=60)
    logs = await asyncio.to_thread(lambda: list(tmp_path.glob("d0-*.log")))
    swept = [e for p in logs for e in log_events(p, "progress_keys_swept")]
    report(
        f"exactly_once_silent_dispatcher_keys_{how}",
        verdict,
        record_property,
        seconds_to_end=round(took, 1),
        bound_seconds=sweep_bound(settings),
        sweeps_that_ended_keys=len([e for e in swept if e["tombstoned"]]),
    )
    assert took <= sweep_bound(settings), took
    assert_sound(verdict)
    assert verdict.duplicates == 0, verdict.summary()


async def write(conn: asyncpg.Connection, topic: str, prefix: str, keys: int, per: int = 2) -> None:
    rows = [
        (topic, f"{prefix}-{k}", orjson.dumps({"key": f"{prefix}-{k}", "seq": s}))
        for s in range(per)
        for k in range(keys)
    ]
    await conn.executemany(
        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, $2, $3)", rows
    )


# --- the claim returns replays (issue 35: no read beside the claim function) ---------------------


async def test_the_claim_function_returns_each_rows_replay_count(
    conn: asyncpg.Connection, pool: asyncpg.Pool, topic: str, eos: Callable[..., Settings]
) -> None:
    """The claim function (and its discovery, which takes new rows) returns each row's replay
    count with its other columns, which the claim's records carry (exactly-once lists (id,
    replays) pairs): the `claim` statement no longer reads it beside the function."""
    await write(conn, topic, "new", 1, per=1)
    await conn.execute("UPDATE outbox SET replays = 3")
    store = DispatchStore(pool, STATEMENTS)
    batch = await Claimer(store, eos(), "o").claim()  # discovery takes the new row
    assert batch is not None and [r.replays for r in batch.records] == [3]
    await expire(conn)
    await conn.execute("UPDATE outbox SET replays = 4")
    row = await conn.fetchrow(
        "SELECT * FROM outbox_claim_work(10, 10, 'p', 30, gen_random_uuid(), false, 5, 100)"
    )
    assert row is not None and row["replays"] == 4 and row["reclaimed"]
    sql = STATEMENTS["claim"].sql
    assert "SELECT o.replays" not in sql and "c.replays" in sql
