"""A fleet member as a process of its own, for test_sources_fleet.py: it beats the home database
(sources/fleet.py) and prints one JSON line whenever its view changes: the live members and
which of N synthetic outbox keys it owns. SIGTERM leaves the fleet; SIGKILL does not."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time

import asyncpg

from outbox_dispatcher import logs
from outbox_dispatcher.sources.fleet import FleetMember, assigned
from outbox_dispatcher.store import db


async def connect(url: str) -> db.Connection:
    conn: db.Connection = await asyncpg.connect(url, timeout=5)
    return conn


async def main(url: str, member_id: str, lease: float, count: int) -> None:
    keys = [f"127.0.0.1:5432/app/tenant_{n:03}.outbox" for n in range(count)]
    member = FleetMember(url, connect, lease_seconds=lease, member_id=member_id)
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
    task = asyncio.create_task(member.run(stopping))
    last: object = None
    while not task.done():
        view = member.view()
        state = (view.members, assigned(keys, view.members or (view.me,), view.me, str))
        if state != last and view.members:
            line = {"members": view.members, "mine": state[1], "at": time.time()}
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
            last = state
        await asyncio.sleep(0.02)
    await task


if __name__ == "__main__":
    logs.configure("console", "INFO")  # on stderr: stdout is the views
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])))
