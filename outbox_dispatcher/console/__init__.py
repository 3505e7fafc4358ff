"""`outbox-dispatcher console`: the outbox as pages for a person and a JSON API for tools, over
the same operations as the CLI (docs/operations.md, "The console")."""

from __future__ import annotations

import uvicorn

from outbox_dispatcher.console.app import create_app
from outbox_dispatcher.settings import Settings

__all__ = ["create_app", "serve"]


async def serve(settings: Settings) -> None:
    """Serve the console until SIGTERM/SIGINT (uvicorn's own handling: it finishes the requests
    under way, then stops)."""
    config = uvicorn.Config(
        create_app(settings),
        host=settings.console_host,
        port=settings.console_port,
        log_config=None,  # our logging (logs.configure), not uvicorn's
        access_log=False,
        server_header=False,
        lifespan="on",
    )
    await uvicorn.Server(config).serve()
