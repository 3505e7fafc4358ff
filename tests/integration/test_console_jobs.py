"""Bulk actions as jobs, in the CLI and the console alike (issue 22; walk-through findings N2, N6,
N7): bounded by what was confirmed, recorded from the first batch with a true count that says
"interrupted" when cut off, with progress, an abort, and no second run by a second click."""

from __future__ import annotations

import asyncio
import html
import re
import signal
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.operate.session import Session
from tests.containers import free_port

from .helpers import cli, interruptible, kill9, spawn_console, wait_until
from .test_console import AUTH, TOKEN, client, csrf_of, dead_rows, log_in

pytestmark = pytest.mark.integration

REQUEUED = "last_error LIKE 'requeued by operator%'"


async def many_dead(conn: asyncpg.Connection, n: int, error: str = "lacks header x") -> None:
    """`n` dead rows without a key (no key registry work: the batches are the only cost)."""
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, dead_at, attempts, last_error)"
        " SELECT 'bulk', NULL, 'x', now(), 3, $2 FROM generate_series(1, $1)",
        n,
        error,
    )


async def many_published(conn: asyncpg.Connection, n: int) -> None:
    await conn.execute(
        "INSERT INTO outbox (topic, payload, published_at)"
        " SELECT 'bulk', 'x', now() FROM generate_series(1, $1)",
        n,
    )


async def slow_batches(conn: asyncpg.Connection, seconds: float = 0.05) -> None:
    """Every statement that changes the outbox takes `seconds` longer: a bulk action is slow
    enough here to be seen running, aborted or cut off (a test-only trigger of this database)."""
    await conn.execute(
        "CREATE FUNCTION test_slow() RETURNS trigger LANGUAGE plpgsql AS $$"
        f" BEGIN PERFORM pg_sleep({seconds}); RETURN NULL; END $$;"
        " CREATE TRIGGER test_slow AFTER UPDATE OR DELETE ON outbox"
        " FOR EACH STATEMENT EXECUTE FUNCTION test_slow();"
    )


async def records(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    """The audit records as operators read them (a record whose process died: interrupted)."""
    from outbox_dispatcher.operate import listings

    session = Session.of(conn, Settings())  # the table's names: public.outbox
    return list(reversed(await listings.audit(session, listings.AuditQuery(), 100)))


async def requeued(conn: asyncpg.Connection) -> int:
    value: int = await conn.fetchval(f"SELECT count(*) FROM outbox WHERE {REQUEUED}")
    return value


# --- The CLI -----------------------------------------------------------------------------------


async def test_a_cli_requeue_cut_off_by_ctrl_c_says_and_records_the_rows_it_changed(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N2 (CLI): before, Ctrl-C kept 1,600 requeued rows, wrote no audit row and did not say
    how many rows changed."""
    await many_dead(conn, 5000)
    await slow_batches(conn)
    settings = make_settings(cleanup_batch_size=50)
    process = await interruptible(settings, "dead", "requeue", "--error", "lacks header")

    async def some_done() -> bool:
        return await requeued(conn) >= 300

    await wait_until(some_done, 60, "the requeue to be under way")
    [running] = await records(conn)
    assert running["status"] == "running" and running["expected"] == 5000
    assert 0 < running["rows"] <= await requeued(conn)  # recorded batch by batch
    process.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 130, err.decode()
    changed = await requeued(conn)
    assert 300 <= changed < 5000
    [record] = await records(conn)
    assert (record["status"], record["rows"], record["command"]) == (
        "interrupted",
        changed,
        "dead requeue",
    )
    assert err.decode().strip().splitlines() == [
        f"outbox-dispatcher: interrupted after it requeued {changed:,} dead rows; those are kept"
        f" (audit record {record['id']}); run the command again to finish"
    ]
    # Run again: the rest, recorded on its own.
    again = await cli(settings, "dead", "requeue", "--error", "lacks header")
    assert again.code == 0 and f"requeued {5000 - changed} dead rows" in again.out
    assert [(r["status"], r["rows"]) for r in await records(conn)] == [
        ("interrupted", changed),
        ("done", 5000 - changed),
    ]


async def test_an_interrupted_replay_is_recorded_as_interrupted_with_no_row_changed(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    await many_published(conn, 3000)
    await slow_batches(conn)
    settings = make_settings(cleanup_batch_size=50)
    process = await interruptible(settings, "replay", "--topic", "bulk")

    async def running() -> bool:
        return bool(await conn.fetchval("SELECT count(*) FROM outbox_operator_audit"))

    await wait_until(running, 60, "the replay to start")
    await asyncio.sleep(1.0)  # some batches, inside its one transaction
    process.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 130
    [record] = await records(conn)
    assert (record["status"], record["rows"]) == ("interrupted", 0)
    assert err.decode().strip() == (
        "outbox-dispatcher: interrupted: nothing was replayed (a replay is one transaction)"
        f" (audit record {record['id']})"
    )
    assert await conn.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0


# --- The console -------------------------------------------------------------------------------


async def _confirm(c: httpx.AsyncClient, data: dict[str, Any]) -> dict[str, str]:
    """The run form of a confirmation page, as the browser would post it."""
    csrf = csrf_of((await c.get("/dead")).text)
    page = await c.post("/actions/confirm", data={"csrf": csrf, **data})
    assert page.status_code == 200, page.text
    form = re.search(
        r'<form method="post" action="/actions/run" id="run">(.*?)</form>', page.text, re.S
    )
    assert form, page.text
    fields = dict(
        re.findall(r'<input type="hidden" name="([a-z]+)" value="([^"]*)"', form.group(1))
    )
    return {name: html.unescape(value) for name, value in fields.items()}


async def test_the_confirmation_binds_the_action_to_the_rows_it_counted(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N6: "would requeue 10", Yes, 15 requeued (rows that died in between); with "every dead
    row", a discard deleted rows the operator never saw counted."""
    confirmed = await dead_rows(conn, "orders", [f"k{i}" for i in range(10)], error="gone")
    [later_death] = await conn.fetch(
        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ('orders', 'late', 'x')"
        " RETURNING id"
    )
    async with client(make_settings(console_token=TOKEN)) as c:
        await log_in(c)
        run = await _confirm(c, {"action": "dead-requeue", "scope": "all"})
        bound = orjson.loads(run["body"])["bound"]
        assert bound["rows"] == 10 and bound["max_id"] == later_death["id"] - 1
        # Between the two clicks: new rows die, and an older pending row dies too.
        newer = await dead_rows(conn, "orders", ["n1", "n2", "n3"], error="gone")
        await conn.execute(
            "UPDATE outbox SET dead_at = now(), last_error = 'gone' WHERE id = $1",
            later_death["id"],
        )
        done = await c.post("/actions/run", data=run)
        assert 'id="outcome">requeued 10 dead rows.' in done.text, done.text
        still = await conn.fetch("SELECT id FROM outbox WHERE dead_at IS NOT NULL ORDER BY id")
        assert [r["id"] for r in still] == sorted([later_death["id"], *newer])
        assert await conn.fetchval(
            "SELECT array_agg(id ORDER BY id) FROM outbox WHERE dead_at IS NULL AND attempts = 0"
        ) == sorted(confirmed)

        # A discard of "every dead row" deletes only the rows its confirmation counted.
        run = await _confirm(c, {"action": "dead-discard", "scope": "all"})
        assert orjson.loads(run["body"])["bound"]["rows"] == 4
        extra = await dead_rows(conn, "orders", ["x1", "x2"], error="gone")
        done = await c.post("/actions/run", data={**run, "typed": "discard"})
        assert 'id="outcome">discarded 4 dead rows.' in done.text
        left = await conn.fetch("SELECT id FROM outbox WHERE dead_at IS NOT NULL ORDER BY id")
        assert [r["id"] for r in left] == extra

        # The API: the dry run answers the bound; sent back, only those rows change.
        dry = await c.post(
            "/api/v1/dead/requeue?dry_run=true", json={"topic": "orders"}, headers=AUTH
        )
        api_bound = dry.json()["bound"]
        assert api_bound["rows"] == 2
        [newest] = await dead_rows(conn, "orders", ["y1"], error="gone")
        body = {"topic": "orders", "bound": api_bound}
        done_api = await c.post("/api/v1/dead/requeue", json=body, headers=AUTH)
        assert done_api.status_code == 200 and done_api.json()["rows"] == 2
        # A bound that more rows match than were confirmed is refused (nothing changes).
        now = await conn.fetchval("SELECT now() + interval '1 second'")
        forged = {"max_id": newest, "before": now.isoformat(), "rows": 0}
        refused = await c.post(
            "/api/v1/dead/requeue", json={"topic": "orders", "bound": forged}, headers=AUTH
        )
        assert refused.status_code == 400
        assert "match within what was confirmed" in refused.json()["error"]
    kinds = [(r["command"], r["rows"], r["expected"], r["status"]) for r in await records(conn)]
    assert kinds == [
        ("dead requeue", 10, 10, "done"),
        ("dead discard", 4, 4, "done"),
        ("dead requeue", 2, 2, "done"),
    ]
    first = (await records(conn))[0]
    assert first["bound"]["rows"] == 10 and first["identity"].startswith("token holder")


async def test_a_bulk_action_is_a_job_with_progress_an_abort_and_no_second_run(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N7: 100,017 rows took 160 s in one POST with no progress; a proxy's timeout gave a 504
    while the action went on; a second click started a second run."""
    await many_dead(conn, 4000)
    await slow_batches(conn)
    async with client(make_settings(console_token=TOKEN, cleanup_batch_size=50)) as c:
        await log_in(c)
        run = await _confirm(c, {"action": "dead-requeue", "scope": "all"})
        started = await c.post("/actions/run", data=run, follow_redirects=False)
        assert started.status_code == 303  # answered long before the action is done
        job = started.headers["location"]
        record = int(job.rsplit("/", 1)[1])
        page = await c.get(job)
        assert 'id="status">running<' in page.text
        assert '<meta http-equiv="refresh" content="1">' in page.text
        progress = re.search(r'<progress id="progress" max="4000" value="(\d+)"', page.text)
        assert progress and 0 < int(progress.group(1)) < 4000
        # The same form again (a second click, a reload): the same job, not a second run.
        again = await c.post("/actions/run", data=run, follow_redirects=False)
        assert again.headers["location"] == job
        csrf = csrf_of(page.text)
        aborted = await c.post(f"{job}/abort", data={"csrf": csrf})
        assert 'id="status">aborted<' in aborted.text, aborted.text
        assert "aborted: requeued" in aborted.text
    changed = await requeued(conn)
    assert 0 < changed < 4000
    [entry] = await records(conn)
    assert (entry["id"], entry["status"], entry["rows"], entry["expected"]) == (
        record,
        "aborted",
        changed,
        4000,
    )
    assert entry["abort_requested_by"].startswith("token holder")


async def test_api_actions_are_jobs_too_with_an_idempotency_key(
    conn: asyncpg.Connection, make_settings: Any, monkeypatch: Any
) -> None:
    await many_dead(conn, 3000)
    await slow_batches(conn)
    from outbox_dispatcher.console import acting

    monkeypatch.setattr(acting, "API_WAIT_SECONDS", 0.5)
    key = {"idempotency-key": "requeue-all-1"}
    async with client(make_settings(console_token=TOKEN, cleanup_batch_size=50)) as c:
        first = await c.post("/api/v1/dead/requeue", json={"all": True}, headers={**AUTH, **key})
        assert first.status_code == 202, first.text
        answer = first.json()
        assert answer["status"] == "running" and answer["expected"] == 3000
        second = await c.post("/api/v1/dead/requeue", json={"all": True}, headers={**AUTH, **key})
        assert second.json()["record"] == answer["record"]
        follow = await c.get(answer["job"], headers=AUTH)
        assert follow.json()["status"] == "running" and follow.json()["rows"] > 0
        stop = await c.post(f"{answer['job']}/abort", headers=AUTH)
        assert stop.status_code == 200

        async def stopped() -> bool:
            return bool((await c.get(answer["job"], headers=AUTH)).json()["status"] != "running")

        await wait_until(stopped, 30, "the job to stop")
        ended = (await c.get(answer["job"], headers=AUTH)).json()
        assert ended["status"] == "aborted" and ended["rows"] == await requeued(conn)
        late = await c.post(f"{answer['job']}/abort", headers=AUTH)
        assert late.status_code == 409
    assert await conn.fetchval("SELECT count(*) FROM outbox_operator_audit") == 1


async def test_an_aborted_replay_changes_nothing(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    await many_published(conn, 3000)
    await slow_batches(conn)
    async with client(make_settings(console_token=TOKEN, cleanup_batch_size=50)) as c:
        await log_in(c)
        csrf = csrf_of((await c.get("/replay")).text)
        page = await c.post(
            "/actions/confirm", data={"csrf": csrf, "action": "replay", "topic": "bulk"}
        )
        form = dict(re.findall(r'<input type="hidden" name="([a-z]+)" value="([^"]*)"', page.text))
        run = {name: html.unescape(value) for name, value in form.items()}
        started = await c.post("/actions/run", data=run, follow_redirects=False)
        job = started.headers["location"]
        await asyncio.sleep(0.5)
        aborted = await c.post(f"{job}/abort", data={"csrf": csrf})
        assert 'id="status">aborted<' in aborted.text
        assert "nothing was replayed" in aborted.text
    assert await conn.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0
    [entry] = await records(conn)
    assert (entry["status"], entry["rows"]) == ("aborted", 0)


@pytest.mark.parametrize("stop", ["kill -9", "SIGTERM"])
async def test_a_console_stopped_mid_requeue_leaves_a_true_record_read_as_interrupted(
    conn: asyncpg.Connection, make_settings: Any, tmp_path: Path, stop: str
) -> None:
    """N2 (console): a requeue whose pod was killed had requeued 76,000 rows, and no audit row
    existed; the client that went away did not stop it either. Killed, the record reads as
    interrupted at once (its connection's lock is gone) and a console's sweep closes it so;
    stopped, the console closes it itself."""
    from outbox_dispatcher.operate import jobs

    await many_dead(conn, 5000)
    await slow_batches(conn)
    port = free_port()
    settings = make_settings(cleanup_batch_size=50)
    process = spawn_console(settings, tmp_path / "console.log", port, OUTBOX_CONSOLE_TOKEN=TOKEN)
    try:
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=2) as c:

            async def up() -> bool:
                try:
                    return (await c.get("/api/v1/status")).status_code == 200
                except httpx.TransportError:
                    return False

            await wait_until(up, 60, "the console to answer")
            # The client gives up after 2 s (a proxy's timeout): the job goes on.
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/api/v1/dead/requeue", json={"error": "lacks header"})

        async def some_done() -> bool:
            return await requeued(conn) >= 500

        await wait_until(some_done, 60, "the requeue to go on without its client")
        if stop == "kill -9":
            kill9(process)  # as a pod eviction would
        else:
            process.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(process.wait, 60) == 0
    finally:
        if process.poll() is None:
            kill9(process)
    changed = await requeued(conn)

    async def cut_off() -> bool:
        [entry] = await records(conn)
        return bool(entry["status"] == "interrupted")

    await wait_until(cut_off, 30, "the record to read as interrupted (its connection gone)")
    [entry] = await records(conn)
    assert entry["rows"] == changed and 500 <= changed < 5000
    assert entry["expected"] == 5000
    if stop == "kill -9":
        assert await conn.fetchval("SELECT status FROM outbox_operator_audit") == "running"
        assert await jobs.sweep(Session.of(conn, Settings())) == [entry["id"]]
    assert await conn.fetchval("SELECT status FROM outbox_operator_audit") == "interrupted"
