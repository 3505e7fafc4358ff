-- The highest id the outbox's identity has drawn (0 before the first): discovery reads it before
-- the rows, so that every id at or below it was drawn by then. SECURITY DEFINER: the dispatcher
-- role has no right on the sequence, and the value tells nothing a claim does not see anyway.
CREATE OR REPLACE FUNCTION ${schema}.${table}_last_id() RETURNS bigint
    LANGUAGE sql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $fn$
SELECT coalesce(pg_sequence_last_value(
           pg_get_serial_sequence('${schema}.${table}', 'id')::regclass), 0);
$fn$;
