-- The settle: record one batch's outcomes, fenced by its token: only rows whose work (key, or
-- the row itself without one) is still held by the token change (locked first, in key order: the
-- claim, the lease keeper and discovery never deadlock with it). A row the reclaimer
-- dead-lettered as a crash loop keeps the token of the lease it ended: its owner was alive after
-- all, and its late mark may record a publication (the broker acknowledged it), nothing else.
-- Then, in a new snapshot, each key goes on from its first row of the batch still pending (a
-- retry, a row not attempted), else from its head: the state of that row, or the work is dropped
-- when no pending row is left. p_keys: each row's key (NULL: none), aligned with p_ids.
CREATE OR REPLACE FUNCTION ${schema}.${table}_settle_work(
    p_token uuid,
    p_owner text,
    p_ids bigint[],
    p_keys text[],
    p_outcomes text[],
    p_errors text[],
    p_delays double precision[],
    p_counted integer[],
    p_delete boolean,
    p_block_on_dead boolean
) RETURNS SETOF bigint
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off SET enable_seqscan = off
AS $fn$
#variable_conflict use_column
DECLARE
    v_paused text[];
    v_gen bigint;
    v_late bigint[];
BEGIN
    -- Rows the reclaimer dead-lettered under this lease (review F14): their owner was only slow,
    -- and a publication (nothing else) it reports stands. Their work is locked first, as every
    -- claim and settle does, then the rows; a key blocked only by them goes on.
    SELECT array_agg(o.id ORDER BY o.id) INTO v_late
      FROM unnest(p_ids, p_outcomes) AS u(id, outcome)
      JOIN ${schema}.${table} o ON o.id = u.id
     WHERE u.outcome = 'published' AND o.dead_at IS NOT NULL AND o.lease_token = p_token;
    IF v_late IS NOT NULL THEN
        RETURN QUERY SELECT * FROM ${schema}.${table}_settle_late(p_token, p_owner, v_late, p_delete);
    END IF;

    IF p_delete THEN
        RETURN QUERY
        WITH batch AS (
            SELECT u.id, coalesce(u.k, u.id::text) AS wk, u.k IS NULL AS kl
              FROM unnest(p_ids, p_keys, p_outcomes) AS u(id, k, outcome)
             WHERE u.outcome = 'published'
        ),
        mine AS (
            SELECT x.ordering_key, x.keyless FROM ${schema}.${table}_work x
             WHERE (x.ordering_key, x.keyless) IN (SELECT b.wk, b.kl FROM batch b)
               AND x.claim_token = p_token
             ORDER BY x.ordering_key, x.keyless
               FOR UPDATE OF x
        )
        DELETE FROM ${schema}.${table} o
         USING batch b
         WHERE o.id = b.id AND o.dead_at IS NULL
           AND EXISTS (SELECT 1 FROM mine m WHERE m.ordering_key = b.wk AND m.keyless = b.kl)
        RETURNING o.id;
    END IF;

    RETURN QUERY
    WITH batch AS (
        SELECT u.id, u.outcome, u.error, u.delay, u.attempt,
               coalesce(u.k, u.id::text) AS wk, u.k IS NULL AS kl
          FROM unnest(p_ids, p_keys, p_outcomes, p_errors, p_delays, p_counted)
               AS u(id, k, outcome, error, delay, attempt)
         WHERE NOT (p_delete AND u.outcome = 'published')
    ),
    mine AS (
        SELECT x.ordering_key, x.keyless FROM ${schema}.${table}_work x
         WHERE (x.ordering_key, x.keyless) IN (SELECT b.wk, b.kl FROM batch b)
           AND x.claim_token = p_token
         ORDER BY x.ordering_key, x.keyless
           FOR UPDATE OF x
    )
    UPDATE ${schema}.${table} o
       SET published_at = CASE WHEN b.outcome = 'published' THEN now() END,
           dead_at = CASE WHEN b.outcome = 'dead' THEN now()
                          WHEN b.outcome = 'published' THEN NULL
                          ELSE o.dead_at END,
           last_error = CASE WHEN b.outcome = 'published' THEN o.last_error
                             ELSE coalesce(b.error, o.last_error) END,
           attempts = o.attempts + b.attempt,
           next_attempt_at = CASE WHEN b.outcome = 'retry'
                                  THEN now() + b.delay * interval '1 second'
                                  ELSE o.next_attempt_at END,
           lease_owner = p_owner
      FROM batch b
     WHERE o.id = b.id AND o.dead_at IS NULL
       AND EXISTS (SELECT 1 FROM mine m WHERE m.ordering_key = b.wk AND m.keyless = b.kl)
    RETURNING o.id;

    SELECT (SELECT array_agg(p.topic) FROM ${schema}.${table}_paused p), x.pause_gen
      INTO v_paused, v_gen
      FROM ${schema}.${table}_cursor x WHERE x.one;
    WITH batch AS (
        SELECT coalesce(u.k, u.id::text) AS wk, u.k IS NULL AS kl,
               min(u.id) FILTER (WHERE u.outcome NOT IN ('published', 'dead')) AS again
          FROM unnest(p_ids, p_keys, p_outcomes) AS u(id, k, outcome)
         GROUP BY 1, 2
    ),
    mine AS (
        SELECT x.ordering_key AS k, x.keyless AS kl,
               least(x.head_id, b.again) AS h
          FROM ${schema}.${table}_work x JOIN batch b ON x.ordering_key = b.wk AND x.keyless = b.kl
         WHERE x.claim_token = p_token
    ),
    heads AS (
        SELECT m.k, m.kl, h.id, h.topic, h.next_attempt_at,
               p_block_on_dead AND EXISTS (
                   SELECT 1 FROM ${schema}.${table} d
                    WHERE d.ordering_key = m.k AND d.dead_at IS NOT NULL) AS blocked
          FROM mine m
          LEFT JOIN LATERAL (
            SELECT o.id, o.topic, o.next_attempt_at FROM ${schema}.${table} o
             WHERE o.ordering_key >= m.k AND o.ordering_key <= m.k AND o.id >= m.h
               AND o.published_at IS NULL AND o.dead_at IS NULL
             ORDER BY o.ordering_key, o.id LIMIT 1) h ON true
         WHERE NOT m.kl
        UNION ALL
        SELECT m.k, m.kl, o.id, o.topic, o.next_attempt_at, false
          FROM mine m
          LEFT JOIN ${schema}.${table} o
            ON o.id = m.h AND o.ordering_key IS NULL
           AND o.published_at IS NULL AND o.dead_at IS NULL
         WHERE m.kl
    ),
    gone AS (
        DELETE FROM ${schema}.${table}_work x USING heads h
         WHERE x.ordering_key = h.k AND x.keyless = h.kl AND h.id IS NULL AND NOT h.blocked
    )
    UPDATE ${schema}.${table}_work x
       SET head_id = coalesce(h.id, x.head_id), head_topic = h.topic,
           state = CASE WHEN h.blocked THEN 'b'
                        WHEN v_paused IS NOT NULL AND h.topic = ANY (v_paused) THEN 'p'
                        WHEN h.next_attempt_at > now() THEN 'w' ELSE 'r' END,
           paused_gen = v_gen,
           not_before = CASE WHEN NOT h.blocked AND h.next_attempt_at > now()
                             THEN h.next_attempt_at ELSE '-infinity' END,
           claim_token = NULL, claim_owner = NULL, claim_expires_at = NULL, claim_first = NULL,
           claim_last = NULL
      FROM heads h
     WHERE x.ordering_key = h.k AND x.keyless = h.kl AND (h.id IS NOT NULL OR h.blocked);
END;
$fn$;
