from __future__ import annotations

import uuid
from datetime import UTC, datetime

from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.models import Batch, OutboxRecord, Outcome, Result
from outbox_dispatcher.store import DispatchStore, Statements

Q = Statements.for_table("public", "outbox")
OK = Result(Outcome.PUBLISHED)
RETRY = Result(Outcome.RETRY, "boom", delay=1.0, counted=True)


def test_settle_arguments_carry_every_row_with_its_key() -> None:
    now = datetime.now(UTC)
    keys = ["b", None, "a", "b"]
    records = [
        OutboxRecord(i, "t", k, b"x", {}, uuid.uuid4(), now, 0, False) for i, k in enumerate(keys)
    ]
    batch = Batch(uuid.uuid4(), records)
    settler = Settler(DispatchStore(None, Q), retry_for=1, delete_on_publish=True)  # type: ignore[arg-type]
    args = settler.arguments(batch, [OK, RETRY, OK, OK])
    assert args == {
        "token": batch.token,
        "owner": "",
        "ids": [0, 1, 2, 3],
        "keys": ["b", None, "a", "b"],
        "outcomes": ["published", "retry", "published", "published"],
        "errors": [None, "boom", None, None],
        "delays": [0.0, 1.0, 0.0, 0.0],
        "counted": [0, 1, 0, 0],
        "delete_published": True,
        "block_on_dead": False,
        "steady": False,
    }
