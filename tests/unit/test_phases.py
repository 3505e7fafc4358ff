"""Exactly-once's per-claim phase times (kafka/exactly_once/phases.py; issue 35, the p99 at
1k/s): every phase of a claim's cycle is timed, and one debug line reports them once its final
mark is in."""

from __future__ import annotations

import pytest

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.kafka.exactly_once import phases
from outbox_dispatcher.kafka.exactly_once.phases import Phases
from tests.unit.test_transactions import TransactionalFake, publisher_of, record, served_by


async def test_every_phase_of_a_committed_claim_is_timed_and_reported_at_its_mark(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reported: list[dict[str, object]] = []
    monkeypatch.setattr(phases.log, "debug", lambda event, **fields: reported.append(fields))
    monkeypatch.setattr(phases.logging.Logger, "isEnabledFor", lambda self, level: True)
    publisher = publisher_of(Settings(delivery="exactly-once"))
    served_by(publisher, TransactionalFake(), monkeypatch)
    d = publisher.publish([record(1, "a"), record(2, "b")], claimed_at=None)
    assert [p.indices async for p in d] == [[0, 1]]
    assert reported == [], "not before the mark"
    publisher.marked(d, every_row=True)
    timed = {"claim", "turn", "retire", "ready", "lookup", "begin", "hand", "acks", "commit"}
    [line] = reported
    assert timed | {"after", "mark", "total_ms", "at", "lane", "rows", "first_id"} <= set(line)
    assert line["rows"] == 2 and line["first_id"] == 1


def test_laps_add_up_per_phase() -> None:
    timed = Phases(0.0)
    timed.lap("turn")
    timed.lap("acks")
    timed.lap("turn")  # a split claim's second transaction
    assert set(timed.ms) == {"turn", "acks"} and all(ms >= 0 for ms in timed.ms.values())
