-- The statements `migrate` and the version checks run (migrations.py), by name; the migrations
-- themselves are schema/migrations/*.sql.

-- relation_exists --
SELECT to_regclass($relation) IS NOT NULL

-- column_exists --
SELECT EXISTS (SELECT 1 FROM pg_attribute
                WHERE attrelid = to_regclass($relation) AND attname = $column AND NOT attisdropped)

-- schema_exists --
SELECT to_regnamespace($schema_name) IS NOT NULL

-- migration_lock --
-- A session lock (the one-key form: never the claim's two-key lock space): a second migrator
-- waits, then finds nothing to do.
SELECT pg_advisory_lock($key)

-- migration_unlock --
SELECT pg_advisory_unlock($key)
