"""A container engine for the tests: docker where its daemon answers, else podman (installed from
Debian when neither is there), through deploy/docker/image.sh, the script `make image` uses.

Shared by the image and compose tests and by the testcontainers path of
tests/integration/conftest.py.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE_SCRIPT = Path("deploy") / "docker" / "image.sh"
NO_ENGINE = 3  # image.sh engine: no engine here and none can be installed


@dataclass(frozen=True)
class Engine:
    name: str  # docker or podman
    env: dict[str, str]  # os.environ plus what the engine needs (podman: CONTAINERS_CONF)

    def run(
        self, *args: str, timeout: float = 120, check: bool = True, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.name, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=cwd,
        )
        if check and result.returncode != 0:
            command = " ".join([self.name, *args])
            msg = f"{command} exited {result.returncode}: {result.stderr[-2000:]}"
            raise RuntimeError(msg)
        return result

    def script(self, root: Path, *args: str, timeout: float = 1800) -> str:
        """deploy/docker/image.sh of the checkout at `root`: its stdout (image names)."""
        result = subprocess.run(
            ["bash", str(root / IMAGE_SCRIPT), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            msg = f"image.sh {' '.join(args)} exited {result.returncode}: {result.stderr[-3000:]}"
            raise RuntimeError(msg)
        return result.stdout

    def service_images(self) -> dict[str, str]:
        """The local PostgreSQL and Kafka images (built once, then reused by their tags)."""
        return dict(line.split("=", 1) for line in self.script(ROOT, "service-images").split())

    @contextmanager
    def api_socket(self) -> Iterator[str]:
        """A Docker API endpoint for Docker clients (testcontainers): docker's own, or
        `podman system service` on a socket of its own, stopped afterwards."""
        if self.name == "docker":
            yield self.env.get("DOCKER_HOST", "unix:///var/run/docker.sock")
            return
        with tempfile.TemporaryDirectory(prefix="outbox-podman-") as tmp:
            path = Path(tmp) / "podman.sock"
            service = subprocess.Popen(
                ["podman", "system", "service", "--time=0", f"unix://{path}"],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                deadline = time.monotonic() + 30
                while not path.exists():
                    if time.monotonic() > deadline or service.poll() is not None:
                        msg = "podman system service did not open its socket"
                        raise RuntimeError(msg)
                    time.sleep(0.1)
                yield f"unix://{path}"
            finally:
                service.terminate()
                try:
                    service.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    service.kill()
                    service.wait(timeout=10)


@functools.cache
def find_engine() -> Engine | str:
    """The engine, or the one line that says why there is none."""
    if shutil.which("bash") is None:
        return "no bash to run deploy/docker/image.sh"
    result = subprocess.run(
        ["bash", str(ROOT / IMAGE_SCRIPT), "engine"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if result.returncode == NO_ENGINE:
        return result.stderr.strip().splitlines()[-1]
    if result.returncode != 0:
        msg = f"deploy/docker/image.sh engine failed: {result.stderr[-2000:]}"
        raise RuntimeError(msg)
    settings = dict(line.split("=", 1) for line in result.stdout.split())
    name = settings.pop("CONTAINER_ENGINE")
    return Engine(name, {**os.environ, **settings})


def free_port() -> int:
    """A free port for a container on the host network, from OUTBOX_TEST_CONTAINER_PORTS
    (default 15400-15599: clear of the ports CI's services use)."""
    low, _, high = os.environ.get("OUTBOX_TEST_CONTAINER_PORTS", "15400-15599").partition("-")
    candidates = list(range(int(low), int(high) + 1))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    msg = f"no free port in OUTBOX_TEST_CONTAINER_PORTS={low}-{high}"
    raise RuntimeError(msg)


def fresh_clone(dest: Path) -> Path:
    """A clone of this checkout's HEAD (what a user or CI gets), not its working tree."""
    subprocess.run(
        ["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(dest)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return dest
