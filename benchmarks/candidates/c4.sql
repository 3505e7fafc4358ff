-- C4: the writer's CHECK constraints not re-run by the mark. PostgreSQL evaluates every CHECK
-- constraint of a table at every UPDATE of a row, whatever columns it sets; the mark sets only
-- published_at and lease_owner. Three ways, each a migration of the rendered schema (outbox,
-- public). checks.py measures the writer's INSERT and the mark on copies of each; the loop's C4
-- applies "@domains" (the cheapest mark, see README) and runs C3 on it.

-- @domains
-- (c) Domains: a domain's CHECK runs when a value is coerced to it (INSERT, or an UPDATE that
-- sets the column), never for a column an UPDATE leaves alone.
DROP VIEW IF EXISTS "public".outbox_leases;
CREATE DOMAIN "public".outbox_topic AS text CHECK (
    VALUE ~ '^[A-Za-z0-9._-]+$' AND length(VALUE) <= 249 AND VALUE NOT IN ('.', '..')
    AND left(VALUE, 2) <> '__');
CREATE DOMAIN "public".outbox_key AS text CHECK (octet_length(VALUE) <= 2048);
CREATE DOMAIN "public".outbox_headers AS jsonb CHECK ("public".outbox_headers_valid(VALUE));
DROP TRIGGER outbox_note_change ON "public".outbox;
DROP TRIGGER outbox_note_removed_dead ON "public".outbox;
ALTER TABLE "public".outbox
    DROP CONSTRAINT outbox_topic_valid,
    DROP CONSTRAINT outbox_topic_not_internal,
    DROP CONSTRAINT outbox_headers_valid,
    DROP CONSTRAINT outbox_ordering_key_length,
    ALTER COLUMN topic TYPE "public".outbox_topic,
    ALTER COLUMN ordering_key TYPE "public".outbox_key,
    ALTER COLUMN headers TYPE "public".outbox_headers;
-- (re-created as schema.sql has it: a column's type cannot change under a trigger's WHEN)
CREATE TRIGGER outbox_note_change
    AFTER UPDATE OF ordering_key, topic, published_at, dead_at, next_attempt_at ON "public".outbox
    FOR EACH ROW
    WHEN (NEW.published_at IS NULL AND NEW.dead_at IS NULL
          AND (OLD.ordering_key IS DISTINCT FROM NEW.ordering_key
               OR OLD.topic IS DISTINCT FROM NEW.topic
               OR OLD.published_at IS NOT NULL OR OLD.dead_at IS NOT NULL
               OR NEW.next_attempt_at < OLD.next_attempt_at))
    EXECUTE FUNCTION "public".outbox_note_change();
CREATE TRIGGER outbox_note_removed_dead
    AFTER DELETE ON "public".outbox
    FOR EACH ROW
    WHEN (OLD.dead_at IS NOT NULL AND OLD.ordering_key IS NOT NULL)
    EXECUTE FUNCTION "public".outbox_note_change();

-- @trigger
-- (b) The same checks in a BEFORE INSERT OR UPDATE OF topic, ordering_key, headers row trigger
-- (PL/pgSQL; no C extension here).
DROP VIEW IF EXISTS "public".outbox_leases;
CREATE FUNCTION "public".outbox_writer_checks() RETURNS trigger
    LANGUAGE plpgsql AS $fn$
BEGIN
    IF NOT (NEW.topic ~ '^[A-Za-z0-9._-]+$' AND length(NEW.topic) <= 249
            AND NEW.topic NOT IN ('.', '..')) THEN
        RAISE EXCEPTION 'new row for relation "outbox" violates check constraint "outbox_topic_valid"'
            USING ERRCODE = 'check_violation';
    END IF;
    IF left(NEW.topic, 2) = '__' THEN
        RAISE EXCEPTION 'new row violates check constraint "outbox_topic_not_internal"'
            USING ERRCODE = 'check_violation';
    END IF;
    IF NOT "public".outbox_headers_valid(NEW.headers) THEN
        RAISE EXCEPTION 'new row violates check constraint "outbox_headers_valid"'
            USING ERRCODE = 'check_violation';
    END IF;
    IF octet_length(NEW.ordering_key) > 2048 THEN
        RAISE EXCEPTION 'new row violates check constraint "outbox_ordering_key_length"'
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END;
$fn$;
ALTER TABLE "public".outbox
    DROP CONSTRAINT outbox_topic_valid,
    DROP CONSTRAINT outbox_topic_not_internal,
    DROP CONSTRAINT outbox_headers_valid,
    DROP CONSTRAINT outbox_ordering_key_length;
CREATE TRIGGER outbox_writer_checks
    BEFORE INSERT OR UPDATE OF topic, ordering_key, headers ON "public".outbox
    FOR EACH ROW EXECUTE FUNCTION "public".outbox_writer_checks();

-- @none
-- Reference only (not a candidate): the writer's four checks dropped.
DROP VIEW IF EXISTS "public".outbox_leases;
ALTER TABLE "public".outbox
    DROP CONSTRAINT outbox_topic_valid,
    DROP CONSTRAINT outbox_topic_not_internal,
    DROP CONSTRAINT outbox_headers_valid,
    DROP CONSTRAINT outbox_ordering_key_length;
