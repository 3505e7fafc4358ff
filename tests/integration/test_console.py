"""The operator console against real PostgreSQL: its API and pages in-process (httpx over ASGI),
and once as the real `outbox-dispatcher console` process over HTTP."""

from __future__ import annotations

import asyncio
import html
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.console import create_app, history
from outbox_dispatcher.store import migrations
from tests.containers import free_port

from .helpers import Services, cli, settings_env
from .test_security import _as_role, _roles_database

pytestmark = pytest.mark.integration

TOKEN = "console-test-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
HOSTILE_KEY = "evil\x1b[2J\x1b[H<script>alert(1)</script>\u202egnp.exe\nforged"
HOSTILE_ERROR = "boom\x1b]0;owned-title\x07 <img src=x onerror=alert(2)> \u202eright-to-left"


def client(settings: Settings, **headers: str) -> httpx.AsyncClient:
    app = create_app(settings, sample=False)
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://127.0.0.1",
        follow_redirects=True,
        headers=headers,
    )


async def log_in(c: httpx.AsyncClient, token: str = TOKEN) -> httpx.Response:
    page = await c.get("/login")
    return await c.post("/login", data={"csrf": csrf_of(page.text), "token": token})


@pytest.fixture
async def api(make_settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with client(make_settings(console_token=TOKEN)) as c:
        yield c


async def dead_rows(
    conn: asyncpg.Connection, topic: str, keys: list[str | None], error: str = "boom"
) -> list[int]:
    rows = await conn.fetch(
        "INSERT INTO outbox (topic, ordering_key, payload, dead_at, attempts, last_error)"
        " SELECT $1, k, 'x', now(), 10, $3 FROM unnest($2::text[]) WITH ORDINALITY AS u(k, n)"
        " ORDER BY n RETURNING id",
        topic,
        keys,
        error,
    )
    return [r["id"] for r in rows]


async def published_rows(conn: asyncpg.Connection, topic: str, n: int) -> list[int]:
    rows = await conn.fetch(
        "INSERT INTO outbox (topic, ordering_key, payload, published_at)"
        " SELECT $1, 'k-' || g, 'x', now() FROM generate_series(1, $2) g RETURNING id",
        topic,
        n,
    )
    return sorted(r["id"] for r in rows)


async def snapshot(conn: asyncpg.Connection) -> tuple[Any, ...]:
    """Everything an action could change."""
    return (
        await conn.fetch(
            "SELECT id, dead_at, published_at, attempts, next_attempt_at FROM outbox ORDER BY id"
        ),
        await conn.fetch("SELECT topic, reason FROM outbox_paused ORDER BY topic"),
        await conn.fetchval("SELECT count(*) FROM outbox_operator_audit"),
    )


async def audits(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        "SELECT command, filter::text AS filter, rows FROM outbox_operator_audit ORDER BY id"
    )
    return [{**dict(r), "filter": orjson.loads(r["filter"])} for r in rows]


def ctl(code: int, escape: str) -> str:
    """How a page shows a control character of writer-controlled text."""
    return f'<span class="ctl" title="control character U+{code:04X}">{escape}</span>'


def raw_controls(text: str) -> set[str]:
    return {c for c in text if c not in "\n\t" and not c.isprintable()}


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, html
    return found.group(1)


ACTIONS = [
    ("/api/v1/dead/requeue", {"all": True}),
    ("/api/v1/dead/discard", {"all": True}),
    ("/api/v1/replay", {"all": True}),
    ("/api/v1/pause", {"all": True}),
    ("/api/v1/resume", {"all": True}),
]


# --- Safety --------------------------------------------------------------------------------------


async def test_an_unauthenticated_action_is_refused_and_changes_nothing(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    await dead_rows(conn, "orders", ["a", "b"])
    await published_rows(conn, "orders", 3)
    await conn.execute("INSERT INTO outbox_paused (topic, paused_by) VALUES ('orders', 'x')")
    before = await snapshot(conn)
    async with client(make_settings(console_token=TOKEN)) as c:
        for path, body in ACTIONS:
            for headers in ({}, {"authorization": "Bearer wrong-token-0123456789"}, {"x": "y"}):
                answer = await c.post(path, json=body, headers=headers)
                assert answer.status_code == 401, (path, answer.text)
                assert answer.headers["www-authenticate"] == "Bearer"
                assert "Bearer" in answer.json()["error"]
        # A session that never logged in cannot act from the pages either, CSRF token or not.
        page = await c.get("/login")
        csrf = csrf_of(page.text)
        body = orjson.dumps({"all": True}).decode()
        refused = await c.post(
            "/actions/run", data={"csrf": csrf, "action": "dead-discard", "body": body}
        )
        assert refused.status_code == 401
    # Without a token (an anonymous read-only console): even a Bearer header is refused, and
    # it says so.
    async with client(make_settings(console_anonymous_read=True)) as c:
        for path, body in ACTIONS:
            answer = await c.post(path, json=body, headers=AUTH)
            assert answer.status_code == 403
            assert "cannot act" in answer.json()["error"]
        page = await c.get("/")
        assert 'id="read-only"' in page.text
        assert "/actions/confirm" not in page.text
        form = await c.get("/login")
        assert 'name="token"' not in form.text  # nothing to log in with
        login = await c.post("/login", data={"token": TOKEN})
        assert login.status_code == 403
    assert await snapshot(conn) == before


async def test_a_form_post_without_the_sessions_csrf_token_is_refused(
    conn: asyncpg.Connection, api: httpx.AsyncClient, make_settings: Any
) -> None:
    ids = await dead_rows(conn, "orders", ["a"])
    before = await snapshot(conn)
    # Logging in needs the CSRF token too (no login CSRF).
    assert (await api.post("/login", data={"token": TOKEN})).status_code == 403
    page = await api.get("/login")
    logged = await api.post(
        "/login", data={"csrf": csrf_of(page.text), "token": TOKEN}, follow_redirects=False
    )
    assert logged.status_code == 303
    cookie = logged.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "max-age=28800" in cookie
    csrf = csrf_of((await api.get("/dead")).text)
    body = orjson.dumps({"ids": ids}).decode()
    for token in (None, "", "forged", csrf[:-1]):
        data = {"action": "dead-discard", "body": body}
        if token is not None:
            data["csrf"] = token
        refused = await api.post("/actions/run", data=data)
        assert refused.status_code == 403, token
        assert "CSRF" in refused.text
    # Another browser (no session cookie) with the right token value is refused as well.
    async with client(make_settings(console_token=TOKEN)) as other:
        data = {"csrf": csrf, "action": "dead-discard", "body": body}
        assert (await other.post("/actions/run", data=data)).status_code == 403
    assert await snapshot(conn) == before


async def test_an_empty_filter_and_bad_input_are_refused_with_a_clear_4xx(
    conn: asyncpg.Connection, api: httpx.AsyncClient
) -> None:
    await dead_rows(conn, "orders", ["a"])
    await published_rows(conn, "orders", 2)
    before = await snapshot(conn)
    refused = [
        ("/api/v1/dead/requeue", {}, "refusing to requeue dead rows without a filter"),
        ("/api/v1/dead/discard", {}, "refusing to discard dead rows without a filter"),
        ("/api/v1/replay", {}, "refusing to replay published rows without a filter"),
        ("/api/v1/dead/requeue", {"all": True, "topic": "orders"}, '"all" cannot be combined'),
        ("/api/v1/dead/requeue", {"ids": []}, "invalid input: ids"),
        ("/api/v1/dead/requeue", {"ids": ["one"]}, "invalid input: ids.0"),
        ("/api/v1/dead/requeue", {"since": "yesterday"}, "invalid input: since"),
        ("/api/v1/dead/requeue", {"topic": "no spaces allowed"}, "invalid input: topic"),
        ("/api/v1/dead/requeue", {"key": "nul\x00"}, "invalid input: key"),
        ("/api/v1/dead/requeue", {"bogus": 1}, "invalid input: bogus"),
        ("/api/v1/dead/requeue", ["orders"], "the body must be a JSON object"),
        ("/api/v1/replay", {"from_id": 5, "to_id": 1}, "from_id 5 is after to_id 1"),
        ("/api/v1/pause", {}, 'give "topic", or "all": true'),
        ("/api/v1/pause", {"topic": "orders", "all": True}, 'give "topic"'),
        ("/api/v1/resume", {}, 'give "topic"'),
        # A resume takes no reason (N14: a field that did nothing).
        ("/api/v1/resume", {"topic": "orders", "reason": "x"}, "invalid input: reason"),
    ]
    for path, body, message in refused:
        answer = await api.post(path, json=body, headers=AUTH)
        assert answer.status_code == 400, (path, body, answer.text)
        assert message in answer.json()["error"], (path, body, answer.json())
    bad = await api.post("/api/v1/dead/requeue", json={"since": "yesterday"}, headers=AUTH)
    assert bad.json()["problems"][0]["field"] == "since"
    not_json = await api.post("/api/v1/dead/requeue", content=b"{nope", headers=AUTH)
    assert not_json.status_code == 400 and not_json.json()["error"] == "the body is not JSON"
    huge = await api.post(
        "/api/v1/dead/requeue", content=b"[" + b"1," * 600_000 + b"1]", headers=AUTH
    )
    assert huge.status_code == 413 and "over 1048576 bytes" in huge.json()["error"]
    dry = await api.post("/api/v1/dead/requeue?dry_run=maybe", json={"all": True}, headers=AUTH)
    assert dry.status_code == 400
    for query in ("limit=0", "limit=abc", "limit=100000", "since=soon", "keyless=maybe"):
        listed = await api.get(f"/api/v1/dead?{query}", headers=AUTH)
        assert listed.status_code == 400, query
        assert listed.json()["error"].startswith("invalid input"), query
    missing = await api.get("/api/v1/rows/999999", headers=AUTH)
    assert missing.json() == {"error": "no row 999999"} and missing.status_code == 404
    page = await api.get("/dead?since=soon", headers=AUTH)
    assert page.status_code == 400 and "invalid input: since" in page.text
    # In the CLI's words, with a way back to the form (N19).
    assert "&#39;soon&#39; is not an ISO-8601 time (e.g. 2026-11-30T12:00:00Z)" in page.text
    assert 'href="/dead" id="back"' in page.text
    assert await snapshot(conn) == before


# --- Actions -------------------------------------------------------------------------------------


async def test_each_api_action_changes_exactly_the_rows_it_says_and_is_audited(
    conn: asyncpg.Connection, api: httpx.AsyncClient
) -> None:
    a = await dead_rows(conn, "alpha", ["a1", "a2", "a3"])
    b = await dead_rows(conn, "beta", ["b1", "b2"])
    published = await published_rows(conn, "gamma", 5)

    dry = await api.post("/api/v1/dead/requeue?dry_run=true", json={"topic": "alpha"}, headers=AUTH)
    counted = dry.json()
    assert counted.pop("bound")["rows"] == 3
    assert counted == {
        "command": "dead requeue",
        "rows": 3,
        "dry_run": True,
        "detail": "would requeue 3 dead rows",
    }
    assert await conn.fetchval("SELECT count(*) FROM outbox WHERE dead_at IS NULL") == 5

    requeued = await api.post("/api/v1/dead/requeue", json={"topic": "alpha"}, headers=AUTH)
    assert requeued.status_code == 200
    assert requeued.json()["rows"] == 3 and requeued.json()["detail"] == "requeued 3 dead rows"
    pending = await conn.fetch(
        "SELECT id FROM outbox WHERE dead_at IS NULL AND published_at IS NULL"
    )
    assert sorted(r["id"] for r in pending) == a

    discarded = await api.post("/api/v1/dead/discard", json={"ids": [b[0]]}, headers=AUTH)
    assert discarded.json()["rows"] == 1
    assert await conn.fetchval(
        "SELECT array_agg(id ORDER BY id) FROM outbox WHERE dead_at IS NOT NULL"
    ) == [b[1]]
    assert await conn.fetchval("SELECT count(*) FROM outbox WHERE id = $1", b[0]) == 0

    body = {"from_id": published[1], "to_id": published[3]}
    replayed = await api.post("/api/v1/replay", json=body, headers=AUTH)
    assert replayed.json()["rows"] == 3
    again = await conn.fetch(
        "SELECT id FROM outbox WHERE topic = 'gamma' AND published_at IS NULL ORDER BY id"
    )
    assert [r["id"] for r in again] == published[1:4]

    paused = await api.post("/api/v1/pause", json={"topic": "gamma", "reason": "why"}, headers=AUTH)
    assert paused.json()["rows"] == 1
    assert await conn.fetch("SELECT topic, reason FROM outbox_paused") == [("gamma", "why")]
    whole = await api.post("/api/v1/pause", json={"all": True}, headers=AUTH)
    assert whole.json()["detail"].startswith("paused the whole table")
    resumed = await api.post("/api/v1/resume", json={"topic": "gamma"}, headers=AUTH)
    assert resumed.json()["rows"] == 1
    resumed = await api.post("/api/v1/resume", json={"all": True}, headers=AUTH)
    assert resumed.json()["rows"] == 1
    not_paused = await api.post("/api/v1/resume", json={"topic": "gamma"}, headers=AUTH)
    assert not_paused.json()["rows"] == 0 and "was not paused" in not_paused.json()["detail"]
    assert await conn.fetchval("SELECT count(*) FROM outbox_paused") == 0

    via = {"via": "console", "http_client": "127.0.0.1"}
    assert await audits(conn) == [
        {"command": "dead requeue", "filter": {"topic": "alpha", **via}, "rows": 3},
        {"command": "dead discard", "filter": {"ids": [b[0]], **via}, "rows": 1},
        {"command": "replay", "filter": {**body, **via}, "rows": 3},
        {"command": "pause", "filter": {"topic": "gamma", "reason": "why", **via}, "rows": 1},
        {"command": "pause", "filter": via, "rows": 1},
        {"command": "resume", "filter": {"topic": "gamma", **via}, "rows": 1},
        {"command": "resume", "filter": via, "rows": 1},
        {"command": "resume", "filter": {"topic": "gamma", **via}, "rows": 0},
    ]
    listed = (await api.get("/api/v1/audit?limit=2", headers=AUTH)).json()["actions"]
    assert [(x["command"], x["rows"]) for x in listed] == [("resume", 0), ("resume", 1)]
    assert {x["identity"] for x in listed} == {"token holder"}
    page = await api.get("/audit?command=replay", headers=AUTH)
    assert page.status_code == 200 and page.text.count("<td>replay</td>") == 1


async def test_page_actions_confirm_with_the_count_then_change_those_rows(
    conn: asyncpg.Connection, api: httpx.AsyncClient
) -> None:
    a = await dead_rows(conn, "alpha", ["a1", "a2"])
    b = await dead_rows(conn, "beta", ["b1", "b2", "b3"], error="Topic Missing")
    page = await api.get("/login")
    await api.post("/login", data={"csrf": csrf_of(page.text), "token": TOKEN})
    listing = await api.get("/dead?topic=beta")
    assert 'id="not-logged-in"' not in listing.text and "/actions/confirm" in listing.text
    csrf = csrf_of(listing.text)
    before = await snapshot(conn)

    # The rows ticked.
    ask = await api.post(
        "/actions/confirm",
        data={"csrf": csrf, "action": "dead-requeue", "scope": "selected", "id": [str(a[0])]},
    )
    assert ask.status_code == 200, ask.text
    assert "This would requeue 1 dead row." in ask.text
    assert await snapshot(conn) == before  # asking changes nothing
    body = re.search(r'name="body" value="([^"]+)"', ask.text)
    assert body
    done = await api.post(
        "/actions/run",
        data={
            "csrf": csrf,
            "action": "dead-requeue",
            "body": html.unescape(body.group(1)),
            "expected": "1",
        },
    )
    assert done.status_code == 200 and "requeued 1 dead row." in done.text
    assert await conn.fetchval("SELECT dead_at IS NULL FROM outbox WHERE id = $1", a[0])
    assert await conn.fetchval("SELECT dead_at IS NOT NULL FROM outbox WHERE id = $1", a[1])

    # Every row matching the page's filter (topic and error text, in any case).
    filtered = await api.get("/dead", params={"topic": "beta", "error": "topic missing"})
    carried = re.search(r'name="filter" value="([^"]+)"', filtered.text)
    assert carried and filtered.text.count('href="/rows/') == 3
    ask = await api.post(
        "/actions/confirm",
        data={
            "csrf": csrf,
            "action": "dead-discard",
            "scope": "matching",
            "filter": html.unescape(carried.group(1)),
        },
    )
    assert "This would discard 3 dead rows." in ask.text
    # An empty filter is refused on the page too.
    empty = await api.post(
        "/actions/confirm", data={"csrf": csrf, "action": "dead-discard", "scope": "matching"}
    )
    assert empty.status_code == 400 and "without a filter" in empty.text
    none_ticked = await api.post(
        "/actions/confirm", data={"csrf": csrf, "action": "dead-discard", "scope": "selected"}
    )
    assert none_ticked.status_code == 400
    body = re.search(r'name="body" value="([^"]+)"', ask.text)
    assert body
    run = {"csrf": csrf, "action": "dead-discard", "body": html.unescape(body.group(1))}
    untyped = await api.post("/actions/run", data=run)
    assert untyped.status_code == 400 and "discard&#34; to confirm a discard" in untyped.text
    done = await api.post("/actions/run", data={**run, "typed": "discard"})
    assert "discarded 3 dead rows." in done.text
    assert await conn.fetchval("SELECT count(*) FROM outbox WHERE id = ANY($1)", b) == 0

    # Replay from its page's form: by id range, counted first.
    published = await published_rows(conn, "delta", 4)
    replay_page = await api.get("/replay")
    assert 'name="from_id"' in replay_page.text
    ask = await api.post(
        "/actions/confirm",
        data={
            "csrf": csrf,
            "action": "replay",
            "from_id": str(published[1]),
            "to_id": str(published[2]),
            "key": "",
        },
    )
    assert "This would replay 2 published rows." in ask.text
    body = re.search(r'name="body" value="([^"]+)"', ask.text)
    assert body
    done = await api.post(
        "/actions/run",
        data={"csrf": csrf, "action": "replay", "body": html.unescape(body.group(1))},
    )
    assert "replayed 2 published rows." in done.text
    again = await conn.fetch("SELECT id FROM outbox WHERE topic = 'delta' AND published_at IS NULL")
    assert sorted(r["id"] for r in again) == published[1:3]

    # Pause from the overview: the confirmation counts the rows that would wait.
    await conn.execute(
        "INSERT INTO outbox (topic, payload) SELECT 'gamma', 'x' FROM generate_series(1, 4)"
    )
    ask = await api.post(
        "/actions/confirm", data={"csrf": csrf, "action": "pause", "topic": "gamma"}
    )
    assert "This would pause topic gamma: 4 pending rows would wait." in ask.text
    assert await conn.fetchval("SELECT count(*) FROM outbox_paused") == 0
    done = await api.post(
        "/actions/run",
        data={"csrf": csrf, "action": "pause", "body": '{"topic": "gamma"}'},
    )
    assert "paused topic gamma" in done.text
    assert await conn.fetchval("SELECT topic FROM outbox_paused") == "gamma"
    overview = await api.get("/")
    assert 'value="resume">Resume' in overview.text
    commands = [(x["command"], x["rows"]) for x in await audits(conn)]
    assert commands == [("dead requeue", 1), ("dead discard", 3), ("replay", 2), ("pause", 1)]


# --- Reads ---------------------------------------------------------------------------------------


async def test_dead_rows_and_blocked_keys_filter_by_topic_key_time_and_error_text(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    await dead_rows(conn, "alpha", ["k1", "k2"], error="UnknownTopicOrPartitionError: gone")
    await dead_rows(conn, "beta", ["k1", None], error="MessageSizeTooLargeError: too big")
    old = await conn.fetchval(
        "INSERT INTO outbox (topic, ordering_key, payload, dead_at, created_at, last_error)"
        " VALUES ('alpha', 'k9', 'x', now(), now() - interval '2 days', 'old') RETURNING id"
    )
    # Keys that wait: one behind a dead row (policy block), one in backoff.
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, attempts, next_attempt_at, last_error)"
        " VALUES ('alpha', 'k1', 'x', 0, now(), NULL),"
        "        ('beta', 'slow', 'x', 3, now() + interval '1 hour', 'timeout')"
    )

    async def keys(c: httpx.AsyncClient, query: str) -> list[tuple[Any, ...]]:
        found = (await c.get(f"/api/v1/dead?{query}")).json()["rows"]
        return sorted(((r["topic"], r["ordering_key"]) for r in found), key=str)

    async with client(make_settings(dead_letter_policy="block", console_anonymous_read=True)) as c:
        assert len(await keys(c, "")) == 5
        assert await keys(c, "topic=beta") == [("beta", "k1"), ("beta", None)]
        assert await keys(c, "topic=(routed)") == []
        assert await keys(c, "key=k1") == [("alpha", "k1"), ("beta", "k1")]
        assert await keys(c, "keyless=true") == [("beta", None)]
        assert await keys(c, "error=toolarge") == [("beta", "k1"), ("beta", None)]
        assert await keys(c, "error=UNKNOWNTOPIC&key=k2") == [("alpha", "k2")]
        yesterday = (datetime.now(UTC) - timedelta(days=1)).isoformat()
        assert await keys(c, f"until={yesterday.replace('+00:00', 'Z')}") == [("alpha", "k9")]
        assert len(await keys(c, f"since={yesterday[:19]}")) == 4  # bare: UTC
        assert len(await keys(c, "limit=2")) == 2
        page = await c.get("/dead?error=old")
        assert f'href="/rows/{old}"' in page.text and page.text.count('href="/rows/') == 1

        blocked = (await c.get("/api/v1/blocked")).json()
        assert blocked["dead_letter_policy"] == "block"
        assert sorted((k["ordering_key"], k["reason"]) for k in blocked["keys"]) == [
            ("k1", "dead"),
            ("slow", "backoff"),
        ]
        only = (await c.get("/api/v1/blocked?topic=beta")).json()["keys"]
        assert [k["ordering_key"] for k in only] == ["slow"]
        assert (await c.get("/api/v1/blocked?key=k1")).json()["keys"][0]["dead_rows"] == 2
        assert "slow" in (await c.get("/blocked")).text
    async with client(make_settings(dead_letter_policy="skip", console_anonymous_read=True)) as c:
        blocked = (await c.get("/api/v1/blocked")).json()
        assert [k["ordering_key"] for k in blocked["keys"]] == ["slow"]


async def test_the_overview_shows_the_numbers_per_topic_and_the_sampled_chart(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    await conn.execute(
        "INSERT INTO outbox (topic, payload) SELECT 'alpha', 'x' FROM generate_series(1, 7)"
    )
    await dead_rows(conn, "beta", ["k"])
    await conn.execute(
        "INSERT INTO outbox_paused (topic, paused_by, reason) VALUES ('beta', 'op', 'r')"
    )
    settings = make_settings(console_sample_seconds=0.05, console_anonymous_read=True)
    samples = history.History()
    sampler = asyncio.create_task(history.sample_forever(settings, samples))
    try:
        for _ in range(100):
            if len(samples.samples()) >= 2:
                break
            await asyncio.sleep(0.05)
    finally:
        sampler.cancel()
    assert samples.samples()[-1].pending == 7 and samples.samples()[-1].dead == 1
    async with client(settings) as c:
        report = (await c.get("/api/v1/status")).json()
        topics = {t["topic"]: t for t in report["topics"]}
        assert topics["alpha"]["pending"] == 7 and topics["beta"]["dead"] == 1
        assert topics["beta"]["paused"] and not topics["alpha"]["paused"]
        assert report["history"]["source"] == "sampled by this console process, in memory"
        page = await c.get("/")
        assert page.status_code == 200
        assert '<div class="value">7</div><div class="label">waiting</div>' in page.text
        assert "<svg" in page.text and "kept in its memory" in page.text
        assert page.headers["content-security-policy"].startswith("default-src 'none'")
    from outbox_dispatcher.console.pages import overview_charts

    backlog, _rates, lag = overview_charts(samples, time.time())
    assert backlog.count("<polyline") == 3 and lag.count("<polyline") == 1


async def test_the_payload_is_hidden_unless_enabled_then_decoded_and_capped(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    json_row, text_row, binary_row = [
        await conn.fetchval(
            "INSERT INTO outbox (topic, payload, headers) VALUES ('t', $1, '{\"h\": \"v\"}')"
            " RETURNING id",
            payload,
        )
        for payload in (
            b'{"secret": "s3cr3t-value"}',
            "héllo s3cr3t-value".encode(),
            b"\xff\x00\x01",
        )
    ]
    async with client(make_settings(console_token=TOKEN), **AUTH) as c:
        shown = (await c.get(f"/api/v1/rows/{json_row}")).json()
        assert shown["payload"] is None and shown["payload_shown"] is False
        assert shown["payload_bytes"] == 26 and shown["headers"] == {"h": "v"}
        assert shown["state"] == "pending"
        for expires, state in (("1 minute", "in flight"), ("-1 minute", "pending")):
            # A claim's lease is its key's (here: the keyless row's own) work.
            await conn.execute(
                "INSERT INTO outbox_work AS w (keyless, ordering_key, head_id, claim_first,"
                " claim_token, claim_owner, claim_expires_at)"
                " VALUES (true, $1::bigint::text, $1, $1, gen_random_uuid(), 'd1',"
                "         now() + $2::text::interval)"
                " ON CONFLICT (ordering_key, keyless)"
                " DO UPDATE SET claim_expires_at = excluded.claim_expires_at",
                json_row,
                expires,
            )
            assert (await c.get(f"/api/v1/rows/{json_row}")).json()["state"] == state
        page = await c.get(f"/rows/{json_row}")
        assert "s3cr3t" not in page.text and 'id="payload-hidden"' in page.text
    async with client(make_settings(console_show_payload=True, console_token=TOKEN), **AUTH) as c:
        shown = (await c.get(f"/api/v1/rows/{json_row}")).json()["payload"]
        assert shown["encoding"] == "json" and '"secret": "s3cr3t-value"' in shown["text"]
        assert (await c.get(f"/api/v1/rows/{text_row}")).json()["payload"]["encoding"] == "utf-8"
        binary = (await c.get(f"/api/v1/rows/{binary_row}")).json()["payload"]
        assert binary == {"encoding": "hex", "text": "ff 00 01", "bytes": 3, "truncated": False}
        assert "s3cr3t-value" in (await c.get(f"/rows/{json_row}")).text
    async with client(
        make_settings(console_show_payload=True, console_payload_max_bytes=2, console_token=TOKEN),
        **AUTH,
    ) as c:
        capped = (await c.get(f"/api/v1/rows/{text_row}")).json()["payload"]
        # The first 2 bytes end inside "é": the partial character is left out, not shown as hex.
        assert capped == {"encoding": "utf-8", "text": "h", "bytes": 19, "truncated": True}


async def test_a_hostile_key_header_and_error_are_shown_inert(
    conn: asyncpg.Connection, api: httpx.AsyncClient
) -> None:
    [row] = await dead_rows(conn, "orders", [HOSTILE_KEY], error=HOSTILE_ERROR)
    await conn.execute(
        "UPDATE outbox SET headers = jsonb_build_object($2::text, $3::text) WHERE id = $1",
        row,
        "x-<b>\u202e",
        "\x1b[31m<i>red</i>",
    )
    await conn.execute(
        "INSERT INTO outbox_paused (topic, paused_by, reason) VALUES ('orders', $1, $2)",
        "ceo\x1b[31m",
        "<script>alert(3)</script>\u2028x",
    )
    await api.post("/api/v1/dead/requeue?dry_run=true", json={"key": HOSTILE_KEY}, headers=AUTH)
    await api.post("/api/v1/pause", json={"topic": "other", "reason": HOSTILE_KEY}, headers=AUTH)
    await log_in(api)
    pages = [("/dead", {}), (f"/rows/{row}", {}), ("/", {}), ("/audit", {})]
    for path, params in [*pages, ("/dead", {"key": HOSTILE_KEY}), ("/blocked", {})]:
        page = await api.get(path, params=params)
        assert page.status_code == 200, path
        assert not raw_controls(page.text), (path, raw_controls(page.text))
        for tag in ("<script>alert", "<img", "<b>", "<i>red"):
            assert tag not in page.text, (path, tag)
    shown = (await api.get(f"/rows/{row}")).text
    # Each control character is its escape in a marked span (N16: a real ESC and the four
    # characters of a stored repr look different); the rest is HTML-escaped.
    esc, bell, rlo, nl = (
        ctl(0x1B, "\\x1b"),
        ctl(0x07, "\\x07"),
        ctl(0x202E, "\\u202e"),
        ctl(0x0A, "\\n"),
    )
    assert (
        f"evil{esc}[2J{esc}[H&lt;script&gt;alert(1)&lt;/script&gt;{rlo}gnp.exe{nl}forged" in shown
    )
    assert (
        f"{esc}]0;owned-title{bell} &lt;img src=x onerror=alert(2)&gt; {rlo}right-to-left" in shown
    )
    assert f"x-&lt;b&gt;{rlo}" in shown and f"{esc}[31m&lt;i&gt;red&lt;/i&gt;" in shown
    # The dead page carries its filter back to an action exactly, in inert ASCII JSON.
    listing = await api.get("/dead", params={"key": HOSTILE_KEY})
    carried = re.search(r'name="filter" value="([^"]+)"', listing.text)
    assert carried and orjson.loads(html.unescape(carried.group(1))) == {"key": HOSTILE_KEY}
    assert 'name="key" value="evil&#x1b;[2J&#x1b;[H&lt;script&gt;' in listing.text
    # The JSON API is exact (JSON escapes what needs escaping).
    assert (await api.get(f"/api/v1/rows/{row}")).json()["ordering_key"] == HOSTILE_KEY


async def test_openapi_is_served_and_describes_every_endpoint(api: httpx.AsyncClient) -> None:
    answer = await api.get("/api/v1/openapi.json")
    assert answer.status_code == 200
    doc = answer.json()
    assert doc["openapi"].startswith("3.")
    paths = set(doc["paths"])
    for path in (
        "/api/v1/status",
        "/api/v1/dead",
        "/api/v1/blocked",
        "/api/v1/rows/{id}",
        "/api/v1/audit",
        "/api/v1/dead/requeue",
        "/api/v1/dead/discard",
        "/api/v1/replay",
        "/api/v1/pause",
        "/api/v1/resume",
    ):
        assert path in paths
    requeue = doc["paths"]["/api/v1/dead/requeue"]["post"]
    schema = requeue["requestBody"]["content"]["application/json"]["schema"]
    assert {"ids", "key", "topic", "since", "until", "all", "error"} <= set(schema["properties"])
    assert schema["additionalProperties"] is False
    assert requeue["security"] == [{"token": []}]


async def test_a_read_only_database_role_serves_the_read_pages(
    services: Services, make_settings: Any
) -> None:
    async with _roles_database(services) as (url, _owner, reader):
        admin = await asyncpg.connect(url)
        try:
            await migrations.migrate(admin, "public", "outbox")
            await admin.execute(
                "INSERT INTO outbox (topic, ordering_key, payload, dead_at, last_error)"
                " VALUES ('orders', 'k', 'x', now(), 'boom')"
            )
            await admin.execute(f"CREATE ROLE \"{reader}\" LOGIN PASSWORD 'pw-reader'")
            await admin.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA public TO "{reader}"')
            row = await admin.fetchval("SELECT id FROM outbox")
            before = await snapshot(admin)
            read_only_url = _as_role(url, reader, "pw-reader")
            async with client(
                make_settings(database_url=read_only_url, console_anonymous_read=True)
            ) as c:
                for path in ("/", "/dead", "/blocked", f"/rows/{row}", "/audit", "/replay"):
                    page = await c.get(path)
                    assert page.status_code == 200, (path, page.text)
                    assert 'id="read-only"' in page.text
                for path in ("status", "dead", "blocked", f"rows/{row}", "audit"):
                    assert (await c.get(f"/api/v1/{path}")).status_code == 200, path
            # With a token but a role that may only read, an action is refused, and says why.
            settings = make_settings(database_url=read_only_url, console_token=TOKEN)
            async with client(settings) as c:
                answer = await c.post("/api/v1/dead/requeue", json={"all": True}, headers=AUTH)
                assert answer.status_code == 403
                refusal = answer.json()["error"]
                assert "the console's database role may not do this" in refusal
                assert "permission denied for table outbox" in refusal
            assert await snapshot(admin) == before
        finally:
            await admin.close()


# --- The real process ----------------------------------------------------------------------------


async def test_the_console_command_serves_pages_and_the_api_over_http(
    conn: asyncpg.Connection, make_settings: Any, tmp_path: Path
) -> None:
    [row] = await dead_rows(conn, "orders", ["k"])
    port = free_port()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # file secrets, as for the other secrets
    env = {
        **settings_env(make_settings()),
        "OUTBOX_CONSOLE_PORT": str(port),
        "OUTBOX_CONSOLE_TOKEN_FILE": str(token_file),
        "OUTBOX_LOG_FORMAT": "json",
    }
    log_path = tmp_path / "console.log"
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "outbox_dispatcher",
            "console",
            env=env,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=10, headers=AUTH) as c:
            for _ in range(300):
                try:
                    status = await c.get("/api/v1/status")
                    break
                except httpx.TransportError:
                    assert process.returncode is None, log_path.read_text()
                    await asyncio.sleep(0.1)
            else:
                pytest.fail(f"the console never answered:\n{log_path.read_text()}")
            assert status.status_code == 200
            assert status.json()["totals"]["dead"] == 1
            assert "The last hour" in (await c.get("/")).text
            refused = await c.post(
                "/api/v1/dead/requeue", json={"ids": [row]}, headers={"authorization": ""}
            )
            assert refused.status_code == 401
            done = await c.post("/api/v1/dead/requeue", json={"ids": [row]}, headers=AUTH)
            assert done.json()["rows"] == 1
        assert await conn.fetchval("SELECT dead_at IS NULL FROM outbox WHERE id = $1", row)
        # SIGTERM: the console stops and exits 0.
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0, log_path.read_text()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    logged = log_path.read_text()
    assert TOKEN not in logged
    assert "console_starting" in logged


async def test_the_cli_filters_dead_rows_by_error_text_too(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """The error-text filter the console offers is the CLI's (`--error`), over the same SQL."""
    await dead_rows(conn, "alpha", ["a", "b"], error="MessageSizeTooLargeError: big")
    [other] = await dead_rows(conn, "alpha", ["c"], error="UnknownTopicOrPartitionError")
    settings = make_settings()
    listed = await cli(settings, "dead", "list", "--error", "toolarge", "--json")
    assert listed.code == 0, listed.err
    assert sorted(r["ordering_key"] for r in orjson.loads(listed.out)) == ["a", "b"]
    requeued = await cli(settings, "dead", "requeue", "--error", "TOOLARGE")
    assert requeued.code == 0 and "requeued 2 dead rows" in requeued.out
    still = await conn.fetch("SELECT id FROM outbox WHERE dead_at IS NOT NULL")
    assert [r["id"] for r in still] == [other]
    assert (await audits(conn))[-1] == {
        "command": "dead requeue",
        "filter": {"error": "TOOLARGE"},
        "rows": 2,
    }
