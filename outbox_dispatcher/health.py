"""/livez, /readyz and /metrics on one small HTTP endpoint.

Liveness never touches the database: it says whether this process's loops still turn (a restart
would help). Readiness says whether the process can do its job now: database reachable with the
right schema version, broker reachable (a restart would not help; traffic and alerts should know).
The server is a few lines of asyncio rather than a web framework: three GET routes, no bodies in.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field

import orjson
import structlog
from prometheus_client import CONTENT_TYPE_LATEST

from outbox_dispatcher import errors

log = structlog.get_logger(__name__)

READ_TIMEOUT = 5.0
MAX_REQUEST_BYTES = 8192


class Heartbeats:
    """When each loop last made progress (or was waiting as it should)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._beats: dict[str, float] = {}

    def beat(self, name: str) -> None:
        self._beats[name] = time.monotonic()

    def forget(self, name: str) -> None:
        self._beats.pop(name, None)

    def stale(self) -> dict[str, float]:
        """Loops silent for longer than the timeout, with their silence in seconds."""
        now = time.monotonic()
        return {
            name: round(now - at, 1) for name, at in self._beats.items() if now - at > self.timeout
        }


@dataclass
class Readiness:
    ready: bool
    checks: dict[str, str] = field(default_factory=dict)


class ReadinessCache:
    """One check at a time, its answer reused for a second: probes and scrapes stay cheap."""

    def __init__(self, check: Callable[[], Awaitable[Readiness]], ttl: float = 1.0) -> None:
        self._check = check
        self._ttl = ttl
        self._lock = asyncio.Lock()
        self._last: tuple[float, Readiness] | None = None

    def forget(self) -> None:
        """The next `get` checks again (the state changed: a fleet's first pass ended)."""
        self._last = None

    async def get(self) -> Readiness:
        async with self._lock:
            now = time.monotonic()
            if self._last is None or now - self._last[0] > self._ttl:
                self._last = (now, await self._check())
            return self._last[1]


@dataclass(eq=False)
class HealthServer:
    """/metrics, /livez and /readyz on `host`:`wanted_port` (0: a free one, then in `port`)."""

    host: str
    wanted_port: int
    _: KW_ONLY
    live: Callable[[], dict[str, object]]
    ready: ReadinessCache
    metrics: Callable[[], bytes]
    port: int | None = field(default=None, init=False)  # where it listens, once started
    _server: asyncio.Server | None = field(default=None, init=False, repr=False)

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(
                self._handle, self.host, self.wanted_port, limit=MAX_REQUEST_BYTES
            )
        except OSError as exc:
            where = f"{self.host}:{self.wanted_port}"
            if exc.errno == errno.EADDRINUSE:
                msg = (
                    f"OUTBOX_HTTP_PORT: {where} is already in use (another dispatcher on this "
                    "host?): give each process its own OUTBOX_HTTP_PORT (0 picks a free one) "
                    "or set OUTBOX_HTTP_ENABLED=false"
                )
            else:
                msg = (
                    f"cannot serve /metrics on {where} ({errors.describe(exc)}): check "
                    "OUTBOX_HTTP_HOST and OUTBOX_HTTP_PORT"
                )
            raise errors.ConfigurationError(msg) from None
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("http_listening", host=self.host, port=self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def serve(self) -> None:
        """Run until cancelled (a supervised loop of the dispatcher); closes the server."""
        if self._server is None:
            await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                request = await reader.readuntil(b"\r\n\r\n")
            method, path = _request_line(request)
            status, content_type, body = await self._route(method, path)
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            writer.write(head if method == "HEAD" else head + body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # a client that went away or sent nonsense: nothing to answer
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass

    async def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        route = path.split("?", 1)[0]
        if route == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, self.metrics()
        if route == "/livez":
            live = self.live()
            status = "200 OK" if live["live"] else "503 Service Unavailable"
            return status, "application/json", orjson.dumps(live)
        if route == "/readyz":
            readiness = await self.ready.get()
            status = "200 OK" if readiness.ready else "503 Service Unavailable"
            body = orjson.dumps({"ready": readiness.ready, "checks": readiness.checks})
            return status, "application/json", body
        return "404 Not Found", "text/plain", b"try /metrics, /livez or /readyz\n"


def _request_line(request: bytes) -> tuple[str, str]:
    parts = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
    if len(parts) != 3:
        return "", ""
    return parts[0], parts[1]
