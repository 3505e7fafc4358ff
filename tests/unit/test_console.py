"""The console's pieces that need no database: input checks, payload decoding, the token, the
sampled history and its chart."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import SecretStr, ValidationError

from outbox_dispatcher.console import auth, history, inputs, service
from outbox_dispatcher.console.app import _ascii_json, _exact_attribute
from outbox_dispatcher.settings import Settings


def test_an_action_needs_a_filter_or_all_and_not_both() -> None:
    with pytest.raises(inputs.InputError, match="without a filter"):
        inputs.parse(inputs.DeadFilter, {}).checked("requeue dead rows")
    with pytest.raises(inputs.InputError, match="cannot be combined"):
        inputs.parse(inputs.DeadFilter, {"all": True, "key": "k"}).checked("x")
    assert inputs.parse(inputs.DeadFilter, {"all": True}).checked("x").empty()
    assert inputs.parse(inputs.DeadFilter, {"keyless": False, "all": True}).checked("x").empty()
    with pytest.raises(inputs.InputError, match="without a filter"):
        inputs.parse(inputs.ReplayFilter, {}).checked("replay")
    with pytest.raises(inputs.InputError, match="is after"):
        inputs.parse(inputs.ReplayFilter, {"from_id": 2, "to_id": 1}).checked("replay")


def test_bad_fields_are_named() -> None:
    with pytest.raises(inputs.InputError) as refused:
        inputs.parse(inputs.DeadFilter, {"since": "soon", "topic": "a b", "extra": 1})
    fields = {p["field"] for p in refused.value.problems}
    assert fields == {"since", "topic", "extra"}
    with pytest.raises(inputs.InputError, match="JSON object"):
        inputs.parse(inputs.DeadFilter, [1])
    with pytest.raises(inputs.InputError, match="key"):
        inputs.parse(inputs.DeadFilter, {"key": "a\x00b"})
    with pytest.raises(inputs.InputError, match="key"):
        inputs.parse(inputs.DeadFilter, {"key": "k" * (inputs.MAX_TEXT + 1)})


def test_a_bare_time_is_utc_and_routed_rows_have_a_name() -> None:
    body = inputs.parse(inputs.DeadFilter, {"since": "2026-01-02T03:04:05", "topic": "(routed)"})
    assert body.since == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert body.filters().topic == "(routed)"
    with pytest.raises(inputs.InputError):
        inputs.parse(inputs.ReplayFilter, {"topic": "(routed)"})


def test_pause_names_a_topic_or_the_whole_table() -> None:
    assert inputs.parse(inputs.PauseBody, {"topic": "t"}).target() == "t"
    assert inputs.parse(inputs.PauseBody, {"all": True}).target() is None
    for body in ({}, {"topic": "t", "all": True}):
        with pytest.raises(inputs.InputError, match='give "topic"'):
            inputs.parse(inputs.PauseBody, body).target()


def test_form_fields_become_model_input() -> None:
    data = inputs.from_query(
        {"key": "k", "topic": "", "keyless": "on", "csrf": "x", "id": "3"}, {"id": ["3", "4"]}
    )
    assert data == {"key": "k", "keyless": True, "ids": ["3", "4"]}


def test_payloads_are_decoded_as_json_text_or_hex() -> None:
    assert service.decode_payload(None, None) is None
    shown = service.decode_payload(b'{"a":1}', 7)
    assert shown == {"encoding": "json", "text": '{\n  "a": 1\n}', "bytes": 7, "truncated": False}
    assert service.decode_payload(b"plain", 5)["encoding"] == "utf-8"  # type: ignore[index]
    assert service.decode_payload(b"\xff\xfe", 2)["text"] == "ff fe"  # type: ignore[index]
    # Cut short: not parsed as JSON; a character cut in two is left out.
    cut = service.decode_payload('{"é'.encode()[:3], 10)
    assert cut == {"encoding": "utf-8", "text": '{"', "bytes": 10, "truncated": True}


def test_the_token_is_compared_in_constant_time_and_is_long_enough() -> None:
    settings = Settings(console_token=SecretStr("t" * 20))
    assert auth.token_matches(settings, "t" * 20)
    assert not auth.token_matches(settings, "t" * 19)
    assert not auth.token_matches(Settings(), "")
    assert auth.session_secret(settings) == auth.session_secret(settings)
    assert auth.session_secret(settings) != auth.session_secret(
        Settings(console_token=SecretStr("u" * 20))
    )
    with pytest.raises(ValidationError, match="at least 16 characters"):
        Settings(console_token=SecretStr("short"))


def test_the_history_keeps_the_last_hour_and_draws_it() -> None:
    kept = history.History(window_seconds=3600)
    for minute in range(0, 120, 10):
        kept.add(history.Sample(minute * 60.0, minute, 0, float(minute)))
    assert [s.at for s in kept.samples()] == [m * 60.0 for m in range(50, 120, 10)]  # 1 h back
    chart = history.svg(kept.samples(), now=119 * 60.0)
    assert chart.startswith("<svg") and chart.count("<polyline") == 2
    assert "max 110" in chart and "1h00m ago" in chart
    # Younger than the window: the chart spans the samples there are.
    young = history.svg(kept.samples()[-2:], now=110 * 60.0)
    assert "10m00s ago" in young
    assert history.svg([], now=0.0).count("<polyline") == 0


def test_hidden_fields_carry_exact_values_without_raw_controls() -> None:
    text = 'k\x1b[2J"<\u202e'
    assert _ascii_json({"key": text}) == '{"key": "k\\u001b[2J\\"<\\u202e"}'
    assert str(_exact_attribute(text)) == "k&#x1b;[2J&#34;&lt;&#x202e;"
