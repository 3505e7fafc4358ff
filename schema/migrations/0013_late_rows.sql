-- Version 13: two ways a committed row could miss its turn, both found from a CI run of
-- tests/integration/test_writers.py (a writer's seq 1 first-delivered before its seq 0), each
-- now a test in tests/integration/test_holes.py. Two functions replaced in place (same
-- signatures); additive like version 12, so `migrate` applies it whenever it runs.
--
-- 1. A hole's snapshot. Discovery recorded the holes it read past with the xmax of a snapshot
--    taken at its start, before the read that found them: a writer that began in between (while
--    the discovery took in the change log, or waited for a lock there) and stayed open past the
--    hole margin and the next claim had its hole closed under it, and its row, committed later,
--    was found only by the sweep (after its key's later rows). The xmin and xmax now come from
--    the read's own snapshot, and a new hole's time is when it was found.
-- 2. A run past a late row. A claim's run of a key read the key's rows from its head in a
--    snapshot of its own: a row committed late below the head (other writers' later rows of the
--    key had gone first), then its writer's next row, were both in that snapshot before any
--    discovery had lowered the head, and the run sent the next row first. A run now takes only
--    rows discoveries have taken in (up to the cursor, outside its holes).

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
                             AND (w.keyless OR (y.id >= w.claim_first AND y.id < w.head_id))))
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

    -- What is new: id, key, pending, whether it can go now (due, topic not paused, no live lease
    -- of a version 9 dispatcher), and whether it lies above the cursor.
    SELECT array_agg(s.id ORDER BY s.id), array_agg(s.ordering_key ORDER BY s.id),
           array_agg(s.ok ORDER BY s.id), array_agg(s.fresh ORDER BY s.id),
           array_agg(s.pending ORDER BY s.id), array_agg(s.touched ORDER BY s.id),
           max(s.id) FILTER (WHERE s.fresh),
           pg_snapshot_xmin(pg_current_snapshot()), pg_snapshot_xmax(pg_current_snapshot())
      INTO v_ids, v_keys, v_ok, v_fresh, v_pending, v_touched, v_top, v_xmin, v_xmax
      FROM ((SELECT o.id, o.ordering_key, o.published_at IS NULL AND o.dead_at IS NULL AS pending,
                    o.next_attempt_at <= now()
                    AND (p_paused IS NULL OR o.topic IS NULL OR o.topic <> ALL (p_paused))
                    AND NOT (c.compat AND o.lease_expires_at > now()) AS ok,
                    true AS fresh, false AS touched
               FROM ${schema}.${table} o
              WHERE o.id > c.position
              ORDER BY o.id LIMIT p_scan)
            UNION ALL
            (SELECT o.id, o.ordering_key, o.published_at IS NULL AND o.dead_at IS NULL,
                    o.next_attempt_at <= now()
                    AND (p_paused IS NULL OR o.topic IS NULL OR o.topic <> ALL (p_paused))
                    AND NOT (c.compat AND o.lease_expires_at > now()),
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
                                                  claim_owner, claim_expires_at, claim_first)
        SELECT u.kl, u.wk, CASE WHEN u.kl THEN u.first ELSE u.last + 1 END, p_token, p_owner,
               now() + p_lease_seconds * interval '1 second', u.first
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
    IF c.compat THEN
        -- Version 9 dispatchers respect row leases: write them too.
        UPDATE ${schema}.${table} o
           SET lease_owner = p_owner, lease_token = p_token,
               lease_expires_at = now() + p_lease_seconds * interval '1 second'
         WHERE o.id = ANY (v_mine);
    END IF;
    RETURN QUERY
    SELECT o.id, o.topic, o.ordering_key, o.payload, o.headers, o.event_id, o.created_at,
           o.attempts, false
      FROM ${schema}.${table} o
     WHERE o.id = ANY (v_mine)
     ORDER BY o.id;
END;
$fn$;

CREATE OR REPLACE FUNCTION ${schema}.${table}_claim_work(
    p_limit integer,
    p_max_keys integer,
    p_owner text,
    p_lease_seconds double precision,
    p_token uuid,
    p_block_on_dead boolean,
    p_max_attempts integer,
    p_scan integer
) RETURNS TABLE (
    id bigint, topic text, ordering_key text, payload bytea, headers jsonb, event_id uuid,
    created_at timestamptz, attempts integer, reclaimed boolean
)
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off
AS $fn$
#variable_conflict use_column
DECLARE
    v_paused text[];
    v_gen bigint;
    c ${schema}.${table}_cursor;
    -- The cursor locked for discovery: its own variable, since a SELECT INTO that finds no row
    -- (another claim holds the cursor) sets its target to NULL, and c.compat must stay known.
    v_locked ${schema}.${table}_cursor;
    v_taken integer := 0;
    v_keys text[];
    v_keyless boolean[];
    v_heads bigint[];
    v_old boolean[];
    v_ends bigint[];
    v_held bigint[] := '{}';
    v_known bigint;
    v_holes int8multirange;
BEGIN
    -- The pauses and their generation, in one snapshot.
    SELECT (SELECT array_agg(p.topic) FROM ${schema}.${table}_paused p), x.pause_gen
      INTO v_paused, v_gen
      FROM ${schema}.${table}_cursor x WHERE x.one;
    IF '*' = ANY (v_paused) THEN
        RETURN;
    END IF;
    -- Keys parked under older pauses whose topic is still paused: parked under these ones now
    -- (a bounded step; the rest at the next claims).
    -- (Read as the oldest generation, an index's first entry: a cached generic plan of
    -- "paused_gen < $1" expects a third of the work and reads all of it.)
    IF (SELECT w.paused_gen FROM ${schema}.${table}_work w
         WHERE w.claim_token IS NULL AND w.state = 'p' ORDER BY w.paused_gen LIMIT 1) < v_gen THEN
        UPDATE ${schema}.${table}_work x SET paused_gen = v_gen
         WHERE (x.ordering_key, x.keyless) IN (
                   SELECT w.ordering_key, w.keyless FROM ${schema}.${table}_work w
                    WHERE w.claim_token IS NULL AND w.state = 'p' AND w.paused_gen < v_gen
                      AND w.head_topic = ANY (v_paused)
                    ORDER BY w.paused_gen LIMIT 4 * p_max_keys
                      FOR UPDATE SKIP LOCKED);
    END IF;

    SELECT * INTO c FROM ${schema}.${table}_cursor x WHERE x.one;
    IF cardinality(c.hole_lo) > 0
       OR (SELECT o.id FROM ${schema}.${table} o WHERE o.id > c.position ORDER BY o.id LIMIT 1)
          IS NOT NULL
       OR (SELECT x.seq FROM ${schema}.${table}_changed x ORDER BY x.seq LIMIT 1) IS NOT NULL THEN
        SELECT * INTO v_locked FROM ${schema}.${table}_cursor x WHERE x.one FOR UPDATE SKIP LOCKED;
        IF FOUND THEN
            c := v_locked;
            RETURN QUERY SELECT * FROM ${schema}.${table}_discover(
                c, p_limit, p_owner, p_lease_seconds, p_token, p_scan, v_paused, 2.0,
                p_block_on_dead);
            GET DIAGNOSTICS v_taken = ROW_COUNT;
        END IF;
    END IF;
    IF v_taken >= p_limit THEN
        RETURN;
    END IF;
    -- Rows a writer moved to another key while a live claim of their old key holds them: their
    -- change waits in the log (see discover), and their new key's run stops before them, so
    -- that a row is never in two live claims.
    IF (SELECT x.seq FROM ${schema}.${table}_changed x ORDER BY x.seq LIMIT 1) IS NOT NULL THEN
        SELECT coalesce(array_agg(DISTINCT y.id), '{}') INTO v_held
          FROM ${schema}.${table}_changed y
         WHERE y.old_key IS DISTINCT FROM y.ordering_key AND EXISTS (
               SELECT 1 FROM ${schema}.${table}_work w
                WHERE w.ordering_key = coalesce(y.old_key, y.id::text)
                  AND w.keyless = (y.old_key IS NULL)
                  AND w.claim_token IS NOT NULL AND w.claim_expires_at > now()
                  AND (w.keyless OR (y.id >= w.claim_first AND y.id < w.head_id)));
    END IF;

    -- What discoveries have taken in: ids up to the cursor, but not its holes. A run takes no
    -- row beyond that: a row a writer committed below its key's head (a late commit), then the
    -- same writer's next row of the key, are both seen by the run's snapshot before a discovery
    -- lowered the head (another claim's, or this claim's own, whose read came before that
    -- commit); the run from the head would send the next row first. Read before the keys are
    -- locked, so that what a discovery did by then is in the work rows they lock (version 13;
    -- tests/integration/test_holes.py).
    SELECT x.position, coalesce((SELECT range_agg(int8range(h.lo, h.hi, '[]'))
                                   FROM unnest(x.hole_lo, x.hole_hi) AS h(lo, hi)), '{}')
      INTO v_known, v_holes
      FROM ${schema}.${table}_cursor x WHERE x.one;

    WITH expired AS (
        -- (lost_end: the lost claim held the key's rows below it, its orphans)
        SELECT w.keyless, w.ordering_key, least(w.claim_first, w.head_id) AS head_id, true AS old,
               w.head_id AS lost_end
          FROM ${schema}.${table}_work w
         WHERE w.claim_token IS NOT NULL AND w.claim_expires_at <= now() AND w.state <> 'x'
         ORDER BY w.claim_expires_at LIMIT p_max_keys
           FOR UPDATE SKIP LOCKED
    ),
    due AS (
        SELECT w.keyless, w.ordering_key, w.head_id, false, NULL::bigint
          FROM ${schema}.${table}_work w
         WHERE w.claim_token IS NULL AND w.state = 'w' AND w.not_before <= now()
         ORDER BY w.not_before LIMIT p_max_keys
           FOR UPDATE SKIP LOCKED
    ),
    ready AS (
        SELECT w.keyless, w.ordering_key, w.head_id, false, NULL::bigint
          FROM ${schema}.${table}_work w
         WHERE w.claim_token IS NULL AND w.state = 'r'
         ORDER BY w.head_id LIMIT p_max_keys
           FOR UPDATE SKIP LOCKED
    ),
    resumed AS (
        -- Parked under older pauses, and its topic is not paused now.
        SELECT w.keyless, w.ordering_key, w.head_id, false, NULL::bigint
          FROM ${schema}.${table}_work w
         WHERE w.claim_token IS NULL AND w.state = 'p' AND w.paused_gen < v_gen
           AND (v_paused IS NULL OR w.head_topic <> ALL (v_paused))
         ORDER BY w.paused_gen LIMIT p_max_keys
           FOR UPDATE SKIP LOCKED
    ),
    unblocked AS (
        -- Blocked by a dead row, and this dispatcher does not block.
        SELECT w.keyless, w.ordering_key, w.head_id, false, NULL::bigint
          FROM ${schema}.${table}_work w
         WHERE NOT p_block_on_dead AND w.claim_token IS NULL AND w.state = 'b'
         ORDER BY w.head_id LIMIT p_max_keys
           FOR UPDATE SKIP LOCKED
    ),
    cand AS (
        SELECT * FROM expired UNION ALL SELECT * FROM due UNION ALL SELECT * FROM ready
        UNION ALL SELECT * FROM resumed UNION ALL SELECT * FROM unblocked
    )
    SELECT array_agg(c.ordering_key ORDER BY c.head_id), array_agg(c.keyless ORDER BY c.head_id),
           array_agg(c.head_id ORDER BY c.head_id), array_agg(c.old ORDER BY c.head_id),
           array_agg(c.lost_end ORDER BY c.head_id)
      INTO v_keys, v_keyless, v_heads, v_old, v_ends
      FROM cand c;
    IF v_keys IS NULL THEN
        RETURN;
    END IF;

    RETURN QUERY
    WITH work AS (
        SELECT u.k, u.kl, u.h, u.old, u.n, u.e,
               -- dead_letter_policy = block: a dead row of the key holds its later rows.
               p_block_on_dead AND NOT u.kl AND EXISTS (
                   SELECT 1 FROM ${schema}.${table} d
                    WHERE d.ordering_key = u.k AND d.dead_at IS NOT NULL) AS blocked
          FROM unnest(v_keys, v_keyless, v_heads, v_old, v_ends) WITH ORDINALITY
               AS u(k, kl, h, old, e, n)
    ),
    room AS (
        SELECT p_limit - v_taken AS rows, count(*) AS keys,
               greatest(1, (p_limit - v_taken) / count(*)) AS share
          FROM work
    ),
    -- Each key's run is read in two passes, so that a claim reads about the rows it takes: its
    -- share and one more (is there more?), then, for keys with more than their share, the room
    -- the other keys left. (One pass of the whole room per key read 50 rows per row taken in a
    -- drain of 1,000 keys.) A key taken over is read as far as the room goes at once: its
    -- orphans (the rows its lost claim held) go first, before any other key's share.
    shares AS (
        SELECT w.k, w.kl, w.n, w.old, r.id, r.topic, r.next_attempt_at, r.looping,
               r.ok AND NOT r.looping AS ok, w.e, r.orphan
          FROM work w CROSS JOIN LATERAL (
            SELECT o.id, o.topic, o.next_attempt_at,
                   o.next_attempt_at <= now()
                   AND (v_paused IS NULL OR o.topic IS NULL OR o.topic <> ALL (v_paused))
                   AND NOT (c.compat AND o.lease_expires_at > now()
                            AND o.lease_token IS DISTINCT FROM p_token)
                   AND o.id <> ALL (v_held)
                   AND o.id <= v_known AND NOT v_holes @> o.id AS ok,
                   w.old AND o.attempts + 1 >= p_max_attempts AS looping,
                   w.old AND o.id < w.e AS orphan
              FROM ${schema}.${table} o
             WHERE o.ordering_key >= w.k AND o.ordering_key <= w.k AND o.id >= w.h
               AND o.published_at IS NULL AND o.dead_at IS NULL
             ORDER BY o.ordering_key, o.id
             LIMIT (SELECT CASE WHEN w.old THEN greatest(rows, share + 1) ELSE share + 1 END
                      FROM room)
          ) r
         WHERE NOT w.kl AND NOT w.blocked
    ),
    hungry AS (
        SELECT s.k, s.kl, s.n, s.old, s.e, max(s.id) AS after FROM shares s
         GROUP BY s.k, s.kl, s.n, s.old, s.e
        HAVING count(*) > (SELECT share FROM room) AND bool_and(s.ok)
    ),
    left_over AS (
        SELECT (SELECT rows FROM room) - coalesce(sum(least(n.rows, (SELECT share FROM room))), 0)
               - (SELECT count(*) FROM work w WHERE w.kl) AS rows
          FROM (SELECT count(*) AS rows FROM shares GROUP BY k) n
    ),
    more AS (
        SELECT w.k, w.kl, w.n, w.old, r.id, r.topic, r.next_attempt_at, r.looping,
               r.ok AND NOT r.looping AS ok, w.e, r.orphan
          FROM hungry w CROSS JOIN LATERAL (
            SELECT o.id, o.topic, o.next_attempt_at,
                   o.next_attempt_at <= now()
                   AND (v_paused IS NULL OR o.topic IS NULL OR o.topic <> ALL (v_paused))
                   AND NOT (c.compat AND o.lease_expires_at > now()
                            AND o.lease_token IS DISTINCT FROM p_token)
                   AND o.id <> ALL (v_held)
                   AND o.id <= v_known AND NOT v_holes @> o.id AS ok,
                   w.old AND o.attempts + 1 >= p_max_attempts AS looping,
                   w.old AND o.id < w.e AS orphan
              FROM ${schema}.${table} o
             WHERE o.ordering_key >= w.k AND o.ordering_key <= w.k AND o.id > w.after
               AND o.published_at IS NULL AND o.dead_at IS NULL
             ORDER BY o.ordering_key, o.id
             LIMIT (SELECT greatest(rows, 0) FROM left_over)
          ) r
    ),
    runs AS (
        SELECT * FROM shares
        UNION ALL
        SELECT * FROM more
        UNION ALL
        SELECT w.k, w.kl, w.n, w.old, o.id, o.topic, o.next_attempt_at,
               w.old AND o.attempts + 1 >= p_max_attempts,
               o.next_attempt_at <= now()
               AND (v_paused IS NULL OR o.topic IS NULL OR o.topic <> ALL (v_paused))
               AND NOT (c.compat AND o.lease_expires_at > now())
               AND NOT (w.old AND o.attempts + 1 >= p_max_attempts)
               AND o.id <> ALL (v_held),
               w.e, w.old
          FROM work w JOIN ${schema}.${table} o ON o.id = w.h
         -- (a row a writer gave a key since is its key's now)
         WHERE w.kl AND o.ordering_key IS NULL AND o.published_at IS NULL AND o.dead_at IS NULL
    ),
    ranked AS (
        SELECT r.*, row_number() OVER (PARTITION BY r.k, r.kl ORDER BY r.id) AS i
          FROM (SELECT r.*, bool_and(r.ok) OVER (PARTITION BY r.k, r.kl ORDER BY r.id) AS prefix
                  FROM runs r) r
         WHERE r.prefix
    ),
    took AS (
        -- Orphans first, then a share each, then the room left to the oldest heads, row by
        -- row (each order keeps a key's rows in id order, so a key's take is a prefix).
        SELECT q.* FROM (
            SELECT r.*, row_number() OVER (
                       ORDER BY NOT r.orphan, r.i > (SELECT share FROM room), r.n, r.i) AS rn
              FROM ranked r) q
         WHERE q.rn <= (SELECT rows FROM room)
    ),
    span AS (
        SELECT t.k, t.kl, min(t.id) AS first, max(t.id) AS last FROM took t GROUP BY 1, 2
    ),
    idle AS (
        SELECT w.k, w.kl, w.old, w.blocked, h.id, h.topic, h.next_attempt_at, h.looping
          FROM work w
          LEFT JOIN LATERAL (SELECT r.id, r.topic, r.next_attempt_at, r.looping FROM runs r
                              WHERE r.k = w.k AND r.kl = w.kl ORDER BY r.id LIMIT 1) h ON true
         WHERE NOT EXISTS (SELECT 1 FROM span s WHERE s.k = w.k AND s.kl = w.kl)
           -- A key that could go but found no room in this batch is left as it was: its state
           -- still holds, and an expired lease stays for the claim that takes it over (and
           -- counts the attempt).
           AND NOT EXISTS (SELECT 1 FROM ranked r WHERE r.k = w.k AND r.kl = w.kl)
    ),
    gone AS (
        DELETE FROM ${schema}.${table}_work x USING idle i
         WHERE x.ordering_key = i.k AND x.keyless = i.kl AND i.id IS NULL AND NOT i.blocked
    ),
    blocked AS (
        UPDATE ${schema}.${table}_work x
           SET state = 'b', not_before = '-infinity',
               claim_token = NULL, claim_owner = NULL, claim_expires_at = NULL, claim_first = NULL
          FROM idle i
         WHERE x.ordering_key = i.k AND x.keyless = i.kl AND i.blocked
    ),
    parked AS (
        -- Nothing to take: the state of the row the run stopped at. A row whose owners kept
        -- dying keeps the expired lease (state x) for the reclaimer.
        UPDATE ${schema}.${table}_work x
           SET head_id = CASE WHEN i.looping THEN x.head_id ELSE i.id END,
               head_topic = i.topic,
               state = CASE WHEN i.looping THEN 'x'
                            WHEN v_paused IS NOT NULL AND i.topic = ANY (v_paused) THEN 'p'
                            WHEN i.next_attempt_at > now() THEN 'w'
                            ELSE 'r' END,
               paused_gen = v_gen,
               not_before = CASE WHEN i.looping THEN x.not_before
                                 WHEN i.next_attempt_at > now() THEN i.next_attempt_at
                                 ELSE '-infinity' END,
               claim_token = CASE WHEN i.looping THEN x.claim_token END,
               claim_owner = CASE WHEN i.looping THEN x.claim_owner END,
               claim_expires_at = CASE WHEN i.looping THEN x.claim_expires_at END,
               claim_first = CASE WHEN i.looping THEN x.claim_first END
          FROM idle i
         WHERE x.ordering_key = i.k AND x.keyless = i.kl AND i.id IS NOT NULL AND NOT i.blocked
    ),
    leased AS (
        UPDATE ${schema}.${table}_work x
           SET claim_token = p_token, claim_owner = p_owner,
               claim_expires_at = now() + p_lease_seconds * interval '1 second',
               claim_first = s.first,
               head_id = CASE WHEN s.kl THEN s.first ELSE s.last + 1 END,
               state = 'r', not_before = '-infinity'
          FROM span s
         WHERE x.ordering_key = s.k AND x.keyless = s.kl
    ),
    bumped AS (
        -- A takeover: its rows' owner died or hung while publishing them (an attempt), and
        -- under version 9 beside it the rows carry the lease too.
        UPDATE ${schema}.${table} o
           SET attempts = o.attempts + CASE WHEN t.old THEN 1 ELSE 0 END,
               lease_owner = CASE WHEN c.compat THEN p_owner ELSE o.lease_owner END,
               lease_token = CASE WHEN c.compat THEN p_token ELSE o.lease_token END,
               lease_expires_at = CASE WHEN c.compat
                                       THEN now() + p_lease_seconds * interval '1 second'
                                       ELSE o.lease_expires_at END
          FROM took t
         WHERE o.id = t.id AND (t.old OR c.compat)
        RETURNING o.id, o.attempts
    )
    SELECT o.id, o.topic, o.ordering_key, o.payload, o.headers, o.event_id, o.created_at,
           coalesce(b.attempts, o.attempts), t.old
      FROM took t
      JOIN ${schema}.${table} o ON o.id = t.id
      LEFT JOIN bumped b ON b.id = t.id
     ORDER BY o.id;
END;
$fn$;

INSERT INTO ${schema}.${table}_schema_steps (version, name) VALUES (13, 'late_rows')
    ON CONFLICT (version) DO NOTHING;
INSERT INTO ${schema}.${table}_schema_version (version, name) VALUES (13, 'late_rows')
    ON CONFLICT (version) DO NOTHING;
