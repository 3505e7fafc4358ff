"""The console's web application: HTML pages for people, a JSON API under /api/v1/ for tools, both
over console/service.py and operate/. Starlette with Jinja2 templates (autoescaped); no script,
nothing loaded from elsewhere (the stylesheet ships in the package). Every request passes the
Host check and gets the security headers (security.py) before any route."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import ASGIApp

from outbox_dispatcher import errors
from outbox_dispatcher.config.outboxes import Source
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.console import auth, history, outboxes, security
from outbox_dispatcher.console.acting import Acts
from outbox_dispatcher.console.inputs import InputError
from outbox_dispatcher.console.outboxes import Kept, OutboxConsoles
from outbox_dispatcher.console.web import LoginNeededError
from outbox_dispatcher.operate.session import DatabaseError

API = "/api/v1"
API_ACTION_PATHS = {
    "dead-requeue": "dead/requeue",
    "dead-discard": "dead/discard",
    "replay": "replay",
    "pause": "pause",
    "resume": "resume",
}


class Console(Acts):
    """The routes, with what they share (web.Base)."""

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        sampler = None
        if self.sample:
            sampler = asyncio.create_task(history.sample_forever(self.settings, self.history))
        try:
            yield
        finally:
            if sampler is not None:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
            await self.jobs.stop()

    def routes(self) -> list[Route]:
        both = [
            ("/", "/status", self.overview),
            ("/dead", "/dead", self.dead),
            ("/dead/groups", "/dead/groups", self.groups),
            ("/rows", "/rows", self.rows),
            ("/rows/{id:int}", "/rows/{id:int}", self.row),
            ("/events/{event_id}", "/events/{event_id}", self.event),
            ("/blocked", "/blocked", self.blocked),
            ("/routed", "/routed", self.routed),
            ("/sources", "/sources", self.sources),
            ("/audit", "/audit", self.audit),
            ("/jobs/{id:int}", "/jobs/{id:int}", self.job),
        ]
        return [
            *(Route(page, endpoint) for page, _, endpoint in both),
            *(Route(f"{API}{path}", endpoint) for _, path, endpoint in both),
            Route("/find", self.find),
            Route("/replay", self.replay_form),
            Route("/login", self.login_form, methods=["GET"]),
            Route("/login", self.login, methods=["POST"]),
            Route("/logout", self.logout, methods=["POST"]),
            Route("/actions/confirm", self.confirm, methods=["POST"]),
            Route("/actions/run", self.run, methods=["POST"]),
            Route("/jobs/{id:int}/abort", self.abort, methods=["POST"]),
            Route(f"{API}/jobs/{{id:int}}/abort", self.abort, methods=["POST"]),
            Route("/static/console.css", self.stylesheet),
            Route(f"{API}/openapi.json", self.openapi),
            *(
                Route(f"{API}/{path}", self.api_action(name), methods=["POST"])
                for name, path in API_ACTION_PATHS.items()
            ),
        ]


def create_app(
    settings: Settings, *, sample: bool = True, fleet: Sequence[Source] = ()
) -> Starlette:
    """The console for these settings; `sample`: run the backlog sampler (in the lifespan);
    `fleet`: with OUTBOX_SOURCES, every source (the sources page lists their outboxes, and each
    other outbox's pages are under /outboxes/LABEL/: console/outboxes.py).
    errors.ConfigurationError when nobody could use it (no token, no trusted proxy, no
    anonymous reading)."""
    console = Console(settings, sample=sample, fleet=fleet)
    routes: list[BaseRoute] = list(console.routes())
    others: OutboxConsoles | None = None
    if fleet:
        others = OutboxConsoles(settings, fleet, functools.partial(_other, console, sample))
        routes.append(Mount(outboxes.MOUNT, app=others))
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(security.AllowedHosts, hosts=security.allowed_hosts(settings)),
            Middleware(security.SecurityHeaders),
            Middleware(
                SessionMiddleware,
                secret_key=auth.session_secret(settings),
                session_cookie=auth.SESSION_COOKIE,
                max_age=auth.SESSION_SECONDS,
                same_site="strict",
            ),
        ],
        exception_handlers=_handlers(console),
        lifespan=console.lifespan,
    )
    app.state.console = console

    async def stop_jobs() -> None:
        await console.jobs.stop()
        if others is not None:
            await others.stop()

    app.state.stop_jobs = stop_jobs
    return app


def _handlers(console: Console) -> dict[Any, Any]:
    return {
        InputError: console.on_input_error,
        LoginNeededError: console.on_login_needed,
        HTTPException: console.on_not_found,
        errors.OutboxDispatcherError: console.on_database_error,
        DatabaseError: console.on_database_error,
    }


def _other(home: Console, sample: bool, settings: Settings, prefix: str) -> tuple[ASGIApp, Kept]:
    """The console of another outbox of the sources, its pages under `prefix`; its history is
    sampled while the mount says so (outboxes.SAMPLED)."""
    console = Console(settings, sample=False, fleet=home.fleet, prefix=prefix, home=home.settings)
    console.templates = home.templates
    app = Starlette(routes=console.routes(), exception_handlers=_handlers(console))

    def sampler() -> asyncio.Task[None]:
        return asyncio.create_task(history.sample_forever(settings, console.history))

    return app, Kept(console.jobs.stop, sampler if sample else _no_sampler)


def _no_sampler() -> asyncio.Task[None]:
    return asyncio.create_task(asyncio.sleep(0))
