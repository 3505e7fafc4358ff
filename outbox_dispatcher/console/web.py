"""What every route of the console shares: the settings, the templates, the sampled history, the
running jobs, the trusted proxies and the login throttle; one database session per request with
who is asking; and the two kinds of answer, a page (HTML) or, under /api/, JSON."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.templating import Jinja2Templates

from outbox_dispatcher import __version__, display, errors
from outbox_dispatcher.config.outboxes import Source
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.console import auth, history, render, service, tasks
from outbox_dispatcher.console.inputs import InputError
from outbox_dispatcher.console.outboxes import MOUNT
from outbox_dispatcher.operate.session import PrivilegeError, Session, connected
from outbox_dispatcher.routing import Router

log = structlog.get_logger(__name__)

LOG_IN_TO_READ = (
    "log in to read this console (with OUTBOX_CONSOLE_TOKEN, or through the trusted proxy); "
    "the API takes Authorization: Bearer <OUTBOX_CONSOLE_TOKEN>"
)


class LoginNeededError(Exception):
    """Reading needs a known person here (OUTBOX_CONSOLE_ANONYMOUS_READ is off)."""


class Base:
    """The console's shared state and answers; the routes are in pages.py and acting.py."""

    def __init__(
        self,
        settings: Settings,
        *,
        sample: bool = True,
        fleet: Sequence[Source] = (),
        prefix: str = "",
        home: Settings | None = None,
    ) -> None:
        auth.check_configured(settings)
        self.settings = settings
        # Where its pages are: "" for the outbox the console serves, /outboxes/LABEL for every
        # other outbox of the sources (console/outboxes.py); each link, redirect and API path
        # starts with it.
        self.prefix = prefix
        self.home = settings if home is None else home  # the settings of the outbox at "/"
        # With OUTBOX_SOURCES: every source (the console serves one outbox of them, `settings`').
        self.fleet = tuple(fleet)
        self.history = history.History()
        self.sample = sample
        self.templates = Jinja2Templates(env=render.environment())
        self.jobs = tasks.Jobs(settings)
        self.proxies = auth.Proxies(settings.console_trusted_proxies)
        self.throttle = auth.Throttle()
        self.router: Router = service.router_of(settings)

    # --- who, on which connection ----------------------------------------------------------

    @contextlib.asynccontextmanager
    async def session(self, request: Request) -> AsyncIterator[tuple[Session, auth.Who]]:
        """The request's database session and who is asking (no check of what they may do)."""
        async with connected(self.settings) as session:
            who = await auth.who(self.settings, self.proxies, request, session, self.prefix)
            yield session, who

    @contextlib.asynccontextmanager
    async def reading(self, request: Request) -> AsyncIterator[tuple[Session, auth.Who]]:
        """As `session`, for a read: refused unless a known person asks or anonymous reading is
        on; logged with who asked."""
        async with self.session(request) as (session, who):
            if not who.known and not self.settings.console_anonymous_read:
                raise LoginNeededError
            log.info(
                "console_read",
                path=request.url.path,
                identity=who.identity,
                source=who.source,
                client=who.client,
            )
            yield session, who

    def can_act(self) -> bool:
        """Whether anyone can act on this console: a token or a trusted proxy is configured."""
        return bool(self.settings.console_token or self.settings.console_trusted_proxies)

    def payload_for(self, who: auth.Who) -> bool:
        """Payloads only with OUTBOX_CONSOLE_SHOW_PAYLOAD, and only to a known person."""
        return self.settings.console_show_payload and who.known

    # --- answers ---------------------------------------------------------------------------

    def api(self, request: Request) -> bool:
        return request.url.path.startswith(f"{self.prefix}/api/")

    def to(self, path: str) -> RedirectResponse:
        """A redirect to one of its own pages (`path` from its root)."""
        return RedirectResponse(f"{self.prefix}{path}", status_code=303)

    def page(
        self,
        request: Request,
        name: str,
        context: dict[str, Any],
        who: auth.Who | None = None,
        status_code: int = 200,
    ) -> Response:
        known = who is not None and who.known
        base = {
            "read_only": not self.can_act(),
            "logged_in": known,
            "who": who,
            "can_act": known and self.can_act(),
            "login_form": self.settings.console_token is not None,
            "csrf": auth.csrf_token(request),
            "version": __version__,
            "table": f"{self.settings.db_schema}.{self.settings.table}",
            "fleet": bool(self.fleet),
            "path": request.url.path,
            "base": self.prefix,
            "served": self.prefix.removeprefix(f"{MOUNT}/") if self.prefix else None,
        }
        return self.templates.TemplateResponse(
            request, name, {**base, **context}, status_code=status_code
        )

    def problem(
        self,
        request: Request,
        code: int,
        message: str,
        extra: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        """A refusal: {error, problems} under /api/, else the error page, which links back to
        the page the request came from."""
        if self.api(request):
            body: dict[str, Any] = {"error": message}
            if extra:
                body["problems"] = extra
            if code == 401:
                headers = {**(headers or {}), "www-authenticate": "Bearer"}
            return JSONResponse(body, status_code=code, headers=headers)
        back = request.url.path if request.method == "GET" and request.url.query else None
        context = {"message": message, "problems": extra or [], "back": back}
        response = self.page(request, "error.html", context, None, code)
        response.headers.update(headers or {})
        return response

    async def on_input_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, InputError)  # noqa: S101 - registered for InputError only
        return self.problem(request, 400, exc.message, exc.problems)

    async def on_login_needed(self, request: Request, exc: Exception) -> Response:
        if self.api(request) or request.method != "GET":
            return self.problem(request, 401, LOG_IN_TO_READ)
        return self.to("/login")

    async def on_not_found(self, request: Request, exc: Exception) -> Response:
        code = getattr(exc, "status_code", 404)
        message = (
            f"no page {display.inert(request.url.path)}"
            if code == 404
            else f"{request.method} is not how {display.inert(request.url.path)} is used"
        )
        return self.problem(request, code, message)

    async def on_database_error(self, request: Request, exc: Exception) -> Response:
        if isinstance(exc, PrivilegeError):
            return self.problem(
                request,
                403,
                f"the console's database role may not do this ({exc.message}): give it the "
                "dispatcher or owner role of schema/roles.sql to act",
            )
        log.warning("console_database_error", error=errors.describe(exc))
        return self.problem(request, 503, display.inert(errors.describe(exc)))
