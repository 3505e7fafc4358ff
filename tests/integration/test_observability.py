"""/metrics, /livez, /readyz, tracing and CloudEvents headers, on real PostgreSQL and Kafka."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import orjson
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from outbox_dispatcher import metrics
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.supervisor import Dispatcher

from .helpers import (
    Services,
    consume,
    http_get,
    insert_sequenced,
    running,
    wait_all_settled,
    wait_until,
)

pytestmark = pytest.mark.integration

SPANS = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def tracer_provider() -> None:
    """The process-wide provider a tracing-enabled dispatcher reports to (set once per process)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(SPANS))
    trace.set_tracer_provider(provider)


async def port_of(dispatcher: Dispatcher) -> int:
    async def bound() -> bool:
        return dispatcher.http_port is not None

    await wait_until(bound, 30, "the HTTP endpoint")
    assert dispatcher.http_port is not None
    return dispatcher.http_port


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics by (name, sorted labels)."""
    status, body = await http_get(port, "/metrics")
    assert status == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


async def test_metrics_livez_and_readyz_describe_a_working_dispatcher(
    conn: asyncpg.Connection, topic: str, make_settings: Any
) -> None:
    await insert_sequenced(conn, topic, keys=5, per_key=20)
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, 'big', $2)",
        topic,
        b"x" * 200_000,
    )
    settings = make_settings(metrics_interval_seconds=0.2, kafka_max_request_bytes=100_000)
    async with running(settings) as dispatcher:
        port = await port_of(dispatcher)
        await wait_all_settled(conn, 60)

        async def sampled_after_settling() -> bool:
            samples = await scrape(port)
            return (
                samples[("outbox_pending_rows", ())] == 0 and samples[("outbox_dead_rows", ())] == 1
            )

        await wait_until(sampled_after_settling, 30, "the table gauges to catch up")
        samples = await scrape(port)
        live_status, live = await http_get(port, "/livez")
        ready_status, ready = await http_get(port, "/readyz")
        missing_status, _ = await http_get(port, "/nope")

    names = {name for name, _ in samples}
    for name in metrics.NAMES:
        exported = {name, f"{name}_count", f"{name}_bucket"} & names
        assert exported, f"{name} is not exported"
    t = (("topic", topic),)
    assert samples[("outbox_published_total", t)] == 100
    assert samples[("outbox_claimed_rows_total", ())] == 101
    assert samples[("outbox_dead_lettered_total", (("reason", "permanent"), *t))] == 1
    assert samples[("outbox_publish_failures_total", (("reason", "permanent"), *t))] == 1
    assert samples[("outbox_commit_to_ack_seconds_count", ())] == 100
    assert samples[("outbox_claim_duration_seconds_count", ())] >= 1
    assert samples[("outbox_publish_duration_seconds_count", ())] >= 1
    assert samples[("outbox_mark_duration_seconds_count", ())] >= 1
    assert samples[("outbox_in_flight_rows", ())] == 0
    assert samples[("outbox_oldest_pending_age_seconds", ())] == 0
    assert samples[("outbox_ready", ())] == 1
    assert [labels for name, labels in samples if name == "outbox_build_info"]
    assert live_status == 200
    assert orjson.loads(live) == {"live": True, "stale_loops": {}}
    assert ready_status == 200
    assert orjson.loads(ready) == {
        "ready": True,
        "checks": {"database": "ok", "schema": "ok", "broker": "ok"},
    }
    assert missing_status == 404


async def test_lag_and_blocked_keys_are_visible(
    conn: asyncpg.Connection, topic: str, make_settings: Any
) -> None:
    """A dead row blocks its key under policy block; the waiting rows show as lag."""
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, dead_at, last_error, created_at) "
        "VALUES ($1, 'stuck', 'x', now(), 'by test', now() - interval '1 hour')",
        topic,
    )
    # A dispatcher noted the highest committed id 10 minutes ago: rows written after that note
    # may be that old by the database's clock (lag is never measured from created_at alone).
    await backdate_clock(conn, minutes=10)
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, created_at) "
        "VALUES ($1, 'stuck', 'y', now() - interval '10 minutes')",
        topic,
    )
    settings = make_settings(metrics_interval_seconds=0.2, dead_letter_policy="block")
    async with running(settings) as dispatcher:
        port = await port_of(dispatcher)

        async def blocked() -> bool:
            return (await scrape(port)).get(("outbox_blocked_keys", (("reason", "dead"),))) == 1

        await wait_until(blocked, 30, "the blocked key to show")
        samples = await scrape(port)
        await conn.execute(
            "INSERT INTO outbox_paused (topic, paused_by) VALUES ($1, 'test')", topic
        )

        async def paused() -> bool:
            return (await scrape(port)).get(("outbox_paused", (("scope", "topic"),))) == 1

        await wait_until(paused, 30, "the pause to show")
        after_pause = await scrape(port)
    assert samples[("outbox_pending_rows", ())] == 1
    assert 590 < samples[("outbox_oldest_pending_age_seconds", ())] < 900
    assert samples[("outbox_dead_rows", ())] == 1
    assert samples[("outbox_paused", (("scope", "topic"),))] == 0
    assert after_pause[("outbox_paused", (("scope", "table"),))] == 0


async def backdate_clock(conn: asyncpg.Connection, *, minutes: float) -> None:
    """A clock entry as a dispatcher would have noted it `minutes` ago: rows written after it
    were committed at most that long ago, by the database's clock. Later entries (the template
    database's, from its migration) go, as time runs one way."""
    await conn.execute(
        "DELETE FROM outbox_clock WHERE at >= now() - $1 * interval '1 minute'", minutes
    )
    await conn.execute(
        "INSERT INTO outbox_clock (seq, at) SELECT coalesce(max(id), 0), "
        "now() - $1 * interval '1 minute' FROM outbox",
        minutes,
    )


async def test_paused_and_held_rows_are_parked_not_lag(
    conn: asyncpg.Connection, topic: str, make_topic: Any, make_settings: Any
) -> None:
    """A planned pause and held rows do not page as lag: they have their own gauges (issue 12)."""
    held_topic = await make_topic()
    await backdate_clock(conn, minutes=20)
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, created_at) "
        "SELECT $1, 'k' || i, 'x', now() - interval '20 minutes' FROM generate_series(1, 3) i",
        topic,
    )
    # Held without a failure (what an interrupted replay of version 0.1 left), and a newer row of
    # the same key, which waits behind it.
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload, created_at, next_attempt_at) "
        "VALUES ($1, 'h', 'x', now() - interval '20 minutes', now() + interval '1 hour')",
        held_topic,
    )
    await conn.execute(
        "INSERT INTO outbox (topic, ordering_key, payload) VALUES ($1, 'h', 'y')", held_topic
    )
    await conn.execute("INSERT INTO outbox_paused (topic, paused_by) VALUES ($1, 'test')", topic)
    settings = make_settings(metrics_interval_seconds=0.2)
    async with running(settings) as dispatcher:
        port = await port_of(dispatcher)

        async def parked() -> bool:
            samples = await scrape(port)
            return (
                samples.get(("outbox_parked_rows", (("reason", "paused"),))) == 3
                and samples.get(("outbox_parked_rows", (("reason", "held"),))) == 2
            )

        await wait_until(parked, 30, "the parked rows to show")
        samples = await scrape(port)
        await conn.execute("DELETE FROM outbox_paused")

        async def resumed() -> bool:
            return (await scrape(port)).get(("outbox_parked_rows", (("reason", "paused"),))) == 0

        await wait_until(resumed, 30, "the resume to show")
    assert samples[("outbox_pending_rows", ())] == 5
    assert samples[("outbox_oldest_pending_age_seconds", ())] == 0  # nothing pages
    assert 1190 < samples[("outbox_oldest_parked_age_seconds", (("reason", "paused"),))] < 1500
    assert 1190 < samples[("outbox_oldest_parked_age_seconds", (("reason", "held"),))] < 1500


async def test_readyz_fails_while_the_schema_version_is_wrong(
    conn: asyncpg.Connection, make_settings: Any
) -> None:
    async with running(make_settings()) as dispatcher:
        port = await port_of(dispatcher)
        status, _ = await http_get(port, "/readyz")
        assert status == 200
        await conn.execute("INSERT INTO outbox_schema_version (version, name) VALUES (99, 'x')")
        await asyncio.sleep(1.2)  # the cached answer expires
        status, body = await http_get(port, "/readyz")
        live_status, _ = await http_get(port, "/livez")
    assert status == 503
    answer = orjson.loads(body)
    assert answer["ready"] is False
    assert answer["checks"]["schema"].startswith("version 99, this dispatcher needs")
    assert live_status == 200  # liveness never depends on the database


async def test_livez_fails_when_a_claim_loop_is_stuck(
    make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def stuck(self: Claimer) -> None:
        await asyncio.Event().wait()

    settings = make_settings(
        claim_tasks=1, liveness_timeout_seconds=1.0, shutdown_grace_seconds=0.5
    )
    async with running(settings) as dispatcher:
        port = await port_of(dispatcher)
        status, _ = await http_get(port, "/livez")
        assert status == 200
        monkeypatch.setattr(Claimer, "claim", stuck)

        async def dead() -> bool:
            return (await http_get(port, "/livez"))[0] == 503

        await wait_until(dead, 30, "/livez to notice the stuck loop")
        _, body = await http_get(port, "/livez")
    answer = orjson.loads(body)
    assert answer["live"] is False
    assert list(answer["stale_loops"]) == ["claim-0"]


async def test_traceparent_travels_unchanged_and_a_linked_producer_span_is_recorded(
    conn: asyncpg.Connection, services: Services, topic: str, make_settings: Any
) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    traceparent = f"00-{trace_id}-00f067aa0ba902b7-01"
    event_id = await conn.fetchval(
        "SELECT outbox_enqueue($1, 'k', 'v'::bytea, jsonb_build_object('traceparent', $2::text, "
        "'tracestate', 'congo=t61rcWkgMzE'))",
        topic,
        traceparent,
    )
    SPANS.clear()
    async with running(make_settings(tracing=True)):
        await wait_all_settled(conn, 30)
    [record] = await consume(services.kafka_bootstrap_servers, topic, 1)
    headers = dict(record.headers)
    assert headers["traceparent"] == traceparent.encode()
    assert headers["tracestate"] == b"congo=t61rcWkgMzE"
    [span] = [s for s in SPANS.get_finished_spans() if s.name == f"send {topic}"]
    assert span.kind is trace.SpanKind.PRODUCER
    assert [format(link.context.trace_id, "032x") for link in span.links] == [trace_id]
    assert span.attributes is not None
    assert span.attributes["messaging.message.id"] == str(event_id)
    assert span.attributes["messaging.destination.name"] == topic
    assert span.status.is_ok


async def test_cloudevents_binary_mode_headers(
    conn: asyncpg.Connection, services: Services, topic: str, make_settings: Any
) -> None:
    plain = await conn.fetchval("SELECT outbox_enqueue($1, 'k', 'v'::bytea)", topic)
    own = await conn.fetchval(
        "SELECT outbox_enqueue($1, 'k', 'v'::bytea, "
        '\'{"ce_type": "order.created", "ce_id": "forged", "content-type": "text/plain"}\')',
        topic,
    )
    settings = make_settings(cloudevents=True, cloudevents_source="/orders")
    async with running(settings):
        await wait_all_settled(conn, 30)
    records = await consume(services.kafka_bootstrap_servers, topic, 2)
    raw = {dict(r.headers)["event-id"].decode(): r.headers for r in records}
    by_id = {event_id: dict(headers) for event_id, headers in raw.items()}
    first = by_id[str(plain)]
    assert first["ce_id"] == str(plain).encode()
    assert first["ce_specversion"] == b"1.0"
    assert first["ce_source"] == b"/orders"
    assert first["ce_type"] == b"outbox.event"
    assert first["content-type"] == b"application/json"
    assert b"T" in first["ce_time"]
    second = by_id[str(own)]
    assert second["ce_id"] == str(own).encode()  # the event id, never the row's own ce_id
    assert second["ce_type"] == b"order.created"
    assert second["content-type"] == b"text/plain"
    assert [name for name, _ in raw[str(own)]].count("ce_id") == 1
