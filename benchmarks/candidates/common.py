"""Shared pieces of the candidate harness: the private cluster, templates, candidate SQL."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
HOST = os.environ.get("CAND_PGHOST", "/tmp/cand-pg-sock")
PORT = int(os.environ.get("CAND_PGPORT", "55440"))
PSQL = os.environ.get("PSQL", "psql")

# Templates: the rendered schema.sql (+ C1's setup), with or without the C4 migration, fresh
# (no statistics) or with 100k published history rows, VACUUM ANALYZEd.
TEMPLATES = {
    "fresh": ("base", False),
    "fresh_c4": ("trigger", False),
    "analyzed": ("base", True),
    "analyzed_c4": ("trigger", True),
    "fresh_c4c": ("domains", False),
    "analyzed_c4c": ("domains", True),
}

CLAIM_C0 = (
    "SELECT id, topic, ordering_key, payload, headers, event_id, created_at, attempts, reclaimed"
    ' FROM "public"."outbox_claim_work"($1, $2, $3, $4, $5, $6, $7, $8)'
)
SETTLE_C0 = 'SELECT * FROM "public"."outbox_settle_work"($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)'
# The candidates' connection: generic plans, and no sequential scan where an index serves (a
# generic plan made while the table has one page would otherwise read the table for good), and
# no JIT (the generic plans' estimates on tables without statistics pass jit_above_cost: one
# claim compiled for 850 ms).
CAND_SETTINGS = {"plan_cache_mode": "force_generic_plan", "enable_seqscan": "off", "jit": "off"}
COLS = "id bigint, topic text, ordering_key text, payload bytea, headers jsonb, event_id uuid, created_at timestamptz, attempts integer, reclaimed boolean"


def dsn(db: str, user: str = "postgres") -> str:
    return f"postgresql://{user}@/{db}?host={HOST}&port={PORT}"


def psql(db: str, sql: str) -> str:
    r = subprocess.run(
        [
            PSQL,
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            HOST,
            "-p",
            str(PORT),
            "-U",
            "postgres",
            "-d",
            db,
        ],
        input=sql,
        text=True,
        capture_output=True,
    )
    if r.returncode:
        raise RuntimeError(r.stderr)
    return r.stdout


def rendered_schema(domains: bool = False) -> str:
    s = (ROOT / "schema" / "schema.sql").read_text()
    if domains:
        # C4c: the slow path's two RETURN QUERYs name the columns that become domains; PL/pgSQL
        # wants the declared result types (text, jsonb) exactly.
        old = "SELECT o.id, o.topic, o.ordering_key, o.payload, o.headers,"
        assert s.count(old) == 2
        s = s.replace(
            old, "SELECT o.id, o.topic::text, o.ordering_key::text, o.payload, o.headers::jsonb,"
        )
    return s.replace("${schema}", '"public"').replace("${table}", "outbox")


def sections(path: Path) -> dict[str, str]:
    """'-- @name' sections of a candidate .sql file."""
    out: dict[str, str] = {}
    name = None
    for line in path.read_text().splitlines(keepends=True):
        m = re.match(r"-- @(\w+)\s*$", line)
        if m:
            name = m.group(1)
            out[name] = ""
        elif name:
            out[name] += line
    return {k: v.strip() + "\n" for k, v in out.items()}


def _params(stmt: str, names: list[str]) -> str:
    return re.sub(r"\$(\d+)", lambda m: names[int(m.group(1)) - 1], stmt)


CLAIM_ARGS = ["p_limit", "p_token", "p_owner", "p_lease", "p_block"]
SETTLE_ARGS = ["s_token", "s_ids", "s_keys", "p_owner"]


def c1_functions() -> str:
    """C1's statements wrapped in PL/pgSQL functions (one RETURN QUERY each), and C3's settle +
    claim in one call (two statements: the claim needs a snapshot taken after the settle)."""
    sec = sections(HERE / "c1.sql")
    claim, settle = sec["claim"].rstrip(), sec["settle"].rstrip()
    settle_plain = re.sub(r"\nRETURNING o\.id\s*$", "", settle)
    return f"""
{sec["setup"]}
CREATE FUNCTION "public".outbox_c1_claim(p_limit integer, p_token uuid, p_owner text,
        p_lease double precision, p_block boolean) RETURNS TABLE ({COLS})
    LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
{_params(claim, CLAIM_ARGS)};
END;
$fn$;

CREATE FUNCTION "public".outbox_c1_settle(s_token uuid, s_ids bigint[], s_keys text[], p_owner text)
    RETURNS SETOF bigint
    LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
{_params(settle, SETTLE_ARGS)};
END;
$fn$;

CREATE FUNCTION "public".outbox_c3_settle_claim(s_token uuid, s_ids bigint[], s_keys text[],
        p_owner text, p_limit integer, p_token uuid, p_lease double precision, p_block boolean)
    RETURNS TABLE ({COLS})
    LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
BEGIN
{_params(settle_plain, SETTLE_ARGS)};
    RETURN QUERY
{_params(claim, CLAIM_ARGS)};
END;
$fn$;
"""


def c1_statements() -> tuple[str, str]:
    sec = sections(HERE / "c1.sql")
    return sec["claim"], sec["settle"]


async def cpu_ns(conn_pid: int) -> int:
    with open(f"/proc/{conn_pid}/schedstat") as f:
        return int(f.read().split()[0])


def build_templates(history: int = 100_000) -> None:
    for name, (variant, analyzed) in TEMPLATES.items():
        db = f"cand_t_{name}"
        psql("postgres", f"DROP DATABASE IF EXISTS {db}; CREATE DATABASE {db} TEMPLATE template0;")
        sql = (
            "CREATE EXTENSION IF NOT EXISTS pg_stat_statements;\n"
            + rendered_schema(variant == "domains")
            + c1_functions()
        )
        if variant != "base":
            sql += sections(HERE / "c4.sql")[variant]
        psql(db, sql)
        if analyzed:
            psql(
                db,
                f"""
INSERT INTO outbox (topic, ordering_key, payload, headers, published_at)
SELECT 'orders', 'old-' || g, convert_to(repeat('x', 512), 'UTF8'), '{{"type": "OrderPaid"}}', now()
  FROM generate_series(1, {history}) g;
UPDATE outbox_cursor SET position = (SELECT max(id) FROM outbox);
VACUUM ANALYZE;
""",
            )
        psql("postgres", f"ALTER DATABASE {db} WITH ALLOW_CONNECTIONS false; CHECKPOINT;")
        print("template", db, "ready", flush=True)


def new_db(template: str, name: str) -> None:
    psql("postgres", f"DROP DATABASE IF EXISTS {name};")
    psql("postgres", f"CREATE DATABASE {name} TEMPLATE cand_t_{template} STRATEGY FILE_COPY;")
