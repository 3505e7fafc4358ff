"""The console's safety (issue 22; walk-through findings N1, N3, N4, N5, N17): the Host check,
reads behind a login unless anonymous reading is chosen, server-side sessions that logout, expiry
and a new token end, a delay after failed logins, and a trusted proxy's user in the audit."""

from __future__ import annotations

import time
from typing import Any

import asyncpg
import pytest
from structlog.testing import capture_logs

from outbox_dispatcher.console import auth

from .test_console import AUTH, TOKEN, audits, client, csrf_of, dead_rows, log_in

pytestmark = pytest.mark.integration

SECRET_PAYLOAD = b'{"card": "4111-1111"}'


async def test_a_rebound_host_name_is_refused_before_anything_is_read(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N1: any Host was served, so a page that rebinds its own name to 127.0.0.1 could read
    keys, headers and errors through the operator's tunnel."""
    await dead_rows(conn, "orders", ["secret-key"])
    settings = make_settings(console_token=TOKEN, console_anonymous_read=True)
    async with client(settings) as c:
        for path in ("/api/v1/dead", "/dead", "/", "/login", "/api/v1/nope"):
            for host in ("attacker.example:9647", "attacker.example", "127.0.0.1.nip.io"):
                answer = await c.get(path, headers={"host": host, **AUTH})
                assert answer.status_code == 400, (path, host)
                assert "secret-key" not in answer.text
                assert "does not answer to the host name" in answer.text
        assert (await c.get("/api/v1/dead", headers={"host": "attacker.example"})).json() == {
            "error": "this console does not answer to the host name 'attacker.example': reach it"
            " by an allowed name (OUTBOX_CONSOLE_ALLOWED_HOSTS; by default 127.0.0.1, localhost"
            " or its own address)"
        }
        for host in ("127.0.0.1:9647", "localhost:9647", "LOCALHOST", "[::1]:9647"):
            assert (await c.get("/api/v1/dead", headers={"host": host})).status_code == 200, host
    named = make_settings(console_anonymous_read=True, console_allowed_hosts="console.example")
    async with client(named) as c:
        assert (await c.get("/", headers={"host": "console.example"})).status_code == 200
        assert (await c.get("/", headers={"host": "localhost"})).status_code == 400


async def test_reads_need_a_login_unless_anonymous_reading_is_chosen(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N5: reading was anonymous and not logged; with OUTBOX_CONSOLE_SHOW_PAYLOAD anyone who
    reached the port read payloads."""
    row = await conn.fetchval(
        "INSERT INTO outbox (topic, ordering_key, payload, dead_at, last_error)"
        " VALUES ('orders', 'k', $1, now(), 'boom') RETURNING id",
        SECRET_PAYLOAD,
    )
    settings = make_settings(console_token=TOKEN, console_show_payload=True)
    async with client(settings) as c:
        for path in ("/api/v1/status", "/api/v1/dead", f"/api/v1/rows/{row}", "/api/v1/audit"):
            refused = await c.get(path)
            assert refused.status_code == 401, path
            assert "log in to read this console" in refused.json()["error"]
        for path in ("/", "/dead", f"/rows/{row}", "/audit", "/blocked", "/rows"):
            page = await c.get(path, follow_redirects=False)
            assert (page.status_code, page.headers["location"]) == (303, "/login"), path
        with capture_logs() as logged:
            shown = await c.get(f"/api/v1/rows/{row}", headers=AUTH)
        assert "4111-1111" in shown.json()["payload"]["text"]
        assert {"event": "console_read", "path": f"/api/v1/rows/{row}"}.items() <= logged[0].items()
        assert logged[0]["identity"] == "token holder" and logged[0]["source"] == "bearer"
    # A read-only anonymous console, chosen explicitly: anyone reads, but never a payload (nor
    # a payload search), and no action.
    anonymous = make_settings(console_anonymous_read=True, console_show_payload=True)
    async with client(anonymous) as c:
        seen = await c.get(f"/api/v1/rows/{row}")
        assert seen.status_code == 200 and seen.json()["payload"] is None
        assert seen.json()["payload_shown"] is False
        assert "4111" not in (await c.get(f"/rows/{row}")).text
        assert (await c.get("/api/v1/rows?payload=4111")).status_code == 401
        acted = await c.post("/api/v1/dead/requeue", json={"all": True}, headers=AUTH)
        assert acted.status_code == 403


async def test_anonymous_viewers_see_no_action_buttons(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N17: a visitor who was not logged in saw every Pause, Resume, Requeue and Discard button,
    each leading to a 401."""
    await dead_rows(conn, "orders", ["a"])
    settings = make_settings(console_token=TOKEN, console_anonymous_read=True)
    async with client(settings) as c:
        for path in ("/", "/dead", "/dead/groups", "/blocked", "/replay"):
            page = await c.get(path)
            assert page.status_code == 200
            assert "/actions/confirm" not in page.text, path
            assert 'type="checkbox" form="act"' not in page.text, path
            assert 'id="not-logged-in"' in page.text
        await log_in(c)
        assert "/actions/confirm" in (await c.get("/dead")).text


async def test_logout_and_expiry_end_the_session_for_every_copy_of_its_cookie(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N3: the cookie was a stateless signed session: a copy taken before logout stayed valid
    for 8 hours."""
    await dead_rows(conn, "orders", ["a"])
    settings = make_settings(console_token=TOKEN)
    async with client(settings) as browser:
        await log_in(browser)
        assert (await browser.get("/api/v1/dead")).status_code == 200
        copied = dict(browser.cookies)
        csrf = csrf_of((await browser.get("/dead")).text)
        assert await conn.fetchval("SELECT count(*) FROM outbox_console_session") == 1
        out = await browser.post("/logout", data={"csrf": csrf})
        assert out.status_code == 200 and out.url.path == "/login"
    async with client(settings) as thief:
        thief.cookies.update(copied)
        assert (await thief.get("/api/v1/dead")).status_code == 401
        refused = await thief.post(
            "/actions/confirm", data={"csrf": csrf, "action": "pause", "topic": "orders"}
        )
        assert refused.status_code == 401
    assert await conn.fetchval("SELECT ended_at IS NOT NULL FROM outbox_console_session"), (
        "ended on the server"
    )
    # Expiry ends it too, and so does a new token.
    async with client(settings) as browser:
        await log_in(browser)
        assert (await browser.get("/api/v1/dead")).status_code == 200
        await conn.execute(
            "UPDATE outbox_console_session SET expires_at = now() - interval '1 second'"
            " WHERE ended_at IS NULL"
        )
        assert (await browser.get("/api/v1/dead")).status_code == 401
        await log_in(browser)
        cookies = dict(browser.cookies)
    renewed = make_settings(console_token="a-new-console-token-0123456789")
    async with client(renewed) as later:
        later.cookies.update(cookies)
        assert (await later.get("/api/v1/dead")).status_code == 401


async def test_failed_logins_are_slowed_down_per_client(
    conn: asyncpg.Connection, make_settings: Any, monkeypatch: Any
) -> None:
    """N4: 200 wrong tokens in 8.4 s all got 401 at once, with no delay and no lockout."""
    monkeypatch.setattr(auth, "FAILED_LOGIN_DELAY", 0.3)
    monkeypatch.setattr(auth, "LOCKOUT_BASE", 30.0)
    async with client(make_settings(console_token=TOKEN)) as c:
        form = await c.get("/login")
        started = time.monotonic()
        wrong = await c.post("/login", data={"csrf": csrf_of(form.text), "token": "guess-1" * 3})
        assert wrong.status_code == 401 and time.monotonic() - started >= 0.3
        # Right away, even the right token is not tried: the client waits first.
        locked = await c.post("/login", data={"csrf": csrf_of(form.text), "token": TOKEN})
        assert locked.status_code == 429
        assert 0 < int(locked.headers["retry-after"]) <= 30
        assert "Too many failed logins" in locked.text
        assert (await c.get("/api/v1/dead")).status_code == 401
    monkeypatch.setattr(auth, "LOCKOUT_BASE", 0.01)
    async with client(make_settings(console_token=TOKEN)) as c:
        form = await c.get("/login")
        await c.post("/login", data={"csrf": csrf_of(form.text), "token": "guess-2" * 3})
        time.sleep(0.05)  # noqa: ASYNC251 - past the (short) lockout
        ok = await c.post("/login", data={"csrf": csrf_of(form.text), "token": TOKEN})
        assert ok.status_code == 200 and ok.url.path == "/"


async def test_a_trusted_proxys_user_is_the_person_and_is_in_the_audit(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """Identity from a named proxy: X-Forwarded-User (and X-Forwarded-For) from its address
    only; recorded in the audit and in a pause's paused_by."""
    ids = await dead_rows(conn, "orders", ["a", "b"])
    # httpx's ASGI transport connects from 127.0.0.1: that is "the proxy" here.
    proxied = make_settings(console_trusted_proxies="127.0.0.1/32")
    headers = {"x-forwarded-user": "alice@example.com", "x-forwarded-for": "203.0.113.9"}
    async with client(proxied, **headers) as c:
        page = await c.get("/dead")
        assert page.status_code == 200 and 'id="who">alice@example.com<' in page.text
        done = await c.post("/api/v1/dead/requeue", json={"ids": [ids[0]]})
        assert done.status_code == 200 and done.json()["rows"] == 1
        paused = await c.post("/api/v1/pause", json={"topic": "orders", "reason": "why"})
        assert paused.status_code == 200
    record = (await c_audit(conn))[0]
    assert (record["identity"], record["identity_source"]) == ("alice@example.com", "proxy")
    assert (await audits(conn))[0]["filter"]["http_client"] == "203.0.113.9"
    assert (await conn.fetchval("SELECT paused_by FROM outbox_paused")).startswith(
        "alice@example.com via console as "
    )
    # From an address that is not the proxy, the header means nothing.
    elsewhere = make_settings(console_trusted_proxies="10.0.0.1")
    async with client(elsewhere, **headers) as c:
        assert (await c.get("/api/v1/dead")).status_code == 401
        refused = await c.post("/api/v1/dead/requeue", json={"ids": [ids[1]]})
        assert refused.status_code == 401


async def c_audit(conn: asyncpg.Connection) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        "SELECT identity, identity_source FROM outbox_operator_audit ORDER BY id"
    )
    return [dict(r) for r in rows]


async def test_a_console_nobody_could_use_refuses_to_start(make_settings: Any) -> None:
    from outbox_dispatcher import errors
    from outbox_dispatcher.console import create_app

    with pytest.raises(errors.ConfigurationError, match="would serve nobody"):
        create_app(make_settings(), sample=False)
