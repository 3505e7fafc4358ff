"""Property-based: whatever a writer puts in the outbox, each row ends in exactly one clear way,
decided in advance by an oracle from the rules, while well-formed rows on other keys keep flowing.

A row is either rejected by the database at write time (with a message naming what is wrong, and
nothing of it in the table), or published byte-exact (key, value, headers, event-id), or
dead-lettered with a specific reason in last_error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import re
import reprlib
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import orjson
import pytest
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

from outbox_dispatcher.config.settings import Settings

from .helpers import Services, check, consume, running, wait_until

pytestmark = pytest.mark.integration

LIMIT = 65_536  # kafka_max_request_bytes in this test: "over the limit" stays cheap
MAX_ATTEMPTS = 3
EVENT_ID_HEADER = "event-id"
CANARY_KEYS = 4
KEY_LIMIT = 2048  # bytes; the outbox_ordering_key_length constraint
TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")

# Text PostgreSQL can store: any code point but NUL and lone surrogates (astral plane included).
TEXT_CHARS = st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\x00")


# --- what a generated row is -------------------------------------------------------------------


_SHORT = reprlib.Repr()  # Python 3.11: attributes, not keyword arguments
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxdict, _SHORT.maxlevel = 60, 60, 8, 3


@dataclass(frozen=True, repr=False)
class Spec:
    """One generated row, before the world's names are filled in."""

    def __repr__(self) -> str:  # large header values would make a failing example unreadable
        fields = ", ".join(f"{k}={_SHORT.repr(v)}" for k, v in self.__dict__.items())
        return f"Spec({fields})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis's printer
        printer.text(repr(self))

    topic: tuple[str, str]  # (kind, detail); see TOPICS
    key: str | tuple[str, int] | None  # (kind, seed): built when needed, a short repr
    headers: Any  # a dict of str -> str, or any other JSON value, or NOT_GIVEN for SQL NULL
    payload: tuple[str, int]  # (kind, size or seed)
    reuse_event_id: bool


SQL_NULL = "<SQL NULL>"

# Text with at least one character a topic name may not contain.
INVALID_TOPIC_TEXT = st.tuples(
    st.text(TEXT_CHARS, max_size=6),
    TEXT_CHARS.filter(lambda c: not TOPIC.match(c)),
    st.text(TEXT_CHARS, max_size=6),
).map("".join)

COMMON_TOPICS = st.one_of(
    st.sampled_from(
        [
            ("main", ""),
            ("main", ""),
            ("other", ""),
            ("long", ""),  # an existing topic with a 249-character name
            ("internal", ""),  # __consumer_offsets: refused at write time (version 5)
            ("routed_default", ""),  # NULL topic, no route header: OUTBOX_DEFAULT_TOPIC
            ("routed_ok", ""),  # NULL topic, the template makes an existing topic
            ("routed_missing", ""),  # NULL topic, the template makes a topic that does not exist
            ("nul", ""),
        ]
    ),
)
ODD_TOPICS = st.one_of(
    st.tuples(st.just("routed_invalid"), INVALID_TOPIC_TEXT),
    st.tuples(
        st.just("missing"),
        st.text(alphabet="abcXYZ019._-", min_size=0, max_size=20),
    ),
    st.tuples(
        st.just("invalid"),
        st.one_of(
            st.sampled_from(["", ".", "..", "a b", "é", "a/b", "x" * 250, "\U0001f600"]),
            INVALID_TOPIC_TEXT,
        ),
    ),
)
TOPICS = st.integers(0, 3).flatmap(lambda n: ODD_TOPICS if n == 2 else COMMON_TOPICS)

ASTRAL = st.characters(min_codepoint=0x10000, max_codepoint=0x10FFFF)
PLAIN_KEYS = st.one_of(
    st.none(),
    st.just(""),
    st.text(TEXT_CHARS, max_size=30),
    st.text(ASTRAL, min_size=1, max_size=8),
)
ODD_KEYS = st.one_of(
    # Long keys, built from a seed (Hypothesis buffers are small): at and over the limit, and
    # 100 kB (random, or repetitive: PostgreSQL would compress that one into its indexes).
    st.tuples(
        st.sampled_from(["at_limit", "over_limit", "100k_random", "100k_repeat"]),
        st.integers(0, 2**32),
    ),
    st.text(TEXT_CHARS, max_size=10).map(lambda s: s + "\x00" + s),
)
KEYS = (
    st.integers(0, 4)
    .flatmap(lambda n: ODD_KEYS if n == 2 else PLAIN_KEYS)
    .filter(lambda k: not isinstance(k, str) or not k.startswith("canary-"))
)

HEADER_NAMES = st.one_of(
    st.text(TEXT_CHARS, max_size=20),
    st.sampled_from(["", " ", "a b", EVENT_ID_HEADER, "content-type", "\U0001f680", "traceparent"]),
).filter(lambda n: n != "route")  # the routing header is the generator's choice alone
HEADER_VALUES = st.one_of(
    st.text(TEXT_CHARS, max_size=40),
    st.integers(1, 4000).map(lambda n: "v" * n),  # large values
)
GOOD_HEADERS = st.dictionaries(HEADER_NAMES, HEADER_VALUES, max_size=40)
BAD_HEADERS = st.one_of(
    # non-string values, which the schema rejects
    st.dictionaries(
        HEADER_NAMES,
        st.one_of(
            st.integers(-(2**63), 2**63 - 1),
            st.booleans(),
            st.none(),
            st.just(["x"]),
            st.just([]),
            st.just({"a": "b"}),
        ),
        min_size=1,
        max_size=3,
    ),
    st.sampled_from([[], "text", 1, None, SQL_NULL]),
    st.text(TEXT_CHARS, max_size=5).map(lambda s: {s: "a\x00b"}),  # NUL in a value
)
# Weighted by hand: one_of() would pick the bad kind half the time, and most rows would be refused.
HEADERS = st.integers(0, 5).flatmap(lambda n: BAD_HEADERS if n == 3 else GOOD_HEADERS)

PAYLOADS = st.one_of(
    st.just(("null", 0)),
    st.just(("empty", 0)),
    st.tuples(st.just("binary"), st.integers(0, 2**32)),
    st.tuples(st.just("near"), st.integers(0, 2**32)),
    st.tuples(st.just("over"), st.integers(0, 2**32)),
)

SPECS = st.builds(
    Spec,
    topic=TOPICS,
    key=KEYS,
    headers=HEADERS,
    payload=PAYLOADS,
    reuse_event_id=st.integers(0, 19).map(lambda n: n == 11),  # not 0: Hypothesis favours it
)


def _long_key(kind: str, seed: int) -> str:
    rng = random.Random(seed)
    if kind == "100k_repeat":
        return rng.choice("ab\U0001f600") * 100_000
    if kind == "100k_random":
        return "".join(chr(rng.randrange(0x20, 0xD000)) for _ in range(100_000))
    # Three-byte characters: KEY_LIMIT bytes exactly, or one character over.
    chars = KEY_LIMIT // 3 + (1 if kind == "over_limit" else 0)
    ascii_pad = KEY_LIMIT - 3 * (KEY_LIMIT // 3) if kind == "at_limit" else 0
    return "".join(chr(rng.randrange(0x800, 0xD000)) for _ in range(chars)) + "k" * ascii_pad


# --- the oracle --------------------------------------------------------------------------------


@dataclass(repr=False)
class World:
    """The topics and settings that every example shares."""

    def __repr__(self) -> str:  # Hypothesis prints it with a failing example: keep it short
        return f"World(main={self.main!r}, records seen={len(self.seen)})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    main: str
    other: str  # also OUTBOX_DEFAULT_TOPIC
    long: str
    routed: str  # exists; routed to by header route=<routed suffix>
    canary: str
    missing_prefix: str  # no topic has this prefix
    settings: Settings
    conn: Any  # asyncpg.Connection
    admin: Any  # AIOKafkaAdminClient
    consumer: Any  # AIOKafkaConsumer
    seen: list[ConsumerRecord[bytes, bytes]] = field(default_factory=list)
    canary_ids: set[str] = field(default_factory=set)
    canary_seq: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    published: dict[str, Expected] = field(default_factory=dict)  # by event id
    dead: set[str] = field(default_factory=set)
    missing_topics: set[str] = field(default_factory=set)


@dataclass
class Row:
    """A generated row with concrete values, and what must become of it."""

    topic: str | None
    key: str | None
    headers_json: str | None
    headers: dict[str, str] | None  # when valid
    payload: bytes | None
    event_id: uuid.UUID | None
    expected: Expected


@dataclass
class Expected:
    outcome: str  # rejected | published | dead | published_or_too_large
    reasons: list[str]  # rejected: regexes, any of which the error must match; dead: all must
    topic: str | None = None
    key: bytes | None = None
    value: bytes | None = None
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    id: int | None = None


def _payload(kind: str, seed: int, rest: int, n_headers: int) -> bytes | None:
    rng = random.Random(seed)
    if kind == "null":
        return None
    if kind == "empty":
        return b""
    if kind == "binary":
        return rng.randbytes(rng.randrange(0, 300))
    if kind == "near":  # as large as surely fits
        return rng.randbytes(max(0, LIMIT - _margin(n_headers) - rest))
    return rng.randbytes(max(0, LIMIT - rest + 1 + rng.randrange(0, 2000)))  # over


def _margin(n_headers: int) -> int:
    """More than a record's framing can add to its key, value and header bytes (record batch
    header, varints per field)."""
    return 200 + 10 * (n_headers + 1)


def concretize(spec: Spec, world: World, previous: list[uuid.UUID]) -> Row:
    """Fill in names and bytes, and decide from the rules what must happen to the row."""
    s = world.settings
    kind, detail = spec.topic
    route: str | None = None
    topic: str | None
    if kind in ("main", "other", "long"):
        topic = getattr(world, kind)
    elif kind == "internal":
        topic = "__consumer_offsets"
    elif kind == "missing":
        topic = f"{world.missing_prefix}{detail}"
    elif kind == "invalid":
        topic = detail
    elif kind == "nul":
        topic = f"{world.main}\x00"
    else:
        topic = None
        route = {
            "routed_default": None,
            "routed_ok": world.routed.removeprefix("test-"),
            "routed_missing": f"{world.missing_prefix.removeprefix('test-')}routed",
            "routed_invalid": detail,
        }[kind]

    headers: dict[str, str] | None = None
    if spec.headers == SQL_NULL:
        headers_json = None
    else:
        value = spec.headers
        if route is not None and isinstance(value, dict):
            value = {**value, "route": route}
        headers_json = orjson.dumps(value).decode()
        if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
            headers = value

    key = _long_key(*spec.key) if isinstance(spec.key, tuple) else spec.key
    event_id = previous[0] if spec.reuse_event_id and previous else None

    # Rejected at write time: every rule the row breaks, as the message must name one of them.
    broken: list[str] = []
    if (topic is not None and "\x00" in topic) or (key is not None and "\x00" in key):
        broken.append(r'invalid byte sequence for encoding "UTF8": 0x00')
    if headers_json is not None and "\\u0000" in headers_json:
        broken.append(r"unsupported Unicode escape sequence")
    if headers_json is None:
        broken.append(r'null value in column "headers" .* violates not-null constraint')
    elif headers is None:
        broken.append(r'violates check constraint "outbox_headers_valid"')
    if topic is not None and (not TOPIC.match(topic) or topic in (".", "..")):
        broken.append(r'violates check constraint "outbox_topic_valid"')
    if topic is not None and topic.startswith("__"):
        broken.append(r'violates check constraint "outbox_topic_not_internal"')
    if key is not None and len(key.encode("utf-8", "surrogatepass")) > KEY_LIMIT:
        broken.append(r'violates check constraint "outbox_ordering_key_length"')
    if event_id is not None:
        broken.append(r'violates unique constraint "outbox_event_id_key"')
    payload_bytes_rest = 0
    sent_headers: list[tuple[str, bytes]] = []
    if headers is not None:
        reserved = s.event_id_header.casefold()
        sent_headers = [(n, v.encode()) for n, v in headers.items() if n.casefold() != reserved]
    key_bytes = None if key is None or "\x00" in key else key.encode()
    payload_bytes_rest = (
        len(key_bytes or b"")
        + sum(len(n.encode()) + len(v) for n, v in sent_headers)
        + len(s.event_id_header.encode())
        + 36
    )
    payload = _payload(*spec.payload, rest=payload_bytes_rest, n_headers=len(sent_headers))
    row = Row(topic, key, headers_json, headers, payload, event_id, Expected("rejected", broken))
    if broken:
        return row

    # Accepted: where does it go, and can it get there?
    expected = row.expected
    expected.key = key_bytes
    expected.value = payload
    expected.headers = sent_headers  # plus event-id, known after the insert
    target = topic
    if topic is None:
        if route is None:
            target = s.default_topic
        elif not TOPIC.match(f"test-{route}"):
            expected.outcome = "dead"
            expected.reasons = [
                r"^permanent error, not retried: RoutingError: ",
                re.escape(f"made {'test-' + route!r} from the row's headers"),
                r"not a valid topic name",
            ]
            return row
        else:
            target = f"test-{route}"
    assert target is not None
    expected.topic = target
    if target.startswith(world.missing_prefix):
        world.missing_topics.add(target)
        expected.outcome = "dead"
        expected.reasons = [
            rf"^gave up after {MAX_ATTEMPTS} failed attempts: TopicMissingError: ",
            re.escape(f"topic {target!r} does not exist"),
            r"OUTBOX_KAFKA_ALLOW_AUTO_CREATE_TOPICS is false: create the topic",
        ]
        return row
    if key is None and payload is None:
        expected.outcome = "dead"
        expected.reasons = [
            r"^permanent error, not retried: UnpublishableRowError: ",
            r"a tombstone \(NULL payload\) needs an ordering_key",
        ]
        return row
    size = payload_bytes_rest + len(payload or b"")
    too_large = [
        r"^permanent error, not retried: MessageSizeTooLargeError: ",
        r"larger than the maximum request size",
    ]
    if size > LIMIT:
        expected.outcome = "dead"
        expected.reasons = too_large
        return row
    if size + _margin(len(sent_headers)) > LIMIT:
        # Within a record's framing of the limit: either is right, nothing else is.
        expected.outcome = "published_or_too_large"
        expected.reasons = too_large
    else:
        expected.outcome = "published"
    if target == "__consumer_offsets":
        ambiguous = expected.outcome == "published_or_too_large"
        expected.outcome = "dead"
        expected.reasons = [
            r"^permanent error, not retried: (InvalidTopicError"
            + ("|MessageSizeTooLargeError" if ambiguous else "")
            + ")"
        ]
        if not ambiguous:
            expected.reasons.append(r"write to an internal topic")
    return row


# --- the world ---------------------------------------------------------------------------------


async def _create(admin: AIOKafkaAdminClient, name: str, created: list[str]) -> str:
    await admin.create_topics([NewTopic(name, num_partitions=3, replication_factor=1)])
    created.append(name)
    return name


async def _ensure_consumer_offsets(admin: AIOKafkaAdminClient) -> None:
    """The internal-topic case writes to __consumer_offsets, which a fresh broker creates only
    when a consumer group first asks for its coordinator: ask, until it exists."""
    for _ in range(120):
        try:
            await admin.find_coordinator("outbox-dispatcher-tests")
        except KafkaError:
            await asyncio.sleep(0.5)
        else:
            return
    msg = "the broker did not create __consumer_offsets"
    raise AssertionError(msg)


@pytest.fixture
async def world(
    services: Services, make_settings: Callable[..., Settings], database_url: str
) -> AsyncIterator[World]:
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka_bootstrap_servers)
    await admin.start()
    created: list[str] = []
    tag = uuid.uuid4().hex[:10]
    conn = await asyncpg.connect(database_url)
    consumer: AIOKafkaConsumer | None = None
    try:
        names = {
            "main": f"test-{tag}-main",
            "other": f"test-{tag}-other",
            "long": f"test-{tag}-" + "l" * (249 - len(f"test-{tag}-")),
            "routed": f"test-{tag}-routed",
            "canary": f"test-{tag}-canary",
        }
        for name in names.values():
            await _create(admin, name, created)
        await _ensure_consumer_offsets(admin)
        settings = make_settings(
            kafka_max_request_bytes=LIMIT,
            kafka_allow_auto_create_topics=False,
            max_attempts=MAX_ATTEMPTS,
            backoff_initial_seconds=0.05,
            backoff_max_seconds=0.2,
            lease_seconds=15.0,
            batch_size=40,
            topic_template="test-{route}",
            default_topic=names["other"],
            http_port=0,
        )
        consumer = AIOKafkaConsumer(
            bootstrap_servers=services.kafka_bootstrap_servers,
            enable_auto_commit=False,
            isolation_level="read_committed",
            group_id=None,
            max_partition_fetch_bytes=4 * LIMIT,
        )
        await consumer.start()
        partitions = [TopicPartition(t, p) for t in names.values() for p in range(3)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        async with running(settings):
            yield World(
                **names,
                missing_prefix=f"test-{tag}-missing-",
                settings=settings,
                conn=conn,
                admin=admin,
                consumer=consumer,
            )
    finally:
        if consumer is not None:
            await consumer.stop()
        await conn.close()
        with contextlib.suppress(Exception):
            await admin.delete_topics(created)
        await admin.close()


async def _insert(conn: asyncpg.Connection, row: Row) -> tuple[int, uuid.UUID] | BaseException:
    """One row in its own transaction: a rejected row takes nothing else with it."""
    try:
        async with conn.transaction():
            inserted = await conn.fetchrow(
                "INSERT INTO outbox (topic, ordering_key, payload, headers, event_id) "
                "VALUES ($1, $2, $3, $4::text::jsonb, coalesce($5, gen_random_uuid())) "
                "RETURNING id, event_id",
                row.topic,
                row.key,
                row.payload,
                row.headers_json,
                row.event_id,
            )
    except (asyncpg.PostgresError, asyncpg.DataError) as exc:
        return exc
    assert inserted is not None
    return inserted["id"], inserted["event_id"]


async def _insert_canaries(world: World) -> None:
    for k in range(CANARY_KEYS):
        key = f"canary-{k}"
        seq = world.canary_seq[key]
        world.canary_seq[key] = seq + 1
        event_id = await world.conn.fetchval(
            "SELECT outbox_enqueue($1, $2, $3)",
            world.canary,
            key,
            orjson.dumps({"key": key, "seq": seq}),
        )
        world.canary_ids.add(str(event_id))


async def _drain(world: World, wanted: set[str], timeout: float = 60.0) -> None:
    """Read until every wanted event id arrived (the consumer stays at its place between
    examples, so each record is read once)."""
    have = {_event_id(r) for r in world.seen}
    deadline = time.monotonic() + timeout
    while not wanted <= have:
        if time.monotonic() > deadline:
            msg = f"{len(wanted - have)} published rows never arrived in Kafka"
            raise AssertionError(msg)
        batch = await world.consumer.getmany(timeout_ms=300, max_records=10_000)
        for records in batch.values():
            world.seen.extend(records)
            have.update(_event_id(r) for r in records)


def _event_id(record: ConsumerRecord[bytes, bytes]) -> str:
    return dict(record.headers).get(EVENT_ID_HEADER, b"").decode()


# --- the property ------------------------------------------------------------------------------


@settings(
    max_examples=int(os.environ.get("OUTBOX_TEST_BAD_INPUT_EXAMPLES", "20")),
    deadline=None,
    derandomize=os.environ.get("OUTBOX_TEST_BAD_INPUT_RANDOM") is None,
    database=None,
    # Each example costs seconds of real publishing: report the failing example as found.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # one dispatcher serves every example, on purpose
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
@given(specs=st.lists(SPECS, min_size=1, max_size=12))
# Regressions, always run first: each of these once got through or stopped the dispatcher.
@example(
    specs=[
        Spec(("main", ""), "k", {"a": ["x"]}, ("binary", 1), reuse_event_id=False),
        Spec(("main", ""), "k", {"a": []}, ("binary", 2), reuse_event_id=False),
        Spec(("main", ""), ("over_limit", 3), {}, ("binary", 3), reuse_event_id=False),
        Spec(("main", ""), ("100k_repeat", 4), {}, ("binary", 4), reuse_event_id=False),
        Spec(("main", ""), None, {}, ("null", 0), reuse_event_id=False),
        Spec(("main", ""), "", {EVENT_ID_HEADER: "forged", "": ""}, ("null", 0), False),
        Spec(("missing", "x"), "k", {}, ("near", 5), reuse_event_id=False),
        Spec(("routed_missing", ""), "k", {}, ("binary", 6), reuse_event_id=False),
        Spec(("internal", ""), "k", {}, ("binary", 7), reuse_event_id=False),
        Spec(("long", ""), "k", {}, ("over", 8), reuse_event_id=False),
        Spec(("main", ""), "k", {}, ("binary", 9), reuse_event_id=True),
    ]
)
async def test_every_row_is_rejected_published_or_dead_lettered_as_the_rules_say(
    world: World, specs: list[Spec]
) -> None:
    conn = world.conn
    start: int = await conn.fetchval("SELECT coalesce(max(id), 0) FROM outbox")
    accepted: list[Row] = []
    previous: list[uuid.UUID] = []
    for spec in specs:
        await _insert_canaries(world)
        row = concretize(spec, world, previous)
        event(f"{row.expected.outcome}: topic {spec.topic[0]}, payload {spec.payload[0]}")
        result = await _insert(conn, row)
        if row.expected.outcome == "rejected":
            assert isinstance(result, BaseException), f"accepted a row that breaks {row.expected}"
            message = str(result)
            assert any(re.search(r, message) for r in row.expected.reasons), (
                f"{type(result).__name__}: {message!r} names none of {row.expected.reasons}"
            )
            continue
        assert not isinstance(result, BaseException), f"rejected a valid row: {result!r}"
        row.expected.id, event_id = result
        row.expected.headers = [*row.expected.headers, (EVENT_ID_HEADER, str(event_id).encode())]
        row.event_id = event_id
        previous.append(event_id)
        accepted.append(row)
    await _insert_canaries(world)

    # Nothing of a rejected row is in the table; every accepted row is, once.
    ids = [r.expected.id for r in accepted]
    stored = await conn.fetch(
        "SELECT id FROM outbox WHERE id > $1 AND topic IS DISTINCT FROM $2", start, world.canary
    )
    assert sorted(r["id"] for r in stored) == sorted(ids)

    async def settled() -> bool:
        left: int = await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_at IS NULL"
        )
        return left == 0

    await wait_until(settled, 90, "every row published or dead-lettered")
    rows = {
        r["id"]: r
        for r in await conn.fetch(
            "SELECT id, event_id, published_at, dead_at, last_error, attempts FROM outbox "
            "WHERE id = ANY($1::bigint[])",
            ids,
        )
    }
    for row in accepted:
        got = rows[row.expected.id]
        outcome = "published" if got["published_at"] is not None else "dead"
        wanted = row.expected.outcome
        if wanted == "published_or_too_large":
            wanted = outcome
        assert outcome == wanted, (
            f"row {got['id']} (topic {row.topic!r}) was {outcome} ({got['last_error']!r}), "
            f"expected {row.expected.outcome}: {row.expected.reasons}"
        )
        if outcome == "dead":
            reason = got["last_error"] or ""
            for pattern in row.expected.reasons:
                assert re.search(pattern, reason), f"{reason!r} does not match {pattern!r}"
            world.dead.add(str(got["event_id"]))
        else:
            world.published[str(got["event_id"])] = row.expected

    await _drain(world, set(world.published) | world.canary_ids)

    # Published rows: in their topic, byte-exact, each once; per key in id order.
    firsts: dict[str, ConsumerRecord[bytes, bytes]] = {}
    for record in world.seen:
        firsts.setdefault(_event_id(record), record)
    last_id: dict[tuple[str, bytes | None], int] = {}
    for event_id, expected in sorted(world.published.items(), key=lambda kv: kv[1].id or 0):
        record = firsts[event_id]
        assert record.topic == expected.topic
        assert record.key == expected.key
        assert record.value == expected.value
        assert sorted(record.headers) == sorted(expected.headers)
        if expected.key is not None:
            assert expected.id is not None
            place = (record.topic, expected.key)
            assert last_id.get(place, -1) < expected.id
            last_id[place] = expected.id
    assert not world.dead & set(firsts), "a dead-lettered row reached Kafka"
    unexpected = set(firsts) - set(world.published) - world.canary_ids
    assert not unexpected, f"records nobody published: {sorted(unexpected)[:5]}"

    # The canaries on other keys kept flowing: all there, in order per key.
    canaries = [r for r in world.seen if r.topic == world.canary]
    verdict = check(canaries, world.canary_ids)
    assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], [])

    # Missing topics stayed missing: the dispatcher never asked the broker to create them.
    existing = set(await world.admin.list_topics())
    assert not world.missing_topics & existing


def test_the_oracle_decides_hand_picked_rows() -> None:
    """The oracle itself (a wrong oracle would make the property vacuous)."""
    world = World(
        main="test-m",
        other="test-o",
        long="test-l",
        routed="test-r",
        canary="test-c",
        missing_prefix="test-missing-",
        settings=Settings(default_topic="test-o", topic_template="test-{route}"),
        conn=None,
        admin=None,
        consumer=None,
    )

    def decide(**fields: Any) -> Expected:
        values: dict[str, Any] = {
            "topic": ("main", ""),
            "key": "k",
            "headers": {"a": "b"},
            "payload": ("binary", 1),
            "reuse_event_id": False,
        }
        return concretize(Spec(**{**values, **fields}), world, [uuid.uuid4()]).expected

    assert decide().outcome == "published"
    assert decide(headers={EVENT_ID_HEADER: "forged"}).headers == []  # replaced by the real one
    assert decide(payload=("near", 2)).outcome == "published"
    assert decide(payload=("over", 2)).outcome == "dead"
    assert decide(key=None, payload=("null", 0)).outcome == "dead"
    assert decide(key="", payload=("null", 0)).outcome == "published"
    assert decide(topic=("missing", "x")).reasons[0].startswith("^gave up after 3")
    assert decide(topic=("routed_missing", "")).topic == "test-missing-routed"
    assert decide(topic=("routed_default", "")).topic == "test-o"
    assert decide(topic=("routed_invalid", "a b")).outcome == "dead"
    assert decide(topic=("internal", "")).outcome == "rejected"
    assert len(decide(topic=("invalid", "a b"), headers={"n": 1}).reasons) == 2
    assert decide(key=("at_limit", 1)).outcome == "published"
    assert decide(key=("over_limit", 1)).outcome == "rejected"
    assert decide(key=("100k_repeat", 1)).outcome == "rejected"
    assert decide(headers=SQL_NULL).outcome == "rejected"
    assert decide(reuse_event_id=True).outcome == "rejected"


async def test_missing_topics_with_and_without_auto_creation(
    conn: asyncpg.Connection, services: Services, make_settings: Callable[..., Settings]
) -> None:
    """OUTBOX_KAFKA_ALLOW_AUTO_CREATE_TOPICS=false: a row for a missing topic is retried, then
    dead-lettered with a message saying to create the topic, and the topic is not created; other
    keys flow meanwhile. With the default (true) the broker creates the topic, except where it
    refuses (a name colliding with an existing one on '.' and '_'), which ends the same way."""
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka_bootstrap_servers)
    await admin.start()
    tag = uuid.uuid4().hex[:10]
    canary, collider = f"test-{tag}-canary", f"test-{tag}-a_b"
    missing, created, colliding = f"test-{tag}-missing", f"test-{tag}-created", f"test-{tag}-a.b"
    try:
        for name in (canary, collider):
            await _create(admin, name, [])

        sequence = iter(range(1000))

        async def write(topic: str) -> tuple[uuid.UUID, set[str]]:
            """A row for `topic`, then canaries (seq continues across calls)."""
            row = await conn.fetchval("SELECT outbox_enqueue($1, 'k', 'x')", topic)
            ids = set()
            for seq in itertools.islice(sequence, 20):
                ids.add(
                    str(
                        await conn.fetchval(
                            "SELECT outbox_enqueue($1, $2, $3)",
                            canary,
                            f"canary-{seq % 4}",
                            orjson.dumps({"key": seq % 4, "seq": seq}),
                        )
                    )
                )
            return row, ids

        async def settle(settings: Settings) -> None:
            async def done() -> bool:
                left: int = await conn.fetchval(
                    "SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_at IS NULL"
                )
                return left == 0

            async with running(settings):
                await wait_until(done, 60, "every row settled")

        strict = make_settings(
            kafka_allow_auto_create_topics=False,
            max_attempts=3,
            backoff_initial_seconds=0.05,
            backoff_max_seconds=0.2,
            http_port=0,
        )
        row, canaries = await write(missing)
        await settle(strict)
        dead = await conn.fetchrow("SELECT * FROM outbox WHERE event_id = $1", row)
        assert dead["dead_at"] is not None and dead["attempts"] == 3
        assert dead["last_error"].startswith("gave up after 3 failed attempts: TopicMissingError")
        assert (
            "OUTBOX_KAFKA_ALLOW_AUTO_CREATE_TOPICS is false: create the topic"
            in (dead["last_error"])
        )
        assert missing not in await admin.list_topics()

        lenient = make_settings(
            max_attempts=2, publish_timeout_seconds=2, backoff_initial_seconds=0.05, http_port=0
        )
        auto, more = await write(created)
        refused, most = await write(colliding)
        await settle(lenient)
        rows = {r["event_id"]: r for r in await conn.fetch("SELECT * FROM outbox")}
        assert rows[auto]["published_at"] is not None
        assert created in await admin.list_topics()
        assert rows[refused]["dead_at"] is not None
        assert "TopicMissingError" in rows[refused]["last_error"]
        assert "was not auto-created: create it" in rows[refused]["last_error"]

        everything = canaries | more | most
        verdict = check(
            await consume(services.kafka_bootstrap_servers, canary, len(everything)), everything
        )
        assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], [])
    finally:
        with contextlib.suppress(Exception):
            await admin.delete_topics([canary, collider, created])
        await admin.close()


async def test_a_stored_row_with_non_string_headers_is_dead_lettered_not_a_crash(
    conn: asyncpg.Connection, services: Services, topic: str, make_settings: Callable[..., Settings]
) -> None:
    """Schema version 2's lax check stored {"a": ["x"]}; such a row used to stop the dispatcher
    (AttributeError in the claim loop) on every start. Now it is dead-lettered and others flow."""
    await conn.execute("ALTER TABLE outbox DROP CONSTRAINT outbox_headers_valid")  # as in v2
    bad = await conn.fetchval(
        'SELECT outbox_enqueue($1, \'k\', \'x\', \'{"a": ["x"], "b": "c"}\')', topic
    )
    good = {
        str(await conn.fetchval("SELECT outbox_enqueue($1, 'k', $2)", topic, orjson.dumps(n)))
        for n in ({"key": "k", "seq": 1}, {"key": "k", "seq": 2})
    }
    async with running(make_settings(http_port=0)) as dispatcher:

        async def settled() -> bool:
            left: int = await conn.fetchval(
                "SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_at IS NULL"
            )
            return left == 0

        await wait_until(settled, 30, "every row settled")
        assert not dispatcher.stopping.is_set()
    row = await conn.fetchrow("SELECT * FROM outbox WHERE event_id = $1", bad)
    assert row["dead_at"] is not None and row["attempts"] == 1
    assert row["last_error"].startswith("permanent error, not retried: UnpublishableRowError")
    assert "header 'a' is a JSON list, not a string" in row["last_error"]
    verdict = check(await consume(services.kafka_bootstrap_servers, topic, 2), good)
    assert (verdict.lost, verdict.reordered, verdict.unexpected) == ([], [], [])
