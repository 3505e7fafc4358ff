-- C1 "one statement per call": the steady path of the v3 data model (cursor row, a work row per
-- key) as one claim statement and one settle statement. Rendered like schema.sql (outbox, public).
-- Sections (lines "-- @name"): setup runs once after the schema; claim and settle are the
-- statements the harness prepares (asyncpg: named prepared statements, generic plans forced on
-- the connection). common.py also wraps each in a PL/pgSQL function with a single RETURN QUERY.
--
-- Claim parameters: $1 limit, $2 token, $3 owner, $4 lease seconds, $5 block_on_dead.
-- Returns the leased rows in id order, or ONE row with id NULL (and nothing else) when the state
-- is not steady: the caller then runs the slow path (outbox_claim_work) for this call.
--
-- Settle parameters: $1 token, $2 ids, $3 keys (aligned with ids, NULL = keyless), $4 owner.
-- All outcomes 'published' (any other outcome: the caller uses outbox_settle_work).

-- @setup
-- The highest id of the key that a discovery passed while the key had a work row. Written by the
-- claim's upsert of a known key (ON CONFLICT DO UPDATE, instead of v3's FOR SHARE): a settle
-- that waited for that claim's lock sees it in the locked row (EvalPlanQual), although its
-- snapshot predates the claim's commit. Not indexed: the write is HOT.
ALTER TABLE "public".outbox_work ADD COLUMN IF NOT EXISTS last_seen bigint;

-- @claim
WITH c AS (
    SELECT x.position, x.hole_lo, x.compat FROM "public".outbox_cursor x WHERE x.one
),
probe AS (
    -- Steady: no holes, no change log, no pause, no v9 beside it, and no known work of any kind
    -- the slow claim takes (each probe reads the first entry of a partial index, or an empty
    -- table); fresh: something above the cursor.
    SELECT cardinality(c.hole_lo) = 0 AND NOT c.compat
           AND NOT EXISTS (SELECT 1 FROM "public".outbox_changed)
           AND NOT EXISTS (SELECT 1 FROM "public".outbox_paused)
           AND NOT EXISTS (SELECT 1 FROM "public".outbox_work w
                            WHERE w.claim_token IS NULL AND w.state = 'r')
           AND NOT EXISTS (SELECT 1 FROM "public".outbox_work w
                            WHERE w.claim_token IS NULL AND w.state = 'w' AND w.not_before <= now())
           -- (first entries in index order: a generic plan of a bare EXISTS may read the
           -- whole table while it has no statistics)
           AND coalesce((SELECT w.claim_expires_at FROM "public".outbox_work w
                          WHERE w.claim_token IS NOT NULL AND w.state <> 'x'
                          ORDER BY w.claim_expires_at LIMIT 1) > now(), true)
           AND NOT EXISTS (SELECT 1 FROM "public".outbox_work w
                            WHERE w.claim_token IS NULL AND w.state = 'p')
           AND NOT ($5::boolean IS FALSE AND EXISTS (SELECT 1 FROM "public".outbox_work w
                            WHERE w.claim_token IS NULL AND w.state = 'b')) AS steady,
           (SELECT o.id FROM "public".outbox o WHERE o.id > c.position
             ORDER BY o.id LIMIT 1) IS NOT NULL AS fresh
      FROM c
),
cur AS (
    -- Locked only when there is something to take (an empty claim takes no xid, writes nothing).
    -- Another claim holds it: nothing for this one (SKIP LOCKED). After a wait-free lock of a
    -- version newer than the snapshot, position is that version's.
    SELECT x.position FROM "public".outbox_cursor x, probe p
     WHERE x.one AND p.steady AND p.fresh
       FOR UPDATE OF x SKIP LOCKED
),
new AS (
    SELECT o.id, o.topic, o.ordering_key, o.payload, o.headers, o.event_id, o.created_at,
           o.attempts, o.published_at IS NULL AND o.dead_at IS NULL AS pending,
           -- 0 while the ids run on from the cursor without a gap; a gap may be a writer still
           -- open (its id drawn before its xid): stop before it, the slow path keeps holes.
           o.id - cur.position - row_number() OVER (ORDER BY o.id) AS gap,
           -- a pending row not due yet (written with a delay) stops the prefix as well (by the
           -- clock, not now(): in C3's settle + claim, now() is the settle's start, before a
           -- row committed since was written)
           bool_and(o.published_at IS NOT NULL OR o.dead_at IS NOT NULL
                    OR o.next_attempt_at <= clock_timestamp()) OVER (ORDER BY o.id) AS due
      FROM cur CROSS JOIN LATERAL (
          SELECT * FROM "public".outbox o WHERE o.id > cur.position ORDER BY o.id LIMIT $1) o
),
take AS (
    SELECT * FROM new WHERE gap = 0 AND due
),
g AS (
    SELECT coalesce(t.ordering_key, t.id::text) AS wk, t.ordering_key IS NULL AS kl,
           min(t.id) AS first, max(t.id) AS last
      FROM take t WHERE t.pending GROUP BY 1, 2
),
leased AS (
    -- A new key is leased to this claim; a key with a work row (held by a live claim: the probes
    -- say no other kind exists, or a concurrent discovery made one) is not taken, its owner's
    -- settle finds these rows through last_seen. DO UPDATE, not DO NOTHING: the upsert locks and
    -- writes the latest version, also of a work row this snapshot does not see.
    INSERT INTO "public".outbox_work AS w (keyless, ordering_key, head_id, claim_token,
                                           claim_owner, claim_expires_at, claim_first, last_seen)
    SELECT g.kl, g.wk, CASE WHEN g.kl THEN g.first ELSE g.last + 1 END, $2::uuid, $3::text,
           now() + $4::float8 * interval '1 second', g.first, g.last
      FROM g ORDER BY g.wk, g.kl
    ON CONFLICT (ordering_key, keyless) DO UPDATE
       SET last_seen = greatest(coalesce(w.last_seen, 0), excluded.last_seen)
    RETURNING w.ordering_key, w.keyless, w.claim_token IS NOT DISTINCT FROM $2::uuid AS mine
),
moved AS (
    UPDATE "public".outbox_cursor x SET position = m.top
      FROM (SELECT max(t.id) AS top FROM take t) m
     WHERE x.one AND m.top IS NOT NULL
       AND EXISTS (SELECT 1 FROM cur)
)
SELECT t.id, t.topic, t.ordering_key, t.payload, t.headers, t.event_id, t.created_at, t.attempts,
       false AS reclaimed
  FROM take t
  JOIN leased l ON l.mine AND l.ordering_key = coalesce(t.ordering_key, t.id::text)
               AND l.keyless = (t.ordering_key IS NULL)
 WHERE t.pending
UNION ALL
-- Not steady (or rows above the cursor but none at its next id): the slow path's turn (why, in
-- the topic column).
SELECT NULL, CASE WHEN NOT p.steady THEN 'unsteady' ELSE 'gap or not due' END, NULL, NULL, NULL, NULL, NULL,
       NULL, NULL
  FROM probe p
 WHERE NOT p.steady OR (p.fresh AND EXISTS (SELECT 1 FROM cur) AND NOT EXISTS (SELECT 1 FROM take))
ORDER BY 1

-- @settle
WITH k AS (
    SELECT coalesce(u.k, u.id::text) AS wk, u.k IS NULL AS kl, array_agg(u.id) AS ids
      FROM unnest($2::bigint[], $3::text[]) AS u(id, k)
     GROUP BY 1, 2 ORDER BY 1, 2
),
mine AS (
    -- The batch's work rows, fenced by the token, locked in key order (as every claim and
    -- settle), each by its primary key. A claim that passed a later row of the key while this
    -- waited wrote last_seen: the locked version shows it.
    SELECT w.ordering_key, w.keyless, w.head_id, w.last_seen, k.ids
      FROM k CROSS JOIN LATERAL (
           SELECT w.ordering_key, w.keyless, w.head_id, w.last_seen FROM "public".outbox_work w
            WHERE w.ordering_key = k.wk AND w.keyless = k.kl AND w.claim_token = $1::uuid
              FOR UPDATE OF w) w
),
decide AS (
    -- more: a pending row of the key waits at or below the cursor (seen by a discovery while
    -- this batch held the key). Rows above the cursor are the next discovery's: it leases the
    -- key again.
    SELECT m.ordering_key, m.keyless,
           NOT m.keyless AND (coalesce(m.last_seen, 0) >= m.head_id OR EXISTS (
               SELECT 1 FROM "public".outbox o
                WHERE o.ordering_key = m.ordering_key AND o.id >= m.head_id
                  AND o.id <= (SELECT x.position FROM "public".outbox_cursor x WHERE x.one)
                  AND o.published_at IS NULL AND o.dead_at IS NULL)) AS more
      FROM mine m
),
gone AS (
    DELETE FROM "public".outbox_work w USING decide d
     WHERE w.ordering_key = d.ordering_key AND w.keyless = d.keyless AND NOT d.more
),
kept AS (
    -- The key is ready work from its head (the slow claim takes its run).
    UPDATE "public".outbox_work w
       SET claim_token = NULL, claim_owner = NULL, claim_expires_at = NULL, claim_first = NULL,
           state = 'r', not_before = '-infinity'
      FROM decide d
     WHERE w.ordering_key = d.ordering_key AND w.keyless = d.keyless AND d.more
)
UPDATE "public".outbox o
   SET published_at = now(), lease_owner = $4::text
 WHERE o.id = ANY (ARRAY(SELECT unnest(m.ids) FROM mine m)) AND o.dead_at IS NULL
RETURNING o.id
