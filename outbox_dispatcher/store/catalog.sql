-- Source discovery's catalogue reads (sources/registry.py), one database at a time, by name.

-- outbox_tables --
-- The tables named in $tables that have their <table>_schema_steps beside them (a schema at
-- version 10 or later, or being migrated there), with their schema: one read of pg_class by its
-- (relname, relnamespace) index per database and interval, however many schemas match.
SELECT n.nspname AS schema_name, t.relname AS table_name
  FROM pg_class t
  JOIN pg_namespace n ON n.oid = t.relnamespace
 WHERE t.relname = ANY($tables::text[])
   AND t.relkind IN ('r', 'p')
   AND EXISTS (SELECT FROM pg_class s
                WHERE s.relname = t.relname || '_schema_steps' AND s.relnamespace = t.relnamespace)
 ORDER BY 1, 2

-- outbox_tables_fingerprint --
-- How many relations carry the names of $tables or of their schema steps, and the sum of their
-- schemas' oids: it changes when a schema's outbox or its steps are created or dropped. An
-- index-only read of pg_class's (relname, relnamespace) index, a tenth of `outbox_tables`'s
-- cost with 500 tenant schemas (0.35 ms against 4 ms), asked at every interval; the full read
-- follows only when it changed (sources/registry.py).
SELECT count(*) AS relations, coalesce(sum(t.relnamespace::bigint), 0) AS namespaces
  FROM pg_class t
 WHERE t.relname = ANY($names::text[])

-- schemas --
-- Every schema of the database but the system ones: what `migrate` expands a pattern against
-- (a new tenant schema has no outbox table yet).
SELECT nspname FROM pg_namespace
 WHERE nspname NOT LIKE 'pg\_%' AND nspname <> 'information_schema'
 ORDER BY 1

-- migration_running --
-- Whether `migrate` holds the table's advisory lock (store/migrations.py `lock_key`, the one-key
-- form: classid 0, objid the key): its schema is not to be served before the last step lands.
SELECT EXISTS (SELECT FROM pg_locks
                WHERE locktype = 'advisory' AND classid = 0 AND objid = $key::bigint::oid
                  AND objsubid = 1 AND granted)
