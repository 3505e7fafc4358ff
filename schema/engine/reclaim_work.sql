-- Work whose owners kept dying while publishing it (the claim that found its first row at
-- max_attempts left it in state x, lease kept; or a lease that expired on a first row at its
-- last attempt before any claim came by): its rows of that lease at their last attempt are
-- dead-lettered,
-- keeping the lease token (a late mark of an owner that was only slow may still record the
-- publication); the key then goes on (skip) or stays blocked (block), keeping the reconcile
-- duty (reconcile_owner: its later rows' claims read the progress first).
CREATE OR REPLACE FUNCTION ${schema}.${table}_reclaim_work(p_max_attempts integer, p_block_on_dead boolean)
RETURNS TABLE (id bigint, event_id uuid, topic text, ordering_key text, lease_owner text)
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off SET enable_seqscan = off
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH looping AS (
        SELECT x.ordering_key, x.keyless, x.claim_token, x.claim_owner, x.claim_first, x.head_id,
               x.claim_last
          FROM ${schema}.${table}_work x
         WHERE (x.ordering_key, x.keyless) IN (
                   (SELECT l.ordering_key, l.keyless FROM ${schema}.${table}_work l
                     WHERE l.state = 'x' ORDER BY l.claim_expires_at LIMIT 500)
                   UNION ALL
                   (SELECT e.ordering_key, e.keyless
                      FROM ${schema}.${table}_work e
                      JOIN ${schema}.${table} o ON o.id = e.claim_first
                     WHERE e.claim_token IS NOT NULL AND e.claim_expires_at < now()
                       AND e.state <> 'x' AND o.attempts + 1 >= p_max_attempts
                       AND o.published_at IS NULL AND o.dead_at IS NULL
                     ORDER BY e.claim_expires_at LIMIT 500))
           AND (x.state = 'x' OR (x.claim_token IS NOT NULL AND x.claim_expires_at < now()))
           FOR UPDATE OF x SKIP LOCKED
    ),
    rows AS (
        SELECT r.id, l.claim_token, l.claim_owner
          FROM looping l
         CROSS JOIN LATERAL (
            SELECT o.id FROM ${schema}.${table} o
             WHERE o.ordering_key >= l.ordering_key AND o.ordering_key <= l.ordering_key
               AND o.id >= l.claim_first AND o.id <= greatest(l.head_id - 1, l.claim_last)
               AND o.published_at IS NULL AND o.dead_at IS NULL
               AND o.attempts + 1 >= p_max_attempts
             ORDER BY o.ordering_key, o.id) r
         WHERE NOT l.keyless
        UNION ALL
        SELECT o.id, l.claim_token, l.claim_owner
          FROM looping l
          JOIN ${schema}.${table} o ON o.id = l.claim_first
         WHERE l.keyless AND o.ordering_key IS NULL
           AND o.published_at IS NULL AND o.dead_at IS NULL AND o.attempts + 1 >= p_max_attempts
    ),
    dead AS (
        UPDATE ${schema}.${table} o
           SET dead_at = now(),
               attempts = o.attempts + 1,
               lease_token = r.claim_token, lease_owner = r.claim_owner,
               lease_expires_at = NULL,
               last_error = format('dead-lettered: the lease expired %s times (the dispatcher '
                                   'that held it crashed or hung while publishing, last owner '
                                   '%s); last error: %s',
                                   o.attempts + 1, r.claim_owner, coalesce(o.last_error, 'none'))
          FROM rows r
         WHERE o.id = r.id
        RETURNING o.id, o.event_id, o.topic, o.ordering_key, o.lease_owner
    ),
    moved AS (
        UPDATE ${schema}.${table}_work x
           SET state = CASE WHEN p_block_on_dead AND NOT l.keyless THEN 'b' ELSE 'r' END,
               head_id = least(l.claim_first, l.head_id), not_before = '-infinity',
               claim_token = NULL, claim_owner = NULL, claim_expires_at = NULL, claim_first = NULL,
               claim_last = NULL,
               reconcile_owner = coalesce(x.reconcile_owner, l.claim_owner)
          FROM looping l
         WHERE x.ordering_key = l.ordering_key AND x.keyless = l.keyless
    )
    SELECT * FROM dead;
END;
$fn$;
