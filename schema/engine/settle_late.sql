-- A late publication of rows the reclaimer dead-lettered under lease p_token (see settle_work):
-- recorded as published (or deleted), and a key that waited only on them is ready again.
CREATE OR REPLACE FUNCTION ${schema}.${table}_settle_late(
    p_token uuid,
    p_owner text,
    p_ids bigint[],
    p_delete boolean
) RETURNS SETOF bigint
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off SET enable_seqscan = off
AS $fn$
#variable_conflict use_column
DECLARE
    v_keys text[];
BEGIN
    SELECT array_agg(DISTINCT o.ordering_key) INTO v_keys
      FROM ${schema}.${table} o WHERE o.id = ANY (p_ids) AND o.ordering_key IS NOT NULL;
    PERFORM 1 FROM ${schema}.${table}_work x
     WHERE NOT x.keyless AND x.ordering_key = ANY (v_keys)
     ORDER BY x.ordering_key
       FOR UPDATE OF x;
    IF p_delete THEN
        RETURN QUERY
        DELETE FROM ${schema}.${table} o
         WHERE o.id = ANY (p_ids) AND o.dead_at IS NOT NULL AND o.lease_token = p_token
        RETURNING o.id;
    ELSE
        RETURN QUERY
        UPDATE ${schema}.${table} o
           SET published_at = now(), dead_at = NULL, lease_owner = p_owner,
               lease_token = NULL, lease_expires_at = NULL
         WHERE o.id = ANY (p_ids) AND o.dead_at IS NOT NULL AND o.lease_token = p_token
        RETURNING o.id;
    END IF;
    UPDATE ${schema}.${table}_work x
       SET state = 'r', not_before = '-infinity'
     WHERE NOT x.keyless AND x.ordering_key = ANY (v_keys)
       AND x.state = 'b' AND x.claim_token IS NULL
       AND NOT EXISTS (SELECT 1 FROM ${schema}.${table} d
                        WHERE d.ordering_key = x.ordering_key AND d.dead_at IS NOT NULL);
END;
$fn$;
