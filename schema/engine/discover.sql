-- Discovery, by the claim that holds the cursor row (`c`): the rows above the cursor (at most
-- p_scan, in id order), the rows that filled a hole and the rows writers or operators changed.
-- Keys nobody knows yet are leased to this claim with their new rows, while the batch has room
-- (when every such row can go now), the others registered as ready work; keys already known are
-- locked FOR SHARE, so that no claim or settle drops one in an older snapshot while this
-- discovery relies on it, and their head is lowered for a row that came late. Returns the rows
-- leased.
CREATE OR REPLACE FUNCTION ${schema}.${table}_discover(
    c ${schema}.${table}_cursor,
    p_limit integer,
    p_owner text,
    p_lease_seconds double precision,
    p_token uuid,
    p_scan integer,
    p_paused text[],
    p_hole_margin double precision,
    p_block_on_dead boolean
) RETURNS TABLE (
    id bigint, topic text, ordering_key text, payload bytea, headers jsonb, event_id uuid,
    created_at timestamptz, attempts integer, reclaimed boolean
)
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off
AS $fn$
#variable_conflict use_column
DECLARE
    -- The read's own snapshot (taken in the read below): a hole it finds is closed only once
    -- every transaction running then has ended (a later snapshot's xmin beyond this xmax). An
    -- xmax from before the read (this function's start) forgot a writer that began in between
    -- (version 13; tests/integration/test_holes.py).
    v_xmin xid8;
    v_xmax xid8;
    v_ids bigint[];
    v_keys text[];
    v_ok boolean[];
    v_fresh boolean[];
    v_pending boolean[];
    v_touched boolean[];
    v_top bigint;
    v_changed bigint[];
    v_changed_keys text[];
    v_left_keys text[];
    v_left_rows text[];
    v_lk text[];
    v_lkl boolean[];
    v_mine bigint[];
    v_read bigint;
BEGIN
    -- Rows writers or operators changed (taken in once: the log is emptied here). A row moved to
    -- another key while a live claim of its old key holds it waits in the log until that claim
    -- ends: a row is never in two live claims.
    IF EXISTS (SELECT 1 FROM ${schema}.${table}_changed) THEN
        WITH taken AS (
            DELETE FROM ${schema}.${table}_changed x
             WHERE x.seq IN (SELECT y.seq FROM ${schema}.${table}_changed y
                              ORDER BY y.seq LIMIT p_scan)
               -- (and so does every later change of the row: moved on again, it is still
               -- in that claim)
               AND NOT EXISTS (
                   SELECT 1 FROM ${schema}.${table}_changed y
                    WHERE y.id = x.id AND y.seq <= x.seq
                      AND y.old_key IS DISTINCT FROM y.ordering_key AND EXISTS (
                          SELECT 1 FROM ${schema}.${table}_work w
                           WHERE w.ordering_key = coalesce(y.old_key, y.id::text)
                             AND w.keyless = (y.old_key IS NULL)
                             AND w.claim_token IS NOT NULL AND w.claim_expires_at > now()
                             AND (w.keyless OR (y.id >= w.claim_first
                                  AND y.id <= greatest(w.head_id - 1, w.claim_last)))))
            RETURNING x.id, x.ordering_key, x.old_key
        )
        SELECT array_agg(DISTINCT t.id),
               array_agg(DISTINCT t.ordering_key) FILTER (WHERE t.ordering_key IS NOT NULL),
               array_agg(DISTINCT t.old_key)
                   FILTER (WHERE t.old_key IS DISTINCT FROM t.ordering_key
                           AND t.old_key IS NOT NULL),
               array_agg(DISTINCT t.id::text)
                   FILTER (WHERE t.old_key IS DISTINCT FROM t.ordering_key AND t.old_key IS NULL)
          INTO v_changed, v_changed_keys, v_left_keys, v_left_rows
          FROM taken t;
        -- The key a row left: what it waited on may have gone with the row (its claim looks
        -- again; a key emptied so is dropped there).
        UPDATE ${schema}.${table}_work w SET state = 'r', not_before = '-infinity'
         WHERE ((w.ordering_key = ANY (v_left_keys) AND NOT w.keyless)
                OR (w.ordering_key = ANY (v_left_rows) AND w.keyless))
           AND w.claim_token IS NULL AND w.state IN ('w', 'p');
        -- A dead row requeued or removed: its key may be blocked no more.
        UPDATE ${schema}.${table}_work w SET state = 'r', not_before = '-infinity'
         WHERE w.ordering_key = ANY (v_changed_keys) AND NOT w.keyless AND w.state = 'b'
           AND NOT EXISTS (SELECT 1 FROM ${schema}.${table} d
                            WHERE d.ordering_key = w.ordering_key AND d.dead_at IS NOT NULL);
    END IF;

    -- What is new: id, key, pending, whether it can go now (due, topic not paused), and whether
    -- it lies above the cursor.
    SELECT array_agg(s.id ORDER BY s.id), array_agg(s.ordering_key ORDER BY s.id),
           array_agg(s.ok ORDER BY s.id), array_agg(s.fresh ORDER BY s.id),
           array_agg(s.pending ORDER BY s.id), array_agg(s.touched ORDER BY s.id),
           max(s.id) FILTER (WHERE s.fresh),
           pg_snapshot_xmin(pg_current_snapshot()), pg_snapshot_xmax(pg_current_snapshot())
      INTO v_ids, v_keys, v_ok, v_fresh, v_pending, v_touched, v_top, v_xmin, v_xmax
      FROM ((SELECT o.id, o.ordering_key, o.published_at IS NULL AND o.dead_at IS NULL AS pending,
                    o.next_attempt_at <= now()
                    AND (p_paused IS NULL OR o.topic IS NULL OR o.topic <> ALL (p_paused)) AS ok,
                    true AS fresh, false AS touched
               FROM ${schema}.${table} o
              WHERE o.id > c.position
              ORDER BY o.id LIMIT p_scan)
            UNION ALL
            (SELECT o.id, o.ordering_key, o.published_at IS NULL AND o.dead_at IS NULL,
                    o.next_attempt_at <= now()
                    AND (p_paused IS NULL OR o.topic IS NULL OR o.topic <> ALL (p_paused)),
                    false, false
               FROM unnest(c.hole_lo, c.hole_hi) AS h(lo, hi)
              CROSS JOIN LATERAL (SELECT * FROM ${schema}.${table} o
                                   WHERE o.id >= h.lo AND o.id <= h.hi) o)
            UNION ALL
            (SELECT o.id, o.ordering_key, o.published_at IS NULL AND o.dead_at IS NULL,
                    -- A changed row waits for its key's turn (it may not be the key's first).
                    false, false, true
               FROM ${schema}.${table} o WHERE o.id = ANY (v_changed) AND o.id <= c.position)) s;

    -- The cursor moves on. Holes (only while writers' transactions overlap): the old ones minus
    -- the ids now seen, minus those no transaction open when they were found can still fill, plus
    -- the gaps between the new ids.
    IF cardinality(c.hole_lo) = 0 AND (v_top IS NULL OR v_top - c.position
            = (SELECT count(*) FROM unnest(v_fresh) AS f WHERE f)) THEN
        IF v_top IS NOT NULL THEN
            UPDATE ${schema}.${table}_cursor x SET position = v_top WHERE x.one;
        END IF;
    ELSIF v_ids IS NULL AND NOT EXISTS (
            SELECT 1 FROM unnest(c.hole_xmax, c.hole_at) AS h(x, at)
             WHERE h.x <= v_xmin AND h.at < now() - p_hole_margin * interval '1 second') THEN
        -- Holes that nothing filled and none that can go: the cursor stays as it is (rewriting
        -- it at every claim while a writer stays open piled up versions its snapshot keeps).
        NULL;
    ELSE
        UPDATE ${schema}.${table}_cursor x
           SET position = greatest(c.position, coalesce(v_top, c.position)),
               (hole_lo, hole_hi, hole_xmax, hole_at) = (
                SELECT coalesce(array_agg(lower(h.piece) ORDER BY lower(h.piece)), '{}'),
                       coalesce(array_agg(upper(h.piece) - 1 ORDER BY lower(h.piece)), '{}'),
                       coalesce(array_agg(h.hx ORDER BY lower(h.piece)), '{}'),
                       coalesce(array_agg(h.hat ORDER BY lower(h.piece)), '{}')
                  FROM (SELECT old.x AS hx, old.at AS hat, r AS piece
                          FROM unnest(c.hole_lo, c.hole_hi, c.hole_xmax, c.hole_at)
                               AS old(lo, hi, x, at)
                         CROSS JOIN LATERAL unnest(
                             int8multirange(int8range(old.lo, old.hi, '[]'))
                             - coalesce((SELECT range_agg(int8range(u.id, u.id, '[]'))
                                           FROM unnest(v_ids) AS u(id)
                                          WHERE u.id >= old.lo AND u.id <= old.hi),
                                        '{}'::int8multirange)) AS r
                         WHERE NOT (old.x <= v_xmin
                                    AND old.at < now() - p_hole_margin * interval '1 second')
                        UNION ALL
                        -- (found now, not at the claim's start: a claim that waited for a
                        -- lock must not find its holes already past the margin)
                        SELECT v_xmax, clock_timestamp(), int8range(g.prev + 1, g.id - 1, '[]')
                          FROM (SELECT u.id, lag(u.id, 1, c.position) OVER (ORDER BY u.id) AS prev
                                  FROM unnest(v_ids, v_fresh) AS u(id, fresh) WHERE u.fresh) g
                         WHERE g.id > g.prev + 1) h)
         WHERE x.one;
    END IF;

    IF v_ids IS NULL THEN
        RETURN;
    END IF;

    -- Their keys (a row without one is its own): known ones locked FOR SHARE, their head lowered
    -- for a row that came late; unknown ones leased to this claim while it has room, the others
    -- registered as ready work.
    WITH g AS (
        SELECT coalesce(u.k, u.id::text) AS wk, u.k IS NULL AS kl, min(u.id) AS first,
               max(u.id) AS last, count(*) AS n, bool_and(u.ok) AS eligible,
               bool_or(u.touched) AS touched
          FROM unnest(v_ids, v_keys, v_ok, v_pending, v_touched) AS u(id, k, ok, pending, touched)
         WHERE u.pending
         GROUP BY 1, 2
    ),
    known AS (
        SELECT w.ordering_key, w.keyless, w.head_id, w.state FROM ${schema}.${table}_work w
          JOIN g ON w.ordering_key = g.wk AND w.keyless = g.kl
         ORDER BY w.ordering_key, w.keyless
           FOR SHARE OF w
    ),
    lowered AS (
        UPDATE ${schema}.${table}_work w
           SET head_id = least(g.first, w.head_id),
               state = CASE WHEN w.state IN ('b', 'x') OR w.claim_token IS NOT NULL THEN w.state
                            ELSE 'r' END,
               not_before = CASE WHEN w.state IN ('b', 'x') OR w.claim_token IS NOT NULL
                                 THEN w.not_before ELSE '-infinity' END
          FROM g JOIN known k ON k.ordering_key = g.wk AND k.keyless = g.kl
         WHERE w.ordering_key = g.wk AND w.keyless = g.kl
           AND (g.first < k.head_id OR g.touched)
    ),
    unknown AS (
        -- Under dead_letter_policy = block a key with a dead row is not leased here (the claim
        -- of known work blocks it).
        SELECT g.wk, g.kl, g.first, g.last, g.n,
               g.eligible AND NOT (p_block_on_dead AND NOT g.kl AND EXISTS (
                   SELECT 1 FROM ${schema}.${table} d
                    WHERE d.ordering_key = g.wk AND d.dead_at IS NOT NULL)) AS eligible,
               sum(g.n) OVER (ORDER BY g.first) AS upto
          FROM g
         WHERE NOT EXISTS (SELECT 1 FROM known k WHERE k.ordering_key = g.wk AND k.keyless = g.kl)
    ),
    leased AS (
        INSERT INTO ${schema}.${table}_work AS w (keyless, ordering_key, head_id, claim_token,
                                                  claim_owner, claim_expires_at, claim_first,
                                                  claim_last)
        SELECT u.kl, u.wk, CASE WHEN u.kl THEN u.first ELSE u.last + 1 END, p_token, p_owner,
               now() + p_lease_seconds * interval '1 second', u.first, u.last
          FROM unknown u
         WHERE u.eligible AND u.upto <= p_limit
         ORDER BY u.wk, u.kl
        ON CONFLICT DO NOTHING
        RETURNING w.ordering_key, w.keyless
    ),
    registered AS (
        INSERT INTO ${schema}.${table}_work (keyless, ordering_key, head_id)
        SELECT u.kl, u.wk, u.first FROM unknown u
         WHERE NOT (u.eligible AND u.upto <= p_limit)
         ORDER BY u.wk, u.kl
        ON CONFLICT DO NOTHING
    )
    SELECT array_agg(l.ordering_key), array_agg(l.keyless) INTO v_lk, v_lkl FROM leased l;

    IF v_lk IS NULL THEN
        RETURN;
    END IF;
    -- The leased keys' rows, read again in a new snapshot: between the read above and the
    -- insert, a key's previous owner may have settled its batch (rows this read saw pending) and
    -- dropped the key's work (so the insert met no conflict). Its rows are published now; a key
    -- left with none is handed back as ready work (its claim looks again).
    SELECT array_agg(o.id ORDER BY o.id)
               FILTER (WHERE o.published_at IS NULL AND o.dead_at IS NULL),
           count(*)
      INTO v_mine, v_read
      FROM unnest(v_ids, v_keys, v_pending) AS u(id, k, pending)
      JOIN unnest(v_lk, v_lkl) AS l(wk, kl)
        ON l.wk = coalesce(u.k, u.id::text) AND l.kl = (u.k IS NULL)
      JOIN ${schema}.${table} o ON o.id = u.id
     WHERE u.pending;
    IF coalesce(cardinality(v_mine), 0) < v_read THEN
        -- (only when some row was settled meanwhile: a key may be left with none)
        UPDATE ${schema}.${table}_work x
           SET claim_token = NULL, claim_owner = NULL, claim_expires_at = NULL, claim_first = NULL,
               claim_last = NULL,
               head_id = x.claim_first, state = 'r', not_before = '-infinity'
          FROM unnest(v_lk, v_lkl) AS l(wk, kl)
         WHERE x.ordering_key = l.wk AND x.keyless = l.kl AND x.claim_token = p_token
           AND NOT EXISTS (SELECT 1 FROM ${schema}.${table} o
                            WHERE o.id = ANY (v_mine)
                              AND coalesce(o.ordering_key, o.id::text) = l.wk
                              AND (o.ordering_key IS NULL) = l.kl);
    END IF;
    IF v_mine IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT o.id, o.topic, o.ordering_key, o.payload, o.headers, o.event_id, o.created_at,
           o.attempts, false
      FROM ${schema}.${table} o
     WHERE o.id = ANY (v_mine)
     ORDER BY o.id;
END;
$fn$;
