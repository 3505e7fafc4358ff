"""The faces of many outboxes (issue 36, OUTBOX_SOURCES) against real PostgreSQL and Kafka: the
metrics of a fleet process carry a bounded `source` label; `status` lists every outbox of every
source and filters them; the operator commands and the console act on the one outbox a filter
names and refuse, listing the choices, when it names none or several; the console's sources page
lists every outbox."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from outbox_dispatcher.cli import EXIT_OK, EXIT_USAGE
from outbox_dispatcher.config.outboxes import sources_of
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.console import create_app
from outbox_dispatcher.operate import sources as operate_sources

from .helpers import (
    Ran,
    Services,
    http_get,
    log_events,
    settings_env,
    spawn,
    stop_all,
    wait_started,
    wait_until,
)
from .sources_helpers import migrate
from .test_many_outboxes import MakeTopic, Tenant, fleet_settings

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def samples(exposition: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of one series name, by their labels."""
    found: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def by_source(found: dict[tuple[tuple[str, str], ...], float]) -> dict[str, float]:
    """Sample values summed per `source` label (KeyError: a sample without one)."""
    summed: dict[str, float] = {}
    for labels, value in found.items():
        source = dict(labels)["source"]
        summed[source] = summed.get(source, 0.0) + value
    return summed


async def test_fleet_metrics_carry_a_bounded_source_label(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    a, b = databases
    await migrate(a, "tenant_a", "tenant_b", "tenant_c")
    await migrate(b, "public")
    tenants = [Tenant(a, f"tenant_{t}", await make_topic()) for t in "abc"]
    tenants.append(Tenant(b, "public", await make_topic()))
    rows = {"tenant_a.outbox": 10, "tenant_b.outbox": 20, "tenant_c.outbox": 30, "shard_b": 40}
    settings = fleet_settings(
        make_settings,
        a,
        [{"schema": "tenant_*"}, {"schema": "public", "database_url": b, "name": "shard_b"}],
        metrics_max_sources=2,
        metrics_interval_seconds=0.2,
    )
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:
        await wait_started([log])
        for tenant, n in zip(tenants, rows.values(), strict=True):
            await tenant.insert(keys=n, per_key=1)
        for tenant in tenants:
            await tenant.all_published()
        (listening,) = log_events(log, "http_listening")
        exposition = ""

        async def sampled_since() -> bool:  # the table gauges read after the last publish
            nonlocal exposition
            status, body = await http_get(listening["port"], "/metrics")
            assert status == 200
            exposition = body.decode()
            pending = samples(exposition, "outbox_pending_rows")
            return bool(pending) and not any(pending.values())

        await wait_until(sampled_since, 30, "the table gauges sampled at 0 pending")
    finally:
        codes = stop_all([process])
    assert codes == [0], log.read_text()[-3000:]
    published = by_source(samples(exposition, "outbox_published_total"))
    own = set(published) - {"other"}
    # Two outboxes have a label of their own (the bound), the other two share "other".
    assert len(own) == 2 and own <= set(rows), published
    assert published["other"] == sum(n for label, n in rows.items() if label not in own)
    for label in own:
        assert published[label] == rows[label], (label, published)
    claimed = by_source(samples(exposition, "outbox_claimed_rows_total"))
    assert claimed == published, (claimed, published)
    histogram = samples(exposition, "outbox_commit_to_ack_seconds_count")
    assert by_source(histogram) == published
    # The table gauges: sampled under each own label (pending 0 by now), none for "other".
    pending = by_source(samples(exposition, "outbox_pending_rows"))
    assert set(pending) == own, pending
    lag = samples(exposition, "outbox_oldest_pending_age_seconds")
    assert {dict(k)["source"] for k in lag} == own
    # The process's own series keep no source label.
    assert samples(exposition, "outbox_ready") == {(): 1.0}
    assert all("source" not in dict(k) for k in samples(exposition, "outbox_in_flight_rows"))


async def test_single_table_metrics_keep_no_source_label(
    services: Services, make_topic: MakeTopic, make_settings: Any, tmp_path: Path
) -> None:
    """Without OUTBOX_SOURCES the series are as before (the dashboards' and alerts')."""
    settings = make_settings(log_format="json", metrics_interval_seconds=0.2)
    log = tmp_path / "one.log"
    process = spawn(settings, log)
    try:
        await wait_started([log])

        async def listening() -> bool:
            return bool(log_events(log, "http_listening"))

        await wait_until(listening, 30, "the metrics endpoint")
        (found,) = log_events(log, "http_listening")
        _, body = await http_get(found["port"], "/metrics")
    finally:
        stop_all([process])
    exposition = body.decode()
    assert () in samples(exposition, "outbox_pending_rows")
    assert "source=" not in exposition


async def command(settings: Settings, *args: str) -> Ran:
    """`outbox-dispatcher ARGS` with these settings but no OUTBOX_SCHEMA or OUTBOX_TABLE (with
    OUTBOX_SOURCES, OUTBOX_SCHEMA is a filter, as --schema)."""
    env = {
        k: v
        for k, v in settings_env(settings).items()
        if k not in ("OUTBOX_SCHEMA", "OUTBOX_TABLE")
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "outbox_dispatcher",
        *args,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return Ran(process.returncode, out.decode(), err.decode())


def spawn_with(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    """`outbox-dispatcher ARGS` as a process of its own with `env`, its output in `log`."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "outbox_dispatcher", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


SOURCES = "tenants/tenant_a", "tenants/tenant_b", "shard_b", "billing"


async def four_outboxes(
    databases: tuple[str, str], make_topic: MakeTopic, make_settings: Any
) -> tuple[Settings, list[Tenant]]:
    """Two tenant schemas of a pattern and a literal `billing` that is missing in the first
    database, a named source in the second; rows pending in each table (5, 7 and 3)."""
    a, b = databases
    await migrate(a, "tenant_a", "tenant_b")
    await migrate(b, "public")
    tenants = [Tenant(a, "tenant_a", await make_topic()), Tenant(a, "tenant_b", await make_topic())]
    tenants.append(Tenant(b, "public", await make_topic()))
    for tenant, n in zip(tenants, (5, 7, 3), strict=True):
        await tenant.insert(keys=n, per_key=1)
    settings = fleet_settings(
        make_settings,
        a,
        [
            {"schema": "tenant_*", "name": "tenants"},
            {"schema": "billing", "name": "billing"},
            {"schema": "public", "database_url": b, "name": "shard_b"},
        ],
    )
    return settings, tenants


async def test_status_lists_every_outbox_of_every_source_and_filters_them(
    services: Services, databases: tuple[str, str], make_topic: MakeTopic, make_settings: Any
) -> None:
    settings, tenants = await four_outboxes(databases, make_topic, make_settings)
    ran = await command(settings, "status", "--json")
    assert ran.code == EXIT_OK, ran.err
    found = json.loads(ran.out)
    outboxes = {o["source"]: o for o in found["outboxes"]}
    assert set(outboxes) == set(SOURCES)
    states = {label: o["state"] for label, o in outboxes.items()}
    assert states == {
        "tenants/tenant_a": "ready",
        "tenants/tenant_b": "ready",
        "shard_b": "ready",
        "billing": "missing",
    }
    pending = {
        label: o["status"]["totals"]["pending"] for label, o in outboxes.items() if o["status"]
    }
    assert pending == {"tenants/tenant_a": 5, "tenants/tenant_b": 7, "shard_b": 3}
    assert outboxes["billing"]["status"] is None and "billing" in outboxes["billing"]["reason"]
    assert outboxes["shard_b"]["schema"] == "public"
    assert outboxes["tenants/tenant_a"]["status"]["totals"]["oldest_pending_age_seconds"] > 0
    assert found["totals"]["pending"] == 15
    assert len(found["databases"]) == 2 and all(d["reachable"] for d in found["databases"])
    assert "postgresql://" not in ran.out
    assert "outbox_ready" not in ran.err, ran.err  # the registry's lines are the data printed
    # --schema (a name or a pattern) and --source filter.
    ran = await command(settings, "status", "--json", "--schema", "tenant_b")
    assert [o["source"] for o in json.loads(ran.out)["outboxes"]] == ["tenants/tenant_b"]
    ran = await command(settings, "status", "--json", "--source", "tenants")
    labels = [o["source"] for o in json.loads(ran.out)["outboxes"]]
    assert sorted(labels) == ["tenants/tenant_a", "tenants/tenant_b"]
    ran = await command(settings, "status", "--source", "shard_b")
    assert ran.code == EXIT_OK, ran.err
    lines = ran.out.splitlines()
    assert lines[1].split()[:4] == ["shard_b", "public.outbox", "of", lines[1].split()[3]]
    assert tenants[2].topic in ran.out  # one outbox named: its topics as well
    assert "tenant_a" not in ran.out
    ran = await command(settings, "status", "--source", "nope")
    assert ran.code == EXIT_USAGE
    assert "no outbox matches --source nope: the outboxes are" in ran.err
    assert all(label in ran.err for label in SOURCES), ran.err


async def test_operator_commands_act_on_the_one_outbox_a_filter_names(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    settings, tenants = await four_outboxes(databases, make_topic, make_settings)
    topic_b = tenants[1].topic
    # None named, several named: refused, with the choices.
    ran = await command(settings, "pause", "--yes")
    assert ran.code == EXIT_USAGE
    assert "no filter matches 4 outboxes" in ran.err and "--source" in ran.err, ran.err
    ran = await command(settings, "pause", "--yes", "--source", "tenants")
    assert ran.code == EXIT_USAGE
    assert "--source tenants matches 2 outboxes (tenants/tenant_a" in ran.err, ran.err
    assert "shard_b" not in ran.err
    # One named: it is paused, and no other.
    ran = await command(
        settings, "pause", "--yes", "--source", "tenants/tenant_b", "--topic", topic_b
    )
    assert ran.code == EXIT_OK, ran.err
    found = json.loads((await command(settings, "status", "--json")).out)
    paused = {
        o["source"]: [p["topic"] for p in o["status"]["pauses"]]
        for o in found["outboxes"]
        if o["status"]
    }
    assert paused == {"tenants/tenant_a": [], "tenants/tenant_b": [topic_b], "shard_b": []}
    ran = await command(
        settings, "resume", "--source", "tenants", "--schema", "tenant_b", "--topic", topic_b
    )
    assert ran.code == EXIT_OK, ran.err
    found = json.loads((await command(settings, "status", "--json")).out)
    assert not any(o["status"]["pauses"] for o in found["outboxes"] if o["status"])
    # Published by a fleet process, then replayed in one outbox only.
    log = tmp_path / "fleet.log"
    process = spawn(settings, log)
    try:
        for tenant in tenants:
            await tenant.all_published()
    finally:
        assert stop_all([process]) == [0], log.read_text()[-3000:]
    ran = await command(settings, "replay", "--all", "--yes", "--source", "shard_b")
    assert ran.code == EXIT_OK, ran.err
    assert [await t.pending() for t in tenants] == [0, 0, 3]
    ran = await command(settings, "dead", "list", "--json", "--source", "tenants/tenant_a")
    assert (ran.code, json.loads(ran.out)) == (EXIT_OK, [])
    # --source without OUTBOX_SOURCES: refused.
    one = make_settings(database_url=databases[0], db_schema="tenant_a")
    ran = await command(one, "pause", "--yes", "--source", "shard_b")
    assert ran.code == EXIT_USAGE and "--source needs OUTBOX_SOURCES" in ran.err, ran.err


async def test_check_checks_every_outbox_of_every_source_and_filters_them(
    services: Services, databases: tuple[str, str], make_topic: MakeTopic, make_settings: Any
) -> None:
    """`check` with OUTBOX_SOURCES: every outbox, each line naming its outbox; a literal source
    whose table is missing and a topic only one outbox's rows need are problems; outboxes with
    nothing to say are counted; --source narrows it, and needs OUTBOX_SOURCES."""
    settings, tenants = await four_outboxes(databases, make_topic, make_settings)
    missing = f"missing-{tenants[1].topic}"
    async with tenants[1].connect() as conn:
        await conn.execute(
            "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, 'k', '{}')", missing
        )
    ran = await command(settings, "check")
    assert ran.code == 1, (ran.out, ran.err)
    assert "ok: settings are valid (3 sources)" in ran.out
    assert "ok: 3 of 4 outboxes (no filter): nothing to report" in ran.out, ran.out
    assert "problem: billing (billing.outbox of " in ran.err and ": missing: " in ran.err
    assert f"problem: topic '{missing}' (tenants/tenant_b: pending rows) does not exist" in ran.err
    assert "tenants/tenant_a" not in ran.out + ran.err, "nothing to say: counted, not listed"
    assert "postgresql://" not in ran.out + ran.err
    ran = await command(settings, "check", "--source", "shard_b")
    assert ran.code == EXIT_OK, ran.err
    assert "ok: 1 of 1 outboxes (--source shard_b): nothing to report" in ran.out
    ran = await command(settings, "check", "--schema", "tenant_a")
    assert ran.code == EXIT_OK, ran.err
    ran = await command(settings, "check", "--source", "nope")
    assert ran.code == 1 and "no outbox matches --source nope" in ran.err, ran.err
    one = make_settings(database_url=databases[0], db_schema="tenant_a")
    ran = await command(one, "check", "--source", "shard_b")
    assert ran.code == 1 and "--source needs OUTBOX_SOURCES" in ran.err, ran.err


async def test_the_console_serves_the_one_outbox_a_filter_names(
    services: Services,
    databases: tuple[str, str],
    make_topic: MakeTopic,
    make_settings: Any,
    tmp_path: Path,
) -> None:
    settings, _ = await four_outboxes(databases, make_topic, make_settings)
    ran = await command(settings, "console")
    assert ran.code == EXIT_USAGE
    assert "no filter matches 4 outboxes" in ran.err and "shard_b" in ran.err, ran.err
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        k: v
        for k, v in settings_env(settings).items()
        if k not in ("OUTBOX_SCHEMA", "OUTBOX_TABLE")
    }
    env |= {"OUTBOX_CONSOLE_PORT": str(port), "OUTBOX_CONSOLE_ANONYMOUS_READ": "true"}
    log = tmp_path / "console.log"
    console = spawn_with(env, log, "console", "--source", "shard_b")
    answer: dict[str, Any] = {}
    try:

        async def answers() -> bool:
            nonlocal answer
            try:
                status, body = await http_get(port, "/api/v1/status")
            except OSError:
                return False
            answer = json.loads(body) if status == 200 else {}
            return status == 200

        await wait_until(answers, 60, "the console to answer")
        # Its sources page: every outbox with its state and backlog, the served one marked.
        status, body = await http_get(port, "/api/v1/sources")
        listed = json.loads(body)
        _, page = await http_get(port, "/sources")
    finally:
        assert stop_all([console]) == [0], log.read_text()[-3000:]
    assert answer["totals"]["pending"] == 3, answer  # shard_b's rows, not the tenants'
    assert status == 200, listed
    outboxes = {o["source"]: o for o in listed["outboxes"]}
    assert set(outboxes) == set(SOURCES)
    assert [label for label, o in outboxes.items() if o["served"]] == ["shard_b"]
    assert {label: o["state"] for label, o in outboxes.items()}["billing"] == "missing"
    waiting = {label: o["totals"]["waiting"] for label, o in outboxes.items() if o["totals"]}
    assert waiting == {"tenants/tenant_a": 5, "tenants/tenant_b": 7, "shard_b": 3}
    html = page.decode()
    assert all(label in html for label in SOURCES)
    assert '<a href="/">shard_b</a>' in html
    assert "postgresql://" not in body.decode() + html


async def test_a_single_table_console_has_no_sources_page(make_settings: Any) -> None:
    app = create_app(make_settings(console_anonymous_read=True), sample=False)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
        answer = await c.get("/api/v1/sources")
        page = await c.get("/")
    assert answer.status_code == 404
    assert "OUTBOX_SOURCES is not set" in answer.json()["error"]
    assert 'href="/sources"' not in page.text


async def test_one_console_serves_every_outbox_of_the_sources_under_its_label(
    services: Services, databases: tuple[str, str], make_topic: MakeTopic, make_settings: Any
) -> None:
    """`console --source shard_b` serves shard_b at / and every other outbox at
    /outboxes/LABEL/ (a named pattern's label is two segments): its reads, its actions (a pause
    lands in that outbox's table and audit, nowhere else), its links and redirects, its logins
    (a login to one outbox is not one to another: each keeps them in its own table)."""
    settings, tenants = await four_outboxes(databases, make_topic, make_settings)
    settings = settings.model_copy(
        update={"console_token": SecretStr(CONSOLE_TOKEN), "console_anonymous_read": True}
    )
    home = await operate_sources.target(settings, "shard_b")
    app = create_app(home, sample=False, fleet=sources_of(settings))
    bearer = {"authorization": f"Bearer {CONSOLE_TOKEN}"}
    b = "/outboxes/tenants/tenant_b"
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"
    ) as c:
        status = (await c.get(f"{b}/api/v1/status", headers=bearer)).json()
        assert status["totals"]["pending"] == 7, status  # tenant_b's rows, not shard_b's 3
        assert (await c.get("/api/v1/status", headers=bearer)).json()["totals"]["pending"] == 3
        paused = await c.post(f"{b}/api/v1/pause", headers=bearer, json={"topic": tenants[1].topic})
        assert paused.status_code == 200, paused.text
        assert paused.json()["job"].startswith(f"{b}/api/v1/jobs/")
        listed = (await c.get("/api/v1/sources", headers=bearer)).json()
        pauses = {o["source"]: o["paused"] for o in listed["outboxes"] if o["totals"]}
        assert pauses == {
            "tenants/tenant_a": [],
            "tenants/tenant_b": [tenants[1].topic],
            "shard_b": [],
        }
        audit = (await c.get(f"{b}/api/v1/audit", headers=bearer)).json()
        assert [r["command"] for r in audit["actions"]] == ["pause"], audit
        home_audit = (await c.get("/api/v1/audit", headers=bearer)).json()
        assert home_audit["actions"] == [], home_audit
        # Pages: links and forms under the outbox's own path; the sources page links each.
        page = (await c.get("/outboxes/tenants/tenant_a/")).text
        assert 'href="/outboxes/tenants/tenant_a/dead"' in page
        assert 'action="/outboxes/tenants/tenant_a/find"' in page and 'href="/dead"' not in page
        found = await c.get("/outboxes/tenants/tenant_a/find?q=17")
        assert found.headers["location"] == "/outboxes/tenants/tenant_a/rows/17"
        sources_page = (await c.get("/sources")).text
        assert 'href="/outboxes/tenants/tenant_b/"' in sources_page
        # Filtered as `status --source --schema` filters it (hundreds of tenants on demand).
        only = (await c.get("/api/v1/sources?schema=tenant_*", headers=bearer)).json()
        assert [o["source"] for o in only["outboxes"]] == ["tenants/tenant_a", "tenants/tenant_b"]
        only = (await c.get("/api/v1/sources?source=shard_b", headers=bearer)).json()
        assert [o["source"] for o in only["outboxes"]] == ["shard_b"]
        assert "tenants/tenant_a" not in (await c.get("/sources?source=shard_b")).text
        # Unknown labels, and the home outbox, are not mounted.
        for path in ("/outboxes/nope/", "/outboxes/shard_b/", "/outboxes/nope/api/v1/status"):
            assert (await c.get(path)).status_code == 404, path
        # Logging in to tenant_a: it lands on tenant_a's overview, logged in there only.
        form = (await c.get("/outboxes/tenants/tenant_a/login")).text
        answer = await c.post(
            "/outboxes/tenants/tenant_a/login",
            data={"csrf": _csrf(form), "token": CONSOLE_TOKEN},
        )
        assert answer.headers["location"] == "/outboxes/tenants/tenant_a/"
        assert 'id="not-logged-in"' not in (await c.get("/outboxes/tenants/tenant_a/")).text
        assert 'id="not-logged-in"' in (await c.get(f"{b}/")).text
        assert 'id="not-logged-in"' in (await c.get("/")).text
    await app.state.stop_jobs()


CONSOLE_TOKEN = "fleet-console-token-0123456789"


def _csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found is not None, html[:500]
    return found.group(1)
