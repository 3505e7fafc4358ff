-- Discovery, by the claim that holds the cursor row (`c`: its position, hole_count and
-- hole_watch only; the hole arrays are read here when needed): the rows above the cursor (at
-- most p_scan, in id order), the rows that filled a hole and the rows writers or operators
-- changed.
--
-- Holes (version 16): ids at or below the cursor not seen yet, each with the transactions
-- (virtual transaction ids, from pg_locks) that were running when it was found. Only those can
-- still fill it: an id is drawn before its row is written, and a transaction that drew one and
-- ended is seen by any later snapshot. A hole is read again only when one of its transactions has
-- ended, and dropped once all have (after that read). Transaction ids (xids) are not enough: a
-- writer draws its id before it has an xid (an ON CONFLICT retry waiting for its first attempt,
-- a BEFORE trigger), and a hole closed on xids alone skipped its row for good (review 3, P1).
-- p_hole_margin is no longer read (kept for the signature).
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
    created_at timestamptz, attempts integer, reclaimed boolean, replays integer
)
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off SET enable_seqscan = off
AS $fn$
#variable_conflict use_column
DECLARE
    -- The highest id drawn, read before the rows (every id at or below it was drawn by then).
    v_last bigint;
    -- The transactions running (other than this one), read before the rows while holes exist.
    v_running text[];
    -- Some hole's transaction ended: the holes are read again.
    v_reread boolean := false;
    v_lo bigint[];
    v_hi bigint[];
    v_vx text[];
    v_at timestamptz[];
    v_position bigint;
    v_gaps int8multirange;
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

    v_last := ${schema}.${table}_last_id();
    IF c.hole_count > 0 THEN
        v_running := ${schema}.${table}_running();
        IF NOT (c.hole_watch <@ v_running) THEN
            v_reread := true;
            SELECT x.hole_lo, x.hole_hi, x.hole_vx, x.hole_at INTO v_lo, v_hi, v_vx, v_at
              FROM ${schema}.${table}_cursor x WHERE x.one;
        END IF;
    END IF;

    -- What is new: id, key, pending, whether it can go now (due, topic not paused), and whether
    -- it lies above the cursor.
    SELECT array_agg(s.id ORDER BY s.id), array_agg(s.ordering_key ORDER BY s.id),
           array_agg(s.ok ORDER BY s.id), array_agg(s.fresh ORDER BY s.id),
           array_agg(s.pending ORDER BY s.id), array_agg(s.touched ORDER BY s.id),
           max(s.id) FILTER (WHERE s.fresh)
      INTO v_ids, v_keys, v_ok, v_fresh, v_pending, v_touched, v_top
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
               FROM unnest(v_lo, v_hi, v_vx) AS h(lo, hi, vx)
              CROSS JOIN LATERAL (SELECT * FROM ${schema}.${table} o
                                   WHERE o.id >= h.lo AND o.id <= h.hi) o
              WHERE v_reread AND NOT (string_to_array(h.vx, ',') <@ v_running))
            UNION ALL
            (SELECT o.id, o.ordering_key, o.published_at IS NULL AND o.dead_at IS NULL,
                    -- A changed row waits for its key's turn (it may not be the key's first).
                    false, false, true
               FROM ${schema}.${table} o WHERE o.id = ANY (v_changed) AND o.id <= c.position)) s;

    -- The cursor moves on, to the highest new id (or, past a run of ids drawn but not seen
    -- longer than a scan, an open bulk insert, to the highest id drawn: that run becomes a hole,
    -- read again only when its writer ends, not at every claim: review 3, P9).
    v_position := greatest(c.position, coalesce(v_top, c.position));
    IF v_last > v_position + p_scan
       AND (SELECT count(*) FROM unnest(v_fresh) AS f WHERE f) < p_scan THEN
        v_position := v_last;
    END IF;
    -- New holes: the ids between the cursor and its new place that this read did not see.
    v_gaps := '{}';
    IF v_position > c.position THEN
        SELECT int8multirange(int8range(c.position + 1, v_position, '[]'))
               - coalesce(range_agg(int8range(u.id, u.id, '[]')), '{}'::int8multirange)
          INTO v_gaps
          FROM unnest(v_ids, v_fresh) AS u(id, fresh) WHERE u.fresh;
    END IF;
    IF isempty(v_gaps) AND NOT v_reread THEN
        -- (the hole arrays are left as they are: no rewrite of the cursor at every claim while a
        -- writer stays open, and none of its TOASTed arrays: review 3, P4)
        IF v_position > c.position THEN
            UPDATE ${schema}.${table}_cursor x SET position = v_position WHERE x.one;
        END IF;
    ELSE
        IF v_running IS NULL THEN
            -- (read after the rows: a writer of a new hole's id that ended before this read
            -- is seen by the read that closes the hole, one of whose transactions this is not)
            v_running := ${schema}.${table}_running();
        END IF;
        IF NOT v_reread THEN
            SELECT x.hole_lo, x.hole_hi, x.hole_vx, x.hole_at INTO v_lo, v_hi, v_vx, v_at
              FROM ${schema}.${table}_cursor x WHERE x.one;
        END IF;
        UPDATE ${schema}.${table}_cursor x
           SET position = v_position,
               (hole_lo, hole_hi, hole_vx, hole_at, hole_count, hole_watch) = (
                SELECT coalesce(array_agg(lower(h.piece) ORDER BY lower(h.piece)), '{}'),
                       coalesce(array_agg(upper(h.piece) - 1 ORDER BY lower(h.piece)), '{}'),
                       coalesce(array_agg(h.vx ORDER BY lower(h.piece)), '{}'),
                       coalesce(array_agg(h.found ORDER BY lower(h.piece)), '{}'),
                       count(*),
                       coalesce((SELECT array_agg(DISTINCT t.vx ORDER BY t.vx)
                                   FROM unnest(array_agg(h.vx)) AS a(list)
                                  CROSS JOIN LATERAL unnest(string_to_array(a.list, ',')) AS t(vx)),
                                '{}')
                  FROM (
                    -- Old holes: read again (some transaction of theirs ended) they lose the
                    -- ids seen and the transactions that ended, and go when none is left;
                    -- the others stay as they were.
                    SELECT CASE WHEN v_reread AND NOT (string_to_array(old.vx, ',') <@ v_running)
                                THEN array_to_string(ARRAY(
                                         SELECT t.vx FROM unnest(string_to_array(old.vx, ','))
                                                AS t(vx)
                                          WHERE t.vx = ANY (v_running) ORDER BY 1), ',')
                                ELSE old.vx END AS vx,
                           old.at AS found, r AS piece
                      FROM unnest(v_lo, v_hi, v_vx, v_at) AS old(lo, hi, vx, at)
                     CROSS JOIN LATERAL unnest(
                         int8multirange(int8range(old.lo, old.hi, '[]'))
                         - coalesce((SELECT range_agg(int8range(u.id, u.id, '[]'))
                                       FROM unnest(v_ids) AS u(id)
                                      WHERE u.id >= old.lo AND u.id <= old.hi),
                                    '{}'::int8multirange)) AS r
                    UNION ALL
                    -- New holes: the transactions running now, and 'new', which no running
                    -- transaction matches: a new hole is read once more at the next discovery
                    -- (a writer of its ids may have ended between this read and the list).
                    SELECT array_to_string(v_running || 'new'::text, ','), clock_timestamp(),
                           g.piece
                      FROM unnest(v_gaps) AS g(piece)
                  ) h
                 WHERE h.vx <> '')
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
        -- A row that came late lowers its key's head. A key a steady claim holds (last_seen
        -- set) records the highest id passed: its one-statement settle locks this row after
        -- this claim and sees it, although its snapshot is older. (Other keys' settles read
        -- their next rows in a snapshot taken after their locks: FOR SHARE above suffices.)
        UPDATE ${schema}.${table}_work w
           SET head_id = CASE WHEN g.first < k.head_id OR g.touched
                              THEN least(g.first, w.head_id) ELSE w.head_id END,
               state = CASE WHEN NOT (g.first < k.head_id OR g.touched)
                                 OR w.state IN ('b', 'x') OR w.claim_token IS NOT NULL
                            THEN w.state ELSE 'r' END,
               not_before = CASE WHEN NOT (g.first < k.head_id OR g.touched)
                                      OR w.state IN ('b', 'x') OR w.claim_token IS NOT NULL
                                 THEN w.not_before ELSE '-infinity' END,
               last_seen = CASE WHEN w.last_seen IS NOT NULL
                                THEN greatest(w.last_seen, g.last) END
          FROM g JOIN known k ON k.ordering_key = g.wk AND k.keyless = g.kl
         WHERE w.ordering_key = g.wk AND w.keyless = g.kl
           AND (g.first < k.head_id OR g.touched OR w.last_seen IS NOT NULL)
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
           o.attempts, false, o.replays
      FROM ${schema}.${table} o
     WHERE o.id = ANY (v_mine)
     ORDER BY o.id;
END;
$fn$;
