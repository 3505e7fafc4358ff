from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

from outbox_dispatcher.models import OutboxRecord
from outbox_dispatcher.publisher import KafkaPublisher, NotAttempted, Sent, record_headers


def test_headers_carry_the_event_id_and_it_cannot_be_forged() -> None:
    event_id = uuid.uuid4()
    rec = OutboxRecord(
        1,
        "t",
        "k",
        b"x",
        {"traceparent": "00-ab", "event-id": "forged", "Event-ID": "forged", "EVENT-id": "x"},
        event_id,
        datetime.now(UTC),
        0,
        False,
    )
    assert record_headers(rec, "event-id") == [
        ("traceparent", b"00-ab"),
        ("event-id", str(event_id).encode()),
    ]


async def test_outcomes_split_acknowledged_failed_pending_and_unsent() -> None:
    loop = asyncio.get_running_loop()
    acked: asyncio.Future[object] = loop.create_future()
    acked.set_result("metadata")
    failed: asyncio.Future[object] = loop.create_future()
    boom = RuntimeError("boom")
    failed.set_exception(boom)
    pending: asyncio.Future[object] = loop.create_future()
    refused = ValueError("refused")
    sent = Sent([acked, failed, pending, refused])
    marker = NotAttempted("shut down")
    assert KafkaPublisher.outcomes(sent, marker, total=5) == [None, boom, marker, refused, marker]
    pending.cancel()
