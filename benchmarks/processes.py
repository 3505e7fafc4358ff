"""The dispatcher under test, as real `outbox-dispatcher run` processes, and what they cost: their
own CPU, that of the PostgreSQL backends serving them, and a broker made slow by the project's
fault proxy."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from benchmarks.stack import RESULTS, Stack
from outbox_dispatcher.config.settings import Settings
from tests.faultproxy import CHUNK, FaultProxy, _Link

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, every core (/proc/stat):
    a window's busy share says whether its latencies were measured on a saturated machine."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
    return (total - idle) / TICKS, total / TICKS


def tcp_ports(pid: int) -> set[int]:
    """The local ports of a process's IPv4/IPv6 TCP sockets, from /proc (Linux): its database
    connections are the backends whose client_port is one of them."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = str(fd.readlink())
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports


@dataclass
class Dispatchers:
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.processes)


@contextlib.asynccontextmanager
async def dispatchers(settings: Settings, count: int = 1) -> AsyncIterator[Dispatchers]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    for name in settings.model_fields_set:  # what the scenario chose; defaults for the rest
        value = getattr(settings, name)
        if hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        elif isinstance(value, bool):
            value = "true" if value else "false"
        env[f"OUTBOX_{name.upper()}"] = str(getattr(value, "value", value))
    env["OUTBOX_LOG_LEVEL"] = os.environ.get("OUTBOX_BENCH_LOG_LEVEL", "WARNING")
    group = Dispatchers()
    log = (RESULTS / "dispatcher.log").open("ab")
    try:
        for _ in range(count):
            group.processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "outbox_dispatcher", "run"],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        yield group
    finally:
        for p in group.processes:
            p.send_signal(signal.SIGTERM)
        for p in group.processes:
            try:  # off the loop: a scenario's broker proxy runs on it and the stop needs it
                await asyncio.to_thread(p.wait, 60)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()


async def wait_ready(url: str, group: Dispatchers) -> None:
    """Until every dispatcher process has its pool open (it connects after start-up)."""
    conn = await asyncpg.connect(url)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            # A dispatcher logged in as another role (benchmarks/statements.py) shows no port
            # nor backend type to this one: its backends count by pid.
            connected = await conn.fetchval(
                "SELECT count(DISTINCT coalesce(client_port::text, 'pid ' || pid)) "
                "FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = 'outbox-dispatcher' "
                "AND (client_port IS NOT NULL OR backend_type IS NULL)"
            )
            if connected >= 2 * len(group.processes):  # pool + LISTEN
                await asyncio.sleep(0.3)
                return
            await asyncio.sleep(0.05)
        msg = f"dispatchers did not connect; see {RESULTS / 'dispatcher.log'}"
        raise RuntimeError(msg)
    finally:
        await conn.close()


async def backend_cpu_by_pid(conn: asyncpg.Connection) -> dict[int, float]:
    """CPU seconds of each PostgreSQL backend serving a dispatcher (its application_name)."""
    pids = await conn.fetch(
        "SELECT pid FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name = 'outbox-dispatcher'"
    )
    cpu = {}
    for row in pids:
        with contextlib.suppress(OSError):
            cpu[row["pid"]] = cpu_seconds(row["pid"])
    return cpu


async def backend_cpu(conn: asyncpg.Connection) -> float:
    return sum((await backend_cpu_by_pid(conn)).values())


class BackendCpuSampler:
    """The dispatchers' backends' CPU over a window, read every `every` seconds: a pooled
    connection that closes inside the window (a fleet's idle pools close after 30 s) keeps what
    it used up to its last reading, which two readings at the window's ends would lose."""

    def __init__(self, conn: asyncpg.Connection, every: float = 0.25) -> None:
        self._conn = conn
        self._every = every
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}

    async def read(self) -> None:
        """A backend first seen now connected inside the window: it counts from zero."""
        for pid, cpu in (await backend_cpu_by_pid(self._conn)).items():
            self._first.setdefault(pid, 0.0)
            self._last[pid] = cpu

    async def window(self, seconds: float) -> float:
        """CPU seconds the backends used in the next `seconds`."""
        self._last = await backend_cpu_by_pid(self._conn)
        self._first = dict(self._last)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await asyncio.sleep(min(self._every, max(0.0, deadline - time.monotonic())))
            await self.read()
        return sum(cpu - self._first.get(pid, 0.0) for pid, cpu in self._last.items())


def backend_cpu_since(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU between two samples; a backend that connected meanwhile counts from zero (one that
    disconnected meanwhile is lost: the dispatcher's pool keeps its connections)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


class LatencyProxy(FaultProxy):
    """The project's fault proxy with latency only: each chunk is forwarded `delay` seconds after
    it arrived while later chunks keep arriving. (FaultProxy.delay sleeps before forwarding each
    chunk in turn, which also caps a connection at one chunk per delay: a bandwidth limit that
    depends on how the kernel happens to split the stream.)"""

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        *,
        from_client: bool = False,
    ) -> None:
        if not self._delay:
            await super()._pump(reader, writer, link, from_client=from_client)
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def forward() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                self.forwarded_bytes += len(data)
            if writer.can_write_eof():
                writer.write_eof()

        sender = asyncio.ensure_future(forward())
        try:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await reader.read(CHUNK):
                    queue.put_nowait((loop.time() + self._delay, data))
            queue.put_nowait(None)
            with contextlib.suppress(OSError, ConnectionError):
                await sender
        finally:
            sender.cancel()


@contextlib.asynccontextmanager
async def slow_broker(stack: Stack, delay: float) -> AsyncIterator[str]:
    """The fault proxy in front of the broker's proxied listener, adding `delay` seconds of
    latency each way. Yields the bootstrap address: the listener advertises the proxy's port,
    so every connection of a client bootstrapped here crosses the proxy."""
    proxy = LatencyProxy("127.0.0.1", stack.proxied_port, listen_port=stack.proxy_port)
    proxy.delay(delay)
    async with proxy:
        yield proxy.address
        assert proxy.forwarded_bytes > 0, "the dispatchers did not reach the broker via the proxy"
