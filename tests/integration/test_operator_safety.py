"""The operator's side at 3 a.m.: inert output, no secret fragments, commands that cannot leave a
mess, status that tells the truth. Each command runs as a real `python -m outbox_dispatcher`."""

from __future__ import annotations

from typing import Any

import asyncpg
import orjson
import pytest

from outbox_dispatcher.settings import Settings

from .helpers import cli

pytestmark = pytest.mark.integration

CLEAR_SCREEN = "evil\x1b[2J\x1b[H\x1b[31mPWNED\x1b[0m"
FORGED_ROW = "line1\nid  event_id  topic  key\n999  fake-row  orders  admin"
HOSTILE_KEYS = [
    CLEAR_SCREEN,
    "title\x1b]0;owned-title\x07x",
    FORGED_ROW,
    "cr\rOVERWRITE",
    "bidi\u202egnp.exe",
]


def _settings(make_settings: Any, **overrides: Any) -> Settings:
    settings: Settings = make_settings(**overrides)
    return settings


def _raw_controls(text: str) -> set[str]:
    return {c for c in text if c != "\n" and not c.isprintable()}


async def _dead_rows(conn: asyncpg.Connection, keys: list[str], topic: str) -> None:
    await conn.executemany(
        "INSERT INTO outbox (topic, ordering_key, payload, dead_at, last_error)"
        " VALUES ($1, $2, 'x', now(), $3)",
        [(topic, key, "no route: " + key) for key in keys],
    )


async def test_dead_list_prints_hostile_keys_inert_and_json_exact(
    conn: asyncpg.Connection, make_settings: Any, topic: str
) -> None:
    await _dead_rows(conn, HOSTILE_KEYS, topic)
    settings = _settings(make_settings)
    listed = await cli(settings, "dead", "list")
    assert listed.code == 0, listed.err
    assert not _raw_controls(listed.out)
    lines = listed.out.splitlines()
    assert len(lines) == 1 + len(HOSTILE_KEYS)  # no forged row
    assert not any(line.startswith("999") for line in lines)
    assert "evil\\x1b[2J\\x1b[H\\x1b[31mPWNED" in listed.out
    exact = await cli(settings, "dead", "list", "--json")
    assert sorted(r["ordering_key"] for r in orjson.loads(exact.out)) == sorted(HOSTILE_KEYS)


async def test_status_prints_a_hostile_pause_note_inert(
    conn: asyncpg.Connection, make_settings: Any, topic: str
) -> None:
    settings = _settings(make_settings)
    reason = "smtp down\x1b[2J\x1b[H\x1b[32mALL GOOD\x1b[0m\nfake: line"
    paused = await cli(
        settings, "pause", "--topic", topic, "--reason", reason, env={"LOGNAME": "ceo\x1b[31m"}
    )
    assert paused.code == 0, paused.err
    shown = await cli(settings, "status")
    assert shown.code == 0, shown.err
    assert not _raw_controls(shown.out)
    assert "fake: line" not in shown.out.splitlines()
    assert "ALL GOOD" in shown.out  # escaped, not hidden
    exact = orjson.loads((await cli(settings, "status", "--json")).out)
    assert exact["pauses"][0]["reason"] == reason
