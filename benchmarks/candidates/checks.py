"""C4: what the writer's CHECK constraints cost the mark, and the writer, on copies of outbox.

    python checks.py [rounds]

Tables (each a copy of the rendered outbox: columns, defaults, identity, indexes, fillfactor 50):
  checks   the five CHECKs as schema.sql has them (today)
  trigger  the four writer CHECKs in a PL/pgSQL BEFORE INSERT OR UPDATE OF topic, ordering_key,
           headers trigger; published/dead stays a CHECK
  domains  the four writer CHECKs as domain constraints on topic, ordering_key, headers
  none     no writer CHECK (reference)
  side     (c') the mark as an INSERT into a narrow side table (id, published_at, lease_owner)
Per round and table, in turn: a one-row writer INSERT, a ten-row writer INSERT, a one-row mark,
a ten-row mark; backend CPU from /proc/<pid>/schedstat around each; medians in microseconds.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys

import asyncpg

from benchmarks.candidates import common

SETUP = """
CREATE DOMAIN t_topic AS text CHECK (
    VALUE ~ '^[A-Za-z0-9._-]+$' AND length(VALUE) <= 249 AND VALUE NOT IN ('.', '..')
    AND left(VALUE, 2) <> '__');
CREATE DOMAIN t_key AS text CHECK (octet_length(VALUE) <= 2048);
CREATE DOMAIN t_headers AS jsonb CHECK (outbox_headers_valid(VALUE));
CREATE FUNCTION t_writer_checks() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    IF NOT (NEW.topic ~ '^[A-Za-z0-9._-]+$' AND length(NEW.topic) <= 249
            AND NEW.topic NOT IN ('.', '..')) THEN
        RAISE EXCEPTION 'topic_valid' USING ERRCODE = 'check_violation';
    END IF;
    IF left(NEW.topic, 2) = '__' THEN
        RAISE EXCEPTION 'topic_not_internal' USING ERRCODE = 'check_violation';
    END IF;
    IF NOT outbox_headers_valid(NEW.headers) THEN
        RAISE EXCEPTION 'headers_valid' USING ERRCODE = 'check_violation';
    END IF;
    IF octet_length(NEW.ordering_key) > 2048 THEN
        RAISE EXCEPTION 'ordering_key_length' USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END;
$fn$;
CREATE TABLE t_checks (LIKE outbox INCLUDING ALL) WITH (fillfactor = 50);
CREATE TABLE t_trigger (LIKE outbox INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING INDEXES,
    CHECK (published_at IS NULL OR dead_at IS NULL)) WITH (fillfactor = 50);
CREATE TRIGGER t_writer_checks BEFORE INSERT OR UPDATE OF topic, ordering_key, headers ON t_trigger
    FOR EACH ROW EXECUTE FUNCTION t_writer_checks();
CREATE TABLE t_domains (LIKE outbox INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING INDEXES,
    CHECK (published_at IS NULL OR dead_at IS NULL)) WITH (fillfactor = 50);
ALTER TABLE t_domains ALTER COLUMN topic TYPE t_topic, ALTER COLUMN ordering_key TYPE t_key,
    ALTER COLUMN headers TYPE t_headers;
CREATE TABLE t_none (LIKE outbox INCLUDING DEFAULTS INCLUDING IDENTITY INCLUDING INDEXES,
    CHECK (published_at IS NULL OR dead_at IS NULL)) WITH (fillfactor = 50);
CREATE TABLE t_side_src (LIKE outbox INCLUDING ALL) WITH (fillfactor = 50);
CREATE TABLE t_side (id bigint PRIMARY KEY, published_at timestamptz NOT NULL, lease_owner text);
"""
TABLES = ["checks", "trigger", "domains", "none", "side"]


async def main(rounds: int) -> None:
    common.new_db("fresh", "cand_checks")
    common.psql("cand_checks", SETUP)
    w = await asyncpg.connect(
        common.dsn("cand_checks", "writer"),
        server_settings={"synchronous_commit": "off", **common.CAND_SETTINGS},
    )
    pid = await w.fetchval("SELECT pg_backend_pid()")
    await w.execute("SELECT pg_stat_statements_reset()")

    def cpu() -> int:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])

    t: dict[tuple[str, str], list[int]] = {
        (tb, op): [] for tb in TABLES for op in ("insert1", "insert10", "mark1", "mark10")
    }
    for r in range(rounds):
        order = TABLES[r % len(TABLES) :] + TABLES[: r % len(TABLES)]
        for tb in order:
            src = "t_side_src" if tb == "side" else f"t_{tb}"
            ins = (
                f"INSERT INTO {src} (topic, ordering_key, payload, headers)"
                " SELECT 'orders', k, $2, $3::jsonb FROM unnest($1::text[]) k RETURNING id"
            )
            a = cpu()
            one = await w.fetch(ins, [f"k{r}"], b"x" * 512, '{"type": "OrderPaid"}')
            t[(tb, "insert1")].append(cpu() - a)
            a = cpu()
            ten = await w.fetch(
                ins, [f"k{r}-{j}" for j in range(10)], b"x" * 512, '{"type": "OrderPaid"}'
            )
            t[(tb, "insert10")].append(cpu() - a)
            if tb == "side":
                mark = (
                    "INSERT INTO t_side (id, published_at, lease_owner)"
                    " SELECT i, now(), 'o' FROM unnest($1::bigint[]) i"
                )
            else:
                mark = f"UPDATE t_{tb} SET published_at = now(), lease_owner = 'o' WHERE id = ANY ($1::bigint[])"
            a = cpu()
            await w.execute(mark, [one[0][0]])
            t[(tb, "mark1")].append(cpu() - a)
            a = cpu()
            await w.execute(mark, [x[0] for x in ten])
            t[(tb, "mark10")].append(cpu() - a)
    wal = await w.fetch(
        """SELECT regexp_replace(query, '^(INSERT INTO|UPDATE) (t_[a-z_]+).*$', '\\1 \\2') AS q,
                  sum(wal_bytes)::float8 / sum(rows) AS wal_per_row
             FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND query ~ '^(INSERT INTO|UPDATE) t_' GROUP BY 1 ORDER BY 1"""
    )
    res = {
        tb: {
            op: round(statistics.median(t[(tb, op)][rounds // 5 :]) / 1e3)
            for op in ("insert1", "insert10", "mark1", "mark10")
        }
        for tb in TABLES
    }
    out = {
        "run": "checks",
        "rounds": rounds,
        "us_median": res,
        "wal_B_per_row": {r["q"]: round(r["wal_per_row"]) for r in wal},
    }
    line = json.dumps(out)
    print(line)
    with open(common.HERE / "results.jsonl", "a") as f:
        f.write(line + "\n")
    await w.close()


asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 500))
