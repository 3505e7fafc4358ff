"""What the console shows (issue 22; walk-through findings N8, N9, N13-N21): the overview shows
everything `status` shows and reloads itself, charts with axes, destructive confirmations that
look destructive and say what they do to which rows, and the smaller findings."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import asyncpg
import orjson
import pytest

from outbox_dispatcher.console import history
from outbox_dispatcher.store import DispatchStore, Statements

from .helpers import cli
from .test_console import AUTH, TOKEN, client, csrf_of, dead_rows, log_in

pytestmark = pytest.mark.integration

OWNER = "worker-7.example:4242:ab12cd"


async def beat(conn: asyncpg.Connection, published: int, dead: int) -> None:
    """A dispatcher's heartbeat, as registry.heartbeat writes it."""
    store = DispatchStore(conn, Statements.for_table("public", "outbox"))
    await store.dispatcher_beat(
        owner=OWNER,
        dead_letter_policy="block",
        version=97,
        totals=(published, dead),
    )


async def test_the_overview_shows_everything_status_shows(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N8: parked rows, the waiting/in-flight split and the heartbeat age were missing; a
    forgotten pause could not be seen. The same report as `status --json`, and each dispatcher's
    host, version, policy and rows in flight."""
    await conn.execute(
        "INSERT INTO outbox (topic, payload, created_at)"
        " SELECT 'held', 'x', now() - interval '3 days' FROM generate_series(1, 20)"
    )
    await conn.execute(
        "INSERT INTO outbox (topic, payload) SELECT 'busy', 'x' FROM generate_series(1, 4)"
    )
    # In flight: each row's claim (a row without a key is its own work) is the dispatcher's.
    await conn.execute(
        "INSERT INTO outbox_work (keyless, ordering_key, head_id, claim_first, claim_token,"
        " claim_owner, claim_expires_at)"
        " SELECT true, id::text, id, id, gen_random_uuid(), $1, now() + interval '1 minute'"
        "   FROM outbox WHERE topic = 'busy'",
        OWNER,
    )
    await beat(conn, 10, 0)
    settings = make_settings(console_token=TOKEN)
    paused = await cli(settings, "pause", "--topic", "held", "--reason", "hold for the migration")
    assert paused.code == 0, paused.err
    status = await cli(settings, "status", "--json")
    async with client(settings, **AUTH) as c:
        report = (await c.get("/api/v1/status")).json()
        page = await c.get("/")
    expected = orjson.loads(status.out)
    ages = ("oldest_pending_age_seconds", "oldest_parked_age_seconds")

    def timeless(found: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in found.items() if k not in ages}

    assert timeless(report["totals"]) == timeless(expected["totals"])
    assert [timeless(t) for t in report["topics"]] == [timeless(t) for t in expected["topics"]]
    assert report["totals"]["oldest_parked_age_seconds"] >= 0  # 3 days old rows: not believed
    assert report["totals"]["parked"] == 20 and report["totals"]["in_flight"] == 4
    [dispatcher] = report["dispatchers"]
    assert (dispatcher["host"], dispatcher["version"], dispatcher["in_flight"]) == (
        "worker-7.example",
        97,
        4,
    )
    cards = re.search(r'<div class="cards" id="totals">(.*?)</div>\n\n', page.text, re.S)
    assert cards
    assert '<div class="value">4</div><div class="label">in flight</div>' in cards.group(1)
    assert '<div class="value">20</div><div class="label">parked, oldest ' in cards.group(1)
    assert "1 dispatcher alive (last heartbeat" in page.text  # N20: no "dispatcher(s)"
    row = re.search(r"<tr><td class=\"mono\">worker-7.example</td>(.*?)</tr>", page.text)
    assert row and "<td>97</td>" in row.group(1) and "block" in row.group(1)
    assert "hold for the migration" in page.text and "s-paused" in page.text
    topics = re.search(r'<table id="topics">(.*?)</table>', page.text, re.S)
    assert topics
    held = re.search(r'<td class="mono">held</td>(.*?)</tr>', topics.group(1), re.S)
    assert held and re.search(r'class="num">20 \(', held.group(1)), "parked, with its age"


async def test_the_overview_reloads_itself_and_charts_with_axes(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N18: no refresh; one chart without axes, each line on its own scale; published/s and
    dead/s not charted."""
    await conn.execute(
        "INSERT INTO outbox (topic, payload) SELECT 'a', 'x' FROM generate_series(1, 5)"
    )
    settings = make_settings(console_token=TOKEN, console_sample_seconds=1)
    samples = history.History()
    await beat(conn, 100, 1)
    await history.sample_once(settings, samples)
    time.sleep(0.2)  # noqa: ASYNC251 - a span between the heartbeats
    await beat(conn, 400, 7)
    await history.sample_once(settings, samples)
    [rate] = samples.rates()
    assert rate.published_per_second and rate.published_per_second > 300
    assert rate.dead_per_second and rate.dead_per_second > 5
    from outbox_dispatcher.console.pages import overview_charts

    backlog, flow, lag = overview_charts(samples, time.time())
    assert "Backlog (rows)" in backlog and "Rows per second" in flow and "Lag" in lag
    for drawn in (backlog, flow, lag):
        assert 'class="grid"' in drawn and "time (UTC)" in drawn
    assert flow.count("<circle") == 2 and "■ published" in flow and "/s<" in flow  # one rate each
    async with client(settings, **AUTH) as c:
        page = await c.get("/")
        assert '<meta http-equiv="refresh" content="5">' in page.text
        assert (await c.get("/?refresh=off")).text.count('http-equiv="refresh"') == 0


async def test_a_destructive_confirmation_looks_destructive_and_says_what_it_does(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N13: "This would discard 100019 dead rows. Filter: {"all":true} [Yes, discard]" looked
    like pausing a topic: no colour, no typed confirmation, no sample, the filter as raw JSON."""
    ids = await dead_rows(conn, "orders", [f"k{i}" for i in range(12)], error="no such topic")
    async with client(make_settings(console_token=TOKEN)) as c:
        await log_in(c)
        csrf = csrf_of((await c.get("/dead")).text)
        discard = await c.post(
            "/actions/confirm", data={"csrf": csrf, "action": "dead-discard", "scope": "all"}
        )
        text = discard.text
        assert '<div class="danger-zone" id="confirmation">' in text
        assert "This would discard 12 dead rows." in text
        assert "cannot be brought back" in text
        assert 'name="typed" id="typed"' in text
        assert '<button id="confirm" class="danger">Yes, discard 12 rows</button>' in text
        assert f"ids up to {max(ids)}" in text and 'id="bound"' in text
        sample = re.search(r'<table id="sample"(.*?)</table>', text, re.S)
        assert sample and sample.group(1).count('href="/rows/') == 5
        assert "The first 5 rows of 12" in text
        assert '<dt>all</dt><dd class="mono">yes</dd>' in text  # not raw JSON
        pause = await c.post(
            "/actions/confirm", data={"csrf": csrf, "action": "pause", "topic": "orders"}
        )
        assert "danger-zone" not in pause.text and 'class="danger"' not in pause.text
        requeue = await c.post(
            "/actions/confirm", data={"csrf": csrf, "action": "dead-requeue", "scope": "all"}
        )
        assert "danger-zone" not in requeue.text and "Yes, requeue 12 rows" in requeue.text


async def test_pauses_from_the_console_carry_a_reason_and_who(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N14: per-topic pauses had no reason field; resume had one that did nothing."""
    await conn.execute("INSERT INTO outbox (topic, payload) VALUES ('orders', 'x')")
    async with client(make_settings(console_token=TOKEN)) as c:
        await log_in(c)
        overview = await c.get("/")
        csrf = csrf_of(overview.text)
        ask = await c.post(
            "/actions/confirm", data={"csrf": csrf, "action": "pause", "topic": "orders"}
        )
        assert 'name="reason"' in ask.text
        body = re.search(r'name="body" value="([^"]+)"', ask.text)
        request = re.search(r'name="request" value="([^"]+)"', ask.text)
        assert body and request
        await c.post(
            "/actions/run",
            data={
                "csrf": csrf,
                "action": "pause",
                "body": body.group(1).replace("&#34;", '"'),
                "request": request.group(1),
                "reason": "broker migration, back at 14:00",
            },
        )
        paused = await conn.fetchrow("SELECT reason, paused_by FROM outbox_paused")
        assert paused["reason"] == "broker migration, back at 14:00"
        assert paused["paused_by"].startswith("token holder (session ")
        resume = await c.post(
            "/actions/confirm", data={"csrf": csrf, "action": "resume", "topic": "orders"}
        )
        assert 'name="reason"' not in resume.text
        whole = await c.get("/")
        form = re.search(r"<h2>The whole table</h2>\s*<form(.*?)</form>", whole.text, re.S)
        assert form and 'name="reason"' not in form.group(1)


async def test_the_blocked_keys_page_shows_why_and_offers_the_action(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N15: the head row's (empty) error was shown instead of the dead row's; no action; text
    about "an interrupted replay of version 0.1"."""
    [dead] = await dead_rows(conn, "orders", ["kb"], error="topic 'ow-missing' does not exist")
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ('orders', 'kb', 'x')"
    )
    settings = make_settings(console_token=TOKEN, dead_letter_policy="block")
    async with client(settings) as c:
        await log_in(c)
        page = await c.get("/blocked")
        assert (
            f'<a href="/rows/{dead}">dead row {dead}</a>: topic &#39;ow-missing&#39;' in page.text
        )
        assert "Requeue its dead rows…" in page.text
        assert "version 0.1" not in page.text
        carried = re.search(r'name="filter" value="([^"]+)"', page.text)
        assert carried and orjson.loads(carried.group(1).replace("&#34;", '"')) == {"key": "kb"}
        api = (await c.get("/api/v1/blocked")).json()["keys"]
        assert api[0]["error"] == "topic 'ow-missing' does not exist"


async def test_the_row_page_leads_somewhere_and_says_what_it_is(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N16: a routed row showed an empty topic, "1 bytes", a dead row a next attempt time, and
    there was no way to the key's other rows."""
    row = await conn.fetchval(
        "INSERT INTO outbox (topic, ordering_key, payload, headers, dead_at, last_error)"
        " VALUES (NULL, 'kr', 'x', '{\"aggregate\": \"ok\"}', now(), 'boom') RETURNING id"
    )
    settings = make_settings(console_token=TOKEN, topic_template="ow-ev.{aggregate}")
    async with client(settings, **AUTH) as c:
        page = (await c.get(f"/rows/{row}")).text
    assert '<dd class="mono" id="topic">(routed) → ow-ev.ok</dd>' in page
    assert "1 byte;" in page and "1 bytes" not in page
    assert "next attempt" not in page
    assert 'href="/rows?key=kr">this key\'s rows</a>' in page
    assert 'href="/dead?key=kr">its dead rows</a>' in page


async def test_routed_rows_show_under_the_topic_they_go_to(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N21: a row routed to ow-ev.ok showed as "(routed) published 1"; ow-ev.ok was nowhere."""
    await conn.execute(
        "INSERT INTO outbox (topic, payload, headers, published_at) VALUES"
        " (NULL, 'x', '{\"aggregate\": \"ok\"}', now()),"
        " (NULL, 'x', '{\"aggregate\": \"ok\"}', NULL),"
        " (NULL, 'x', '{\"aggregate\": \"bad\"}', now()),"
        " (NULL, 'x', '{}', NULL)"
    )
    settings = make_settings(console_token=TOKEN, topic_template="ow-ev.{aggregate}")
    async with client(settings, **AUTH) as c:
        found = (await c.get("/api/v1/routed")).json()["destinations"]
        page = await c.get("/routed")
        dead = (await c.get("/api/v1/rows")).json()["rows"]
    assert found[0]["topic"] == "ow-ev.ok" and (found[0]["pending"], found[0]["published"]) == (
        1,
        1,
    )
    assert {(d["topic"], d["pending"], d["published"]) for d in found[1:]} == {
        ("ow-ev.bad", 0, 1),
        (None, 1, 0),
    }
    [unroutable] = [d for d in found if d["topic"] is None]
    assert "lacks header(s) aggregate" in unroutable["unroutable"]
    assert '<td class="mono">ow-ev.ok</td>' in page.text
    assert {r.get("routed_to") for r in dead} >= {"ow-ev.ok", "ow-ev.bad"}


async def test_error_pages_are_the_clis_words_with_a_way_back(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N19: an unknown page answered a bare "Not Found" (no navigation, no JSON under /api/)."""
    async with client(make_settings(console_token=TOKEN), **AUTH) as c:
        page = await c.get("/nope")
        assert page.status_code == 404 and 'href="/dead">Dead rows</a>' in page.text
        assert "no page /nope" in page.text
        api = await c.get("/api/v1/nope")
        assert api.status_code == 404 and api.json() == {"error": "no page /api/v1/nope"}
        wrong = await c.delete("/api/v1/dead")
        assert (
            wrong.status_code == 405 and "is not how /api/v1/dead is used" in wrong.json()["error"]
        )
        bad = await c.get("/audit", params={"since": "yesterday"})
        assert "&#39;yesterday&#39; is not an ISO-8601 time" in bad.text
        assert 'href="/audit" id="back"' in bad.text


async def test_the_audit_page_reads_plainly_and_filters(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N20: filters double-escaped, dates on four lines, no time or role filter, no link to the
    affected rows; "reason": null in pause filters."""
    ids = await dead_rows(conn, "orders", ["a", "b"])
    settings = make_settings(console_token=TOKEN)
    async with client(settings, **AUTH) as c:
        await c.post("/api/v1/dead/requeue", json={"ids": ids})
        await c.post("/api/v1/pause", json={"topic": "orders", "reason": "smtp down\x1b[2J"})
        page = (await c.get("/audit")).text
        assert "reason=smtp down" in page and "\\\\u001b" not in page
        assert '<span class="ctl" title="control character U+001B">\\x1b</span>[2J' in page
        assert (
            f'href="/rows?from_id={ids[0]}&amp;to_id={ids[1]}">ids {ids[0]}\u2013{ids[1]}</a>'
            in page
        )
        assert "<time datetime=" in page
        done = (await c.get("/api/v1/audit", params={"status": "done"})).json()["actions"]
        assert len(done) == 2
        assert (await c.get("/api/v1/audit", params={"who": "nobody"})).json()["actions"] == []
        mine = (await c.get("/api/v1/audit", params={"who": "token holder"})).json()["actions"]
        assert len(mine) == 2
        since = (await c.get("/api/v1/audit", params={"since": "2999-01-01T00:00:00Z"})).json()
        assert since["actions"] == []
    filters = await conn.fetch("SELECT filter::text FROM outbox_operator_audit ORDER BY id")
    assert "null" not in filters[1]["filter"]


async def test_dead_list_says_when_nothing_matches_and_check_fails_on_a_misspelt_variable(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N9: `dead list --key nosuch` printed only its header line. Also: `check` exited 0 with a
    misspelt OUTBOX_* variable."""
    settings = make_settings()
    nothing = await cli(settings, "dead", "list")
    assert nothing.code == 0 and nothing.out.strip() == "there are no dead rows"
    await dead_rows(conn, "orders", ["a"])
    none = await cli(settings, "dead", "list", "--key", f"nosuch-{uuid.uuid4().hex[:6]}")
    assert none.code == 0 and none.out.strip() == "no dead row matches the filter"
    typo = await cli(settings, "check", env={"OUTBOX_DEADLETTER_POLICY": "block"})
    assert typo.code == 1 and "problem: OUTBOX_DEADLETTER_POLICY is not a setting" in typo.err
