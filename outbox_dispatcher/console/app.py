"""The console's web application: HTML pages for people, a JSON API under /api/v1/ for tools, both
over console/service.py. Starlette with Jinja2 templates (autoescaped); no script, nothing loaded
from elsewhere (the stylesheet ships in the package)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import asyncpg
import orjson
import structlog
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup, escape
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox_dispatcher import __version__, display, errors
from outbox_dispatcher.console import auth, history, openapi, service
from outbox_dispatcher.console.inputs import (
    AuditQuery,
    BlockedQuery,
    DeadQuery,
    InputError,
    action_body,
    from_query,
    parse,
)
from outbox_dispatcher.console.service import ACTIONS
from outbox_dispatcher.settings import Settings

log = structlog.get_logger(__name__)

READ_ONLY = (
    "the console is read-only: set OUTBOX_CONSOLE_TOKEN (or OUTBOX_CONSOLE_TOKEN_FILE) to allow "
    "actions"
)
HEADERS = {
    # No script, no frames, no foreign resources: the pages need none.
    "content-security-policy": "default-src 'none'; style-src 'self'; img-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


class SecurityHeaders:
    """HEADERS on every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    *((k.encode(), v.encode()) for k, v in HEADERS.items()),
                ]
            await send(message)

        await self.app(scope, receive, sending)


def _time(value: object) -> str:
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = datetime.fromisoformat(value)
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return "-" if value is None else str(value)


def _ascii_json(value: object) -> str:
    """JSON with every non-ASCII character escaped: exact, yet no control or bidi character
    reaches the page (for hidden form fields that carry a filter back)."""
    return json.dumps(value, ensure_ascii=True, default=_time_value)


def _time_value(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(type(value).__name__)


def _exact_attribute(value: object) -> Markup:
    """An attribute value that the browser reads back exactly while the page's source holds no
    raw control, format or line-breaking character (each written as a character reference)."""
    text = str(escape("" if value is None else value))
    exact = "".join(f"&#x{ord(c):x};" if display.unsafe(c) else c for c in text)
    return Markup(exact)  # noqa: S704 - escaped above, and character references are inert


def _environment() -> Environment:
    env = Environment(
        loader=PackageLoader("outbox_dispatcher.console", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
    )
    # Writer-controlled text: control, bidi and line-breaking characters shown as escapes, as
    # on the terminal; autoescaping then makes the rest inert HTML.
    env.filters["inert"] = lambda value: display.inert("" if value is None else str(value))
    env.filters["inert_lines"] = lambda value: display.inert_multiline(str(value))
    env.filters["age"] = display.age_text
    env.filters["time"] = _time
    env.filters["json"] = lambda value: orjson.dumps(value).decode()
    env.filters["ascii_json"] = _ascii_json
    env.filters["exact"] = _exact_attribute
    return env


class Console:
    """The routes, with the settings and the sampled history they share."""

    def __init__(self, settings: Settings, *, sample: bool = True) -> None:
        self.settings = settings
        self.history = history.History()
        self.sample = sample
        self.templates = Jinja2Templates(env=_environment())

    # --- plumbing --------------------------------------------------------------------------

    def page(
        self, request: Request, name: str, context: dict[str, Any], status_code: int = 200
    ) -> Response:
        base = {
            "read_only": not auth.enabled(self.settings),
            "logged_in": auth.logged_in(request),
            "csrf": auth.csrf_token(request),
            "version": __version__,
            "table": f"{self.settings.db_schema}.{self.settings.table}",
        }
        return self.templates.TemplateResponse(
            request, name, {**base, **context}, status_code=status_code
        )

    def problem(self, request: Request, code: int, message: str, extra: Any = None) -> Response:
        if request.url.path.startswith("/api/"):
            body: dict[str, Any] = {"error": message}
            if extra:
                body["problems"] = extra
            headers = {"www-authenticate": "Bearer"} if code == 401 else None
            return JSONResponse(body, status_code=code, headers=headers)
        return self.page(request, "error.html", {"message": message, "problems": extra or []}, code)

    async def on_input_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, InputError)  # noqa: S101 - registered for InputError only
        return self.problem(request, 400, exc.message, exc.problems)

    async def on_database_error(self, request: Request, exc: Exception) -> Response:
        if isinstance(exc, asyncpg.InsufficientPrivilegeError):
            return self.problem(
                request,
                403,
                f"the console's database role may not do this ({exc.message}): give it the "
                "dispatcher or owner role of schema/roles.sql to act",
            )
        log.warning("console_database_error", error=errors.describe(exc))
        return self.problem(request, 503, display.inert(errors.describe(exc)))

    # --- reads, both faces -----------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        report = await service.overview(self.settings, self.history)
        if request.url.path.startswith("/api/"):
            return JSONResponse(report)
        chart = history.svg(self.history.samples(), service.now())
        return self.page(request, "overview.html", {"report": report, "chart": chart})

    async def dead(self, request: Request) -> Response:
        query = parse(DeadQuery, from_query(request.query_params, _multi(request)))
        found = await service.dead(self.settings, query)
        if request.url.path.startswith("/api/"):
            return JSONResponse({"rows": found, "limit": query.limit})
        current = query.model_dump(exclude_defaults=True, exclude={"limit"})
        return self.page(request, "dead.html", {"rows": found, "query": query, "filter": current})

    async def blocked(self, request: Request) -> Response:
        query = parse(BlockedQuery, from_query(request.query_params, {}))
        found = await service.blocked(self.settings, query)
        if request.url.path.startswith("/api/"):
            return JSONResponse(found)
        return self.page(request, "blocked.html", {**found, "query": query})

    async def row(self, request: Request) -> Response:
        row_id: int = request.path_params["id"]
        found = await service.row(self.settings, row_id)
        if found is None:
            return self.problem(request, 404, f"no row {row_id}")
        if request.url.path.startswith("/api/"):
            return JSONResponse(found)
        return self.page(request, "row.html", {"row": found})

    async def audit(self, request: Request) -> Response:
        query = parse(AuditQuery, from_query(request.query_params, {}))
        found = await service.audit(self.settings, query)
        if request.url.path.startswith("/api/"):
            return JSONResponse({"actions": found})
        return self.page(request, "audit.html", {"actions": found, "query": query})

    async def replay_form(self, request: Request) -> Response:
        return self.page(request, "replay.html", {})

    # --- API actions -----------------------------------------------------------------------

    def api_action(self, name: str) -> Callable[[Request], Awaitable[Response]]:
        model = ACTIONS[name][0]

        async def endpoint(request: Request) -> Response:
            if not auth.enabled(self.settings):
                return self.problem(request, 403, READ_ONLY)
            if not auth.bearer_ok(self.settings, request):
                return self.problem(
                    request, 401, "actions need Authorization: Bearer <OUTBOX_CONSOLE_TOKEN>"
                )
            raw = await _body(request)
            if raw is None:
                return self.problem(request, 413, f"the body is over {MAX_BODY_BYTES} bytes")
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError:
                return self.problem(request, 400, "the body is not JSON")
            dry_run = request.query_params.get("dry_run", "false")
            if dry_run not in ("true", "false"):
                return self.problem(request, 400, "dry_run must be true or false")
            body = parse(model, data)
            outcome = await service.act(
                self.settings, name, body, dry_run=dry_run == "true", client=_client(request)
            )
            if not outcome.dry_run:
                log.info("console_action", command=outcome.command, rows=outcome.rows, via="api")
            return JSONResponse(outcome.as_json())

        return endpoint

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi.document(ACTIONS))

    # --- pages: login and actions ----------------------------------------------------------

    async def login_form(self, request: Request) -> Response:
        return self.page(request, "login.html", {"failed": False})

    async def login(self, request: Request) -> Response:
        form = await request.form()
        if not auth.csrf_ok(request, form.get(auth.CSRF_FIELD)):
            return self.problem(request, 403, _CSRF)
        if not auth.enabled(self.settings):
            return self.problem(request, 403, READ_ONLY)
        token = form.get("token")
        if not isinstance(token, str) or not auth.token_matches(self.settings, token):
            log.warning("console_login_failed", client=_client(request))
            return self.page(request, "login.html", {"failed": True}, 401)
        auth.log_in(request)
        log.info("console_login", client=_client(request))
        return RedirectResponse("/", status_code=303)

    async def logout(self, request: Request) -> Response:
        form = await request.form()
        if not auth.csrf_ok(request, form.get(auth.CSRF_FIELD)):
            return self.problem(request, 403, _CSRF)
        request.session.clear()
        return RedirectResponse("/", status_code=303)

    async def _acting(self, request: Request) -> tuple[Any, Response | None]:
        """The form of an action post, or the refusal: read-only, not logged in, bad CSRF."""
        form = await request.form()
        if not auth.csrf_ok(request, form.get(auth.CSRF_FIELD)):
            return form, self.problem(request, 403, _CSRF)
        if not auth.enabled(self.settings):
            return form, self.problem(request, 403, READ_ONLY)
        if not auth.logged_in(request):
            return form, self.problem(request, 401, "log in (with OUTBOX_CONSOLE_TOKEN) to act")
        return form, None

    async def _named(self, request: Request) -> tuple[Any, str, Response | None]:
        """The form of an action post and the action it names, or the refusal."""
        form, refused = await self._acting(request)
        name = str(form.get("action", ""))
        if refused is None and name not in ACTIONS:
            refused = self.problem(request, 400, f"unknown action {display.inert(name)!r}")
        return form, name, refused

    async def confirm(self, request: Request) -> Response:
        """Step one of an action from a page: count what it would change, ask."""
        form, name, refused = await self._named(request)
        if refused:
            return refused
        body = parse(ACTIONS[name][0], action_body(name, form))
        outcome = await service.act(
            self.settings, name, body, dry_run=True, client=_client(request)
        )
        return self.page(
            request,
            "confirm.html",
            {"action": name, "outcome": outcome, "body": body.model_dump(exclude_defaults=True)},
        )

    async def run(self, request: Request) -> Response:
        """Step two: do it; the page says how many rows changed."""
        form, name, refused = await self._named(request)
        if refused:
            return refused
        try:
            data = orjson.loads(str(form.get("body", "")))
        except orjson.JSONDecodeError:
            return self.problem(request, 400, "the action's body is not JSON")
        body = parse(ACTIONS[name][0], data)
        outcome = await service.act(
            self.settings, name, body, dry_run=False, client=_client(request)
        )
        log.info("console_action", command=outcome.command, rows=outcome.rows, via="page")
        expected = form.get("expected")
        return self.page(request, "done.html", {"outcome": outcome, "expected": expected})

    async def stylesheet(self, request: Request) -> Response:
        css = resources.files(__package__).joinpath("static/console.css").read_bytes()
        return Response(css, media_type="text/css")

    # --- the application -------------------------------------------------------------------

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

    def routes(self) -> list[Route]:
        api = "/api/v1"
        return [
            Route("/", self.overview),
            Route("/dead", self.dead),
            Route("/blocked", self.blocked),
            Route("/rows/{id:int}", self.row),
            Route("/audit", self.audit),
            Route("/replay", self.replay_form),
            Route("/login", self.login_form, methods=["GET"]),
            Route("/login", self.login, methods=["POST"]),
            Route("/logout", self.logout, methods=["POST"]),
            Route("/actions/confirm", self.confirm, methods=["POST"]),
            Route("/actions/run", self.run, methods=["POST"]),
            Route("/static/console.css", self.stylesheet),
            Route(f"{api}/status", self.overview),
            Route(f"{api}/dead", self.dead),
            Route(f"{api}/blocked", self.blocked),
            Route(f"{api}/rows/{{id:int}}", self.row),
            Route(f"{api}/audit", self.audit),
            Route(f"{api}/openapi.json", self.openapi),
            *(
                Route(f"{api}/{path}", self.api_action(name), methods=["POST"])
                for name, path in API_ACTION_PATHS.items()
            ),
        ]


API_ACTION_PATHS = {
    "dead-requeue": "dead/requeue",
    "dead-discard": "dead/discard",
    "replay": "replay",
    "pause": "pause",
    "resume": "resume",
}

_CSRF = "the form's CSRF token is missing or stale: reload the page and try again"


# An action's body: a filter with at most inputs.MAX_IDS ids fits many times over.
MAX_BODY_BYTES = 1_048_576


async def _body(request: Request) -> bytes | None:
    """The request's body, or None past MAX_BODY_BYTES (read no further than that)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _client(request: Request) -> str | None:
    return request.client.host if request.client else None


def _multi(request: Request) -> dict[str, list[str]]:
    return {"id": request.query_params.getlist("id")}


def create_app(settings: Settings, *, sample: bool = True) -> Starlette:
    """The console for these settings; `sample`: run the backlog sampler (in the lifespan)."""
    console = Console(settings, sample=sample)
    app = Starlette(
        routes=console.routes(),
        middleware=[
            Middleware(SecurityHeaders),
            Middleware(
                SessionMiddleware,
                secret_key=auth.session_secret(settings),
                session_cookie=auth.SESSION_COOKIE,
                max_age=auth.SESSION_SECONDS,
                same_site="strict",
            ),
        ],
        exception_handlers={
            InputError: console.on_input_error,
            errors.OutboxDispatcherError: console.on_database_error,
            asyncpg.PostgresError: console.on_database_error,
        },
        lifespan=console.lifespan,
    )
    app.state.console = console
    return app
