"""Who may act: the API by `Authorization: Bearer <OUTBOX_CONSOLE_TOKEN>`, the pages by a signed
session cookie got from the login form with the same token. Every form post carries the
session's CSRF token. Without a token setting the console is read-only: nothing can log in."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from starlette.requests import Request

from outbox_dispatcher.settings import Settings

SESSION_COOKIE = "outbox_console"
SESSION_SECONDS = 8 * 3600
CSRF_FIELD = "csrf"


def enabled(settings: Settings) -> bool:
    return settings.console_token is not None


def token_matches(settings: Settings, given: str) -> bool:
    """Constant-time comparison with the configured token; always False without one."""
    if settings.console_token is None:
        return False
    expected = settings.console_token.get_secret_value().encode()
    return hmac.compare_digest(given.encode(), expected)


def bearer_ok(settings: Settings, request: Request) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and token_matches(settings, token.strip())


def session_secret(settings: Settings) -> str:
    """Derived from the token, so that consoles sharing a token share sessions and a new token
    ends every session; without a token a random one (nobody can log in anyway)."""
    if settings.console_token is None:
        return secrets.token_hex(32)
    key = settings.console_token.get_secret_value().encode()
    return hmac.new(key, b"outbox-dispatcher console session", hashlib.sha256).hexdigest()


def logged_in(request: Request) -> bool:
    return request.session.get("operator") is True


def csrf_token(request: Request) -> str:
    """This session's CSRF token, made on first use."""
    token = request.session.get(CSRF_FIELD)
    if not isinstance(token, str):
        token = secrets.token_urlsafe(32)
        request.session[CSRF_FIELD] = token
    return token


def csrf_ok(request: Request, given: object) -> bool:
    expected = request.session.get(CSRF_FIELD)
    if not isinstance(expected, str) or not isinstance(given, str):
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def log_in(request: Request) -> None:
    """A fresh session: the CSRF token of the anonymous one is not carried over."""
    request.session.clear()
    request.session["operator"] = True
    csrf_token(request)
