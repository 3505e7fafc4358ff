"""A TCP proxy that injects network faults between a client and a real service.

Our own, small and asyncio-only, so that tests can cut PostgreSQL or Kafka for one client without
touching the service other tests use. Faults:

* ``cut()``: every open connection is aborted and new ones are refused (the listening socket is
  closed, so connect() fails with ECONNREFUSED); ``cut(hold=True)`` accepts new connections but
  holds them, unanswered, until ``restore()`` connects them upstream.
* ``blackhole()``: connections stay open, new ones are accepted, and every byte in either
  direction is dropped silently: the client sees a hang, never a reset. On ``restore()`` the
  connections that lost bytes are aborted (their byte streams are broken beyond repair, like a
  middlebox that lost its state); untouched ones carry on.
* ``stall()``: like a blackhole for the client (a hang, no reset), but nothing is lost: bytes
  wait in the proxy and are delivered, in order, on ``restore()``, like a partition that heals
  while TCP keeps retransmitting.
* ``fault_on(pattern)``: stall (or, with drop=True, blackhole) the proxy the moment a chunk from
  the client contains `pattern`; that chunk is held (or dropped) too. A fault aimed at one
  statement, e.g. the dispatcher's mark. Patterns are matched within one read, which suits
  protocol messages far smaller than CHUNK. With ``after=True`` the matching chunk itself still
  reaches the server and the blackhole starts behind it: the server acts on the request and its
  reply is lost (a statement that committed, its answer never delivered).
* ``delay(seconds)``: each chunk waits that long before it is forwarded (0 turns it off).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

CHUNK = 65_536


class Mode(enum.Enum):
    FORWARD = "forward"
    CUT = "cut"
    HOLD = "hold"
    BLACKHOLE = "blackhole"
    STALL = "stall"


@dataclass(eq=False)
class _Link:
    """One client connection and (once connected) its upstream connection."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tainted: bool = False  # bytes were dropped: the streams no longer line up
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def abort(self) -> None:
        self.client.transport.abort()
        if self.upstream is not None:
            self.upstream.transport.abort()


class FaultProxy:
    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        self.target = (target_host, target_port)
        self.host = listen_host
        self.port = listen_port
        self.mode = Mode.FORWARD
        self._delay = 0.0
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._restored = asyncio.Event()
        self._restored.set()
        self._pattern: tuple[bytes, ...] | None = None
        self._pattern_drops = False
        self._pattern_after = False
        self.tripped = asyncio.Event()  # set when fault_on's pattern went by
        # Counters a test can assert on (e.g. "the client really talked through the proxy").
        self.accepted = 0
        self.forwarded_bytes = 0
        self.dropped_bytes = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        return len(self._links)

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, self.host, self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await self._close_listener()
        for link in list(self._links):
            link.abort()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # Faults -------------------------------------------------------------------------------

    async def cut(self, *, hold: bool = False) -> None:
        """Abort every connection; refuse new ones (or hold them, with hold=True)."""
        self.mode = Mode.HOLD if hold else Mode.CUT
        self._restored.clear()
        if not hold:
            await self._close_listener()
        for link in list(self._links):
            link.abort()

    def blackhole(self) -> None:
        """Keep connections open but drop every byte, both ways, from now on."""
        self.mode = Mode.BLACKHOLE
        self._restored.clear()

    def stall(self) -> None:
        """Hold every byte, both ways, until restore() delivers them."""
        self.mode = Mode.STALL
        self._restored.clear()

    def fault_on(
        self, pattern: bytes | tuple[bytes, ...] | None, *, drop: bool = False, after: bool = False
    ) -> None:
        """Stall (drop=False) or blackhole (drop=True) as soon as the client sends `pattern`
        (or any of a tuple of them); with after=True, blackhole just behind that chunk (it is
        delivered, the reply is lost). None disarms. Fires once."""
        self._pattern = (pattern,) if isinstance(pattern, bytes) else pattern
        self._pattern_drops = drop
        self._pattern_after = after

    def delay(self, seconds: float) -> None:
        self._delay = seconds

    async def restore(self) -> None:
        """Forward again: reopen the listener, drop broken links, connect held ones."""
        if self._server is None:
            await self.start()  # same port: clients reconnect to the address they know
        for link in list(self._links):
            if link.tainted:
                link.abort()
        self.mode = Mode.FORWARD
        self.tripped.clear()
        self._restored.set()

    async def _close_listener(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.close()
            # wait_closed() would wait for our own open links too; the socket is closed now.

    # Plumbing -----------------------------------------------------------------------------

    def _spawn(self, coro: object, link: _Link | None = None) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if link is not None:
            link.tasks.add(task)
            task.add_done_callback(link.tasks.discard)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        link = _Link(client=writer)
        self._links.add(link)
        try:
            if self.mode is Mode.CUT:
                return
            if self.mode is Mode.BLACKHOLE:
                link.tainted = True
                await self._drain_into_void(reader, link)
                return
            await self._restored.wait()  # HOLD: wait, unanswered
            if writer.is_closing():
                return
            up_reader, up_writer = await asyncio.open_connection(*self.target)
            link.upstream = up_writer
            self._spawn(self._pump(up_reader, writer, link), link)
            await self._pump(reader, up_writer, link, from_client=True)
            # The client closed its side; let the upstream finish its answer, then close.
            await asyncio.gather(*list(link.tasks), return_exceptions=True)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._links.discard(link)
            link.abort()

    async def _drain_into_void(self, reader: asyncio.StreamReader, link: _Link) -> None:
        while data := await reader.read(CHUNK):
            self.dropped_bytes += len(data)
            if self._restored.is_set():
                link.abort()
                return

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        *,
        from_client: bool = False,
    ) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(CHUNK):
                if from_client and self._pattern and any(p in data for p in self._pattern):
                    self._pattern = None
                    if self._pattern_after:
                        # Blackhole first, so that the reply cannot slip through, then deliver
                        # this chunk past it.
                        self.blackhole()
                        link.tainted = True
                        self.tripped.set()
                        writer.write(data)
                        await writer.drain()
                        self.forwarded_bytes += len(data)
                        continue
                    if self._pattern_drops:
                        self.blackhole()
                    else:
                        self.stall()
                    self.tripped.set()
                if self.mode is Mode.STALL:
                    await self._restored.wait()
                if self.mode is Mode.BLACKHOLE:
                    link.tainted = True
                    self.dropped_bytes += len(data)
                    continue
                if self._delay:
                    await asyncio.sleep(self._delay)
                if link.tainted:
                    return
                writer.write(data)
                await writer.drain()
                self.forwarded_bytes += len(data)
            if writer.can_write_eof():
                writer.write_eof()


@contextlib.asynccontextmanager
async def fault_proxy(
    target_host: str, target_port: int, *, listen_port: int = 0
) -> AsyncIterator[FaultProxy]:
    proxy = FaultProxy(target_host, target_port, listen_port=listen_port)
    async with proxy:
        yield proxy
