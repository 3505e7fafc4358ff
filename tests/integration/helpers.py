"""Helpers for integration tests: writing rows, running dispatchers, reading what Kafka got."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest
from pydantic import SecretStr

from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.supervisor import Dispatcher
from tests.checker import Verdict as Verdict
from tests.checker import check as check
from tests.checker import consume as consume

# Moved to tests/checker.py; re-exported so that older tests keep importing them from here.
from tests.faultproxy import FaultProxy


@dataclass(frozen=True)
class Services:
    database_url: str
    kafka_bootstrap_servers: str
    control: Path | None  # deploy/local/services.sh, to stop and start the broker

    async def broker(self, action: str) -> None:
        """Stop or start the broker, off the event loop (an in-process dispatcher keeps running)."""
        if self.control is None:
            msg = "this test stops the broker and needs the local services script"
            raise RuntimeError(msg)
        command = ["bash", str(self.control), f"kafka-{action}"]
        await asyncio.to_thread(subprocess.run, command, check=True, timeout=180)


async def insert_sequenced(
    conn: asyncpg.Connection,
    topic: str,
    keys: int,
    per_key: int,
    *,
    interleave: bool = True,
    first_seq: int = 0,
) -> list[tuple[str, int]]:
    """Insert keys x per_key rows whose payload is {"key", "seq"}; seq follows id order per key."""
    seqs = range(first_seq, first_seq + per_key)
    order = (
        [(f"key-{k}", s) for s in seqs for k in range(keys)]
        if interleave
        else [(f"key-{k}", s) for k in range(keys) for s in seqs]
    )
    await conn.executemany(
        "INSERT INTO outbox (topic, ordering_key, payload, headers) VALUES ($1, $2, $3, $4)",
        [
            (topic, key, orjson.dumps({"key": key, "seq": seq}), f'{{"seq": "{seq}"}}')
            for key, seq in order
        ],
    )
    return order


async def sessions_waiting_on_a_lock(conn: asyncpg.Connection) -> int:
    """Sessions of this database waiting for a lock (a statement the test holds up)."""
    waiting: int = await conn.fetchval(
        "SELECT count(DISTINCT l.pid) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
        " WHERE NOT l.granted AND a.datname = current_database()"
    )
    return waiting


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], timeout: float, what: str, interval: float = 0.1
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(interval)
    msg = f"timed out after {timeout}s waiting for {what}"
    raise AssertionError(msg)


# Rows a claim holds, for count(): leases live on the key's work (outbox_leases reads them per
# row), not on the rows.
LEASED = "id IN (SELECT id FROM outbox_leases)"
LIVE_LEASE = "id IN (SELECT id FROM outbox_leases WHERE lease_expires_at > now())"
EXPIRED_LEASE = "id IN (SELECT id FROM outbox_leases WHERE lease_expires_at <= now())"


async def count(conn: asyncpg.Connection, where: str = "true") -> int:
    value: int = await conn.fetchval(f"SELECT count(*) FROM outbox WHERE {where}")
    return value


async def wait_all_settled(conn: asyncpg.Connection, timeout: float) -> None:
    async def done() -> bool:
        return await count(conn, "published_at IS NULL AND dead_at IS NULL") == 0

    await wait_until(done, timeout, "every row published or dead-lettered")


async def event_ids(conn: asyncpg.Connection) -> set[str]:
    return {str(r["event_id"]) for r in await conn.fetch("SELECT event_id FROM outbox")}


@contextlib.asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[Dispatcher]:
    """A dispatcher in this process, stopped gracefully on exit."""
    dispatcher = Dispatcher(settings)
    task = asyncio.create_task(dispatcher.run())
    try:
        yield dispatcher
    finally:
        dispatcher.stop()
        await asyncio.wait_for(task, settings.shutdown_grace_seconds + 30)


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that makes a subprocess dispatcher use these settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        key = "OUTBOX_SCHEMA" if name == "db_schema" else f"OUTBOX_{name.upper()}"
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        elif isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, bool):
            value = "true" if value else "false"
        env[key] = str(value)
    return env


@dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str


async def cli(
    settings: Settings,
    *args: str,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
    module: bool = True,
) -> Ran:
    """`outbox-dispatcher ARGS` as a real process with these settings in its environment (plus
    `env`); with module=False, `python ARGS` in the same environment."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *(("-m", "outbox_dispatcher") if module else ()),
        *args,
        env={**settings_env(settings), **(env or {})},
        stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(stdin), 120)
    assert process.returncode is not None
    return Ran(process.returncode, out.decode(), err.decode())


def ctrl_c_as_at_a_terminal() -> None:
    """In the child before exec: SIGINT at its default and unblocked, as a shell gives it. A
    disposition of "ignored" or a blocked SIGINT inherited from the test process would survive
    the exec, and Python would then never see the Ctrl-C a test sends (CI saw a replay wait
    60 s after it, twice, in full runs only)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


async def interruptible(settings: Settings, *args: str) -> asyncio.subprocess.Process:
    """`outbox-dispatcher ARGS` as at a terminal (Ctrl-C works; no stdin), its output piped."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "outbox_dispatcher",
        *args,
        env=settings_env(settings),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=ctrl_c_as_at_a_terminal,
    )


def spawn_console(
    settings: Settings, log_path: Path, port: int, **variables: str
) -> subprocess.Popen[bytes]:
    """`outbox-dispatcher console` as a real process on `port` (its own process group), with
    OUTBOX_* `variables` besides the settings' (JSON logs)."""
    env = {**settings_env(settings), "OUTBOX_CONSOLE_PORT": str(port), "OUTBOX_LOG_FORMAT": "json"}
    env.update(variables)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "outbox_dispatcher", "console"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def spawn(settings: Settings, log_path: Path, *args: str) -> subprocess.Popen[bytes]:
    """`outbox-dispatcher run` as a real process (its own process group)."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "outbox_dispatcher", "run", *args],
            env=settings_env(settings),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


async def wait_started(log_paths: Sequence[Path], timeout: float = 60) -> None:
    """Until every dispatcher logged that its loops run."""

    async def all_started() -> bool:
        return all(p.exists() and '"started"' in p.read_text() for p in log_paths)

    await wait_until(all_started, timeout, "the dispatchers to start")


def stop_all(processes: Sequence[subprocess.Popen[bytes]]) -> list[int | None]:
    """SIGTERM every process still running, then their exit codes (None: killed after 60 s)."""
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes: list[int | None] = []
    for p in processes:
        try:
            codes.append(p.wait(timeout=60))
        except subprocess.TimeoutExpired:
            kill9(p)
            codes.append(None)
    return codes


def log_events(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    """The JSON log lines of a spawned dispatcher (all, or those of one event)."""
    found: list[dict[str, Any]] = []
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        if not line.startswith("{") or (event is not None and f'"{event}"' not in line):
            continue
        with contextlib.suppress(orjson.JSONDecodeError):
            found.append(orjson.loads(line))
    return [e for e in found if event is None or e.get("event") == event]


def kill9(process: subprocess.Popen[bytes]) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


async def kill9_with_rows_in_flight(
    conn: asyncpg.Connection, process: subprocess.Popen[bytes], in_flight_sql: str, timeout: float
) -> int:
    """Kill -9 a dispatcher at a moment it holds leases; return how many rows they cover.

    A count taken while the process runs races its next settle (a probe saw 0 rows in flight
    between two batches), so the process is frozen with SIGSTOP first: its leases cannot change
    while the count runs, and it is killed only if the count found some.
    """
    deadline = time.monotonic() + timeout
    while True:
        os.killpg(process.pid, signal.SIGSTOP)
        in_flight = int(await conn.fetchval(f"SELECT count(*) FROM outbox WHERE {in_flight_sql}"))
        if in_flight > 0:
            kill9(process)
            return in_flight
        os.killpg(process.pid, signal.SIGCONT)
        if time.monotonic() > deadline:
            raise AssertionError(f"no rows were in flight within {timeout}s")
        await asyncio.sleep(0.02)


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    """GET http://127.0.0.1:port/path: (status, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        await writer.drain()
        response = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


# The broker's PROXIED listener (deploy/local/services.sh: the broker's port + 10002) advertises
# the proxy's fixed port (+ 10003), so that a client bootstrapped at the proxy reaches the broker
# only through it (tests/integration/test_network_faults.py proves it).
PROXIED_OFFSET = 10002
PROXY_OFFSET = 10003


@contextlib.asynccontextmanager
async def kafka_proxy(services: Services) -> AsyncIterator[FaultProxy]:
    """A FaultProxy in front of the broker's PROXIED listener (a test is skipped without it)."""
    port = int(services.kafka_bootstrap_servers.split(",")[0].rpartition(":")[2])
    proxied = int(os.environ.get("OUTBOX_TEST_KAFKA_PROXIED_PORT", port + PROXIED_OFFSET))
    proxy_port = int(os.environ.get("OUTBOX_TEST_KAFKA_PROXY_PORT", port + PROXY_OFFSET))
    if not port_open("127.0.0.1", proxied):
        pytest.skip(
            f"the broker has no PROXIED listener on {proxied}: restart it with "
            "deploy/local/services.sh kafka-stop && kafka-start"
        )
    async with FaultProxy("127.0.0.1", proxied, listen_port=proxy_port) as proxy:
        yield proxy


def port_open(host: str, port: int) -> bool:
    """Something accepts connections on host:port (within 2 s)."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2):
        return True
    return False
