"""The console's pieces that need no database: input checks, payload decoding, the token, the
Host check, the login throttle, the sampled history and its charts, how values are shown."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.console import auth, charts, history, inputs, render, security, service
from outbox_dispatcher.console.render import ascii_json as _ascii_json
from outbox_dispatcher.console.render import exact_attribute as _exact_attribute


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


def test_the_history_keeps_the_last_hour_and_its_rates_come_from_the_dispatchers() -> None:
    kept = history.History(window_seconds=3600)
    for minute in range(0, 120, 10):
        counters = {"a": (minute * 60, minute, minute * 60.0)}
        kept.add(history.Sample(minute * 60.0, minute, 0, float(minute), counters=counters))
    assert [s.at for s in kept.samples()] == [m * 60.0 for m in range(50, 120, 10)]  # 1 h back
    rates = kept.rates()
    # 600 rows published and 10 dead between heartbeats 600 s apart: 1/s and 1/60 s.
    assert rates[0].published_per_second == 1.0
    assert rates[0].dead_per_second == 10 / 600
    assert len(rates) == 6  # from the second sample on


def test_rates_span_heartbeats_not_samples() -> None:
    """Counters change only with a heartbeat (every 10 s): samples in between keep the rate of
    the last two heartbeats instead of reading 0 and then a spike. A restarted dispatcher
    (its counter goes down) counts as no rows, not a negative rate."""
    samples = [
        history.Sample(0.0, 0, 0, None, counters={"a": (0, 0, 0.0)}),
        history.Sample(1.0, 0, 0, None, counters={"a": (0, 0, 0.0)}),
        history.Sample(10.0, 0, 0, None, counters={"a": (50, 0, 10.0)}),
        history.Sample(11.0, 0, 0, None, counters={"a": (50, 0, 10.0), "b": (7, 0, 11.0)}),
        history.Sample(20.0, 0, 0, None, counters={"a": (100, 0, 20.0), "b": (27, 1, 21.0)}),
        history.Sample(30.0, 0, 0, None, counters={"a": (3, 0, 30.0), "b": (27, 1, 21.0)}),
    ]
    found = [(r.at, r.published_per_second, r.dead_per_second) for r in history.rates(samples)]
    assert found == [(10.0, 5.0, 0.0), (11.0, 5.0, 0.0), (20.0, 7.0, 0.1), (30.0, 2.0, 0.1)]


def test_charts_have_a_value_axis_from_zero_and_a_time_axis() -> None:
    """N18: axes with round ticks, one scale for the chart's lines, the time in UTC."""
    now = 1_800_000_000.0
    points = [(now - 600 + 60 * i, float(10 * i)) for i in range(11)]
    drawn = charts.chart(
        "Backlog (rows)",
        "",
        [charts.Series("pending", "#000", points), charts.Series("dead", "#f00", [(now, 7.0)])],
        now=now,
        window=3600,
    )
    assert drawn.startswith("<svg") and drawn.count("<polyline") == 1
    assert drawn.count("<circle") == 1  # a line of one point is a dot
    for tick in (">0<", ">50<", ">100<"):
        assert tick in drawn, tick
    assert "time (UTC)" in drawn and ">pending<" not in drawn and "■ pending" in drawn
    assert ":" in drawn.split('text-anchor="middle">')[1][:8]  # a clock tick, HH:MM
    assert "no samples yet" in charts.chart("Lag", "s", [], now=now, window=3600)
    assert charts.label(90, "s") == "1m30s" and charts.label(1500, "") == "1.5k"
    assert charts.nice_step(103) == 50 and charts.nice_step(0) == 1


def test_values_are_shown_for_people() -> None:
    assert render.plural(1, "dispatcher") == "1 dispatcher"
    assert render.plural(3, "sample") == "3 samples"
    assert render.plural(2400, "row") == "2,400 rows"
    assert render.relative(0.5) == "just now" and render.relative(125) == "2 min ago"
    assert render.relative(-300) == "in 5 min"
    when = str(render.when(datetime.now(UTC)))
    assert when.startswith("<time datetime=") and "UTC" in when and "just now" in when
    # A real ESC is a marked escape; the four characters "\x1b" stay themselves (N16).
    shown = str(render.inert("a\x1bb\\x1b<"))
    assert shown == 'a<span class="ctl" title="control character U+001B">\\x1b</span>b\\x1b&lt;'


def test_the_host_header_must_name_the_console() -> None:
    """N1: the names a browser uses to reach the console, not a rebound one."""
    assert security.allowed_hosts(Settings()) == {"127.0.0.1", "localhost", "::1"}
    mine = Settings(console_host="console.internal")
    assert "console.internal" in security.allowed_hosts(mine)
    assert security.allowed_hosts(Settings(console_host="0.0.0.0")) == {  # noqa: S104
        "127.0.0.1",
        "localhost",
        "::1",
    }
    assert security.allowed_hosts(Settings(console_allowed_hosts="Ops.Example, x")) == {
        "ops.example",
        "x",
    }
    assert security.host_of("attacker.example:9647") == "attacker.example"
    assert security.host_of("[::1]:9647") == "::1" and security.host_of("LOCALHOST") == "localhost"


async def test_failed_logins_make_the_next_attempt_wait_longer(monkeypatch: Any) -> None:
    """N4: each failure doubles the wait of that client; others are not slowed."""
    monkeypatch.setattr(auth, "FAILED_LOGIN_DELAY", 0.0)
    throttle = auth.Throttle()
    assert throttle.wait("10.0.0.1") == 0
    await throttle.failed("10.0.0.1")
    assert 0.5 < throttle.wait("10.0.0.1") <= auth.LOCKOUT_BASE
    await throttle.failed("10.0.0.1")
    assert auth.LOCKOUT_BASE < throttle.wait("10.0.0.1") <= 2 * auth.LOCKOUT_BASE
    for _ in range(20):
        await throttle.failed("10.0.0.1")
    assert throttle.wait("10.0.0.1") <= auth.LOCKOUT_MAX
    assert throttle.wait("10.0.0.2") == 0
    throttle.succeeded("10.0.0.1")
    assert throttle.wait("10.0.0.1") == 0


def test_trusted_proxies_name_the_person_and_the_client() -> None:
    proxies = auth.Proxies("10.0.0.0/8, 192.168.1.1")
    assert proxies.trusts("10.1.2.3") and proxies.trusts("192.168.1.1")
    assert not proxies.trusts("192.168.1.2") and not proxies.trusts("nonsense")
    assert not auth.Proxies(None).trusts("127.0.0.1")
    with pytest.raises(ValidationError, match="not an address or network"):
        Settings(console_trusted_proxies="10.0.0.0/8, bogus")


def test_a_console_nobody_could_use_does_not_start() -> None:
    with pytest.raises(errors.ConfigurationError, match="would serve nobody"):
        auth.check_configured(Settings())
    auth.check_configured(Settings(console_anonymous_read=True))
    auth.check_configured(Settings(console_trusted_proxies="127.0.0.1"))


def test_hidden_fields_carry_exact_values_without_raw_controls() -> None:
    text = 'k\x1b[2J"<\u202e'
    assert _ascii_json({"key": text}) == '{"key": "k\\u001b[2J\\"<\\u202e"}'
    assert str(_exact_attribute(text)) == "k&#x1b;[2J&#34;&lt;&#x202e;"


@pytest.mark.parametrize("name", ["dead-requeue", "dead-discard", "replay"])
def test_the_consoles_bulk_actions_are_sized_by_action_batch_size(name: str) -> None:
    """Their own setting (OUTBOX_ACTION_BATCH_SIZE), and the retention's batch when unset."""
    body_type, make = service.ACTIONS[name]
    body = body_type.model_validate({"all": True})
    url = "postgresql://u@h/d"
    sized = make(Settings(database_url=url, action_batch_size=9, cleanup_batch_size=7), body, None)
    fallback = make(Settings(database_url=url, cleanup_batch_size=7), body, None)
    assert (getattr(sized, "batch_size", None), getattr(fallback, "batch_size", None)) == (9, 7)
