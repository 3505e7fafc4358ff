-- Version 9: a stale owner's late mark of a row the reclaimer dead-lettered (review F14).
--
-- The reclaimer dead-letters a row whose lease expired max_attempts times as a crash loop. Its
-- owner may still be alive and publishing it (a GC pause or a slow broker longer than the lease;
-- with max_attempts=1 every lease expiry), and its mark was fenced because the sweep cleared the
-- token: the row stayed dead although it is in Kafka, held its key under `block`, and a requeue
-- published it again. The sweep now keeps the token of the lease it ended (queries.sql), and the
-- settle lets that token's mark record a publication on such a row, nothing else (a failure
-- leaves the sweep's verdict), then refreshes the dead flag of the row's key. Same signature: a
-- dispatcher of version 8 still running when this commits keeps working (its sweep clears tokens,
-- as before).

-- The settle: record one batch's outcomes, fenced by its token, then release its keys (pointing
-- each at its new head, or forgetting it when it has none). Lock order everywhere: registry rows
-- (sorted by key) before outbox rows, so the mark, the lease keeper and the claim never deadlock.
-- A row the reclaimer dead-lettered as a crash loop keeps the token of the lease it ended (version
-- 9): its owner was alive after all, and its late mark may record a publication (the broker
-- acknowledged it: the row is in Kafka), nothing else; its key's dead flag is then refreshed.
CREATE OR REPLACE FUNCTION ${schema}.${table}_settle(
    p_token uuid,
    p_keys text[],
    p_ids bigint[],
    p_outcomes text[],
    p_errors text[],
    p_delays double precision[],
    p_counted integer[],
    p_delete boolean
) RETURNS SETOF bigint
    LANGUAGE plpgsql VOLATILE
AS $fn$
#variable_conflict use_column
DECLARE
    v_empty text[];
    v_locked text[];
    v_revived text[];
BEGIN
    PERFORM 1 FROM ${schema}.${table}_key k
     WHERE k.ordering_key = ANY (p_keys) AND k.lease_token = p_token
     ORDER BY k.ordering_key
       FOR UPDATE;

    -- Keys with a dead row of this lease, which this mark may publish (read from the small index
    -- of dead rows; there is usually none).
    SELECT array_agg(DISTINCT d.ordering_key) INTO v_revived
      FROM ${schema}.${table} d
     WHERE d.ordering_key = ANY (p_keys) AND d.dead_at IS NOT NULL AND d.lease_token = p_token;

    IF p_delete THEN
        RETURN QUERY
        DELETE FROM ${schema}.${table} o
         USING unnest(p_ids, p_outcomes) AS r(id, outcome)
         WHERE o.id = r.id AND r.outcome = 'published' AND o.lease_token = p_token
        RETURNING o.id;
    END IF;

    RETURN QUERY
    UPDATE ${schema}.${table} o
       SET published_at = CASE WHEN r.outcome = 'published' THEN now() END,
           dead_at = CASE WHEN r.outcome = 'dead' THEN now() END,
           last_error = CASE WHEN r.outcome = 'published' THEN o.last_error
                             ELSE coalesce(r.error, o.last_error) END,
           attempts = o.attempts + r.attempt,
           next_attempt_at = CASE WHEN r.outcome = 'retry'
                                  THEN now() + r.delay * interval '1 second'
                                  ELSE o.next_attempt_at END,
           lease_token = NULL,
           lease_expires_at = NULL
      FROM unnest(p_ids, p_outcomes, p_errors, p_delays, p_counted)
           AS r(id, outcome, error, delay, attempt)
     WHERE o.id = r.id AND o.lease_token = p_token
       AND (o.dead_at IS NULL OR r.outcome = 'published')
       AND NOT (p_delete AND r.outcome = 'published')
    RETURNING o.id;

    IF v_revived IS NOT NULL THEN
        UPDATE ${schema}.${table}_key k
           SET has_dead = EXISTS (SELECT 1 FROM ${schema}.${table} d
                                   WHERE d.ordering_key = k.ordering_key AND d.dead_at IS NOT NULL)
         WHERE k.ordering_key = ANY (v_revived) AND k.has_dead;
    END IF;

    -- Keys left with nothing pending are forgotten at once instead of released and then deleted
    -- (one write of the key's row instead of two: at a steady rate most keys empty out with
    -- every batch). As in <table>_key_forget: only under the exclusive lock of the key's bucket
    -- (no writer of it in flight) and in a snapshot taken after the lock; a key whose bucket is
    -- busy is released below and forgotten by a later claim.
    SELECT array_agg(u.k) INTO v_empty
      FROM (SELECT DISTINCT x.k FROM unnest(p_keys) AS x(k)) u(k)
     WHERE NOT EXISTS (SELECT 1 FROM ${schema}.${table} o
                        WHERE o.ordering_key >= u.k AND o.ordering_key <= u.k
                          AND o.published_at IS NULL AND o.dead_at IS NULL
                        ORDER BY o.ordering_key, o.id LIMIT 1);
    IF v_empty IS NOT NULL THEN
        SELECT array_agg(u.k) INTO v_locked
          FROM unnest(v_empty[1:128]) AS u(k)  -- a bounded number of locks per settle
         WHERE pg_try_advisory_xact_lock(hashtext('${schema}.${table}_key'),
                                         ${schema}.${table}_key_bucket(u.k));
        IF v_locked IS NOT NULL THEN
            DELETE FROM ${schema}.${table}_key k
             WHERE k.ordering_key = ANY (v_locked)
               AND (k.lease_token = p_token OR k.lease_token IS NULL
                    OR k.lease_expires_at <= now())
               AND NOT EXISTS (SELECT 1 FROM ${schema}.${table} o
                                WHERE o.ordering_key >= k.ordering_key
                                  AND o.ordering_key <= k.ordering_key
                                  AND o.published_at IS NULL AND o.dead_at IS NULL
                                ORDER BY o.ordering_key, o.id LIMIT 1);
        END IF;
    END IF;

    -- The other keys: released, each pointing at its new head.
    WITH mine AS (
        SELECT u.k, h.id, h.topic, h.next_attempt_at
          FROM unnest(p_keys) AS u(k)
          LEFT JOIN LATERAL (
            SELECT o.id, o.topic, o.next_attempt_at
              FROM ${schema}.${table} o
             WHERE o.ordering_key >= u.k AND o.ordering_key <= u.k
               AND o.published_at IS NULL AND o.dead_at IS NULL
             ORDER BY o.ordering_key, o.id LIMIT 1) h ON true
    )
    UPDATE ${schema}.${table}_key k
       SET lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
           head_id = coalesce(m.id, k.head_id),
           head_topic = CASE WHEN m.id IS NULL THEN k.head_topic ELSE m.topic END,
           not_before = coalesce(m.next_attempt_at, '-infinity'),
           has_dead = m.id IS NOT NULL AND EXISTS (
               SELECT 1 FROM ${schema}.${table} d
                WHERE d.ordering_key = m.k AND d.dead_at IS NOT NULL)
      FROM mine m
     WHERE k.ordering_key = m.k AND k.lease_token = p_token;
END;
$fn$;

INSERT INTO ${schema}.${table}_schema_version (version, name) VALUES (9, 'late_marks')
    ON CONFLICT (version) DO NOTHING;
