-- The lease keeper: extend only live leases of the caller's tokens (an expired one may belong to
-- someone else already). Returns the ids whose work is still held.
CREATE OR REPLACE FUNCTION ${schema}.${table}_extend_work(
    p_ids bigint[],
    p_tokens uuid[],
    p_seconds double precision
) RETURNS SETOF bigint
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off SET enable_seqscan = off
AS $fn$
DECLARE
    v_held uuid[];
BEGIN
    -- Locked in key order first, as claims and settles lock work: an update in scan order
    -- deadlocked with a settle of the same claim and with discovery.
    WITH mine AS (
        SELECT x.ordering_key, x.keyless FROM ${schema}.${table}_work x
         WHERE x.claim_token = ANY (p_tokens) AND x.claim_expires_at > now() AND x.state <> 'x'
         ORDER BY x.ordering_key, x.keyless
           FOR UPDATE OF x
    ),
    extended AS (
        UPDATE ${schema}.${table}_work x
           SET claim_expires_at = now() + p_seconds * interval '1 second'
          FROM mine m
         WHERE x.ordering_key = m.ordering_key AND x.keyless = m.keyless
           AND x.claim_token = ANY (p_tokens) AND x.claim_expires_at > now() AND x.state <> 'x'
        RETURNING x.claim_token
    )
    SELECT array_agg(DISTINCT e.claim_token) INTO v_held FROM extended e;
    RETURN QUERY SELECT r.id FROM unnest(p_ids, p_tokens) AS r(id, token)
                  WHERE r.token = ANY (v_held);
END;
$fn$;
