"""The checker's verdict logic on hand-built records: each failure kind, and what is not one."""

from __future__ import annotations

import orjson
import pytest

from tests.checker import Record, Written, check


def rows(*specs: tuple[str, str | None, int]) -> dict[str, Written]:
    return {e: Written(e, k, seq) for e, k, seq in specs}


def rec(
    offset: int,
    event_id: str | None,
    key: str | None,
    seq: int | None,
    *,
    partition: int = 0,
    topic: str = "t",
    timestamp: int = 0,
) -> Record:
    headers = [] if event_id is None else [("event-id", event_id.encode())]
    value = None if seq is None else orjson.dumps({"key": key, "seq": seq})
    key_bytes = None if key is None else key.encode()
    return Record(topic, partition, offset, key_bytes, value, headers, timestamp)


WRITTEN = rows(("e1", "a", 0), ("e2", "a", 1), ("e3", "b", 0), ("e4", "b", 1))


def clean() -> list[Record]:
    return [
        rec(0, "e1", "a", 0),
        rec(1, "e2", "a", 1),
        rec(0, "e3", "b", 0, partition=1),
        rec(1, "e4", "b", 1, partition=1),
    ]


def test_a_clean_delivery_is_ok() -> None:
    verdict = check(clean(), WRITTEN)
    assert verdict.ok
    assert (verdict.delivered, verdict.lost, verdict.duplicates, verdict.max_copies) == (
        4,
        [],
        0,
        1,
    )
    assert verdict.summary()["ok"] is True


def test_order_across_partitions_and_record_order_in_the_list_do_not_matter() -> None:
    assert check(list(reversed(clean())), WRITTEN).ok


def test_a_missing_row_is_lost() -> None:
    verdict = check(clean()[:3], WRITTEN)
    assert verdict.lost == ["e4"]
    assert not verdict.ok


def test_a_second_copy_is_a_duplicate_that_carried_its_event_id() -> None:
    records = [*clean(), rec(2, "e1", "a", 0)]
    verdict = check(records, WRITTEN)
    assert verdict.ok, "duplicates are allowed: at-least-once"
    assert verdict.duplicates == 1
    assert verdict.max_copies == 2
    [dup] = verdict.duplicate_details
    assert (dup.event_id, dup.copy, dup.first, dup.carried_event_id) == (
        "e1",
        "t/0@2",
        "t/0@0",
        True,
    )


def test_a_copy_without_its_event_id_is_matched_by_key_and_seq() -> None:
    records = [*clean(), rec(2, None, "a", 1), rec(3, "other-id", "a", 0)]
    verdict = check(records, WRITTEN)
    assert verdict.duplicates == 2
    assert verdict.duplicates_without_event_id == 2
    assert not verdict.unexpected


def test_first_deliveries_out_of_order_are_reordered() -> None:
    records = [rec(0, "e2", "a", 1), rec(1, "e1", "a", 0), *clean()[2:]]
    verdict = check(records, WRITTEN)
    assert verdict.reordered == ["b'a': 0 after 1"]
    assert not verdict.ok


def test_a_late_duplicate_is_not_a_reordering() -> None:
    records = [*clean(), rec(2, "e1", "a", 0)]
    assert check(records, WRITTEN).reordered == []


def test_a_record_of_no_row_is_unexpected() -> None:
    records = [*clean(), rec(2, "e9", "a", 7), rec(3, None, "z", None)]
    verdict = check(records, WRITTEN)
    assert verdict.unexpected == ["e9", "(no event id) t/0@3"]
    assert not verdict.ok


def test_dead_lettered_rows_are_not_expected() -> None:
    written = {**WRITTEN, "e5": Written("e5", "b", 2, dead=True)}
    verdict = check(clean(), written)
    assert verdict.ok
    assert verdict.dead == ["e5"]


def test_the_order_comes_from_the_written_rows_when_given() -> None:
    written = {"e1": Written("e1", "a", 10), "e2": Written("e2", "a", 5)}
    verdict = check([rec(0, "e1", None, None), rec(1, "e2", None, None)], written)
    assert len(verdict.reordered) == 1


@pytest.mark.parametrize("kind", ["lost", "duplicated", "reordered", "unexpected"])
def test_the_summary_counts_each_kind(kind: str) -> None:
    broken = {
        "lost": clean()[1:],
        "duplicated": [*clean(), rec(5, "e3", "b", 0, partition=1)],
        "reordered": [rec(0, "e2", "a", 1), rec(1, "e1", "a", 0), *clean()[2:]],
        "unexpected": [*clean(), rec(9, "nope", "q", 1)],
    }[kind]
    summary = check(broken, WRITTEN).summary()
    assert summary[kind] == 1
    assert summary["ok"] is (kind == "duplicated")


def test_the_older_form_takes_a_set_of_event_ids() -> None:
    verdict = check([rec(0, "e2", "a", 1), rec(1, "e1", "a", 0)], {"e1", "e2", "e3"})
    assert (verdict.lost, len(verdict.reordered)) == (["e3"], 1)


# --- per key across topics (first deliveries ordered by the records' timestamps) -----------

CROSS = rows(("x0", "k", 0), ("y1", "k", 1), ("x2", "k", 2))


def test_a_key_across_topics_in_order_is_ok() -> None:
    records = [
        rec(0, "x0", "k", 0, topic="x", timestamp=100),
        rec(0, "y1", "k", 1, topic="y", timestamp=150),
        rec(1, "x2", "k", 2, topic="x", timestamp=200),
    ]
    verdict = check(records, CROSS)
    assert verdict.ok
    assert verdict.reordered_across_topics == []


def test_a_later_row_first_delivered_in_another_topic_before_an_earlier_one_is_reordered() -> None:
    # The F2 interleaving: row 0 (topic x) failed and was re-published after row 1 (topic y).
    records = [
        rec(0, "y1", "k", 1, topic="y", timestamp=100),
        rec(0, "x0", "k", 0, topic="x", timestamp=5_000),
        rec(1, "x2", "k", 2, topic="x", timestamp=5_001),
    ]
    verdict = check(records, CROSS)
    assert verdict.reordered == [], "each partition on its own is in order"
    assert len(verdict.reordered_across_topics) == 1
    assert (
        "1 (y/0@0, t=100) first-delivered before 0 (x/0@0, t=5000)"
        in (verdict.reordered_across_topics[0])
    )
    assert not verdict.ok
    assert verdict.summary()["reordered_across_topics"] == 1


def test_the_same_millisecond_is_not_a_reorder() -> None:
    records = [
        rec(0, "y1", "k", 1, topic="y", timestamp=100),
        rec(0, "x0", "k", 0, topic="x", timestamp=100),
        rec(1, "x2", "k", 2, topic="x", timestamp=100),
    ]
    assert check(records, CROSS).ok


def test_other_keys_timestamps_do_not_matter() -> None:
    written = rows(("a0", "a", 0), ("b0", "b", 0))
    records = [
        rec(0, "a0", "a", 0, topic="x", timestamp=900),
        rec(0, "b0", "b", 0, topic="y", timestamp=100),
    ]
    assert check(records, written).ok


def test_a_later_copy_does_not_count_only_the_first_delivery() -> None:
    records = [
        rec(0, "x0", "k", 0, topic="x", timestamp=100),
        rec(0, "y1", "k", 1, topic="y", timestamp=150),
        rec(1, "x2", "k", 2, topic="x", timestamp=200),
        rec(2, "x0", "k", 0, topic="x", timestamp=300),  # a duplicate of row 0, later
    ]
    verdict = check(records, CROSS)
    assert verdict.ok
    assert verdict.duplicates == 1


def test_timestamps_within_one_partition_are_left_to_the_offset_check() -> None:
    # CreateTime within a partition need not rise with the offset; the offset order decides.
    written = rows(("a0", "a", 0), ("a1", "a", 1))
    records = [
        rec(0, "a0", "a", 0, timestamp=500),
        rec(1, "a1", "a", 1, timestamp=100),
    ]
    assert check(records, written).ok


def test_partitions_of_one_topic_count_like_topics() -> None:
    written = rows(("a0", "a", 0), ("a1", "a", 1))
    records = [
        rec(0, "a0", "a", 0, partition=0, timestamp=500),
        rec(0, "a1", "a", 1, partition=2, timestamp=100),
    ]
    assert len(check(records, written).reordered_across_topics) == 1
