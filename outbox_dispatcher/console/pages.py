"""The console's reads, each a page and the same data as JSON under /api/v1/: the overview, dead
rows (paged, sorted, counted, grouped by cause), rows in any state (search by event id, key,
header, payload), one row, blocked keys, routed rows by destination, the audit and one action's
record (its progress)."""

from __future__ import annotations

import time
import uuid
from importlib import resources
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from outbox_dispatcher.console import charts, history, openapi, service
from outbox_dispatcher.console.inputs import (
    AuditQuery,
    BlockedQuery,
    DeadQuery,
    GroupsQuery,
    RowsBrowse,
    SourcesQuery,
    from_query,
    parse,
)
from outbox_dispatcher.console.service import ACTIONS
from outbox_dispatcher.console.web import Base

NO_SOURCES = "this console serves one table (OUTBOX_SOURCES is not set): there is no sources page"
# The overview reloads itself this often at the least (its samples come every
# OUTBOX_CONSOLE_SAMPLE_SECONDS); a running action's page every second.
REFRESH_SECONDS = 5.0


def _multi(request: Request) -> dict[str, list[str]]:
    return {"id": request.query_params.getlist("id")}


def overview_charts(samples: history.History, now: float) -> list[str]:
    """Backlog, rates, lag: each its own chart, with axes."""
    kept, rates = samples.samples(), samples.rates()
    window = samples.window_seconds
    backlog = charts.chart(
        "Backlog (rows)",
        "",
        [
            charts.Series("pending", "#1f6fb4", [(s.at, float(s.pending)) for s in kept]),
            charts.Series("parked", "#8a5cc2", [(s.at, float(s.parked)) for s in kept]),
            charts.Series("dead", "#c0392b", [(s.at, float(s.dead)) for s in kept]),
        ],
        now=now,
        window=window,
    )
    flow = charts.chart(
        "Rows per second",
        "/s",
        [
            charts.Series("published", "#2e8b57", [(r.at, r.published_per_second) for r in rates]),
            charts.Series("dead", "#c0392b", [(r.at, r.dead_per_second) for r in rates]),
        ],
        now=now,
        window=window,
    )
    lag = charts.chart(
        "Lag: oldest pending age",
        "s",
        [charts.Series("lag", "#d35400", [(s.at, s.oldest_pending_age_seconds) for s in kept])],
        now=now,
        window=window,
    )
    return [backlog, flow, lag]


class Reads(Base):
    def _listing(
        self, request: Request, name: str, found: dict[str, Any], query: Any, who: Any
    ) -> Response:
        """A page that goes on with `before`: its links keep the query but that."""
        if self.api(request):
            return JSONResponse(found)
        listing = query.model_dump(exclude_defaults=True, exclude={"before"}, mode="json")
        return self.page(request, name, {**found, "query": query, "listing": listing}, who)

    async def overview(self, request: Request) -> Response:
        async with self.reading(request) as (session, who):
            report = await service.overview(session, self.settings, self.history)
        if self.api(request):
            return JSONResponse(report)
        refresh = request.query_params.get("refresh") != "off"
        every = max(REFRESH_SECONDS, self.settings.console_sample_seconds)
        context = {
            "report": report,
            "charts": overview_charts(self.history, time.time()),
            "refresh_seconds": every if refresh else None,
        }
        return self.page(request, "overview.html", context, who)

    async def dead(self, request: Request) -> Response:
        query = parse(DeadQuery, from_query(request.query_params, _multi(request)))
        async with self.reading(request) as (session, who):
            found = await service.dead(session, query, self.router)
        if self.api(request):
            return JSONResponse(found)
        current = query.model_dump(
            exclude_defaults=True,
            exclude={"limit", "sort", "after", "before", "bound"},
            mode="json",
        )
        listing = query.model_dump(
            exclude_defaults=True, exclude={"after", "before", "bound"}, mode="json"
        )
        context = {**found, "query": query, "filter": current, "listing": listing}
        return self.page(request, "dead.html", context, who)

    async def groups(self, request: Request) -> Response:
        query = parse(GroupsQuery, from_query(request.query_params, _multi(request)))
        async with self.reading(request) as (session, who):
            found = await service.groups(session, query)
        if self.api(request):
            return JSONResponse(found)
        current = query.model_dump(exclude_defaults=True, exclude={"limit", "bound"}, mode="json")
        context = {**found, "query": query, "filter": current}
        return self.page(request, "groups.html", context, who)

    async def rows(self, request: Request) -> Response:
        query = parse(RowsBrowse, from_query(request.query_params, {}))
        if query.payload is not None and not self.settings.console_show_payload:
            return self.problem(
                request, 403, "payload search needs OUTBOX_CONSOLE_SHOW_PAYLOAD=true"
            )
        async with self.reading(request) as (session, who):
            if query.payload is not None and not who.known:
                return self.problem(request, 401, "payload search needs a login")
            found = await service.rows(session, query, self.router)
        return self._listing(request, "rows.html", found, query, who)

    async def row(self, request: Request) -> Response:
        row_id: int = request.path_params["id"]
        async with self.reading(request) as (session, who):
            payload = self.payload_for(who)
            found = await service.row(
                session, self.settings, row_id, payload=payload, router=self.router
            )
        if found is None:
            return self.problem(request, 404, f"no row {row_id}")
        if self.api(request):
            return JSONResponse(found)
        return self.page(request, "row.html", {"row": found}, who)

    async def event(self, request: Request) -> Response:
        """The row of an event id: "was event X sent, when, how often"."""
        text = request.path_params["event_id"]
        try:
            event_id = uuid.UUID(text)
        except ValueError:
            return self.problem(request, 400, f"{text!r} is not an event id (a UUID)")
        async with self.reading(request) as (session, _who):
            row_id = await service.row_of_event(session, event_id)
        if row_id is None:
            return self.problem(request, 404, f"no row has event id {event_id}")
        api = "/api/v1" if self.api(request) else ""
        return self.to(f"{api}/rows/{row_id}")

    async def find(self, request: Request) -> Response:
        """The search box: a row id, an event id, or a key."""
        text = request.query_params.get("q", "").strip()
        if text.isdigit():
            return self.to(f"/rows/{int(text)}")
        try:
            return self.to(f"/events/{uuid.UUID(text)}")
        except ValueError:
            pass
        target = "/rows" if not text else f"/rows?{_query({'key': text})}"
        return self.to(target)

    async def blocked(self, request: Request) -> Response:
        query = parse(BlockedQuery, from_query(request.query_params, {}))
        async with self.reading(request) as (session, who):
            found = await service.blocked(session, self.settings, query)
        if self.api(request):
            return JSONResponse(found)
        return self.page(request, "blocked.html", {**found, "query": query}, who)

    async def routed(self, request: Request) -> Response:
        async with self.reading(request) as (session, who):
            found = await service.routed(session, self.router)
        if self.api(request):
            return JSONResponse({"destinations": found})
        settings = self.settings
        context = {
            "destinations": found,
            "template": settings.topic_template,
            "default_topic": settings.default_topic,
        }
        return self.page(request, "routed.html", context, who)

    async def sources(self, request: Request) -> Response:
        """With OUTBOX_SOURCES: every outbox of every source, its state and backlog (as
        `status`), each linked to its pages: the console's own outbox at /, every other at
        /outboxes/LABEL/ (console/outboxes.py)."""
        if not self.fleet:
            return self.problem(request, 404, NO_SOURCES)
        query = parse(SourcesQuery, from_query(request.query_params, {}))
        async with self.reading(request) as (_, who):
            pass  # who may read: the served table's logins and settings decide
        found = await service.sources(self.home, self.fleet, query)
        if self.api(request):
            return JSONResponse(found)
        return self.page(request, "sources.html", {**found, "query": query}, who)

    async def audit(self, request: Request) -> Response:
        query = parse(AuditQuery, from_query(request.query_params, {}))
        async with self.reading(request) as (session, who):
            found = await service.audit(session, query)
        return self._listing(request, "audit.html", found, query, who)

    async def job(self, request: Request) -> Response:
        """One action's record: its progress while it runs, then how it ended."""
        record_id: int = request.path_params["id"]
        async with self.reading(request) as (session, who):
            found = await service.record(session, record_id)
        if found is None:
            return self.problem(request, 404, f"no audit record {record_id}")
        if self.api(request):
            return JSONResponse(found)
        return self.page(request, "job.html", {"job": found}, who)

    async def replay_form(self, request: Request) -> Response:
        async with self.reading(request) as (_session, who):
            pass
        return self.page(request, "replay.html", {}, who)

    async def login_form(self, request: Request) -> Response:
        return self.page(request, "login.html", {"failed": False, "wait": 0})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi.document(ACTIONS))

    async def stylesheet(self, request: Request) -> Response:
        css = resources.files(__package__).joinpath("static/console.css").read_bytes()
        return Response(css, media_type="text/css")


def _query(params: dict[str, Any]) -> str:
    return urlencode(params)
