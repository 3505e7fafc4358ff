"""Many outboxes (issue 36): the first event of a tenant idle for a while. An idle outbox is
claimed when a notification or the probe finds work; with exactly-once (issue 35) its lanes
(its transactional producers) open at its first batch and close after OUTBOX_LANES_IDLE_SECONDS
without use (dispatch/fleet_delivery.py), so that idle tenants hold no producer. Commit to a
read_committed consumer, against an event sent right after (the outbox served, its lanes
open)."""

from __future__ import annotations

import asyncio
import statistics

import asyncpg
from aiokafka import AIOKafkaConsumer

from benchmarks.fleet import fleet_settings, one_event, tenants
from benchmarks.processes import dispatchers, wait_ready
from benchmarks.stack import Stack

LANES_IDLE = 2.0  # OUTBOX_LANES_IDLE_SECONDS of the scenario (180 s by default)
CLOSED_AFTER = 2 * LANES_IDLE + 1.0  # the closer looks every quarter of it: closed by then
LIMIT = 60.0  # seconds an event may take before the scenario calls it lost


async def first_after_idle(
    stack: Stack, outboxes: int, samples: int, delivery: str
) -> dict[str, float]:
    """One process serving `outboxes` tenants. One tenant's events: a first one (the first its
    lanes carry: their transactional ids new to the broker, with exactly-once), then for
    each sample an event once the tenant was idle CLOSED_AFTER s (its lanes closed, with
    exactly-once), then one more right after; milliseconds from each commit to its record at a
    read_committed consumer."""
    first = 0.0
    reopened: list[float] = []
    opened: list[float] = []
    async with tenants(stack, outboxes) as (url, topic):
        settings = fleet_settings(url, stack, delivery=delivery, lanes_idle_seconds=LANES_IDLE)
        async with dispatchers(settings) as group:
            await wait_ready(url, group)
            consumer = AIOKafkaConsumer(
                topic,
                bootstrap_servers=stack.bootstrap,
                auto_offset_reset="latest",
                group_id=None,
                fetch_max_wait_ms=5,
                isolation_level="read_committed",
            )
            await consumer.start()
            try:
                await consumer.getmany(timeout_ms=500)  # assigned, at the end
                conn = await asyncpg.connect(url)
                try:
                    name = "tenant_0000"
                    first = await _event_ms(conn, consumer, name, topic)  # (its lanes' first)
                    for _ in range(samples):
                        await asyncio.sleep(CLOSED_AFTER)
                        reopened.append(await _event_ms(conn, consumer, name, topic))
                        opened.append(await _event_ms(conn, consumer, name, topic))
                finally:
                    await conn.close()
            finally:
                await consumer.stop()
    return {
        "lanes_idle_seconds": LANES_IDLE,
        "idle_seconds": CLOSED_AFTER,
        "first_event_served_ms": first,
        "first_event_after_idle_ms_median": statistics.median(reopened),
        "first_event_after_idle_ms_max": max(reopened),
        "event_lanes_open_ms_median": statistics.median(opened),
        "event_lanes_open_ms_max": max(opened),
    }


async def _event_ms(
    conn: asyncpg.Connection, consumer: AIOKafkaConsumer, name: str, topic: str
) -> float:
    """One row committed to tenant `name`: milliseconds until a read_committed consumer has it
    (LIMIT when it never comes)."""
    return 1000 * await one_event(conn, consumer, name, topic, LIMIT)
