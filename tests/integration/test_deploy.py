"""The container's process model without Docker: the Dockerfile's ENTRYPOINT + CMD, run as PID 1 of
a new PID namespace, publishes what the compose demo writer enqueues and stops on SIGTERM with
exit 0.

PID 1 matters: the kernel delivers a signal to a namespace's init process only if that process
installed a handler for it, so a dispatcher relying on default signal actions would ignore the
SIGTERM Kubernetes and Docker send (and be SIGKILLed after the grace period). Where `unshare`
cannot make a PID namespace, the test runs the same command as a plain process and records that.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import yaml

from outbox_dispatcher.config.settings import Settings
from tests.deploy_files import DEPLOY, exec_form, healthcheck_command, parse_dockerfile

from .helpers import (
    Services,
    check,
    consume,
    count,
    event_ids,
    http_get,
    log_events,
    settings_env,
    wait_all_settled,
    wait_until,
)

pytestmark = pytest.mark.integration

DEMO_WRITER = DEPLOY / "compose" / "demo_writer.py"
COMPOSE = DEPLOY / "compose" / "compose.yaml"


def image_entrypoint() -> list[str]:
    """ENTRYPOINT of the runtime stage, the console script resolved in this venv's bin/ (the image
    puts its venv's bin/ first on PATH)."""
    entrypoint = exec_form(parse_dockerfile()[-1].last("ENTRYPOINT") or "")
    script = Path(sys.executable).parent / entrypoint[0]
    assert script.exists(), f"{entrypoint[0]} is not a console script of this venv"
    return [str(script), *entrypoint[1:]]


def image_command() -> list[str]:
    """ENTRYPOINT + CMD of the runtime stage: what a container of the image runs by default."""
    return [*image_entrypoint(), *exec_form(parse_dockerfile()[-1].last("CMD") or "")]


def pid_namespace_works() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", "true"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    return probe.returncode == 0


def child_of(pid: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # pid (comm) state ppid ...: comm may hold spaces, so split after its ')'.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                return int(entry.name)
    return None


def namespace_pids(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(p) for p in line.split()[1:]]
    return [pid]


def start(command: list[str], env: dict[str, str], output: Path | None) -> subprocess.Popen[bytes]:
    if output is None:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    with output.open("ab") as log:
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def exit_code(command: list[str], env: dict[str, str]) -> int:
    return subprocess.run(command, env=env, capture_output=True, timeout=30, check=False).returncode


def file_settings_supported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> bool:
    """Whether this build reads OUTBOX_<SETTING>_FILE (as compose and Kubernetes use it)."""
    probe = tmp_path / "http_host"
    probe.write_text("127.0.0.2\n")
    with monkeypatch.context() as patch:
        patch.setenv("OUTBOX_HTTP_HOST_FILE", str(probe))
        return Settings().http_host == "127.0.0.2"


async def test_image_command_as_pid_1_publishes_the_demo_writers_events_and_stops_on_sigterm(
    conn: asyncpg.Connection,
    services: Services,
    topic: str,
    database_url: str,
    make_settings: Any,
    tmp_path: Path,
    record_property: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = make_settings(log_format="json")  # OUTBOX_HTTP_PORT=0: a free port
    env = settings_env(settings)
    # The DSN from a file, as compose and the Kubernetes manifests pass it (where supported).
    dsn_file = tmp_path / "database_url"
    dsn_file.write_text(database_url + "\n")
    from_file = file_settings_supported(monkeypatch, tmp_path)
    record_property("database_url_from_file", from_file)
    if from_file:
        del env["OUTBOX_DATABASE_URL"]
        env["OUTBOX_DATABASE_URL_FILE"] = str(dsn_file)
    command = image_command()
    isolated = pid_namespace_works()
    record_property("pid_namespace", isolated)
    if isolated:
        unshare = shutil.which("unshare")
        assert unshare is not None
        command = [unshare, "--pid", "--fork", "--mount-proc", *command]
    else:
        print("\nunshare cannot make a PID namespace here: running the command as a plain process")
    log_path = tmp_path / "dispatcher.log"
    launcher = start(command, env, log_path)
    writer: subprocess.Popen[bytes] | None = None
    try:
        if isolated:

            async def init_started() -> bool:
                return child_of(launcher.pid) is not None

            await wait_until(init_started, 30, "unshare to start the namespace's init")
            init = child_of(launcher.pid)
            assert init is not None
            assert namespace_pids(init)[-1] == 1, "the dispatcher is PID 1 of its namespace"
        else:
            init = launcher.pid

        async def listening() -> bool:
            return any(e["event"] == "http_listening" for e in log_events(log_path))

        await wait_until(listening, 60, "the dispatcher's HTTP endpoint")
        [port] = [e["port"] for e in log_events(log_path) if e["event"] == "http_listening"]

        async def ready() -> bool:
            return (await http_get(port, "/readyz"))[0] == 200

        await wait_until(ready, 60, "/readyz to pass")

        # The image's HEALTHCHECK, with this venv's python: passes here, fails on a closed port.
        health = [sys.executable, *healthcheck_command(parse_dockerfile()[-1])[1:]]
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        passes = {**base_env, "OUTBOX_HTTP_PORT": str(port)}
        assert await asyncio.to_thread(exit_code, health, passes) == 0
        fails = {**base_env, "OUTBOX_HTTP_PORT": "1"}
        assert await asyncio.to_thread(exit_code, health, fails) != 0

        # The compose demo writer, its DSN read from a file as in compose.
        demo_env = {
            **base_env,
            "DEMO_DATABASE_URL_FILE": str(dsn_file),
            "DEMO_TOPIC": topic,
            "DEMO_INTERVAL_SECONDS": "0.05",
            "DEMO_KEYS": "3",
        }
        writer = start([sys.executable, str(DEMO_WRITER)], demo_env, None)

        async def some_written() -> bool:
            return await count(conn) >= 12

        await wait_until(some_written, 60, "the demo writer to enqueue 12 events")
        writer.send_signal(signal.SIGTERM)
        output, _ = await asyncio.to_thread(writer.communicate, timeout=30)
        assert writer.returncode == 0, output.decode()
        assert b"demo writer stopped after" in output
        written = await count(conn)
        await wait_all_settled(conn, 60)
        assert await count(conn, "published_at IS NOT NULL") == written

        # The counter follows the mark's commit by a moment.
        sample = f'outbox_published_total{{topic="{topic}"}} {float(written)}'.encode()

        async def counted() -> bool:
            status, body = await http_get(port, "/metrics")
            return status == 200 and sample in body

        await wait_until(counted, 30, "/metrics to count the published rows")

        os.kill(init, signal.SIGTERM)
        try:
            code: int | None = await asyncio.to_thread(
                launcher.wait, settings.shutdown_grace_seconds + 30
            )
        except subprocess.TimeoutExpired:
            code = None  # SIGTERM ignored: PID 1 without a handler for it
    finally:
        for process in (launcher, writer):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    events = log_events(log_path)
    text = log_path.read_text()[-3000:]
    assert code == 0, text
    assert [e["signal"] for e in events if e["event"] == "signal_received"] == ["SIGTERM"], text
    [stopped] = [e for e in events if e["event"] == "stopped"]
    assert stopped["published"] == written, text
    assert not [e for e in events if e["level"] in ("error", "critical")], text
    assert "shutdown_grace_expired" not in {e["event"] for e in events}
    records = await consume(services.kafka_bootstrap_servers, topic, written)
    verdict = check(records, await event_ids(conn))
    assert (verdict.delivered, verdict.lost, verdict.reordered) == (written, [], [])
    print(
        f"\nPID 1 in a new PID namespace: {isolated}; DSN from a file: {from_file}; "
        f"{written} events; exit {code}"
    )


async def test_compose_migrate_service_exits_0_and_is_idempotent(
    empty_database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compose's dispatcher waits for `migrate` to complete successfully: its command (the image's
    ENTRYPOINT + the service's command, with the service's environment) creates the schema in an
    empty database and exits 0, and exits 0 again when there is nothing to do."""
    service = yaml.safe_load(COMPOSE.read_text())["services"]["migrate"]
    command = [*image_entrypoint(), *service["command"]]
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env = {**base_env, **{k: str(v) for k, v in service["environment"].items()}}
    dsn_file = tmp_path / "database_url"
    dsn_file.write_text(empty_database_url + "\n")
    env["OUTBOX_DATABASE_URL_FILE"] = str(dsn_file)
    if not file_settings_supported(monkeypatch, tmp_path):
        env["OUTBOX_DATABASE_URL"] = empty_database_url
    first = await asyncio.to_thread(exit_code, command, env)
    second = await asyncio.to_thread(exit_code, command, env)
    assert (first, second) == (0, 0)
    conn = await asyncpg.connect(empty_database_url)
    try:
        assert await conn.fetchval("SELECT to_regclass('public.outbox') IS NOT NULL")
    finally:
        await conn.close()
