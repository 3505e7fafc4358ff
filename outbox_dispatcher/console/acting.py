"""The console's changes: logging in and out, and the actions, from a page in two steps (a
confirmation that counts the rows, shows a sample and fixes the bound; then the run, as a job) or
from the API (a dry run that answers the count and the bound; the action, as a job that answers
when done or, past API_WAIT_SECONDS, with its record to follow); aborting a running action."""

from __future__ import annotations

import secrets
from typing import Any

import orjson
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from outbox_dispatcher import display
from outbox_dispatcher.console import auth, service
from outbox_dispatcher.console.inputs import InputError, action_body, parse
from outbox_dispatcher.console.pages import Reads
from outbox_dispatcher.console.service import ACTIONS, DESTRUCTIVE
from outbox_dispatcher.operate import jobs
from outbox_dispatcher.operate.actions import ActionRefusedError

log = structlog.get_logger(__name__)

READ_ONLY = (
    "this console cannot act: set OUTBOX_CONSOLE_TOKEN_FILE (people log in with the token) or "
    "OUTBOX_CONSOLE_TRUSTED_PROXIES (a proxy names them) to let people act"
)
NOT_KNOWN = "log in (with OUTBOX_CONSOLE_TOKEN, or through the trusted proxy) to act"
CSRF = "the form's CSRF token is missing or stale: reload the page and try again"
# A page's run waits this long for its action, so that a small one is done when its page shows;
# the API answers a finished action (200) or, past this, its running record (202).
PAGE_WAIT_SECONDS = 2.0
API_WAIT_SECONDS = 10.0
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


def _outcome(record: dict[str, Any], prefix: str) -> dict[str, Any]:
    """An action's answer from its record: what the API has always answered, and the record."""
    return {
        "command": record["command"],
        "rows": record["rows"],
        "dry_run": False,
        "detail": record["detail"] or f"{record['status']}: {record['rows']} rows so far",
        "record": record["id"],
        "status": record["status"],
        "expected": record["expected"],
        "job": f"{prefix}/api/v1/jobs/{record['id']}",
    }


class Acts(Reads):
    # --- logging in and out ----------------------------------------------------------------

    async def login(self, request: Request) -> Response:
        form = await request.form()
        if not auth.csrf_ok(request, form.get(auth.CSRF_FIELD)):
            return self.problem(request, 403, CSRF)
        if self.settings.console_token is None:
            return self.problem(request, 403, "this console has no token to log in with")
        client = self.proxies.client(request)
        wait = self.throttle.wait(client)
        if wait > 0:
            context = {"failed": False, "wait": int(wait + 0.999)}
            response = self.page(request, "login.html", context, None, 429)
            response.headers["retry-after"] = str(int(wait + 0.999))
            return response
        token = form.get("token")
        if not isinstance(token, str) or not auth.token_matches(self.settings, token):
            log.warning("console_login_failed", client=client)
            await self.throttle.failed(client)
            return self.page(request, "login.html", {"failed": True, "wait": 0}, None, 401)
        self.throttle.succeeded(client)
        async with self.session(request) as (session, _who):
            await auth.log_in(request, session, self.settings, client, self.prefix)
        log.info("console_login", client=client)
        return self.to("/")

    async def logout(self, request: Request) -> Response:
        form = await request.form()
        if not auth.csrf_ok(request, form.get(auth.CSRF_FIELD)):
            return self.problem(request, 403, CSRF)
        async with self.session(request) as (session, who):
            await auth.log_out(request, session, self.prefix)
        log.info("console_logout", identity=who.identity, client=who.client)
        return self.to("/login")

    # --- actions from a page ---------------------------------------------------------------

    async def _form(self, request: Request) -> tuple[Any, str, Response | None]:
        """The form of an action post and the action it names, or the refusal: bad CSRF, a
        console that cannot act, an unknown action."""
        form = await request.form()
        name = str(form.get("action", ""))
        if not auth.csrf_ok(request, form.get(auth.CSRF_FIELD)):
            return form, name, self.problem(request, 403, CSRF)
        if not self.can_act():
            return form, name, self.problem(request, 403, READ_ONLY)
        if name not in ACTIONS:
            return form, name, self.problem(request, 400, f"unknown action {display.inert(name)!r}")
        return form, name, None

    async def confirm(self, request: Request) -> Response:
        """Step one: count what the action would change, fix the bound, show a sample, ask."""
        form, name, refused = await self._form(request)
        if refused:
            return refused
        body = parse(ACTIONS[name][0], action_body(name, form))
        async with self.session(request) as (session, who):
            if not who.known:
                return self.problem(request, 401, NOT_KNOWN)
            action = service.build(self.settings, name, body, who.by())
            outcome = await service.count(session, action)
            sample = await service.sample(session, name, body, outcome)
        carried = body.model_dump(exclude_defaults=True, mode="json")
        if outcome.bound is not None:
            carried["bound"] = outcome.bound.as_json()
        context = {
            "action": name,
            "outcome": outcome,
            "asked": body.model_dump(exclude_defaults=True, exclude={"bound"}, mode="json"),
            "body": carried,
            "bound": outcome.bound,
            "sample": sample,
            "destructive": name in DESTRUCTIVE,
            "request_key": secrets.token_urlsafe(16),
        }
        return self.page(request, "confirm.html", context, who)

    async def run(self, request: Request) -> Response:
        """Step two: start the action within the bound that was confirmed, as a job; then its
        record's page. The same form posted again (a second click) finds the first run."""
        form, name, refused = await self._form(request)
        if refused:
            return refused
        async with self.session(request) as (_session, who):
            if not who.known:
                return self.problem(request, 401, NOT_KNOWN)
        try:
            data = orjson.loads(str(form.get("body", "")))
        except orjson.JSONDecodeError:
            return self.problem(request, 400, "the action's body is not JSON")
        reason = str(form.get("reason", "")).strip()
        if name == "pause" and reason and isinstance(data, dict):
            data = {**data, "reason": reason}  # given on the confirmation page
        body = parse(ACTIONS[name][0], data)
        if name in DESTRUCTIVE and str(form.get("typed", "")).strip().lower() != "discard":
            return self.problem(request, 400, 'type "discard" to confirm a discard')
        key = str(form.get("request", "")) or None
        action = service.build(self.settings, name, body, who.by())
        record = await self._start(action, who, key)
        await self.jobs.settle(record, PAGE_WAIT_SECONDS)
        return self.to(f"/jobs/{record}")

    async def _start(self, action: Any, who: auth.Who, key: str | None) -> int:
        try:
            return await self.jobs.start(action, who.origin(), key)
        except jobs.DuplicateRunError as again:
            if again.record is None:
                raise InputError("this request was started before") from None
            return again.record
        except ActionRefusedError as exc:
            raise InputError(exc.message) from None

    async def abort(self, request: Request) -> Response:
        """Ask a running action to stop after its current batch (any console, any process)."""
        record: int = request.path_params["id"]
        if self.api(request):
            async with self.session(request) as (session, who):
                if not who.known:
                    return self.problem(request, 401, NOT_KNOWN)
                asked = await jobs.request_abort(session, record, who.identity)
                found = await service.record(session, record)
            if not asked:
                return self.problem(request, 409, f"audit record {record} is not running")
            return JSONResponse(found)
        form = await request.form()
        if not auth.csrf_ok(request, form.get(auth.CSRF_FIELD)):
            return self.problem(request, 403, CSRF)
        async with self.session(request) as (session, who):
            if not who.known:
                return self.problem(request, 401, NOT_KNOWN)
            asked = await jobs.request_abort(session, record, who.identity)
        log.info("console_abort", record=record, identity=who.identity, asked=asked)
        await self.jobs.settle(record, PAGE_WAIT_SECONDS)
        return self.to(f"/jobs/{record}")

    # --- actions from the API --------------------------------------------------------------

    def api_action(self, name: str) -> Any:
        model = ACTIONS[name][0]

        async def endpoint(request: Request) -> Response:
            if not self.can_act():
                return self.problem(request, 403, READ_ONLY)
            raw = await _body(request)
            if raw is None:
                return self.problem(request, 413, f"the body is over {MAX_BODY_BYTES} bytes")
            dry_run = request.query_params.get("dry_run", "false")
            async with self.session(request) as (session, who):
                if not who.known:
                    return self.problem(
                        request, 401, "actions need Authorization: Bearer <OUTBOX_CONSOLE_TOKEN>"
                    )
                try:
                    data = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    return self.problem(request, 400, "the body is not JSON")
                if dry_run not in ("true", "false"):
                    return self.problem(request, 400, "dry_run must be true or false")
                action = service.build(self.settings, name, parse(model, data), who.by())
                if dry_run == "true":
                    return JSONResponse((await service.count(session, action)).as_json())
            key = request.headers.get("idempotency-key") or None
            record = await self._start(action, who, key)
            await self.jobs.settle(record, API_WAIT_SECONDS)
            async with self.session(request) as (session, _):
                found = await service.record(session, record)
            assert found is not None  # noqa: S101 - it was just written
            running = found["status"] == jobs.RUNNING
            return JSONResponse(_outcome(found, self.prefix), status_code=202 if running else 200)

        return endpoint
