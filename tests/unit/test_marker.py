from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from outbox_dispatcher.marker import Marker
from outbox_dispatcher.models import Batch, OutboxRecord, Outcome, Result
from outbox_dispatcher.sql import Queries

Q = Queries.for_table("public", "outbox")
OK = Result(Outcome.PUBLISHED)
RETRY = Result(Outcome.RETRY, "boom", delay=1.0, counted=True)


def batch(n: int) -> Batch:
    now = datetime.now(UTC)
    records = [OutboxRecord(i, "t", "k", b"x", {}, uuid.uuid4(), now, 0, False) for i in range(n)]
    return Batch(uuid.uuid4(), records)


def plan(results: list[Result], *, delete: bool) -> list[tuple[str, Any]]:
    marker = Marker(None, Q, retry_for=1, delete_on_publish=delete)  # type: ignore[arg-type]
    return [(sql, args[0]) for sql, args in marker._statements(batch(len(results)), results)]


@pytest.mark.parametrize(
    ("results", "delete", "expected"),
    [
        ([OK, OK], False, [(Q.mark_published, [0, 1])]),
        ([OK, RETRY], False, [(Q.settle, [0, 1])]),
        ([RETRY, RETRY], False, [(Q.settle, [0, 1])]),
        ([OK, OK], True, [(Q.delete_published, [0, 1])]),
        ([OK, RETRY], True, [(Q.delete_published, [0]), (Q.settle, [1])]),
        ([RETRY, RETRY], True, [(Q.settle, [0, 1])]),
    ],
)
def test_one_statement_for_the_common_case(
    results: list[Result], delete: bool, expected: list[tuple[str, list[int]]]
) -> None:
    assert plan(results, delete=delete) == expected
