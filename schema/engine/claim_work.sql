-- The claim: one round trip, one short transaction.
-- 1. New rows, by the claim that gets the cursor when there are some (see <table>_discover).
-- 2. Known work, while the batch has room: keys whose lease expired (their owner died), due
--    waiting ones, ready ones oldest head first, paused ones whose topic was resumed, blocked
--    ones when this dispatcher does not block; each locked SKIP LOCKED (another claim's work is
--    skipped, never waited for). Then, in a new snapshot (taken after those locks: what a
--    previous owner settled is seen), each key's pending run from its head, cut at the first row
--    not due, in a paused topic, or (after a takeover) one whose
--    owners kept dying: a run is a prefix, never with a gap. A key taken over sends its orphans
--    (the rows its lost claim held, below the key's head) first, as far as the batch goes; then
--    each key gets its share of the batch, and the room that keys with fewer rows leave goes to
--    the oldest heads. Each key is then
--    leased with one write, or, when it yielded nothing, given the state of the row it stopped at,
--    or dropped when it has no pending row.
-- The reconcile duty (reconcile_owner, version 16; docs/design/exactly-once.md): a key whose
-- lease this claim finds expired keeps, whatever becomes of it here (leased, parked, blocked,
-- left as a crash loop), the owner whose outcome is unknown; every later claim of the key returns
-- its rows as reclaimed until an exactly-once takeover has read the progress and cleared it
-- (dispatch.sql `reconciled`). No path of the engine clears it; the work row goes only with the
-- key's last pending row.
-- Each row comes with its replay count (version 16; issue 35, E5: exactly-once lists (id,
-- replays) pairs), read with its other columns.
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
    created_at timestamptz, attempts integer, reclaimed boolean, replays integer
)
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off SET enable_seqscan = off
AS $fn$
#variable_conflict use_column
DECLARE
    v_paused text[];
    v_gen bigint;
    c ${schema}.${table}_cursor;
    -- The cursor locked for discovery: its own variable, since a SELECT INTO that finds no row
    -- (another claim holds the cursor) sets its target to NULL.
    v_locked ${schema}.${table}_cursor;
    v_taken integer := 0;
    v_keys text[];
    v_keyless boolean[];
    v_heads bigint[];
    v_old boolean[];
    v_duty boolean[];
    v_ends bigint[];
    v_room integer := p_limit;
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

    -- (Not the hole arrays: they are TOASTed once holes pile up, and read only when needed.)
    SELECT x.position, x.hole_count, x.hole_watch INTO c.position, c.hole_count, c.hole_watch
      FROM ${schema}.${table}_cursor x WHERE x.one;
    IF (SELECT o.id FROM ${schema}.${table} o WHERE o.id > c.position ORDER BY o.id LIMIT 1)
          IS NOT NULL
       OR (SELECT x.seq FROM ${schema}.${table}_changed x ORDER BY x.seq LIMIT 1) IS NOT NULL
       -- (a hole is looked at again only once a transaction running when it was found ended)
       OR (c.hole_count > 0 AND NOT (c.hole_watch <@ ${schema}.${table}_running())) THEN
        SELECT x.position, x.hole_count, x.hole_watch
          INTO v_locked.position, v_locked.hole_count, v_locked.hole_watch
          FROM ${schema}.${table}_cursor x WHERE x.one FOR UPDATE SKIP LOCKED;
        IF FOUND THEN
            c := v_locked;
            -- Known work waiting (a lease that expired, a retry due, a key registered by an
            -- earlier discovery): discovery gets half the batch, so that new keys arriving
            -- faster than a batch never starve takeovers and older keys (review 3, P3).
            -- (Each an index's first entry: a generic plan of EXISTS may read the whole work
            -- table when it expects many matches.)
            IF (SELECT w.claim_expires_at FROM ${schema}.${table}_work w
                 WHERE w.claim_token IS NOT NULL
                 ORDER BY w.claim_expires_at LIMIT 1) <= now()
               OR (SELECT w.not_before FROM ${schema}.${table}_work w
                    WHERE w.claim_token IS NULL AND w.state = 'w'
                    ORDER BY w.not_before LIMIT 1) <= now()
               OR (SELECT w.head_id FROM ${schema}.${table}_work w
                    WHERE w.claim_token IS NULL AND w.state = 'r'
                    ORDER BY w.head_id LIMIT 1) IS NOT NULL THEN
                v_room := p_limit - p_limit / 2;
            END IF;
            RETURN QUERY SELECT * FROM ${schema}.${table}_discover(
                c, v_room, p_owner, p_lease_seconds, p_token, p_scan, v_paused, 2.0,
                p_block_on_dead);
            GET DIAGNOSTICS v_taken = ROW_COUNT;
        END IF;
    END IF;
    IF v_taken >= p_limit THEN
        RETURN;
    END IF;
    -- What discoveries have taken in: ids up to the cursor, but not its holes. A run takes no
    -- row beyond that: a row a writer committed below its key's head (a late commit), then the
    -- same writer's next row of the key, are both seen by the run's snapshot before a discovery
    -- lowered the head (another claim's, or this claim's own, whose read came before that
    -- commit); the run from the head would send the next row first. Read before the keys are
    -- locked, so that what a discovery did by then is in the work rows they lock (version 13;
    -- tests/integration/test_holes.py).
    SELECT x.position,
           CASE WHEN x.hole_count > 0
                THEN coalesce((SELECT range_agg(int8range(h.lo, h.hi, '[]'))
                                 FROM unnest(x.hole_lo, x.hole_hi) AS h(lo, hi)), '{}')
                ELSE '{}' END
      INTO v_known, v_holes
      FROM ${schema}.${table}_cursor x WHERE x.one;

    WITH expired AS (
        -- (lost_end: the lost claim held the key's rows below it, its orphans)
        SELECT w.keyless, w.ordering_key, least(w.claim_first, w.head_id) AS head_id, true AS old,
               greatest(w.head_id, w.claim_last + 1) AS lost_end, true AS duty
          FROM ${schema}.${table}_work w
         WHERE w.claim_token IS NOT NULL AND w.claim_expires_at <= now() AND w.state <> 'x'
         ORDER BY w.claim_expires_at LIMIT p_max_keys
           FOR UPDATE SKIP LOCKED
    ),
    due AS (
        SELECT w.keyless, w.ordering_key, w.head_id, false, NULL::bigint,
               w.reconcile_owner IS NOT NULL
          FROM ${schema}.${table}_work w
         WHERE w.claim_token IS NULL AND w.state = 'w' AND w.not_before <= now()
         ORDER BY w.not_before LIMIT p_max_keys
           FOR UPDATE SKIP LOCKED
    ),
    ready AS (
        SELECT w.keyless, w.ordering_key, w.head_id, false, NULL::bigint,
               w.reconcile_owner IS NOT NULL
          FROM ${schema}.${table}_work w
         WHERE w.claim_token IS NULL AND w.state = 'r'
         ORDER BY w.head_id LIMIT p_max_keys
           FOR UPDATE SKIP LOCKED
    ),
    resumed AS (
        -- Parked under older pauses, and its topic is not paused now.
        SELECT w.keyless, w.ordering_key, w.head_id, false, NULL::bigint,
               w.reconcile_owner IS NOT NULL
          FROM ${schema}.${table}_work w
         WHERE w.claim_token IS NULL AND w.state = 'p' AND w.paused_gen < v_gen
           AND (v_paused IS NULL OR w.head_topic <> ALL (v_paused))
         ORDER BY w.paused_gen LIMIT p_max_keys
           FOR UPDATE SKIP LOCKED
    ),
    unblocked AS (
        -- Blocked by a dead row, and this dispatcher does not block.
        SELECT w.keyless, w.ordering_key, w.head_id, false, NULL::bigint,
               w.reconcile_owner IS NOT NULL
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
           array_agg(c.lost_end ORDER BY c.head_id), array_agg(c.duty ORDER BY c.head_id)
      INTO v_keys, v_keyless, v_heads, v_old, v_ends, v_duty
      FROM cand c;
    IF v_keys IS NULL THEN
        RETURN;
    END IF;

    RETURN QUERY
    WITH held AS MATERIALIZED (
        -- Rows a writer moved to another key while a live claim of their old key holds them:
        -- their change waits in the log (see discover), and their new key's run stops before
        -- them, so that a row is never in two live claims. Read in the runs' own snapshot: a
        -- move committed after an earlier statement's read was seen by the runs but not held
        -- (review 3, P6).
        SELECT coalesce(array_agg(DISTINCT y.id), '{}') AS ids
          FROM ${schema}.${table}_changed y
         WHERE y.old_key IS DISTINCT FROM y.ordering_key AND EXISTS (
               SELECT 1 FROM ${schema}.${table}_work w
                WHERE w.ordering_key = coalesce(y.old_key, y.id::text)
                  AND w.keyless = (y.old_key IS NULL)
                  AND w.claim_token IS NOT NULL AND w.claim_expires_at > now()
                  AND (w.keyless OR (y.id >= w.claim_first
                                      AND y.id <= greatest(w.head_id - 1, w.claim_last))))
    ),
    work AS (
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
                   AND o.id <> ALL ((SELECT h.ids FROM held h)::bigint[])
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
                   AND o.id <> ALL ((SELECT h.ids FROM held h)::bigint[])
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
               AND NOT (w.old AND o.attempts + 1 >= p_max_attempts)
               AND o.id <> ALL ((SELECT h.ids FROM held h)::bigint[]),
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
        SELECT t.k, t.kl, bool_or(t.old) AS old, min(t.id) AS first, max(t.id) AS last
          FROM took t GROUP BY 1, 2
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
               claim_token = NULL, claim_owner = NULL, claim_expires_at = NULL, claim_first = NULL,
               claim_last = NULL,
               reconcile_owner = CASE WHEN i.old THEN coalesce(x.reconcile_owner, x.claim_owner)
                                      ELSE x.reconcile_owner END
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
               claim_first = CASE WHEN i.looping THEN x.claim_first END,
               claim_last = CASE WHEN i.looping THEN x.claim_last END,
               reconcile_owner = CASE WHEN i.old THEN coalesce(x.reconcile_owner, x.claim_owner)
                                      ELSE x.reconcile_owner END
          FROM idle i
         WHERE x.ordering_key = i.k AND x.keyless = i.kl AND i.id IS NOT NULL AND NOT i.blocked
    ),
    leased AS (
        UPDATE ${schema}.${table}_work x
           SET claim_token = p_token, claim_owner = p_owner,
               claim_expires_at = now() + p_lease_seconds * interval '1 second',
               claim_first = s.first, claim_last = s.last, last_seen = NULL,
               head_id = CASE WHEN s.kl THEN s.first ELSE s.last + 1 END,
               state = 'r', not_before = '-infinity',
               reconcile_owner = CASE WHEN s.old THEN coalesce(x.reconcile_owner, x.claim_owner)
                                      ELSE x.reconcile_owner END
          FROM span s
         WHERE x.ordering_key = s.k AND x.keyless = s.kl
    ),
    bumped AS (
        -- A takeover: its rows' owner died or hung while publishing them (an attempt).
        UPDATE ${schema}.${table} o
           SET attempts = o.attempts + 1
          FROM took t
         WHERE o.id = t.id AND t.old
        RETURNING o.id, o.attempts
    )
    SELECT o.id, o.topic, o.ordering_key, o.payload, o.headers, o.event_id, o.created_at,
           coalesce(b.attempts, o.attempts), t.old OR v_duty[t.n], o.replays
      FROM took t
      JOIN ${schema}.${table} o ON o.id = t.id
      LEFT JOIN bumped b ON b.id = t.id
     ORDER BY o.id;
END;
$fn$;
