"""Demo consumer for deploy/compose: prints every record the dispatcher publishes, one line each.

Runs in the outbox-dispatcher image (aiokafka is there). Reads the topic from the start as consumer
group `demo-consumer` and prints partition, offset, key, the `event-id` header and the value.
Stops on SIGTERM/SIGINT (it is PID 1 in its container).

Environment: DEMO_BOOTSTRAP_SERVERS (default kafka:9092), DEMO_TOPIC (default demo.orders).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from aiokafka import AIOKafkaConsumer


async def main() -> int:
    topic = os.environ.get("DEMO_TOPIC", "demo.orders")
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=os.environ.get("DEMO_BOOTSTRAP_SERVERS", "kafka:9092"),
        group_id="demo-consumer",
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await consumer.start()
    consumed = 0
    try:
        while not stop.is_set():
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    headers = dict(record.headers)
                    event_id = headers.get("event-id", b"").decode()
                    key = record.key.decode() if record.key else ""
                    value = record.value.decode() if record.value else ""
                    sys.stdout.write(
                        f"consumed {record.topic} {record.partition}@{record.offset} "
                        f"key={key} event_id={event_id} {value}\n"
                    )
                    consumed += 1
            sys.stdout.flush()
    finally:
        await consumer.stop()
    sys.stdout.write(f"demo consumer stopped after {consumed} records\n")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
