"""The fault-injecting proxy against a local echo server: each fault does what tests rely on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from tests.faultproxy import FaultProxy


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def proxy() -> AsyncIterator[FaultProxy]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with FaultProxy("127.0.0.1", port) as p:
        yield p
    server.close()
    await server.wait_closed()


async def _open(proxy: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", proxy.port)


async def _roundtrip(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes, timeout: float = 2
) -> bytes:
    writer.write(data)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(data)), timeout)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except ConnectionError:
        pass


async def test_forwards_both_ways(proxy: FaultProxy) -> None:
    reader, writer = await _open(proxy)
    assert await _roundtrip(reader, writer, b"hello") == b"hello"
    assert proxy.accepted == 1
    assert proxy.forwarded_bytes == 10  # 5 there, 5 back
    await _close(writer)


async def test_cut_aborts_connections_and_refuses_new_ones_until_restore(
    proxy: FaultProxy,
) -> None:
    reader, writer = await _open(proxy)
    assert await _roundtrip(reader, writer, b"a") == b"a"
    await proxy.cut()
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await _roundtrip(reader, writer, b"b")
    await _close(writer)
    with pytest.raises(ConnectionRefusedError):
        await _open(proxy)
    await proxy.restore()
    reader, writer = await _open(proxy)
    assert await _roundtrip(reader, writer, b"c") == b"c"
    await _close(writer)


async def test_cut_with_hold_keeps_new_connections_waiting_until_restore(
    proxy: FaultProxy,
) -> None:
    await proxy.cut(hold=True)
    reader, writer = await _open(proxy)  # accepted...
    writer.write(b"held")
    with pytest.raises(TimeoutError):  # ...but not answered
        await asyncio.wait_for(reader.readexactly(4), 0.3)
    await proxy.restore()
    assert await asyncio.wait_for(reader.readexactly(4), 2) == b"held"
    await _close(writer)


async def test_blackhole_hangs_instead_of_resetting(proxy: FaultProxy) -> None:
    reader, writer = await _open(proxy)
    assert await _roundtrip(reader, writer, b"x") == b"x"
    proxy.blackhole()
    writer.write(b"lost")
    await writer.drain()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(10), 0.5)
    assert not writer.is_closing()
    # New connections are accepted and hang too.
    reader2, writer2 = await _open(proxy)
    writer2.write(b"also lost")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader2.read(10), 0.3)
    assert proxy.dropped_bytes >= len(b"lost")
    # After restore the broken streams are aborted; fresh connections work.
    await proxy.restore()
    assert await asyncio.wait_for(reader.read(10), 2) == b""
    await _close(writer)
    await _close(writer2)
    reader, writer = await _open(proxy)
    assert await _roundtrip(reader, writer, b"ok") == b"ok"
    await _close(writer)


async def test_delay_slows_each_chunk(proxy: FaultProxy) -> None:
    reader, writer = await _open(proxy)
    proxy.delay(0.2)
    started = time.monotonic()
    assert await _roundtrip(reader, writer, b"slow") == b"slow"
    assert time.monotonic() - started >= 0.35  # delayed there and back
    proxy.delay(0)
    await _close(writer)


async def test_stall_hangs_then_delivers_everything_in_order(proxy: FaultProxy) -> None:
    reader, writer = await _open(proxy)
    proxy.stall()
    writer.write(b"one,")
    writer.write(b"two")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(10), 0.4)
    await proxy.restore()
    assert await asyncio.wait_for(reader.readexactly(7), 2) == b"one,two"
    await _close(writer)


async def test_fault_on_a_pattern_stalls_that_chunk_and_later_ones(proxy: FaultProxy) -> None:
    reader, writer = await _open(proxy)
    proxy.fault_on(b"MARK")
    assert await _roundtrip(reader, writer, b"claim") == b"claim"
    assert not proxy.tripped.is_set()
    writer.write(b"MARK 1")
    await asyncio.wait_for(proxy.tripped.wait(), 2)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(10), 0.4)
    await proxy.restore()
    assert await asyncio.wait_for(reader.readexactly(6), 2) == b"MARK 1"
    assert await _roundtrip(reader, writer, b"MARK 2") == b"MARK 2"  # disarmed after one
    await _close(writer)


async def test_fault_on_a_pattern_with_drop_blackholes_from_that_chunk(proxy: FaultProxy) -> None:
    reader, writer = await _open(proxy)
    proxy.fault_on(b"MARK", drop=True)
    writer.write(b"MARK 1")
    await asyncio.wait_for(proxy.tripped.wait(), 2)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(10), 0.4)
    assert proxy.dropped_bytes == 6
    await proxy.restore()  # the stream lost bytes: aborted, never delivered
    assert await asyncio.wait_for(reader.read(10), 2) == b""
    await _close(writer)


async def test_fault_on_a_pattern_after_delivers_that_chunk_and_loses_the_reply() -> None:
    received = bytearray()
    got = asyncio.Event()

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(4096):
            received.extend(data)
            got.set()
            writer.write(b"reply:" + data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(record, "127.0.0.1", 0)
    async with FaultProxy("127.0.0.1", server.sockets[0].getsockname()[1]) as proxy:
        reader, writer = await _open(proxy)
        proxy.fault_on(b"COMMIT", after=True)
        writer.write(b"COMMIT 1")
        await asyncio.wait_for(proxy.tripped.wait(), 2)
        await asyncio.wait_for(got.wait(), 2)
        assert bytes(received) == b"COMMIT 1"  # the server got the request...
        with pytest.raises(TimeoutError):  # ...and its reply never came back
            await asyncio.wait_for(reader.read(10), 0.4)
        await proxy.restore()  # the stream lost bytes: aborted
        assert await asyncio.wait_for(reader.read(10), 2) == b""
        await _close(writer)
    server.close()
    await server.wait_closed()
