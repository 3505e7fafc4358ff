"""What every answer of the console goes through before any route: the Host check (a page on
another site that rebinds its own name to 127.0.0.1 is refused, so it cannot read the console
through the operator's browser or tunnel) and the security headers (no script, no frames, no
foreign resources, nothing cached)."""

from __future__ import annotations

import html

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox_dispatcher.config.names import split_list
from outbox_dispatcher.config.settings import Settings

HEADERS = {
    # No script, no frames, no foreign resources: the pages need none.
    "content-security-policy": "default-src 'none'; style-src 'self'; img-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}

# Addresses that mean "every interface": not a name a browser uses to reach the console.
_WILDCARDS = {"0.0.0.0", "::", ""}  # noqa: S104 - recognised, not bound


def allowed_hosts(settings: Settings) -> frozenset[str]:
    """OUTBOX_CONSOLE_ALLOWED_HOSTS, or the console's own address and the loopback names."""
    configured = split_list(settings.console_allowed_hosts)
    if configured:
        return frozenset(host.lower().strip("[]") for host in configured)
    defaults = {"127.0.0.1", "localhost", "::1"}
    if settings.console_host not in _WILDCARDS:
        defaults.add(settings.console_host.lower().strip("[]"))
    return frozenset(defaults)


def host_of(header: str) -> str:
    """The name in a Host header, without its port: 'example:9647' -> 'example',
    '[::1]:9647' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    if header.count(":") == 1:
        return header.partition(":")[0]
    return header


class AllowedHosts:
    """Refuse (400) a request whose Host header names no allowed host, before any route runs."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str]) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        host = host_of(headers.get(b"host", b"").decode("latin-1"))
        if host in self.hosts:
            await self.app(scope, receive, send)
            return
        await _refuse(scope, send, host)


async def _refuse(scope: Scope, send: Send, host: str) -> None:
    message = (
        f"this console does not answer to the host name {host!r}: reach it by an allowed name "
        "(OUTBOX_CONSOLE_ALLOWED_HOSTS; by default 127.0.0.1, localhost or its own address)"
    )
    if str(scope.get("path", "")).startswith("/api/"):
        body, kind = orjson.dumps({"error": message}), b"application/json"
    else:
        page = f"<!doctype html><title>Refused</title><p>{html.escape(message)}</p>"
        body, kind = page.encode(), b"text/html; charset=utf-8"
    headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in HEADERS.items()]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})


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
