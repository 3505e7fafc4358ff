from __future__ import annotations

import logging

import orjson
import pytest
import structlog

from outbox_dispatcher import logs
from outbox_dispatcher.logs import RepeatFilter


def record(name: str, msg: str, created: float) -> logging.LogRecord:
    r = logging.LogRecord(name, logging.ERROR, __file__, 1, msg, None, None)
    r.created = created
    return r


def test_client_library_repeats_pass_once_per_window_with_a_count() -> None:
    f = RepeatFilter(("aiokafka",), window_seconds=30)
    assert f.filter(record("aiokafka.client", "Unable to update metadata from %s", 0.0))
    assert not f.filter(record("aiokafka.client", "Unable to update metadata from %s", 0.1))
    assert not f.filter(record("aiokafka.client", "Unable to update metadata from %s", 10))
    later = record("aiokafka.client", "Unable to update metadata from %s", 31)
    assert f.filter(later)
    assert later.suppressed_repeats == 2  # type: ignore[attr-defined]
    assert f.filter(record("aiokafka.client", "another message", 31.1))


def test_our_own_logs_are_never_suppressed() -> None:
    f = RepeatFilter(("aiokafka",))
    assert all(f.filter(record("outbox_dispatcher.x", "same", 0.0)) for _ in range(5))


def test_json_lines_for_our_logs_and_the_client_libraries(
    capsys: pytest.CaptureFixture[str],
) -> None:
    try:
        logs.configure("json", "INFO")
        structlog.get_logger("outbox_dispatcher.test").info(
            "batch_settled", rows=3, event_id="e-1", topic="orders", duration_ms=1.5
        )
        logging.getLogger("aiokafka.conn").warning("Unable to connect to %s", "broker:9092")
        logging.getLogger("asyncpg.pool").info("chatty at INFO, hidden")
        lines = capsys.readouterr().err.splitlines()
    finally:
        logs.configure("console", "INFO")  # as tests/conftest.py has it
    ours, theirs = (orjson.loads(line) for line in lines)  # exactly two lines, each one object
    assert ours["event"] == "batch_settled"
    assert (ours["rows"], ours["event_id"], ours["topic"]) == (3, "e-1", "orders")
    assert {"level", "logger", "timestamp"} <= ours.keys()
    assert theirs["event"] == "Unable to connect to broker:9092"
    assert (theirs["level"], theirs["logger"]) == ("warning", "aiokafka.conn")


def test_console_format_escapes_control_characters_in_every_field(
    capsys: pytest.CaptureFixture[str],
) -> None:
    try:
        logs.configure("console", "INFO")
        structlog.get_logger("outbox_dispatcher.test").error(
            "dead_lettered", ordering_key="ckey\x1b[41mRED\n999 forged", reason="r\u202egnp"
        )
        err = capsys.readouterr().err
    finally:
        logs.configure("console", "INFO")
    assert "\x1b[41m" not in err and "\u202e" not in err
    assert err.count("\n") == 1  # the key's newline forged no second line
    # Escaped, once or (inside the renderer's repr of a value with spaces) twice.
    assert "ckey\\x1b[41mRED" in err.replace("\\\\", "\\")
    assert "r\\u202egnp" in err


def test_aiokafkas_topic_not_in_metadata_is_not_logged_as_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    try:
        logs.configure("json", "INFO")
        logging.getLogger("aiokafka.cluster").error("Topic %s not found in cluster metadata", "t")
        logging.getLogger("aiokafka.cluster").error("something else %s", "t")
        lines = capsys.readouterr().err.splitlines()
    finally:
        logs.configure("console", "INFO")
    assert [orjson.loads(line)["event"] for line in lines] == ["something else t"]
