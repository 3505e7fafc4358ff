"""Exactly-once's records of progress (docs/design/exactly-once.md): the progress topic, what a
dispatcher's progress record says, fencing another dispatcher's transactions and reading what
the dispatchers committed.

Every transaction of a dispatcher ends with one progress record, keyed by its transactional id,
that lists every batch it committed and has not yet seen marked in the database, this one
included. So the last committed record of an id is all a takeover needs (the topic is
compacted: older records of an id may go), once the id is fenced: its open transaction aborted
or its commit in progress finished, and no later one can start under the old producer.

A record lists rows as (id, replays) pairs under the outbox's identity (a uuid the schema keeps,
drawn again by a TRUNCATE): a row an operator replayed, or a row of a truncated table whose ids
started over, never matches a stale record (issue 35, E5). Version 1 records (bare ids, the
database and oid as identity) are skipped: a takeover then sends their rows again, never marks
them unsent. A tombstone (no value) ends a key once nothing it listed is pending (E9).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

from outbox_dispatcher import errors
from outbox_dispatcher.kafka import tls
from outbox_dispatcher.kafka.producers import ProducerConfig, Producers
from outbox_dispatcher.kafka.tls import ConnectionConfig

VERSION = 2
# A record's bytes beyond its pairs, as config/checks.py counts them (PROGRESS_RECORD_OVERHEAD_
# BYTES: a record of one full batch must fit OUTBOX_KAFKA_MAX_REQUEST_BYTES, checked at start).
RECORD_OVERHEAD_BYTES = 1024
PAIR_BYTES_AT_MOST = 33  # "[<bigint>,<int>]," (config/checks.py's PROGRESS_PAIR_BYTES_AT_MOST)

Pair = tuple[int, int]  # a row in a progress record: its id and its replay count
Listed = dict[str, list[Pair]]  # tag: pairs
Record = tuple[bytes | None, bytes | None]  # a progress record's key and value


@dataclass(frozen=True)
class ProgressConfig:
    """Where progress goes and whose it is."""

    topic: str  # OUTBOX_PROGRESS_TOPIC
    outbox: str  # "<schema>.<table>": records of another outbox on the topic are not ours
    transactional_id_prefix: str  # OUTBOX_TRANSACTIONAL_ID_PREFIX
    timeout_seconds: float  # OUTBOX_TRANSACTION_TIMEOUT_SECONDS

    def transactional_id(self, owner: str) -> str:
        return f"{self.transactional_id_prefix}{self.outbox}.{owner}"


def record_value(
    config: ProgressConfig, identity: str, owner: str, batches: Mapping[str, Sequence[Pair]]
) -> bytes:
    """A progress record: the (id, replays) pairs of each batch (by its tag) committed and not
    seen marked, under the outbox's `identity`."""
    body = {
        "v": VERSION,
        "outbox": config.outbox,
        "identity": identity,
        "owner": owner,
        "batches": {t: [list(p) for p in pairs] for t, pairs in batches.items()},
    }
    return orjson.dumps(body)


def last_batches(
    config: ProgressConfig, identity: str, records: Iterable[Record]
) -> dict[str, Listed]:
    """Per key (a lane's transactional id), the batches (tag: pairs) its last progress record
    lists (`records`: in log order; the last of each key wins, a tombstone ends it; another
    outbox's or identity's, a version 1 one, or an unreadable one, is skipped)."""
    last: dict[str, Listed] = {}
    for key, value in records:
        name = (key or b"").decode(errors="replace")
        if value is None:
            last.pop(name, None)
            continue
        batches = _batches(config, identity, value)
        if batches is not None:
            last[name] = batches
    return last


def _batches(config: ProgressConfig, identity: str, value: bytes) -> Listed | None:
    """A record's batches, if it is this outbox's under `identity` and readable."""
    try:
        body = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict) or body.get("v") != VERSION:
        return None
    if body.get("outbox") != config.outbox or body.get("identity") != identity:
        return None
    batches = body.get("batches")
    if not isinstance(batches, dict):
        return None
    try:
        return {str(t): [(int(i), int(r)) for i, r in pairs] for t, pairs in batches.items()}
    except (TypeError, ValueError):
        return None


def committed_pairs(config: ProgressConfig, identity: str, records: Iterable[Record]) -> set[Pair]:
    """The pairs in any key's last progress record: committed, not seen marked."""
    return {
        p
        for batches in last_batches(config, identity, records).values()
        for pairs in batches.values()
        for p in pairs
    }


async def fence(producer_config: ProducerConfig, transactional_id: str, seconds: float) -> None:
    """Fence `transactional_id` within `seconds`: a producer under it initialises (the broker
    aborts the id's open transaction, or first finishes its commit in progress, and refuses the
    old producer from now on) and closes. Its first request already aborts an open transaction;
    the start waits for the id's markers, which a partition short of in-sync replicas does not
    take (TimeoutError past `seconds`)."""
    producers = Producers(dataclasses.replace(producer_config, transactional_id=transactional_id))
    await producers.start(seconds)
    try:
        producer = producers.current()
        async with asyncio.timeout(seconds):
            await producer.begin_transaction()
            await producer.abort_transaction()  # nothing was sent: ends at once
    finally:
        await producers.stop()


async def read_committed(
    connection: ConnectionConfig,
    topic: str,
    partitions: Iterable[int],
    seconds: float,
    end_seconds: float | None = None,
) -> list[Record]:
    """Every committed record of the progress topic (of its `partitions`), in log order per
    partition, up to its high watermark when the read starts (review E4): every record written
    before then is read once its transaction ended, not only those below the last stable offset
    (an older open transaction there, another outbox's or a hanging one, would hide a committed
    record). The read takes `seconds` at most, and waits for such a transaction to end
    `end_seconds` at most (by default the same): past that, ProgressEndUnreachedError (what was
    committed is unknown; the caller decides nothing)."""
    tps = [TopicPartition(topic, p) for p in partitions]
    ends = await high_watermarks(connection, tps, seconds)
    consumer = AIOKafkaConsumer(
        **client_options(connection),
        isolation_level="read_committed",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    reader = _Reader(consumer, tps, ends)
    try:
        async with asyncio.timeout(max(seconds, end_seconds or 0.0)):
            return await reader.read(end_seconds or seconds)
    except TimeoutError:
        raise reader.unreached() from None
    finally:
        await consumer.stop()


async def high_watermarks(
    connection: ConnectionConfig, tps: list[TopicPartition], seconds: float
) -> dict[TopicPartition, int]:
    """Each partition's high watermark (a read_uncommitted ListOffsets: past every record
    written, committed or not; a read_committed one answers the last stable offset)."""
    consumer = AIOKafkaConsumer(
        **client_options(connection), isolation_level="read_uncommitted", enable_auto_commit=False
    )
    await consumer.start()
    try:
        async with asyncio.timeout(seconds):
            ends: dict[TopicPartition, int] = await consumer.end_offsets(tps)
            return ends
    finally:
        await consumer.stop()


class _Reader:
    """A read_committed read to given end offsets; where it stopped, if it did not get there."""

    def __init__(
        self, consumer: AIOKafkaConsumer, tps: list[TopicPartition], ends: dict[TopicPartition, int]
    ) -> None:
        self.consumer = consumer
        self.tps = tps
        self.ends = ends
        self.positions: dict[TopicPartition, int] = dict.fromkeys(tps, 0)

    async def read(self, end_seconds: float) -> list[Record]:
        self.consumer.assign(self.tps)
        await self.consumer.seek_to_beginning(*self.tps)
        values: list[Record] = []
        waiting = {tp for tp in self.tps if self.ends[tp] > 0}
        # Once nothing more comes below the end (an open transaction holds the last stable
        # offset there), the wait for it is bounded by end_seconds.
        stuck_since: float | None = None
        loop = asyncio.get_running_loop()
        while waiting:
            batches = await self.consumer.getmany(*waiting, timeout_ms=500)
            for messages in batches.values():
                values.extend((m.key, m.value) for m in messages)
            before = dict(self.positions)
            for tp in waiting:
                self.positions[tp] = await self.consumer.position(tp)
            waiting = {tp for tp in waiting if self.positions[tp] < self.ends[tp]}
            if batches or self.positions != before:
                stuck_since = None
            elif stuck_since is None:
                stuck_since = loop.time()
            elif loop.time() - stuck_since > end_seconds:
                raise self.unreached()
        return values

    def unreached(self) -> ProgressEndUnreachedError:
        behind = {
            tp: (self.positions[tp], self.ends[tp])
            for tp in self.tps
            if self.positions[tp] < self.ends[tp]
        }
        return ProgressEndUnreachedError(behind)


def client_options(connection: ConnectionConfig) -> dict[str, Any]:
    """The connection's settings as an aiokafka consumer or admin client takes them."""
    c = connection
    return {
        "bootstrap_servers": c.bootstrap_servers.split(","),
        "client_id": c.client_id,
        "request_timeout_ms": int(max(c.request_timeout_seconds, 10.0) * 1000),
        "security_protocol": c.security_protocol,
        "ssl_context": tls.ssl_context(c),
        "sasl_mechanism": c.sasl_mechanism or "PLAIN",
        "sasl_plain_username": c.sasl_username,
        "sasl_plain_password": c.sasl_password.get_secret_value() if c.sasl_password else None,
    }


class ProgressUnavailableError(errors.BrokerUnavailableError):
    """The progress of the other dispatchers could not be read (the broker is away): the rows a
    takeover found wait, leased, for the next try."""


class ProgressEndUnreachedError(ProgressUnavailableError):
    """The progress could not be read to its end: a transaction open on the progress partition
    (before the end the read aims at) did not end in time, so a committed record after it may be
    hidden. Nothing is decided: the rows wait, leased. A transaction that never ends is a hanging
    one (KIP-664): the operator aborts it."""

    def __init__(self, behind: Mapping[TopicPartition, tuple[int, int]]) -> None:
        where = ", ".join(
            f"{tp.topic}[{tp.partition}] read to offset {at} of {end}"
            for tp, (at, end) in behind.items()
        )
        super().__init__(
            f"the progress topic could not be read to its end ({where or 'nothing read'}): a "
            "transaction open there holds it. If it does not end within the transaction "
            "timeout, it hangs: list it with `kafka-transactions.sh find-hanging` and end it "
            "with `kafka-transactions.sh abort` (the rows wait until then)"
        )
        self.behind = dict(behind)


class ProgressRecordTooLargeError(errors.BrokerUnavailableError):
    """A lane's progress record does not fit OUTBOX_KAFKA_MAX_REQUEST_BYTES (review E8): it lists
    the batches the lane committed and has not seen marked, and some marks failed. The lane's
    transaction is aborted as in an outage (its rows are not refused, its producer is kept) and
    goes again after the pause, once batches nobody needs any more left the list."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"the progress record ({size} bytes) does not fit OUTBOX_KAFKA_MAX_REQUEST_BYTES "
            f"({limit}): batches whose marks failed are listed until their rows are settled "
            "(a takeover after their leases expire settles them); if it lasts, raise "
            "OUTBOX_KAFKA_MAX_REQUEST_BYTES (and the broker's message.max.bytes) or lower "
            "OUTBOX_BATCH_SIZE"
        )
