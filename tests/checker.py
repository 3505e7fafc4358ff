"""The delivery checker: what the outbox committed against what a read_committed consumer got.

Used by the tests and, as a script, against any database and topics:

    python -m tests.checker --database-url postgresql://... --bootstrap host:9092 --topic t1

prints a JSON verdict (exit status 0 when nothing was lost, reordered or unexpected).

The verdict says which committed rows never arrived (lost), which arrived more than once
(duplicated, and whether each copy carried the row's event id), which keys had a first delivery
out of order (reordered: within one partition, by offset; reordered_across_topics: a key whose
rows went to several topics or partitions, by the records' timestamps), and which records match
no committed row (unexpected). Duplicates are what at-least-once costs; the others are failures.

Across partitions only the timestamps can order first deliveries. They are exact with topics
created with message.timestamp.type=LogAppendTime (the broker's clock when it appended the
record; the multi-broker tests do this); with CreateTime they are the producer's clock when the
dispatcher handed the record over, so a re-publish shows, a record held in flight does not.
Equal timestamps (one millisecond) are not counted as a reorder.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import asyncpg
import orjson
from aiokafka import AIOKafkaConsumer

EVENT_ID_HEADER = "event-id"


class Delivered(Protocol):
    """What the checker needs of a consumed record (aiokafka's ConsumerRecord has it)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes]]: ...
    @property
    def timestamp(self) -> int: ...


@dataclass(frozen=True)
class Record:
    """A consumed record, built by hand in unit tests or copied from a ConsumerRecord."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]] = ()
    timestamp: int = 0


@dataclass(frozen=True)
class Written:
    """A committed outbox row: its key and its place in the key's order."""

    event_id: str
    key: str | None
    order: int  # the payload's "seq" when it has one, else the row id
    dead: bool = False


@dataclass
class Duplicate:
    """A second (third...) copy of a row."""

    event_id: str
    copy: str  # topic/partition@offset
    first: str
    carried_event_id: bool  # False: matched to its row by (key, seq) only


@dataclass
class Verdict:
    """What the consumer saw against what was written."""

    delivered: int = 0
    lost: list[str] = field(default_factory=list)
    duplicates: int = 0
    reordered: list[str] = field(default_factory=list)
    reordered_across_topics: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    duplicate_details: list[Duplicate] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)  # dead-lettered rows: never expected
    max_copies: int = 0
    # The lost rows as the table shows them (verdict_for): "not published yet" is a row the
    # dispatchers never got to (a test that stopped them too soon), "marked published" a real loss.
    lost_in_table: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Nothing lost, reordered or unexpected (duplicates are allowed: at-least-once)."""
        return not (self.lost or self.reordered or self.reordered_across_topics or self.unexpected)

    @property
    def duplicates_without_event_id(self) -> int:
        return sum(1 for d in self.duplicate_details if not d.carried_event_id)

    def summary(self) -> dict[str, Any]:
        """Counts and the first few examples of each kind, for logs and reports."""
        return {
            "ok": self.ok,
            "delivered": self.delivered,
            "lost": len(self.lost),
            "duplicated": self.duplicates,
            "duplicates_without_event_id": self.duplicates_without_event_id,
            "max_copies": self.max_copies,
            "reordered": len(self.reordered),
            "reordered_across_topics": len(self.reordered_across_topics),
            "unexpected": len(self.unexpected),
            "dead_lettered": len(self.dead),
            "examples": {
                "lost": self.lost[:5],
                "reordered": self.reordered[:5],
                "reordered_across_topics": self.reordered_across_topics[:5],
                "unexpected": self.unexpected[:5],
                "duplicated": [asdict(d) for d in self.duplicate_details[:5]],
                "lost_in_table": self.lost_in_table,
            },
        }


def _seq(value: bytes | None) -> int | None:
    if not value:
        return None
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    seq = doc.get("seq") if isinstance(doc, dict) else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None


def _where(record: Delivered) -> str:
    return f"{record.topic}/{record.partition}@{record.offset}"


def check(
    records: Sequence[Delivered],
    written: Mapping[str, Written] | set[str],
    event_id_header: str = EVENT_ID_HEADER,
) -> Verdict:
    """Lost, duplicated (same row twice), reordered (per key, first deliveries out of order) and
    unexpected records.

    `written` maps event id to the committed row; a plain set of event ids (the older form) takes
    the order from each record's payload "seq". A record whose event id is missing or unknown is
    matched to its row by (key, seq) when it can be: a copy of a row that lost its event id.
    """
    rows: Mapping[str, Written | None] = (
        dict.fromkeys(written) if isinstance(written, set) else written
    )
    by_content: dict[tuple[str | None, int], str] = {
        (w.key, w.order): w.event_id for w in rows.values() if w is not None and w.key is not None
    }
    verdict = Verdict()
    first_copy: dict[str, str] = {}
    copies: Counter[str] = Counter()
    last_order: dict[tuple[str, bytes | None], int] = {}
    firsts: dict[bytes, list[tuple[int, int, tuple[str, int], str]]] = defaultdict(list)
    by_partition: dict[tuple[str, int], list[Delivered]] = defaultdict(list)
    for record in records:
        by_partition[(record.topic, record.partition)].append(record)
    for (topic, _), partition_records in sorted(by_partition.items()):
        for record in sorted(partition_records, key=lambda r: r.offset):
            event_id = dict(record.headers).get(event_id_header, b"").decode(errors="replace")
            seq = _seq(record.value)
            carried = event_id in rows
            if not carried:
                key = record.key.decode(errors="replace") if record.key is not None else None
                matched = by_content.get((key, seq)) if seq is not None else None
                if matched is None:
                    verdict.unexpected.append(event_id or f"(no event id) {_where(record)}")
                    continue
                event_id = matched
            copies[event_id] += 1
            if event_id in first_copy:
                verdict.duplicates += 1
                verdict.duplicate_details.append(
                    Duplicate(event_id, _where(record), first_copy[event_id], carried)
                )
                continue
            first_copy[event_id] = _where(record)
            verdict.delivered += 1
            row = rows[event_id]
            order = row.order if row is not None else seq
            if order is None:
                continue
            if record.key is not None:
                firsts[record.key].append(
                    (order, record.timestamp, (topic, record.partition), _where(record))
                )
            key_of = (topic, record.key)
            previous = last_order.get(key_of)
            if previous is not None and order <= previous:
                verdict.reordered.append(f"{record.key!r}: {order} after {previous}")
            last_order[key_of] = order
    verdict.reordered_across_topics = _across_partitions(firsts)
    verdict.dead = sorted(e for e, w in rows.items() if w is not None and w.dead)
    expected = {e for e, w in rows.items() if w is None or not w.dead}
    verdict.lost = sorted(expected - first_copy.keys())
    verdict.max_copies = max(copies.values(), default=0)
    return verdict


def _across_partitions(
    firsts: Mapping[bytes, Sequence[tuple[int, int, tuple[str, int], str]]],
) -> list[str]:
    """Per key, in row order: a first delivery whose timestamp is earlier than that of an
    earlier row of the key in another partition (same-partition order is the offset check's)."""
    found: list[str] = []
    for key, deliveries in firsts.items():
        if len({partition for _, _, partition, _ in deliveries}) < 2:
            continue
        # Per partition, the earlier row with the latest first delivery so far.
        latest: dict[tuple[str, int], tuple[int, int, str]] = {}
        for order, timestamp, partition, where in sorted(deliveries):
            if timestamp < 0:
                continue
            for other, (t, o, w) in latest.items():
                if other != partition and timestamp < t:
                    found.append(
                        f"{key!r}: {order} ({where}, t={timestamp}) first-delivered before "
                        f"{o} ({w}, t={t})"
                    )
                    break
            if partition not in latest or timestamp > latest[partition][0]:
                latest[partition] = (timestamp, order, where)
    return found


async def written_rows(
    conn: asyncpg.Connection, topics: Sequence[str] | None = None, table: str = "outbox"
) -> dict[str, Written]:
    """Every committed row (of these topics), by event id. `table` is trusted (a test or the
    operator's command line names it)."""
    query = (
        "SELECT event_id::text AS event_id, ordering_key, id, payload, dead_at IS NOT NULL AS dead"
        f" FROM {table}"
    )
    args: list[object] = []
    if topics:
        query += " WHERE topic = ANY($1::text[])"
        args.append(list(topics))
    rows = await conn.fetch(query, *args)
    result = {}
    for r in rows:
        seq = _seq(r["payload"])
        result[r["event_id"]] = Written(
            r["event_id"], r["ordering_key"], r["id"] if seq is None else seq, r["dead"]
        )
    return result


async def consume(
    bootstrap: str,
    topic: str | Sequence[str],
    expected: int,
    timeout: float = 60.0,
    quiet: float = 1.0,
    isolation: str = "read_committed",
) -> list[Record]:
    """Read the topics from the start (read_committed, or `isolation`) until `expected` records
    arrived (or fail), then until `quiet` seconds pass without a record, to catch extra
    copies."""
    topics = [topic] if isinstance(topic, str) else list(topic)
    consumer = AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level=isolation,
        group_id=None,
    )
    await consumer.start()
    records: list[Record] = []
    try:
        deadline = time.monotonic() + timeout
        quiet_until: float | None = None
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=300, max_records=10_000)
            got = [r for rs in batch.values() for r in rs]
            records.extend(
                Record(r.topic, r.partition, r.offset, r.key, r.value, list(r.headers), r.timestamp)
                for r in got
            )
            if len(records) >= expected:
                now = time.monotonic()
                if got or quiet_until is None:
                    quiet_until = now + quiet
                elif now > quiet_until:
                    break
    finally:
        await consumer.stop()
    if len(records) < expected:
        msg = f"consumed {len(records)} records of {expected} expected from {topics}"
        raise AssertionError(msg)
    return records


async def verdict_for(
    database_url: str,
    bootstrap: str,
    topics: Sequence[str],
    *,
    table: str = "outbox",
    timeout: float = 60.0,
    event_id_header: str = EVENT_ID_HEADER,
    isolation: str = "read_committed",
) -> Verdict:
    """Record the committed rows of `topics`, consume the topics (as a consumer of `isolation`
    does), and judge."""
    conn = await asyncpg.connect(database_url)
    try:
        written = await written_rows(conn, topics, table)
    finally:
        await conn.close()
    expected = sum(1 for w in written.values() if not w.dead)
    try:
        records = await consume(bootstrap, topics, expected, timeout, isolation=isolation)
    except AssertionError:
        records = await consume(bootstrap, topics, 0, quiet=5.0, isolation=isolation)
    verdict = check(records, written, event_id_header)
    if verdict.lost:
        conn = await asyncpg.connect(database_url)
        try:
            rows = await conn.fetch(
                "SELECT published_at IS NOT NULL AS published, count(*) AS n"
                f" FROM {table} WHERE event_id::text = ANY($1::text[]) GROUP BY 1",
                verdict.lost,
            )
        finally:
            await conn.close()
        verdict.lost_in_table = {
            "marked published" if r["published"] else "not published yet": r["n"] for r in rows
        }
    return verdict


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.checker", description=__doc__)
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers")
    parser.add_argument("--topic", action="append", required=True, help="repeat for several")
    parser.add_argument("--table", default="outbox")
    parser.add_argument("--event-id-header", default=EVENT_ID_HEADER)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for records")
    args = parser.parse_args(argv)
    verdict = asyncio.run(
        verdict_for(
            args.database_url,
            args.bootstrap,
            args.topic,
            table=args.table,
            timeout=args.timeout,
            event_id_header=args.event_id_header,
        )
    )
    sys.stdout.write(orjson.dumps(verdict.summary(), option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
