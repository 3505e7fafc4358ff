"""One console for every outbox of the sources (OUTBOX_SOURCES, issue 36): the outbox it was
started for (`console --source`) at /, every other at /outboxes/LABEL/ (its `source` label, as
`status` and the metrics name it), with the same pages, API and actions.

Each outbox's pages are a console of their own, made at its first request and kept: its
logins, audit, jobs and sampled history live in its own table, as a console started for it
would have them (a person logs in to each outbox they act on; the cookie keeps one login per
outbox). What they share is the root's: the host check, the security headers, the cookie's key,
the templates. A label is an outbox's `source` label as the sources page links it (else 404);
a label with a '/' (a named pattern's `name/schema`) is two path segments."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Sequence

import structlog
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from outbox_dispatcher.config.outboxes import Source
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.operate import sources

log = structlog.get_logger(__name__)

MOUNT = "/outboxes"
# How many outboxes' consoles sample their history at once (the most recently visited): each
# reads its table's backlog every OUTBOX_CONSOLE_SAMPLE_SECONDS.
SAMPLED = 16
NOT_FOUND = "no outbox of the sources has this label: the sources page (/sources) lists them"
Make = Callable[[Settings, str], tuple[ASGIApp, "Kept"]]


class Kept:
    """What the mount keeps of one outbox's console: how to stop its jobs and its sampler."""

    def __init__(
        self,
        stop_jobs: Callable[[], Awaitable[None]],
        sample: Callable[[], asyncio.Task[None]],
    ) -> None:
        self.stop_jobs = stop_jobs
        self._sample = sample
        self.sampler: asyncio.Task[None] | None = None

    def sampling(self, on: bool) -> None:
        if on and self.sampler is None:
            self.sampler = self._sample()
        elif not on and self.sampler is not None:
            self.sampler.cancel()
            self.sampler = None


class OutboxConsoles:
    """The ASGI app mounted at MOUNT: routes /LABEL/... to that outbox's console."""

    def __init__(self, home: Settings, fleet: Sequence[Source], make: Make) -> None:
        self._home = home
        self._fleet = tuple(fleet)
        self._make = make
        self._apps: dict[str, ASGIApp] = {}
        self._kept: collections.OrderedDict[str, Kept] = collections.OrderedDict()
        self._lock = asyncio.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rest = str(scope.get("path", ""))[len(str(scope.get("root_path", ""))) :]
        found = await self._find(rest)
        if found is None:
            await _not_found(scope, receive, send)
            return
        label, app = found
        self._visited(label)
        child = {**scope, "root_path": f"{scope.get('root_path', '')}/{label}"}
        await app(child, receive, send)

    async def _find(self, rest: str) -> tuple[str, ASGIApp] | None:
        """The console of the label `rest` starts with (one segment, or two), made if new."""
        parts = rest.strip("/").split("/")
        for label in ("/".join(parts[:2]), parts[0]):
            if label in self._apps and (rest == f"/{label}" or rest.startswith(f"/{label}/")):
                return label, self._apps[label]
        for label in dict.fromkeys(("/".join(parts[:2]), parts[0])):
            if label and (app := await self._resolve(label)) is not None:
                return label, app
        return None

    async def _resolve(self, label: str) -> ASGIApp | None:
        async with self._lock:
            if label in self._apps:
                return self._apps[label]
            settings = await sources.labelled(self._home, self._fleet, label)
            if settings is None or _same_table(settings, self._home):
                return None  # the home outbox's pages are at /
            app, kept = self._make(settings, f"{MOUNT}/{label}")
            self._apps[label], self._kept[label] = app, kept
            log.info("console_outbox_opened", source=label)
            return app

    def _visited(self, label: str) -> None:
        """Its history is sampled while it is among the SAMPLED most recently visited."""
        self._kept.move_to_end(label)
        self._kept[label].sampling(True)
        for old in list(self._kept.values())[:-SAMPLED]:
            old.sampling(False)

    async def stop(self) -> None:
        """At shutdown: each outbox's running actions interrupted (their records say so), its
        sampler stopped."""
        for kept in self._kept.values():
            kept.sampling(False)
            await kept.stop_jobs()


def _same_table(one: Settings, other: Settings) -> bool:
    return (
        one.database_url.get_secret_value() == other.database_url.get_secret_value()
        and one.db_schema == other.db_schema
        and one.table == other.table
    )


async def _not_found(scope: Scope, receive: Receive, send: Send) -> None:
    """No outbox of the sources has this label (or it is the home outbox, served at /)."""
    answer: Response = (
        JSONResponse({"error": NOT_FOUND}, status_code=404)
        if "/api/" in str(scope.get("path", ""))
        else PlainTextResponse(NOT_FOUND, status_code=404)
    )
    await answer(scope, receive, send)
