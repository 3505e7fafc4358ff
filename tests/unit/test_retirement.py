"""Exactly-once's progress kept bounded (kafka/exactly_once/retirement.py; issue 35, E8, E9):
batches nobody needs leave a lane's list, keys get tombstones only once nothing they list is needed,
an oversized record is an outage of the lane, and a configuration whose record cannot fit is
refused."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.kafka import failures
from outbox_dispatcher.kafka.batches import Answer
from outbox_dispatcher.kafka.exactly_once.delivery import TransactionalDelivery
from outbox_dispatcher.kafka.exactly_once.progress import Pair, ProgressRecordTooLargeError
from outbox_dispatcher.kafka.exactly_once.retirement import Retirement
from tests.unit.test_transactions import ID, publisher_of, record


class _Database:
    """progress_needed's answers: the identity and which ids are still pending."""

    def __init__(self, pending: set[int]) -> None:
        self.identity = ID
        self.pending = pending
        self.asked: list[list[Pair]] = []

    async def needed(self, pairs: list[Pair]) -> tuple[str, set[int]]:
        self.asked.append(pairs)
        return self.identity, {i for i, _ in pairs if i in self.pending}


async def test_a_batch_whose_mark_failed_leaves_the_list_once_its_rows_are_not_pending() -> None:
    """E8: a tag whose mark failed (or changed only part of its rows) used to stay listed for
    the life of the process; it goes once none of its rows is pending."""
    db = _Database(pending={1, 2})
    publisher = publisher_of(Settings(delivery="exactly-once"), needed=db.needed)
    lane = publisher.lanes[0]
    lane.unmarked["stuck"] = [(1, 0), (2, 0)]
    lane.unmarked["done"] = [(3, 0)]
    await publisher.retire.check(publisher.lanes, force=True)
    assert lane.unmarked == {"stuck": [(1, 0), (2, 0)]}, "a pending row keeps its batch listed"
    db.pending = {2}
    await publisher.retire.check(publisher.lanes)
    assert "stuck" in lane.unmarked, "at most every RETIRE_EVERY_SECONDS"
    db.pending = set()
    await publisher.retire.check(publisher.lanes, force=True)
    assert lane.unmarked == {}


async def test_a_new_identity_forgets_every_batch_listed_under_the_old_one() -> None:
    db = _Database(pending={1})
    publisher = publisher_of(Settings(delivery="exactly-once"), needed=db.needed)
    publisher.lanes[0].unmarked["t"] = [(1, 0)]
    db.identity = "after-a-truncate"
    await publisher.retire.check(publisher.lanes, force=True)
    assert publisher.lanes[0].unmarked == {} and publisher.retire.identity == "after-a-truncate"


async def test_other_keys_are_tombstoned_once_done_and_their_dispatcher_no_longer_beats() -> None:
    """E9: a key a takeover read gets a tombstone when nothing it lists is pending and no
    dispatcher that beats recorded it; a lane's given-up id once its batches left the list."""
    db = _Database(pending={1})
    beating = {"x.public.outbox.live"}

    async def beats() -> set[str]:
        return beating

    publisher = publisher_of(Settings(delivery="exactly-once"), needed=db.needed, beating=beats)
    retire: Retirement = publisher.retire
    lanes = publisher.lanes
    retire.read(
        lanes,
        {
            "x.public.outbox.dead": {"t": [(1, 0)]},
            "x.public.outbox.live": {"u": [(2, 0)]},
            lanes[0].transactional_id: {"v": [(3, 0)]},
        },
    )
    assert set(retire.due) == {"x.public.outbox.dead", "x.public.outbox.live"}, "never its own"
    await retire.check(lanes, force=True)
    assert retire.to_send(lanes) == [], "row 1 pending; the other's dispatcher beats"
    db.pending = set()
    beating.clear()
    await retire.check(lanes, force=True)
    assert retire.to_send(lanes) == ["x.public.outbox.dead", "x.public.outbox.live"]
    retire.sent(["x.public.outbox.dead", "x.public.outbox.live"])
    lane = lanes[0]
    lane.unmarked["w"] = [(4, 0)]
    lane.last_listed = frozenset({"w"})
    given_up = lane.transactional_id
    lane.renew()
    assert retire.to_send(lanes) == [], "its batch is still listed"
    lane.unmarked.clear()
    assert retire.to_send(lanes) == [given_up]


async def test_an_oversized_progress_record_is_an_outage_not_a_refusal() -> None:
    """E8: a record past OUTBOX_KAFKA_MAX_REQUEST_BYTES was a refusal (the producer replaced,
    the rows retried at once: a hot loop); now the lane's transaction waits as in an outage."""
    settings = Settings(delivery="exactly-once", batch_size=50, kafka_max_request_bytes=4096)
    publisher = publisher_of(settings)
    lane = publisher.lanes[0]
    lane.unmarked["stuck"] = [(i, 0) for i in range(1000)]
    sent: list[Any] = []

    class _Producer:
        async def send(self, *args: Any, **kwargs: Any) -> Any:
            sent.append(args)
            return asyncio.get_running_loop().create_future()

    lane.producers.current = lambda: _Producer()  # type: ignore[method-assign]

    class _Batches:
        where: dict[Any, Any] = {}

        def encode(self, indices: Any) -> None:
            pass

        def send(self, pending: list[int], answers: list[Answer], *_: Any) -> list[int]:
            sent.extend(pending)
            return []

    d = TransactionalDelivery(publisher, lane, [record(0)], 0.0)
    found = await publisher._send_all(d, _Batches(), [0], [None], {})  # type: ignore[arg-type]
    assert isinstance(found, tuple) and isinstance(found[1], ProgressRecordTooLargeError)
    assert not failures.is_rejection(found[1]) and found[1].retriable
    assert sent == [], "neither the rows nor the record are handed to the producer"


def test_a_batch_size_whose_progress_record_cannot_fit_a_request_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"OUTBOX_BATCH_SIZE=2000 .*OUTBOX_KAFKA_MAX_REQ"):
        Settings(delivery="exactly-once", batch_size=2000, kafka_max_request_bytes=65536)
    Settings(delivery="exactly-once", batch_size=1000, kafka_max_request_bytes=65536)
    Settings(delivery="at-least-once", batch_size=2000, kafka_max_request_bytes=65536)
    Settings(delivery="exactly-once", batch_size=10_000)  # the defaults' 1 MiB


async def test_a_list_that_changed_during_the_check_is_left_for_the_next() -> None:
    """A split claim's next part committed under the same tag while the check asked about its
    earlier rows (marked by then): the tag now lists rows still pending, and stays."""
    publisher: Any = None

    async def needed(pairs: list[Pair]) -> tuple[str, set[int]]:
        publisher.lanes[0].unmarked["split"] = [(1, 0), (2, 0)]  # its second part committed
        return ID, set()

    publisher = publisher_of(Settings(delivery="exactly-once"), needed=needed)
    publisher.lanes[0].unmarked["split"] = [(1, 0)]
    await publisher.retire.check(publisher.lanes, force=True)
    assert publisher.lanes[0].unmarked == {"split": [(1, 0), (2, 0)]}
