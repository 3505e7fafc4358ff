"""The console at scale (issue 22; walk-through findings N11, N16 in part): keyset paging with
totals and sort in pages and API, search by event id, key, header and payload text (bounded
scans), dead rows grouped by cause with an action per group, and published rows to browse: was
event X sent, when, how often."""

from __future__ import annotations

import html
import re
from typing import Any

import asyncpg
import pytest

from .test_console import AUTH, TOKEN, client, csrf_of, log_in

pytestmark = pytest.mark.integration


async def test_dead_rows_page_by_keyset_with_a_total_in_four_orders(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """N11: lists stopped at 1,000 rows with no paging, no total, no sort."""
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, dead_at, last_error)"
        " SELECT CASE WHEN g % 2 = 0 THEN 'even' ELSE 'odd' END, 'k' || g, 'x',"
        "        now() - (g % 7) * interval '1 minute', 'boom ' || g"
        "   FROM generate_series(1, 250) g"
    )
    ids = [r["id"] for r in await conn.fetch("SELECT id FROM outbox ORDER BY id")]
    by_death = [r["id"] for r in await conn.fetch("SELECT id FROM outbox ORDER BY dead_at, id")]
    async with client(make_settings(console_token=TOKEN), **AUTH) as c:

        async def walk(sort: str, **filters: str) -> list[int]:
            seen: list[int] = []
            params: dict[str, Any] = {"sort": sort, "limit": 100, **filters}
            while True:
                page = (await c.get("/api/v1/dead", params=params)).json()
                assert page["total"] == (250 if not filters else 125)
                seen += [r["id"] for r in page["rows"]]
                if page["next"] is None:
                    return seen
                params["after"] = page["next"]

        assert await walk("id") == ids
        assert await walk("-id") == ids[::-1]
        assert await walk("dead_at") == by_death
        assert await walk("-dead_at") == by_death[::-1]
        odd_topic = await walk("id", topic="odd")
        assert len(odd_topic) == 125 and odd_topic == sorted(odd_topic)
        # Back from the third page: the second one again, then the first (which has no
        # previous page).
        first = (await c.get("/api/v1/dead", params={"limit": 100})).json()
        second = (await c.get("/api/v1/dead", params={"limit": 100, "after": first["next"]})).json()
        third = (await c.get("/api/v1/dead", params={"limit": 100, "after": second["next"]})).json()
        assert len(third["rows"]) == 50 and third["next"] is None
        back = (
            await c.get("/api/v1/dead", params={"limit": 100, "before": third["previous"]})
        ).json()
        assert [r["id"] for r in back["rows"]] == [r["id"] for r in second["rows"]]
        start = (
            await c.get("/api/v1/dead", params={"limit": 100, "before": back["previous"]})
        ).json()
        assert [r["id"] for r in start["rows"]] == ids[:100] and start["previous"] is None
        bad = await c.get("/api/v1/dead", params={"sort": "dead_at", "after": "nonsense"})
        assert bad.status_code == 400 and "not a cursor" in bad.json()["error"]
        assert (await c.get("/api/v1/dead", params={"sort": "key"})).status_code == 400
        # The page: its total, and links to the next page that keep filter and order.
        page = await c.get("/dead", params={"topic": "odd", "sort": "-dead_at", "limit": 50})
        assert 'id="total">125 rows match<' in page.text
        nxt = re.search(r'href="/dead\?([^"]+)" id="next"', page.text)
        assert nxt and "topic=odd" in nxt.group(1) and "sort=-dead_at" in nxt.group(1)
        following = await c.get("/dead?" + html.unescape(nxt.group(1)))
        assert following.status_code == 200 and 'id="previous"' in following.text
        assert 'name="dead_since"' in page.text and 'name="keyless"' in page.text  # N12


async def test_dead_rows_group_by_cause_with_an_action_per_group(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    """With 100k dead rows the first question is how many distinct causes: topic, cause, count,
    oldest, and a requeue or discard per group."""
    await conn.execute(
        "INSERT INTO outbox (topic, payload, dead_at, last_error)"
        " SELECT 't', 'x', now() - g * interval '1 second',"
        "        CASE WHEN g <= 30 THEN 'the record is ' || (1000000 + g) || ' bytes, too large'"
        "             ELSE 'topic ''gone-' || g || ''' does not exist' END"
        "   FROM generate_series(1, 40) g"
    )
    await conn.execute(
        "INSERT INTO outbox (topic, payload, dead_at, last_error)"
        " VALUES ('u', 'x', now(), 'the record is 5 bytes, too large')"
    )
    async with client(make_settings(console_token=TOKEN)) as c:
        await log_in(c)
        found = (await c.get("/api/v1/dead/groups")).json()
        shapes = [(g["topic"], g["cause"], g["rows"]) for g in found["groups"]]
        assert shapes == [
            ("t", "the record is # bytes, too large", 30),
            ("t", "topic 'gone-#' does not exist", 10),
            ("u", "the record is # bytes, too large", 1),
        ]
        assert found["total_groups"] == 3
        assert found["groups"][0]["sample_error"].startswith("the record is 10000")
        page = await c.get("/dead/groups")
        assert 'id="total-groups">3 causes<' in page.text
        # The group's rows, then its action: only those rows.
        listed = await c.get(
            "/api/v1/dead", params={"topic": "t", "cause": "topic 'gone-#' does not exist"}
        )
        assert listed.json()["total"] == 10
        carried = re.findall(r'name="filter" value="([^"]+)"', page.text)
        group = html.unescape(carried[1])
        csrf = csrf_of(page.text)
        ask = await c.post(
            "/actions/confirm",
            data={"csrf": csrf, "action": "dead-requeue", "scope": "matching", "filter": group},
        )
        assert "This would requeue 10 dead rows." in ask.text
    assert await conn.fetchval("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL") == 41, (
        "asking changes nothing"
    )


async def test_rows_are_found_by_event_id_key_header_and_payload_in_bounded_scans(
    conn: asyncpg.Connection, make_settings: Any, monkeypatch: Any
) -> None:
    """N16: nothing searched by event id; published rows could not be browsed at all."""
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, headers, published_at)"
        " SELECT 'orders', 'k-' || (g % 10), convert_to('{\"order\": ' || g || '}', 'UTF8'),"
        "        jsonb_build_object('traceparent', '00-trace-' || g), now()"
        "   FROM generate_series(1, 300) g"
    )
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, dead_at, last_error)"
        " VALUES ('orders', 'k-3', 'x', now(), 'boom')"
    )
    wanted = await conn.fetchrow(
        "SELECT id, event_id FROM outbox WHERE payload = convert_to('{\"order\": 42}', 'UTF8')"
    )
    from outbox_dispatcher.operate import listings

    monkeypatch.setattr(listings, "ROWS_WINDOW", 100)  # pages scan 100 ids: several windows
    settings = make_settings(console_token=TOKEN, console_show_payload=True)
    async with client(settings, **AUTH) as c:
        # By event id: the unique index, whatever the window.
        by_event = await c.get("/api/v1/rows", params={"event_id": str(wanted["event_id"])})
        assert [r["id"] for r in by_event.json()["rows"]] == [wanted["id"]]
        assert by_event.json()["next_before"] is None
        # By key, newest first, window by window until the scan has covered every id.
        seen: list[int] = []
        params: dict[str, Any] = {"key": "k-3"}
        while True:
            page = (await c.get("/api/v1/rows", params=params)).json()
            seen += [r["id"] for r in page["rows"]]
            if page["next_before"] is None:
                break
            params["before"] = page["next_before"]
        assert len(seen) == 31 and seen == sorted(seen, reverse=True)
        dead_first = (await c.get("/api/v1/rows", params={"key": "k-3", "state": "dead"})).json()
        assert len(dead_first["rows"]) == 1
        # A header's "name=value" (any case), a payload's bytes.
        traced = (await c.get("/api/v1/rows", params={"header": "TRACEPARENT=00-trace-42"})).json()
        scanned = traced
        while not scanned["rows"] and scanned["next_before"]:
            scanned = (
                await c.get(
                    "/api/v1/rows",
                    params={"header": "traceparent=00-trace-42", "before": scanned["next_before"]},
                )
            ).json()
        assert [r["id"] for r in scanned["rows"]][-1] == wanted["id"]
        paid = (await c.get("/api/v1/rows", params={"payload": '"order": 42}'})).json()
        hits = paid["rows"]
        while paid["next_before"]:
            paid = (
                await c.get(
                    "/api/v1/rows",
                    params={"payload": '"order": 42}', "before": paid["next_before"]},
                )
            ).json()
            hits += paid["rows"]
        assert [r["id"] for r in hits] == [wanted["id"]]
        page = await c.get("/rows", params={"key": "k-3"})
        assert 'id="next"' in page.text and "search older ids" in page.text
        # The search box: a row id, an event id, a key.
        assert (await c.get("/find", params={"q": str(wanted["id"])})).url.path == (
            f"/rows/{wanted['id']}"
        )
        assert (await c.get("/find", params={"q": str(wanted["event_id"])})).url.path == (
            f"/rows/{wanted['id']}"
        )
        assert (await c.get("/find", params={"q": "k-3"})).url.query == b"key=k-3"
        missing = await c.get("/events/00000000-0000-0000-0000-000000000000")
        assert missing.status_code == 404 and "no row has event id" in missing.text


async def test_a_row_says_whether_its_event_was_sent_when_and_how_often(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    row = await conn.fetchval(
        "INSERT INTO outbox (topic, payload, published_at) VALUES ('orders', 'x', now())"
        " RETURNING id"
    )
    async with client(make_settings(console_token=TOKEN), **AUTH) as c:
        first = (await c.get(f"/api/v1/rows/{row}")).json()
        assert (first["state"], first["published_times"], first["replays"]) == ("published", 1, 0)
        replayed = await c.post("/api/v1/replay", json={"from_id": row, "to_id": row})
        assert replayed.json()["rows"] == 1
        pending = (await c.get(f"/api/v1/rows/{row}")).json()
        assert (pending["state"], pending["published_times"]) == ("pending", 1)
        await conn.execute("UPDATE outbox SET published_at = now() WHERE id = $1", row)
        again = await c.get(f"/rows/{row}")
        assert "sent 2 times (1 replay)" in again.text
        event = (await c.get(f"/api/v1/rows/{row}")).json()["event_id"]
        assert (await c.get(f"/events/{event}")).url.path == f"/rows/{row}"
