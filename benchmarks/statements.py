"""Statements per steady cycle (issue 34): the dispatcher's SQL statements, nested ones too, counted
by pg_stat_statements (`track = all`), per claim that returned rows.

The dispatcher under count logs in as a role of its own (ROLE, a member of the bench's role, so it
has the same rights: only the name differs), so that its statements are told from the writers'
and the harness's in the same database: pg_stat_statements keys them by role and database. Its
entries are read as that role (pg_stat_statements shows a statement's text to its own role) from
the bench's own database, so that the reading is not counted. The count is the difference of
two readings, one right before the load and one after its last record arrived: in a database
created for the measurement this is what a reset before would give, without the grant that
`pg_stat_statements_reset` needs. Cycles are the dispatcher's settles, from its /metrics
(`outbox_mark_duration_seconds_count`): one per claim that returned rows (a batch settled in
parts counts once per part, which a loopback run does not see); claims in all
(`outbox_claim_duration_seconds_count`) beside them.

A stack without the extension (not preloaded, `track` not `all`, not created in the bench's
database and this role may not create it) gives no figure; `why_not` says why and the goal is
"not measured".
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

ROLE = "outbox_bench_dispatcher"
PASSWORD = "outbox-bench-dispatcher"  # noqa: S105 - a bench role of the local stack
TOP = 12  # statements shown per scenario

# What the scenarios recorded beside their figures (floats only go through the medians): each
# run's top statements, by scenario, and why a figure was not measured.
REPORTS: dict[str, list[list[dict[str, Any]]]] = {}
WHY_NOT: dict[str, str] = {}

READ = """
SELECT s.queryid, s.toplevel, s.calls, s.rows, s.total_exec_time, s.total_plan_time,
       s.plans, s.query
  FROM pg_stat_statements s
 WHERE s.userid = (SELECT oid FROM pg_roles WHERE rolname = $1)
   AND s.dbid = (SELECT oid FROM pg_database WHERE datname = $2)
"""
METRIC = re.compile(r"^(outbox_(?:mark|claim)_duration_seconds_count) ([0-9.e+]+)$", re.M)


@dataclass
class Counting:
    """What a scenario needs to count: the stack's answer, set once per run by `prepare`."""

    why_not: str = "not prepared"
    admin_url: str = ""
    role_admin_url: str = ""  # the bench's database, as ROLE

    @property
    def ready(self) -> bool:
        return not self.why_not


COUNTING = Counting()


def as_role(url: str, role: str = ROLE, password: str = PASSWORD) -> str:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{role}:{password}@{host}{port}"))


async def prepare(admin_url: str) -> Counting:
    """Check the extension (creating it in the bench's database if this role may) and the
    dispatcher's role (created if missing); sets COUNTING."""
    COUNTING.admin_url = admin_url
    COUNTING.why_not = " ".join((await _prepare(admin_url)).split())  # one line: a table cell
    if COUNTING.why_not:
        print(f"statements per cycle: not measured: {COUNTING.why_not}", flush=True)
    else:
        COUNTING.role_admin_url = as_role(admin_url)
    return COUNTING


async def _prepare(admin_url: str) -> str:
    conn = await asyncpg.connect(admin_url)
    try:
        database = await conn.fetchval("SELECT current_database()")
        if not await conn.fetchval(
            "SELECT count(*) FROM pg_extension WHERE extname = 'pg_stat_statements'"
        ):
            try:
                await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            except asyncpg.PostgresError as exc:
                return (
                    f"the extension pg_stat_statements is not in database {database} and this "
                    f"role cannot create it ({exc}); deploy/local/services.sh pg-start creates it"
                )
        try:
            await conn.fetchval("SELECT count(*) FROM pg_stat_statements")
        except asyncpg.PostgresError as exc:
            return (
                f"pg_stat_statements is not loaded ({exc}): services.sh writes "
                "shared_preload_libraries; restart PostgreSQL (services.sh pg-stop, pg-start)"
            )
        track = await conn.fetchval("SELECT current_setting('pg_stat_statements.track', true)")
        if track != "all":
            return (
                f"pg_stat_statements.track is {track!r}, not 'all' (nested statements would go "
                "uncounted)"
            )
        try:
            if await conn.fetchval("SELECT count(*) FROM pg_roles WHERE rolname = $1", ROLE):
                await conn.execute(f"ALTER ROLE {ROLE} LOGIN PASSWORD '{PASSWORD}'")
            else:
                await conn.execute(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{PASSWORD}'")
            me = await conn.fetchval("SELECT quote_ident(current_user)")
            if not await conn.fetchval("SELECT pg_has_role($1, current_user, 'USAGE')", ROLE):
                await conn.execute(f"GRANT {me} TO {ROLE}")
        except asyncpg.PostgresError as exc:
            return f"cannot create the dispatcher's login role {ROLE} ({exc})"
    finally:
        await conn.close()
    try:
        probe = await asyncpg.connect(as_role(admin_url))
        await probe.close()
    except (OSError, asyncpg.PostgresError) as exc:
        return f"the dispatcher's role {ROLE} cannot log in ({exc})"
    return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {name: float(value) for name, value in METRIC.findall(text)}


@dataclass
class Reading:
    entries: dict[tuple[int, bool], asyncpg.Record]
    metrics: dict[str, float]
    dealloc: int


@dataclass
class Counter:
    """Two readings of a dispatcher's statements and settles; `figures` from their difference."""

    database: str
    http_port: int
    conn: asyncpg.Connection
    readings: list[Reading] = field(default_factory=list)

    async def read(self) -> None:
        metrics = await asyncio.to_thread(_scrape, self.http_port)
        rows = await self.conn.fetch(READ, ROLE, self.database)
        dealloc = await self.conn.fetchval("SELECT dealloc FROM pg_stat_statements_info")
        self.readings.append(
            Reading({(r["queryid"], r["toplevel"]): r for r in rows}, metrics, int(dealloc))
        )

    def figures(self) -> tuple[dict[str, float], list[dict[str, Any]]]:
        before, after = self.readings[0], self.readings[-1]
        delta: list[dict[str, Any]] = []
        for key, row in after.entries.items():
            old = before.entries.get(key)
            calls = row["calls"] - (old["calls"] if old else 0)
            if calls <= 0:
                continue
            delta.append(
                {
                    "calls": calls,
                    "rows": row["rows"] - (old["rows"] if old else 0),
                    "exec_ms": row["total_exec_time"] - (old["total_exec_time"] if old else 0),
                    "plan_ms": row["total_plan_time"] - (old["total_plan_time"] if old else 0),
                    "toplevel": row["toplevel"],
                    "query": " ".join(str(row["query"]).split()),
                }
            )

        def metric(name: str) -> float:
            return after.metrics.get(name, 0.0) - before.metrics.get(name, 0.0)

        cycles = metric("outbox_mark_duration_seconds_count")
        claims = metric("outbox_claim_duration_seconds_count")
        statements = sum(d["calls"] for d in delta)
        top = sorted(delta, key=lambda d: d["calls"], reverse=True)[:TOP]
        for d in top:
            d["per_cycle"] = d["calls"] / cycles if cycles else None
        if after.dealloc != before.dealloc:
            print(
                "pg_stat_statements evicted entries during the count "
                f"({after.dealloc - before.dealloc} deallocations): statements per cycle is a "
                "lower bound (raise "
                "pg_stat_statements.max)",
                flush=True,
            )
        per = float("nan") if not cycles else statements / cycles
        return {
            "statements_per_cycle": per,
            "statements_toplevel_per_cycle": float("nan")
            if not cycles
            else sum(d["calls"] for d in delta if d["toplevel"]) / cycles,
            "cycles": cycles,
            "claims_empty_per_cycle": float("nan") if not cycles else (claims - cycles) / cycles,
        }, top


@contextlib.asynccontextmanager
async def counting(url: str) -> AsyncIterator[tuple[dict[str, Any], Counter | None]]:
    """For a scenario in database `url`: the dispatcher's settings (its role's URL, a /metrics
    port) and a Counter, or ({}, None) when the stack cannot count (COUNTING.why_not)."""
    if not COUNTING.ready:
        yield {}, None
        return
    port = free_port()
    conn = await asyncpg.connect(COUNTING.role_admin_url)
    try:
        database = urlsplit(url).path.lstrip("/")
        yield (
            {"database_url": as_role(url), "http_port": port, "http_host": "127.0.0.1"},
            Counter(database, port, conn),
        )
    finally:
        await conn.close()


def record(scenario: str, top: list[dict[str, Any]]) -> None:
    REPORTS.setdefault(scenario, []).append(top)


def top_table(scenario: str, top: list[dict[str, Any]]) -> str:
    lines = [
        f"#### Top statements, {scenario} (last run; calls per cycle, top = top-level)",
        "",
        "| calls/cycle | calls | rows | exec ms | plan ms | level | statement |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in top:
        per = "" if d["per_cycle"] is None else f"{d['per_cycle']:.2f}"
        query = d["query"] if len(d["query"]) <= 140 else d["query"][:137] + "..."
        query = query.replace("|", "\\|")
        lines.append(
            f"| {per} | {d['calls']:,} | {d['rows']:,} | {d['exec_ms']:,.1f} | "
            f"{d['plan_ms']:,.1f} | {'top' if d['toplevel'] else 'nested'} | `{query}` |"
        )
    return "\n".join(lines)
