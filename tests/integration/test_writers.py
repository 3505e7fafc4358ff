"""The writer examples in every language (examples/writers/), built and run against the real
stack: committed events arrive with key, value, headers and event id; rolled-back ones never do;
writers in several languages at once on the same keys keep per-key order."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest

from .helpers import Services, consume, running, wait_all_settled

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
WRITERS = ROOT / "examples" / "writers"


def _run(command: list[str], cwd: Path) -> None:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is needed to build the {name} writer example"
    return path


@pytest.fixture(scope="session")
def writers() -> dict[str, list[str]]:
    """Build every example once; returns the command line of each, by language."""
    _run([_tool("mvn"), "-q", "-B", "package"], WRITERS / "java")
    _run([_tool("go"), "build", "-o", "outbox-writer", "."], WRITERS / "go")
    npm = _tool("npm")
    _run(
        [npm, "install", "--no-package-lock", "--no-audit", "--no-fund", "--silent"],
        WRITERS / "node",
    )
    _run([npm, "run", "--silent", "build"], WRITERS / "node")
    python = WRITERS / "python"
    return {
        "python-asyncpg": [sys.executable, str(python / "asyncpg_writer.py")],
        "python-psycopg": [sys.executable, str(python / "psycopg_writer.py")],
        "java-jdbc": [
            _tool("java"),
            "-jar",
            str(WRITERS / "java" / "target" / "outbox-writer.jar"),
        ],
        "go-pgx": [str(WRITERS / "go" / "outbox-writer")],
        "node-pg": [_tool("node"), str(WRITERS / "node" / "dist" / "writer.js")],
    }


@pytest.fixture
async def business_schema(conn: asyncpg.Connection) -> None:
    await conn.execute((WRITERS / "schema.sql").read_text())


async def write(
    command: list[str], dsn: str, topic: str, key: str, count: int, writer: str, *extra: str
) -> list[dict[str, Any]]:
    process = await asyncio.create_subprocess_exec(
        *command,
        "--dsn",
        dsn,
        "--topic",
        topic,
        "--key",
        key,
        "--count",
        str(count),
        "--writer",
        writer,
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return [json.loads(line) for line in out.decode().splitlines()]


LANGS = ["python-asyncpg", "python-psycopg", "java-jdbc", "go-pgx", "node-pg"]


@pytest.mark.parametrize("lang", LANGS)
@pytest.mark.usefixtures("business_schema")
async def test_a_writer_in_each_language(
    lang: str,
    writers: dict[str, list[str]],
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    make_settings: Any,
) -> None:
    writer = f"w-{uuid.uuid4().hex[:6]}"
    committed = await write(writers[lang], database_url, topic, "order-1", 3, writer)
    rolled_back = await write(
        writers[lang], database_url, topic, "order-2", 2, writer, "--rollback"
    )
    assert [c["seq"] for c in committed] == [0, 1, 2]
    assert all(r["rolled_back"] for r in rolled_back)
    assert await conn.fetchval("SELECT count(*) FROM example_orders WHERE writer = $1", writer) == 3
    async with running(make_settings()):
        await wait_all_settled(conn, 30)
    records = await consume(services.kafka_bootstrap_servers, topic, 3)
    assert len(records) == 3, "rolled-back events must never be published"
    for record, expected in zip(sorted(records, key=lambda r: r.offset), committed, strict=True):
        headers = dict(record.headers)
        assert record.key == b"order-1"
        assert orjson.loads(record.value or b"") == {
            "writer": writer,
            "lang": lang,
            "key": "order-1",
            "seq": expected["seq"],
        }
        assert headers["event-id"].decode() == expected["event_id"]
        assert headers["lang"] == lang.encode()
        assert headers["writer"] == writer.encode()
        assert headers["seq"] == str(expected["seq"]).encode()


@pytest.mark.usefixtures("business_schema")
async def test_writers_in_every_language_at_once_keep_per_key_order(
    writers: dict[str, list[str]],
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    make_settings: Any,
) -> None:
    keys = ["order-a", "order-b"]
    async with running(make_settings()):
        runs = await asyncio.gather(
            *(
                write(writers[lang], database_url, topic, key, 20, f"{lang}:{key}")
                for lang in LANGS
                for key in keys
            )
        )
        await wait_all_settled(conn, 60)
    expected = {line["event_id"] for run in runs for line in run}
    assert len(expected) == len(LANGS) * len(keys) * 20
    records = await consume(services.kafka_bootstrap_servers, topic, len(expected))
    seen: set[str] = set()
    last: dict[tuple[bytes | None, str], int] = {}
    for record in sorted(records, key=lambda r: (r.partition, r.offset)):
        event_id = dict(record.headers)["event-id"].decode()
        if event_id in seen:
            continue
        seen.add(event_id)
        body = orjson.loads(record.value or b"")
        stream = (record.key, body["writer"])  # one writer's events for one key
        assert body["seq"] == last.get(stream, -1) + 1, f"{stream} out of order"
        last[stream] = body["seq"]
    assert seen == expected
