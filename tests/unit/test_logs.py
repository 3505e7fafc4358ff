from __future__ import annotations

import logging

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
