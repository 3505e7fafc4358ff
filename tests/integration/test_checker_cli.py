"""`python -m tests.checker` against a real database and topic: the JSON verdict and exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer

from .helpers import Services, insert_sequenced, running, wait_all_settled

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def checker(database_url: str, bootstrap: str, topic: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *(sys.executable, "-m", "tests.checker", "--database-url", database_url),
            *("--bootstrap", bootstrap, "--topic", topic, "--timeout", "30"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_the_checker_runs_as_a_script(
    conn: asyncpg.Connection,
    database_url: str,
    services: Services,
    topic: str,
    make_settings: Any,
) -> None:
    await insert_sequenced(conn, topic, keys=5, per_key=4)
    async with running(make_settings(http_port=0)):
        await wait_all_settled(conn, 60)
    ok = checker(database_url, services.kafka_bootstrap_servers, topic)
    assert ok.returncode == 0, ok.stderr
    verdict = json.loads(ok.stdout)
    assert (verdict["ok"], verdict["delivered"], verdict["lost"]) == (True, 20, 0)

    # A record no row explains: the verdict says so and the exit status is 1.
    producer = AIOKafkaProducer(bootstrap_servers=services.kafka_bootstrap_servers)
    await producer.start()
    try:
        await producer.send_and_wait(topic, b'{"seq": 99}', key=b"stray")
    finally:
        await producer.stop()
    bad = checker(database_url, services.kafka_bootstrap_servers, topic)
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["unexpected"] == 1
