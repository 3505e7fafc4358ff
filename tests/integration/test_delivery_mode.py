"""The delivery mode in the registry (schema version 14): a real exactly-once dispatcher is named
so by `status` (table and JSON) and the console, an older release's row (no mode) is "not
reported", dispatchers that differ are a warning; and a new release keeps beating, without the
mode, on a schema not yet at 14 (a rolling upgrade)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.operate import reads
from outbox_dispatcher.operate.session import Session
from outbox_dispatcher.registry import Heartbeat
from outbox_dispatcher.store import DispatchStore, Statements, migrations

from .helpers import cli, spawn, stop_all, wait_until
from .test_console import AUTH, TOKEN, client

pytestmark = pytest.mark.integration

STATEMENTS = Statements.for_table("public", "outbox")
OLDER = "older-host:4242:ab12cd"  # a dispatcher of the release before version 14
OTHER = "other-host:77:ef34ab"


async def _beat(conn: asyncpg.Connection, owner: str, delivery: str | None) -> None:
    """A heartbeat as a release before 14 (no mode: delivery None) or another one writes it."""
    store = DispatchStore(conn, STATEMENTS)
    await store.dispatcher_beat(
        owner=owner, dead_letter_policy="skip", version=13, totals=(0, 0), delivery=delivery
    )


async def _status(settings: Settings) -> tuple[str, dict[str, Any]]:
    shown = await cli(settings, "status")
    assert shown.code == 0, shown.err
    as_json = await cli(settings, "status", "--json")
    assert as_json.code == 0, as_json.err
    return shown.out, orjson.loads(as_json.out)


def _row(page: str, owner: str) -> str:
    found = re.search(rf'<td class="mono">{re.escape(owner)}</td>(.*?)</tr>', page)
    assert found, page
    return found.group(1)


async def test_status_and_the_console_name_a_running_exactly_once_dispatcher(
    conn: asyncpg.Connection, make_settings: Any, tmp_path: Path
) -> None:
    settings = make_settings(
        delivery="exactly-once",
        progress_topic=f"progress-{uuid.uuid4().hex[:10]}",
        lease_seconds=3.0,
        transaction_timeout_seconds=2.0,
        console_token=TOKEN,
    )
    process = spawn(settings, tmp_path / "eos.log")
    try:

        async def registered() -> bool:
            return bool(await conn.fetchval("SELECT count(*) FROM outbox_dispatchers"))

        await wait_until(registered, 60, "the exactly-once dispatcher's heartbeat")
        owner = await conn.fetchval("SELECT owner FROM outbox_dispatchers")
        await _beat(conn, OLDER, None)

        text, report = await _status(settings)
        assert "delivery exactly-once (1 not reported: older release)" in text, text
        assert "warning:" not in text
        assert report["delivery"] == "exactly-once"
        assert report["delivery_modes"] == {"exactly-once": 1, "not reported": 1}
        by_owner = {d["owner"]: d["delivery"] for d in report["dispatchers"]}
        assert by_owner == {owner: "exactly-once", OLDER: None}
        async with client(settings, **AUTH) as c:
            page = (await c.get("/")).text
            api = (await c.get("/api/v1/status")).json()
        assert (api["delivery"], api["delivery_modes"]) == (
            report["delivery"],
            report["delivery_modes"],
        )
        assert "<td>exactly-once</td>" in _row(page, owner)
        assert "<td>not reported (older release)</td>" in _row(page, OLDER)
        assert 'id="delivery-mixed"' not in page

        # A dispatcher of the table publishing at least once: its transactions do not fence.
        await _beat(conn, OTHER, "at-least-once")
        text, report = await _status(settings)
        lines = text.splitlines()
        assert any(
            "delivery mixed (1 at-least-once, 1 exactly-once, 1 not reported)" in line
            for line in lines
        ), text
        assert lines[-1].startswith("warning: the live dispatchers run different delivery modes")
        assert report["delivery"] == "mixed"
        async with client(settings, **AUTH) as c:
            page = (await c.get("/")).text
        assert 'id="delivery-mixed"' in page and "<td>at-least-once</td>" in _row(page, OTHER)
    finally:
        assert stop_all([process]) == [0], (tmp_path / "eos.log").read_text()[-3000:]


async def test_a_new_release_beats_without_the_mode_until_the_schema_has_it(
    empty_database_url: str, make_settings: Any
) -> None:
    """On version 13 (not migrated yet) the heartbeat writes its counters and no mode, and
    `status` runs and says "not reported"; once `migrate` applied 14, the next beat names the
    mode."""
    conn = await asyncpg.connect(empty_database_url)
    try:
        for migration in migrations.load_migrations()[: migrations.DELIVERY_VERSION - 1]:
            sql = migrations.render(migration.path.read_text("utf-8"), "public", "outbox")
            async with conn.transaction():
                await conn.execute(sql)
        assert await migrations.current_version(conn, "public", "outbox") == 13
        store = DispatchStore(conn, STATEMENTS)
        heartbeat = Heartbeat(store, Settings(delivery="exactly-once"), "new:1:aa", lambda: (5, 1))
        session = Session(conn, STATEMENTS, "public.outbox")

        await heartbeat.beat()
        [row] = await conn.fetch("SELECT * FROM outbox_dispatchers")
        assert "delivery" not in row and (row["version"], row["published_total"]) == (
            migrations.latest_version(),
            5,
        )
        [older] = await reads.read_dispatchers(session, 60)
        assert older.delivery is None
        assert reads.delivery_in_force([older]) == reads.NOT_REPORTED
        text, report = await _status(make_settings(database_url=empty_database_url))
        assert "delivery not reported (older release)" in text
        assert report["delivery"] == "not reported"

        assert await migrations.migrate(conn, "public", "outbox") == list(
            range(migrations.DELIVERY_VERSION, migrations.latest_version() + 1)
        )
        await heartbeat.beat()
        assert await conn.fetchval("SELECT delivery FROM outbox_dispatchers") == "exactly-once"
        [found] = await reads.read_dispatchers(session, 60)
        assert found.delivery == "exactly-once"
    finally:
        await conn.close()
