"""`outbox-dispatcher console`: the outbox as pages for a person and a JSON API for tools, over
the same operations as the CLI (docs/operations.md, "The operator console")."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterator, Sequence

import uvicorn

from outbox_dispatcher.config.outboxes import Source
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.console.app import create_app

__all__ = ["create_app", "serve"]


class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGTERM/SIGINT end serve() normally (exit 0, as `run`
    does) instead of being raised again once it returns, which would end the process by the
    signal, and that a shutdown first interrupts the actions this console runs (their records
    say so, with their rows) instead of letting requests that wait on them keep it alive.
    Reaches into uvicorn's private `_captured_signals`: the console-process test
    (tests/integration/test_console.py) fails if that changes."""

    def __init__(self, config: uvicorn.Config, stop_jobs: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self.stop_jobs = stop_jobs

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.stop_jobs()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()


async def serve(settings: Settings, fleet: Sequence[Source] = ()) -> None:
    """Serve the console until SIGTERM/SIGINT: uvicorn finishes the requests under way, then
    stops. `fleet`: with OUTBOX_SOURCES, every source (`settings` name the outbox served)."""
    app = create_app(settings, fleet=fleet)
    config = uvicorn.Config(
        app,
        host=settings.console_host,
        port=settings.console_port,
        log_config=None,  # our logging (logs.configure), not uvicorn's
        access_log=False,
        server_header=False,
        lifespan="on",
    )
    await _Server(config, app.state.stop_jobs).serve()
