"""The delivery mode of the live dispatchers as the operator reads it (schema version 14): one
mode, `mixed` when they differ (exactly-once's fence relies on every dispatcher of a table being
transactional), `not reported` for an older release; and how `status` and the console say it."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import pytest

from outbox_dispatcher.cli import tables
from outbox_dispatcher.console import render
from outbox_dispatcher.operate import reads

AT = datetime(2026, 11, 30, tzinfo=UTC)
ALO, EOS = "at-least-once", "exactly-once"


def dispatcher(owner: str, delivery: str | None) -> reads.Dispatcher:
    return reads.Dispatcher(owner, "skip", AT, AT, 2.0, version=14, delivery=delivery)


def of(*modes: str | None) -> list[reads.Dispatcher]:
    return [dispatcher(f"host-{i}:{i}:x", mode) for i, mode in enumerate(modes)]


@pytest.mark.parametrize(
    ("modes", "in_force", "counted"),
    [
        ((), None, {}),
        ((EOS,), EOS, {EOS: 1}),
        ((EOS, EOS), EOS, {EOS: 2}),
        ((ALO, EOS), reads.MIXED, {ALO: 1, EOS: 1}),
        ((ALO, EOS, None), reads.MIXED, {ALO: 1, EOS: 1, reads.NOT_REPORTED: 1}),
        ((None, None), reads.NOT_REPORTED, {reads.NOT_REPORTED: 2}),
        ((EOS, None), EOS, {EOS: 1, reads.NOT_REPORTED: 1}),
    ],
)
def test_the_mode_in_force_is_the_one_reported_or_mixed(
    modes: tuple[str | None, ...], in_force: str | None, counted: dict[str, int]
) -> None:
    found = of(*modes)
    assert reads.delivery_in_force(found) == in_force
    assert reads.delivery_modes(found) == counted
    report = reads.as_json([], [], found, "skip")
    assert (report["delivery"], report["delivery_modes"]) == (in_force, counted)
    assert [d["delivery"] for d in report["dispatchers"]] == list(modes)


def _status(*modes: str | None) -> list[str]:
    return tables.as_table([], [], of(*modes), "skip").splitlines()


def test_status_names_the_mode_of_the_live_dispatchers() -> None:
    [line] = [line for line in _status(EOS, EOS) if line.startswith("dispatchers:")]
    assert line.endswith("dead-letter policy skip, delivery exactly-once")
    assert not any(line.startswith("warning:") for line in _status(EOS, EOS))
    assert _status(ALO)[-1].endswith(", delivery at-least-once")


def test_status_warns_when_the_live_dispatchers_run_different_modes() -> None:
    lines = _status(EOS, ALO, None)
    assert lines[-2].endswith(", delivery mixed (1 at-least-once, 1 exactly-once, 1 not reported)")
    assert lines[-1] == tables.MIXED_DELIVERY
    assert "exactly-once's fence" in lines[-1] and "OUTBOX_DELIVERY" in lines[-1]


def test_status_says_an_older_release_reports_no_mode() -> None:
    assert _status(None)[-1].endswith(", delivery not reported (older release)")
    assert _status(EOS, None)[-1].endswith(
        ", delivery exactly-once (1 not reported: older release)"
    )
    none_alive = _status()[-1]
    assert none_alive.startswith("dispatchers: none alive") and "delivery" not in none_alive


def _overview(*modes: str | None) -> str:
    report: dict[str, Any] = reads.as_json([], [], of(*modes), "skip")
    report["history"] = {"interval_seconds": 5, "samples": []}
    template = render.environment().get_template("overview.html")
    return template.render(report=report, charts=[], refresh_seconds=0, can_act=False)


def _cells(page: str) -> list[str]:
    """Each dispatcher row's delivery cell (the fourth)."""
    rows = re.findall(r'<tr><td class="mono">host-\d+</td>(.*?)</tr>', page)
    return [re.findall(r"<td[^>]*>(.*?)</td>", row)[2] for row in rows]


def test_the_console_shows_each_dispatchers_mode_and_warns_when_they_differ() -> None:
    page = _overview(EOS, EOS)
    assert _cells(page) == [EOS, EOS]
    assert "ago); delivery exactly-once; blocked keys" in page
    assert 'id="delivery-mixed"' not in page
    mixed = _overview(ALO, EOS)
    assert _cells(mixed) == [ALO, EOS]
    warning = re.search(r'<p class="error" id="delivery-mixed">(.*?)</p>', mixed)
    assert warning and "(1 at-least-once, 1 exactly-once)" in warning.group(1)
    assert "exactly-once's fence relies on every dispatcher" in warning.group(1)


def test_the_console_says_an_older_release_reports_no_mode() -> None:
    page = _overview(EOS, None)
    assert _cells(page) == [EOS, "not reported (older release)"]
    assert "delivery exactly-once (1 not reported: older release);" in page
    assert "delivery not reported (older release);" in _overview(None)
