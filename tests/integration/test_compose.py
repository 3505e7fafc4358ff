"""deploy/compose up for real, from a fresh clone: PostgreSQL, Kafka, migrate, the dispatcher, the
demo writer and the demo consumer, with compose.local.yaml's locally built images. The consumer
must print the writer's events, in order per key; then everything comes down.

podman-compose (a dev dependency) drives podman; with docker, `docker compose`. Its own stack on
free host ports: it does not use the test services.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
import time
import uuid
from pathlib import Path

import orjson
import pytest

from tests.containers import Engine, free_port

from .helpers import http_get, wait_until

# Cold, the first test builds the images (a minute or two each on 2 cores).
pytestmark = [pytest.mark.integration, pytest.mark.container, pytest.mark.timeout(1800)]

CONSUMED = re.compile(r"^consumed (\S+) (\d+)@(\d+) key=(\S+) event_id=(\S+) (\{.*\})$", re.M)
EVENTS = 10


def compose_command(engine: Engine) -> list[str]:
    if engine.name == "docker":
        return ["docker", "compose"]
    podman_compose = Path(sys.executable).parent / "podman-compose"
    found = str(podman_compose) if podman_compose.exists() else shutil.which("podman-compose")
    assert found, "podman-compose is a dev dependency: make install"
    return [found]


async def test_compose_up_publishes_the_writers_events_to_the_consumer_and_comes_down(
    engine: Engine, checkout: Path, dispatcher_image: str
) -> None:
    images = engine.service_images()
    http_port = free_port()
    env = {
        **engine.env,
        **images,
        "DISPATCHER_IMAGE": dispatcher_image,
        "COMPOSE_PG_PORT": str(free_port()),
        "COMPOSE_HTTP_PORT": str(http_port),
    }
    project = f"outbox-compose-test-{uuid.uuid4().hex[:8]}"
    directory = checkout / "deploy" / "compose"
    base = [
        *compose_command(engine),
        "-p", project, "-f", "compose.yaml", "-f", "compose.local.yaml",
    ]  # fmt: skip

    async def compose(*args: str, timeout: float = 300) -> str:
        process = await asyncio.create_subprocess_exec(
            *base,
            *args,
            cwd=directory,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(process.communicate(), timeout)
        text = output.decode()
        assert process.returncode == 0, f"compose {' '.join(args)}: {text[-3000:]}"
        return text

    def container(service: str) -> str:
        separator = "_" if engine.name == "podman" else "-"  # podman-compose's names, docker's
        return separator.join((project, service, "1"))

    def logs(service: str) -> str:
        result = engine.run("logs", container(service), check=False)
        return result.stdout + result.stderr

    # podman 4.3 cannot start a container whose --requires chain holds an exited one (migrate):
    # --no-deps leaves the order to compose and the waiting to the services' restart policies.
    up = ["up", "-d", "--no-deps"] if engine.name == "podman" else ["up", "-d", "--no-build"]
    started = time.monotonic()
    try:
        await compose(*up)

        async def consumed() -> bool:
            return len(CONSUMED.findall(logs("consumer"))) >= EVENTS

        await wait_until(consumed, 300, f"the demo consumer to print {EVENTS} events", interval=1)
        took = time.monotonic() - started

        async def ready() -> bool:
            try:
                return (await http_get(http_port, "/readyz"))[0] == 200
            except OSError:
                return False

        await wait_until(ready, 60, "the dispatcher's /readyz on its published port")
        records = CONSUMED.findall(logs("consumer"))
        writer = logs("writer")
        migrate = engine.run(
            "inspect", "--format", "{{.State.ExitCode}}", container("migrate")
        ).stdout.strip()
    finally:
        down = await compose("down", "-v", "-t", "30")
    left = engine.run("ps", "-a", "--filter", f"name={project}", "--format", "{{.Names}}")
    assert left.stdout.strip() == "", down[-2000:]
    assert migrate == "0"
    assert all(topic == "demo.orders" for topic, *_ in records)
    event_ids = [event_id for *_, event_id, _ in records]
    assert len(set(event_ids)) >= EVENTS
    # Per key, the writer's sequence numbers arrive in order (at-least-once: repeats allowed).
    last: dict[str, int] = {}
    for _, _, _, key, _, value in records:
        seq = orjson.loads(value)["seq"]
        assert seq >= last.get(key, -1), f"{key}: {seq} after {last[key]}"
        last[key] = seq
    assert f"enqueued demo.orders {records[0][3]}" in writer
    print(f"\ncompose up to {EVENTS} consumed events: {took:.0f}s; {len(records)} consumed")
