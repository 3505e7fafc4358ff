-- A claim whose reply never arrived (the connection dropped after the commit): its dispatcher
-- knows the token it chose and gives the work back at once, instead of stalling its keys for a
-- whole lease and counting an attempt. Returns how many keys (and rows without one) it held.
-- The reconcile duty (reconcile_owner) stays: a claim that took over an expired lease and whose
-- reply was lost leaves the key to a claim that still reads the progress first.
CREATE OR REPLACE FUNCTION ${schema}.${table}_release_work(p_token uuid) RETURNS integer
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off SET enable_seqscan = off
AS $fn$
DECLARE
    v_rows integer;
BEGIN
    WITH mine AS (
        SELECT x.ordering_key, x.keyless FROM ${schema}.${table}_work x
         WHERE x.claim_token = p_token AND x.state <> 'x'
         ORDER BY x.ordering_key, x.keyless
           FOR UPDATE OF x
    ),
    released AS (
        UPDATE ${schema}.${table}_work x
           SET claim_token = NULL, claim_owner = NULL, claim_expires_at = NULL,
               head_id = least(x.claim_first, x.head_id), claim_first = NULL, claim_last = NULL,
               state = 'r', not_before = '-infinity'
          FROM mine m
         WHERE x.ordering_key = m.ordering_key AND x.keyless = m.keyless
           AND x.claim_token = p_token AND x.state <> 'x'
        RETURNING 1
    )
    SELECT count(*)::integer INTO v_rows FROM released;
    RETURN v_rows;
END;
$fn$;
