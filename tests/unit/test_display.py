"""Writer-controlled text is inert in every human output; JSON stays exact."""

from __future__ import annotations

from datetime import UTC, datetime

from outbox_dispatcher import display
from outbox_dispatcher.cli import tables
from outbox_dispatcher.operate import reads

FORGING_KEY = "line1\nid  event_id  topic  key\n999  fake-row  orders  admin"
CLEAR_SCREEN = "evil\x1b[2J\x1b[H\x1b[31mPWNED\x1b[0m"
HOSTILE = [
    CLEAR_SCREEN,
    "title\x1b]0;owned-title\x07x",
    FORGING_KEY,
    "cr\rOVERWRITE",
    "bidi\u202egnp.exe",
    "c1\x9bcsi",
    "sep\u2028line",
]


def _visible_controls(text: str) -> set[str]:
    return {c for c in text if c != "\n" and not c.isprintable()}


def test_inert_escapes_controls_escapes_and_bidi_and_keeps_plain_text() -> None:
    assert display.inert("orders-42 ключ") == "orders-42 ключ"
    assert display.inert(CLEAR_SCREEN) == "evil\\x1b[2J\\x1b[H\\x1b[31mPWNED\\x1b[0m"
    assert display.inert("a\nb\rc\td") == "a\\nb\\rc\\td"
    assert display.inert("bidi\u202egnp") == "bidi\\u202egnp"
    # A real backslash is doubled, so a key "a\\nb" never looks like a key with a newline.
    assert display.inert("a\\nb") == "a\\\\nb"
    for text in HOSTILE:
        assert display.inert(text).isprintable()


def _dead_row(key: str, topic: str | None = "orders", error: str = "boom") -> dict[str, object]:
    now = datetime(2026, 11, 30, tzinfo=UTC)
    return {
        "id": 1,
        "event_id": "76aa553a-e5b7-441c-830a-4b4a0a0348b3",
        "topic": topic,
        "ordering_key": key,
        "attempts": 1,
        "created_at": now,
        "dead_at": now,
        "last_error": error,
    }


def test_dead_list_table_cannot_clear_the_screen_or_forge_a_row() -> None:
    rows = [_dead_row(key, error="reason " + key) for key in HOSTILE]
    table = tables.dead_table(rows)
    lines = table.split("\n")
    assert len(lines) == 1 + len(HOSTILE)  # the header and one line per row: nothing forged
    assert not any(line.startswith("999") for line in lines)
    assert not _visible_controls(table)
    assert "evil\\x1b[2J" in table


def test_status_table_escapes_pause_notes_and_who() -> None:
    pause = reads.Pause(
        topic="orders",
        paused_at=datetime(2026, 11, 30, tzinfo=UTC),
        paused_by="ceo\x1b[31m",
        reason="smtp down\x1b[2J\x1b[H\x1b[32mALL GOOD\x1b[0m\nfake: line",
    )
    table = tables.as_table([reads.TopicStatus("orders", 1, 0, 0, 0, 1.0)], [pause])
    assert not _visible_controls(table)
    assert "fake: line" not in table.split("\n")
    assert table.split("\n")[-1].startswith("paused: topic orders since")
    # JSON stays exact.
    assert reads.as_json([], [pause])["pauses"] == [pause.as_json()]
    assert pause.as_json()["reason"] == pause.reason


def test_ages_are_for_people_in_the_table() -> None:
    assert [display.age_text(s) for s in (None, 2.44, 725, 11_040, 273_600.3)] == [
        "-",
        "2.4s",
        "12m05s",
        "3h04m",
        "3d04h",
    ]
