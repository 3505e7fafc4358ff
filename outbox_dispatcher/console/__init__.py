"""`outbox-dispatcher console`: the outbox as pages for a person and a JSON API for tools, over
the same operations as the CLI (docs/operations.md, "The operator console")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn

from outbox_dispatcher.console.app import create_app
from outbox_dispatcher.settings import Settings

__all__ = ["create_app", "serve"]


class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGTERM/SIGINT end serve() normally (exit 0, as `run`
    does) instead of being raised again once it returns, which would end the process by the
    signal. Reaches into uvicorn's private `_captured_signals`: the console-process test
    (tests/integration/test_console.py) fails if that changes."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()


async def serve(settings: Settings) -> None:
    """Serve the console until SIGTERM/SIGINT: uvicorn finishes the requests under way, then
    stops."""
    config = uvicorn.Config(
        create_app(settings),
        host=settings.console_host,
        port=settings.console_port,
        log_config=None,  # our logging (logs.configure), not uvicorn's
        access_log=False,
        server_header=False,
        lifespan="on",
    )
    await _Server(config).serve()
