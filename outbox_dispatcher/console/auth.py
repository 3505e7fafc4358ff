"""Who is asking, and what they may do.

A person is known to the console in one of three ways: named by a trusted proxy
(`X-Forwarded-User` from an address of OUTBOX_CONSOLE_TRUSTED_PROXIES), logged in with the console
token (a session: a row of <table>_console_session, which logout, expiry and a new token end for
every copy of its cookie), or, for the API, with the token as a Bearer token. A known person reads
and acts; nobody else reads unless OUTBOX_CONSOLE_ANONYMOUS_READ, and then never acts nor sees
payloads. Failed logins are slowed down per client. Every form post carries the CSRF token of its
browser's (signed) cookie.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import secrets
import time
from dataclasses import dataclass

from starlette.requests import Request

from outbox_dispatcher import errors
from outbox_dispatcher.config.names import split_list
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.operate import logins
from outbox_dispatcher.operate.jobs import Origin
from outbox_dispatcher.operate.session import Session

SESSION_COOKIE = "outbox_console"
SESSION_SECONDS = 8 * 3600
CSRF_FIELD = "csrf"
TOKEN_HOLDER = "token holder"  # noqa: S105 - a name, not a secret

# Every failed login answers after FAILED_LOGIN_DELAY seconds; a client's next attempt is refused
# (429) for LOCKOUT_BASE * 2^(failures - 1) seconds, at most LOCKOUT_MAX, failures counted over
# the last FAILURE_MEMORY seconds.
FAILED_LOGIN_DELAY = 1.0
LOCKOUT_BASE = 1.0
LOCKOUT_MAX = 60.0
FAILURE_MEMORY = 900.0
_MAX_CLIENTS = 10_000

NOBODY_CAN_USE = (
    "the console would serve nobody: set OUTBOX_CONSOLE_TOKEN_FILE (people log in with the "
    "token), OUTBOX_CONSOLE_TRUSTED_PROXIES (a proxy names them), or "
    "OUTBOX_CONSOLE_ANONYMOUS_READ=true (anyone who reaches it reads, nobody acts)"
)


def check_configured(settings: Settings) -> None:
    usable = settings.console_token or settings.console_trusted_proxies
    if not usable and not settings.console_anonymous_read:
        raise errors.ConfigurationError(NOBODY_CAN_USE)


@dataclass(frozen=True)
class Who:
    """The person asking (identity None: nobody known) and the client's address."""

    identity: str | None = None
    source: str | None = None  # proxy, login, bearer
    client: str | None = None

    @property
    def known(self) -> bool:
        return self.identity is not None

    def origin(self) -> Origin:
        via: dict[str, object] = {"via": "console", "http_client": self.client or "?"}
        return Origin(via=via, identity=self.identity, source=self.source)

    def by(self) -> str | None:
        """Who, for a pause's paused_by."""
        return None if self.identity is None else f"{self.identity} via console"


class Proxies:
    """The trusted proxies: their requests name the person and the client."""

    def __init__(self, setting: str | None) -> None:
        self.networks = [ipaddress.ip_network(item, strict=False) for item in split_list(setting)]

    def trusts(self, address: str | None) -> bool:
        if not address or not self.networks:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self.networks)

    def client(self, request: Request) -> str | None:
        """The client's address: the peer's, or behind a trusted proxy the last address of
        X-Forwarded-For that is not one of the proxies."""
        peer = request.client.host if request.client else None
        if not self.trusts(peer):
            return peer
        hops = [h.strip() for h in request.headers.get("x-forwarded-for", "").split(",")]
        for hop in reversed([h for h in hops if h]):
            if not self.trusts(hop):
                return hop
        return peer

    def user(self, request: Request) -> str | None:
        """X-Forwarded-User, only from a trusted proxy (from anyone else it means nothing)."""
        peer = request.client.host if request.client else None
        name = request.headers.get("x-forwarded-user", "").strip()
        return name[:200] if name and self.trusts(peer) else None


def token_matches(settings: Settings, given: str) -> bool:
    """Constant-time comparison with the configured token; always False without one."""
    if settings.console_token is None:
        return False
    expected = settings.console_token.get_secret_value().encode()
    return hmac.compare_digest(given.encode(), expected)


def bearer_ok(settings: Settings, request: Request) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and token_matches(settings, token.strip())


def _derived(settings: Settings, label: bytes) -> str:
    if settings.console_token is None:
        return secrets.token_hex(32)
    key = settings.console_token.get_secret_value().encode()
    return hmac.new(key, label, hashlib.sha256).hexdigest()


def session_secret(settings: Settings) -> str:
    """The key of the signed cookie (it carries the CSRF token and the session's key):
    derived from the token, so that consoles sharing a token share cookies."""
    return _derived(settings, b"outbox-dispatcher console session")


def token_tag(settings: Settings) -> str:
    """Which token a session logged in with: a new token ends every session."""
    return _derived(settings, b"outbox-dispatcher console token tag")[:32]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _sid(prefix: str) -> str:
    """The cookie's field of a login to the outbox whose pages are under `prefix` (each outbox
    keeps its logins in its own table: console/outboxes.py)."""
    return f"sid{prefix}"


async def who(
    settings: Settings, proxies: Proxies, request: Request, session: Session, prefix: str = ""
) -> Who:
    client = proxies.client(request)
    user = proxies.user(request)
    if user is not None:
        return Who(user, "proxy", client)
    if bearer_ok(settings, request):
        return Who(TOKEN_HOLDER, "bearer", client)
    key = request.session.get(_sid(prefix))
    if isinstance(key, str) and settings.console_token is not None:
        found = await logins.find_login(session, digest=_digest(key), token_tag=token_tag(settings))
        if found is not None:
            return Who(found, "login", client)
    return Who(None, None, client)


async def log_in(
    request: Request, session: Session, settings: Settings, client: str | None, prefix: str = ""
) -> None:
    """A new server-side session for this browser: a fresh cookie (the CSRF token of the
    anonymous one is not carried over; the logins to other outboxes of the console are)."""
    key = secrets.token_urlsafe(32)
    digest = _digest(key)
    identity = f"{TOKEN_HOLDER} (session {digest.hex()[:8]})"
    await logins.open_login(
        session,
        digest=digest,
        identity=identity,
        client=client,
        token_tag=token_tag(settings),
        seconds=SESSION_SECONDS,
    )
    kept = {k: v for k, v in request.session.items() if k.startswith("sid") and k != _sid(prefix)}
    request.session.clear()
    request.session.update({**kept, _sid(prefix): key})
    csrf_token(request)


async def log_out(request: Request, session: Session, prefix: str = "") -> None:
    """End the session in the database (every copy of its cookie), then forget it (the logins
    to the console's other outboxes stay)."""
    key = request.session.pop(_sid(prefix), None)
    request.session.pop(CSRF_FIELD, None)  # a fresh one at the next form
    if isinstance(key, str):
        await logins.end_login(session, digest=_digest(key))


def csrf_token(request: Request) -> str:
    """This browser's CSRF token, made on first use."""
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


class Throttle:
    """Failed logins per client address, in this process: each makes the next attempt wait
    twice as long (from LOCKOUT_BASE seconds up to LOCKOUT_MAX)."""

    def __init__(self) -> None:
        self._failures: dict[str, tuple[int, float]] = {}  # client -> (failures, last failure)

    def wait(self, client: str | None) -> float:
        """Seconds before `client` may try again (0: now)."""
        failures, last = self._failures.get(client or "?", (0, 0.0))
        if not failures:
            return 0.0
        lockout = min(LOCKOUT_BASE * 2 ** (failures - 1), LOCKOUT_MAX)
        return float(max(0.0, last + lockout - time.monotonic()))

    async def failed(self, client: str | None) -> None:
        """Count a failure, then answer only after FAILED_LOGIN_DELAY."""
        now = time.monotonic()
        if len(self._failures) >= _MAX_CLIENTS:
            self._forget(now)
        failures, last = self._failures.get(client or "?", (0, 0.0))
        if now - last > FAILURE_MEMORY:
            failures = 0
        self._failures[client or "?"] = (failures + 1, now)
        await asyncio.sleep(FAILED_LOGIN_DELAY)

    def succeeded(self, client: str | None) -> None:
        self._failures.pop(client or "?", None)

    def _forget(self, now: float) -> None:
        stale = [c for c, (_, last) in self._failures.items() if now - last > FAILURE_MEMORY]
        for client in stale or list(self._failures)[: _MAX_CLIENTS // 2]:
            del self._failures[client]
