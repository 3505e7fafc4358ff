"""The HTTP endpoint and the heartbeat bookkeeping, without services."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from outbox_dispatcher.health import HealthServer, Heartbeats, Readiness, ReadinessCache


async def request(port: int, raw: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    response = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = response.partition(b"\r\n\r\n")
    return (int(head.split(b" ", 2)[1]) if head else 0), body


def test_a_loop_is_stale_only_after_the_timeout() -> None:
    beats = Heartbeats(timeout=0.05)
    beats.beat("claim-0")
    assert beats.stale() == {}
    time.sleep(0.06)
    beats.beat("lease-keeper")
    assert list(beats.stale()) == ["claim-0"]
    beats.forget("claim-0")
    assert beats.stale() == {}


async def test_routes_status_codes_and_readiness_caching() -> None:
    checks = 0
    ready = True

    async def check() -> Readiness:
        nonlocal checks
        checks += 1
        return Readiness(ready, {"database": "ok" if ready else "unreachable"})

    live = {"live": True, "stale_loops": {}}
    server = HealthServer(
        "127.0.0.1",
        0,
        live=lambda: live,
        ready=ReadinessCache(check, ttl=0.2),
        metrics=lambda: b"outbox_ready 1.0\n",
    )
    await server.start()
    assert server.port
    try:
        get = b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n"
        assert await request(server.port, get % b"/metrics") == (200, b"outbox_ready 1.0\n")
        assert (await request(server.port, get % b"/readyz"))[0] == 200
        ready = False
        assert (await request(server.port, get % b"/readyz"))[0] == 200  # cached for 0.2 s
        await asyncio.sleep(0.25)
        status, body = await request(server.port, get % b"/readyz")
        assert (status, orjson.loads(body)["checks"]) == (503, {"database": "unreachable"})
        assert checks == 2
        live = {"live": False, "stale_loops": {"claim-0": 130.0}}
        assert (await request(server.port, get % b"/livez"))[0] == 503
        assert await request(server.port, b"HEAD /metrics HTTP/1.1\r\n\r\n") == (200, b"")
        assert (await request(server.port, b"POST /livez HTTP/1.1\r\n\r\n"))[0] == 405
        assert (await request(server.port, get % b"/"))[0] == 404
        assert (await request(server.port, b"garbage\r\n\r\n"))[0] == 405
    finally:
        await server.close()


async def test_a_port_in_use_is_one_configuration_error_with_the_hint() -> None:
    import socket

    from outbox_dispatcher import errors

    async def check() -> Readiness:
        return Readiness(True, {})

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = HealthServer(
            "127.0.0.1",
            port,
            live=lambda: {"live": True},
            ready=ReadinessCache(check),
            metrics=lambda: b"",
        )
        with pytest.raises(errors.ConfigurationError, match="already in use") as raised:
            await server.start()
    assert "OUTBOX_HTTP_PORT (0 picks a free one)" in str(raised.value)
