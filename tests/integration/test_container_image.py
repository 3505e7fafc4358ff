"""The image as users run it: built from a fresh clone by deploy/docker/image.sh (`make image`), run
with the engine here on the host network against the test services, locked down the way compose
and the Kubernetes manifests run it.

Prints the image size and the time from `run` to a passing /readyz (figures, not assertions).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import orjson
import pytest

from tests.containers import Engine, free_port

from .helpers import (
    Services,
    check,
    consume,
    event_ids,
    http_get,
    insert_sequenced,
    wait_all_settled,
    wait_until,
)

# Cold, the first test builds the images (a minute or two each on 2 cores).
pytestmark = [pytest.mark.integration, pytest.mark.container, pytest.mark.timeout(1800)]

GRACE_SECONDS = 10
UID = 10001
IMAGE_FACTS = """
import importlib.util, json, pathlib, shutil, sys
import outbox_dispatcher
package = pathlib.Path(outbox_dispatcher.__file__).parent
modules = sorted(p.stem for p in package.glob("*.py"))
tag = sys.implementation.cache_tag
compiled = sorted(m for m in modules if (package / "__pycache__" / f"{m}.{tag}.pyc").exists())
tools = [t for t in ("gcc", "cc", "make", "pip", "pip3") if shutil.which(t)]
print(json.dumps({"modules": modules, "compiled": compiled, "tools": tools}))
"""


@pytest.fixture
async def secret_role(conn: asyncpg.Connection, database_url: str) -> AsyncIterator[str]:
    """The test database's DSN for a role of its own with an unguessable password, so that the
    password's appearance anywhere is a leak."""
    role = f"outbox_image_{uuid.uuid4().hex[:8]}"
    password = f"pw-{uuid.uuid4().hex}"
    owner = await conn.fetchval("SELECT current_user")
    await conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}' IN ROLE {owner}")
    scheme, _, rest = database_url.partition("://")
    host_and_db = rest.split("@", 1)[1]
    try:
        yield f"{scheme}://{role}:{password}@{host_and_db}"
    finally:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
        )
        await conn.execute(f"DROP ROLE {role}")


async def test_image_runs_locked_down_publishes_and_stops_on_sigterm(
    engine: Engine,
    dispatcher_image: str,
    services: Services,
    conn: asyncpg.Connection,
    secret_role: str,
    topic: str,
    tmp_path: Path,
) -> None:
    password = secret_role.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
    secret = tmp_path / "database_url"
    secret.write_text(secret_role + "\n")
    secret.chmod(0o644)  # the container's uid 10001 reads it through a read-only bind mount
    port = free_port()
    name = f"outbox-image-test-{uuid.uuid4().hex[:8]}"
    run = [
        "run", "--detach", "--name", name, "--network", "host",
        "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "-v", f"{secret}:/run/secrets/database_url:ro",
        "-e", "OUTBOX_DATABASE_URL_FILE=/run/secrets/database_url",
        "-e", f"OUTBOX_KAFKA_BOOTSTRAP_SERVERS={services.kafka_bootstrap_servers}",
        "-e", f"OUTBOX_HTTP_PORT={port}",
        "-e", f"OUTBOX_SHUTDOWN_GRACE_SECONDS={GRACE_SECONDS}",
        "-e", "OUTBOX_POLL_INTERVAL_SECONDS=0.2",
        "-e", "OUTBOX_LOG_FORMAT=json",
        dispatcher_image,
    ]  # fmt: skip
    started = time.monotonic()
    engine.run(*run)
    try:

        async def ready() -> bool:
            try:
                return (await http_get(port, "/readyz"))[0] == 200
            except OSError:
                return False

        await wait_until(ready, 60, "/readyz of the container", interval=0.05)
        to_ready = time.monotonic() - started
        assert (await http_get(port, "/livez"))[0] == 200

        # Non-root, read-only root filesystem, and the secret nowhere in the engine's view.
        assert engine.run("exec", name, "id", "-u").stdout.strip() == str(UID)
        writable = engine.run("exec", name, "touch", "/opt/outbox-dispatcher/x", check=False)
        assert writable.returncode != 0, "the root filesystem is writable"
        assert "Read-only file system" in writable.stderr
        [inspected] = orjson.loads(engine.run("inspect", name).stdout)
        assert inspected["HostConfig"]["ReadonlyRootfs"] is True
        assert inspected["Config"]["User"] == f"{UID}:{UID}"
        assert password not in engine.run("inspect", name).stdout
        # No compiler or pip on the PATH; every module of the package byte-compiled in the image.
        facts = orjson.loads(engine.run("exec", name, "python", "-c", IMAGE_FACTS).stdout)
        assert facts["tools"] == [], facts
        assert facts["modules"] and facts["modules"] == facts["compiled"], facts
        if engine.name == "podman":  # docker runs HEALTHCHECKs itself, on its own schedule
            assert engine.run("healthcheck", "run", name, check=False).returncode == 0

        order = await insert_sequenced(conn, topic, keys=3, per_key=10)
        await wait_all_settled(conn, 60)
        records = await consume(services.kafka_bootstrap_servers, topic, len(order))
        verdict = check(records, await event_ids(conn))
        assert (verdict.delivered, verdict.lost, verdict.reordered) == (len(order), [], [])

        # SIGTERM (the image's STOPSIGNAL): exit 0 before the engine would resort to SIGKILL.
        stopping = time.monotonic()
        await asyncio.to_thread(
            engine.run, "stop", "--time", str(GRACE_SECONDS + 15), name, timeout=GRACE_SECONDS + 60
        )
        stopped_after = time.monotonic() - stopping
        [state] = orjson.loads(engine.run("inspect", name).stdout)
        logs = engine.run("logs", name)
        output = logs.stdout + logs.stderr
    finally:
        engine.run("rm", "--force", name, check=False)
    assert state["State"]["ExitCode"] == 0, output[-3000:]
    assert stopped_after < GRACE_SECONDS + 15, output[-3000:]
    events = [orjson.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert [e["signal"] for e in events if e["event"] == "signal_received"] == ["SIGTERM"]
    assert [e["published"] for e in events if e["event"] == "stopped"] == [len(order)]
    assert password not in output
    print(
        f"\ncontainer run to /readyz: {to_ready:.2f}s; {len(order)} events published; "
        f"SIGTERM to exit 0: {stopped_after:.2f}s"
    )
