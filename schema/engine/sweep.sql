-- The anti-entropy sweep: from the sweep's place, the next p_rows ids at or below the cursor, in
-- id order; any pending row there that no work covers (a key with no work, or work whose head is
-- above it and whose claim does not hold it) is registered. Rows get there only by paths that
-- bypass the cursor: ids written below it (explicit ids, a restore into a live table, a
-- sequence set back), a key update with triggers disabled. Returns how many it registered and
-- whether it finished a pass over the table.
CREATE OR REPLACE FUNCTION ${schema}.${table}_sweep(
    p_rows integer,
    p_hold_seconds double precision,
    OUT repaired integer,
    OUT wrapped boolean
)
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off SET enable_seqscan = off
AS $fn$
DECLARE
    c ${schema}.${table}_cursor;
    v_last bigint;
BEGIN
    SELECT * INTO c FROM ${schema}.${table}_cursor x WHERE x.one FOR UPDATE SKIP LOCKED;
    repaired := 0;
    wrapped := false;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    WITH part AS (
        SELECT o.id, o.ordering_key, o.published_at IS NULL AND o.dead_at IS NULL AS pending
          FROM ${schema}.${table} o
         WHERE o.id > c.swept AND o.id <= c.position
         ORDER BY o.id LIMIT p_rows
    ),
    stray AS (
        SELECT coalesce(p.ordering_key, p.id::text) AS wk, p.ordering_key IS NULL AS kl,
               min(p.id) AS first,
               -- A row a writer moved to this key with triggers off may still be in flight under
               -- its old key: if any live claim's range holds its id, the key waits one lease.
               CASE WHEN bool_or(EXISTS (
                        SELECT 1 FROM ${schema}.${table}_work l
                         WHERE l.claim_token IS NOT NULL AND l.claim_expires_at > now()
                           AND (p.id = l.claim_first
                                OR (NOT l.keyless AND p.id > l.claim_first
                                    AND p.id <= greatest(l.head_id - 1, l.claim_last)))))
                    THEN now() + p_hold_seconds * interval '1 second'
                    ELSE '-infinity' END AS not_before
          FROM part p
         WHERE p.pending
           -- (a row in the change log is known: the claim that takes its change in places it,
           -- once no live claim of its old key holds it)
           AND NOT EXISTS (SELECT 1 FROM ${schema}.${table}_changed x WHERE x.id = p.id)
           AND NOT EXISTS (
               SELECT 1 FROM ${schema}.${table}_work w
                WHERE w.ordering_key = coalesce(p.ordering_key, p.id::text)
                  AND w.keyless = (p.ordering_key IS NULL)
                  AND (w.head_id <= p.id
                       OR (w.claim_token IS NOT NULL AND w.claim_first <= p.id)))
         GROUP BY 1, 2
    ),
    fixed AS (
        INSERT INTO ${schema}.${table}_work AS w (keyless, ordering_key, head_id, state, not_before)
        SELECT s.kl, s.wk, s.first, CASE WHEN s.not_before > now() THEN 'w' ELSE 'r' END,
               s.not_before
          FROM stray s ORDER BY s.wk, s.kl
        ON CONFLICT (ordering_key, keyless) DO UPDATE
           SET head_id = least(w.head_id, excluded.head_id),
               state = CASE WHEN w.state IN ('b', 'x') OR w.claim_token IS NOT NULL THEN w.state
                            ELSE excluded.state END,
               not_before = CASE WHEN w.state IN ('b', 'x') OR w.claim_token IS NOT NULL
                                 THEN w.not_before
                                 ELSE greatest(w.not_before, excluded.not_before) END
        RETURNING 1
    )
    SELECT (SELECT count(*)::integer FROM fixed), (SELECT max(p.id) FROM part p)
      INTO repaired, v_last;
    IF v_last IS NULL OR v_last >= c.position THEN
        wrapped := true;
        UPDATE ${schema}.${table}_cursor x SET swept = 0, sweep_started_at = now() WHERE x.one;
    ELSE
        UPDATE ${schema}.${table}_cursor x SET swept = v_last WHERE x.one;
    END IF;
END;
$fn$;
