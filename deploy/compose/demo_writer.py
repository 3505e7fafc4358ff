"""Demo writer for deploy/compose: one outbox event per interval, as an application would write it.

Runs in the outbox-dispatcher image (asyncpg is there). Each event goes through the schema's
`outbox_enqueue_json` in its own transaction; keys cycle over a few orders so that the per-key order
shows in the topic. Stops on SIGTERM/SIGINT (it is PID 1 in its container).

Environment: DEMO_DATABASE_URL or DEMO_DATABASE_URL_FILE (a file holding the DSN), DEMO_TOPIC
(default demo.orders), DEMO_INTERVAL_SECONDS (default 1), DEMO_KEYS (default 5).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
from pathlib import Path

import asyncpg
import orjson

STATUSES = ("created", "paid", "packed", "shipped", "delivered")


def database_url() -> str:
    path = os.environ.get("DEMO_DATABASE_URL_FILE")
    if path:
        return Path(path).read_text().strip()
    return os.environ.get("DEMO_DATABASE_URL", "postgresql://outbox:outbox@postgres:5432/outbox")


async def main() -> int:
    topic = os.environ.get("DEMO_TOPIC", "demo.orders")
    interval = float(os.environ.get("DEMO_INTERVAL_SECONDS", "1"))
    keys = int(os.environ.get("DEMO_KEYS", "5"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    conn = await asyncpg.connect(database_url())
    written = 0
    try:
        for n in itertools.count():
            key = f"order-{n % keys}"
            event = {"order": key, "seq": n // keys, "status": STATUSES[(n // keys) % 5]}
            await conn.fetchval(
                "SELECT outbox_enqueue_json($1, $2, $3::text::jsonb)",
                topic,
                key,
                orjson.dumps(event).decode(),
            )
            written += 1
            sys.stdout.write(f"enqueued {topic} {key} {event['status']}\n")
            sys.stdout.flush()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if stop.is_set():
                break
    finally:
        await conn.close()
    sys.stdout.write(f"demo writer stopped after {written} events\n")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
