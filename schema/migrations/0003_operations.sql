-- Version 3: operators pause publishing per topic or for the whole table
-- (`outbox-dispatcher pause` / `resume`), and the claim skips what is paused.

-- One row per pause. topic '*' (never a valid Kafka topic name) pauses the whole table, routed
-- rows included; any other value pauses that topic.
CREATE TABLE ${schema}.${table}_paused (
    topic text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text,
    reason text,
    CONSTRAINT ${table}_paused_topic_valid CHECK (
        topic = '*' OR (topic ~ '^[A-Za-z0-9._-]{1,249}$' AND topic NOT IN ('.', '..'))
    )
);

COMMENT ON TABLE ${schema}.${table}_paused IS
    'Paused topics of the outbox: the claim leaves their rows pending. Topic ''*'' pauses the whole table.';

-- The claim: one round trip, two snapshots.
--
-- Statement 1 reads the oldest p_scan pending rows in id order. A key's first row there is its
-- head (its oldest pending row), and its rows there are a prefix of its run, so everything the
-- claim needs is in that one index range scan. It takes, oldest key first, a transaction-scoped
-- advisory lock on as many keys whose head is due and unleased as the batch can fill (one row per
-- key when every key has one row waiting, fewer keys with longer runs under a backlog, so that
-- other claimers find keys too).
-- Statement 2 runs with a fresh snapshot (this function is VOLATILE, and READ COMMITTED gives each
-- statement its own), so it sees every lease committed by whoever held one of those keys before
-- us. It re-checks every picked row by primary key (still pending, unleased, due) under FOR UPDATE
-- SKIP LOCKED; a row that fails ends its key's run for this claim, so a key never has a gap and
-- never a second owner. The rest is leased, fenced by a fresh token, in one UPDATE.
--
-- Pauses (version 3): the paused set is read once per call. A whole-table pause ('*') returns
-- nothing. Rows of paused topics are left out of the scan, so that a paused backlog never fills
-- the window and holds back other topics; rows with a NULL topic (routed by the dispatcher) are
-- paused only with the whole table. A key with rows in several topics keeps its order: while
-- anything is paused, each ready key is probed once for its first pending row in a paused topic
-- before the end of its rows in the window; its run ends there, and the key waits when that row
-- comes before its head.
CREATE OR REPLACE FUNCTION ${schema}.${table}_claim(
    p_limit integer,
    p_scan integer,
    p_owner text,
    p_lease_seconds double precision,
    p_lock_space integer,
    p_block_on_dead boolean,
    p_max_attempts integer
) RETURNS TABLE (
    id bigint,
    topic text,
    ordering_key text,
    payload bytea,
    headers jsonb,
    event_id uuid,
    created_at timestamptz,
    attempts integer,
    lease_token uuid,
    lease_expires_at timestamptz,
    reclaimed boolean
)
    LANGUAGE plpgsql VOLATILE
AS $fn$
#variable_conflict use_column
DECLARE
    v_ids bigint[];          -- rows seen, in id order (keyed rows only)
    v_row_keys text[];       -- their keys
    v_keys text[];           -- keys whose head is ready, oldest first
    v_rows_per_key numeric;
    v_null_ids bigint[];
    v_per_key integer;
    v_token uuid := gen_random_uuid();
    v_paused text[];         -- paused topics; '*' is the whole table
    v_stop_keys text[];      -- keys with a paused row before the end of their rows in the window
    v_stop_ids bigint[];     -- that row
    v_held_keys text[];      -- keys whose head comes after such a row
BEGIN
    SELECT array_agg(p.topic) INTO v_paused FROM ${schema}.${table}_paused p;
    IF '*' = ANY (v_paused) THEN
        RETURN;
    END IF;

    WITH seen AS (
        SELECT o.id, o.ordering_key,
               o.next_attempt_at <= now()
               AND (o.lease_expires_at IS NULL OR o.lease_expires_at <= now()) AS ready
          FROM ${schema}.${table} o
         WHERE o.published_at IS NULL AND o.dead_at IS NULL
           AND (v_paused IS NULL OR o.topic IS NULL OR o.topic <> ALL (v_paused))
         ORDER BY o.id
         LIMIT p_scan
    ),
    heads AS (
        SELECT DISTINCT ON (s.ordering_key) s.ordering_key AS k, s.id AS first_id, s.ready
          FROM seen s
         WHERE s.ordering_key IS NOT NULL
         ORDER BY s.ordering_key, s.id
    )
    SELECT (SELECT array_agg(h.k ORDER BY h.first_id) FROM heads h
             WHERE h.ready
               AND NOT (p_block_on_dead AND EXISTS (
                    SELECT 1 FROM ${schema}.${table} d
                     WHERE d.ordering_key = h.k AND d.dead_at IS NOT NULL))),
           (SELECT count(*) FROM seen s WHERE s.ordering_key IS NOT NULL)::numeric
             / greatest(1, (SELECT count(*) FROM heads)),
           (SELECT array_agg(s.id ORDER BY s.id) FROM seen s WHERE s.ordering_key IS NOT NULL),
           (SELECT array_agg(s.ordering_key ORDER BY s.id) FROM seen s
             WHERE s.ordering_key IS NOT NULL),
           (SELECT array_agg(s.id ORDER BY s.id) FROM seen s
             WHERE s.ordering_key IS NULL AND s.ready)
      INTO v_keys, v_rows_per_key, v_ids, v_row_keys, v_null_ids;

    IF v_paused IS NOT NULL AND v_keys IS NOT NULL THEN
        SELECT array_agg(m.k), array_agg(m.stop_id),
               array_agg(m.k) FILTER (WHERE m.stop_id < m.first_id)
          INTO v_stop_keys, v_stop_ids, v_held_keys
          FROM (SELECT r.k, r.first_id,
                       (SELECT b.id FROM ${schema}.${table} b
                         WHERE b.ordering_key = r.k
                           AND b.published_at IS NULL AND b.dead_at IS NULL
                           AND b.id < r.last_id AND b.topic = ANY (v_paused)
                         ORDER BY b.id
                         LIMIT 1) AS stop_id
                  FROM (SELECT w.k, min(w.id) AS first_id, max(w.id) AS last_id
                          FROM unnest(v_ids, v_row_keys) AS w(id, k)
                          JOIN unnest(v_keys) AS mine(k) ON mine.k = w.k
                         GROUP BY w.k) r) m
         WHERE m.stop_id IS NOT NULL;
        IF v_stop_keys IS NOT NULL THEN
            SELECT array_agg(w.id ORDER BY w.id), array_agg(w.k ORDER BY w.id)
              INTO v_ids, v_row_keys
              FROM unnest(v_ids, v_row_keys) AS w(id, k)
              LEFT JOIN unnest(v_stop_keys, v_stop_ids) AS s(k, stop_id) ON s.k = w.k
             WHERE s.stop_id IS NULL OR w.id < s.stop_id;
            SELECT array_agg(u.k ORDER BY u.n) INTO v_keys
              FROM unnest(v_keys) WITH ORDINALITY AS u(k, n)
             WHERE NOT EXISTS (SELECT 1 FROM unnest(coalesce(v_held_keys, '{}'::text[])) AS h(k)
                                WHERE h.k = u.k);
        END IF;
    END IF;

    IF v_keys IS NULL AND v_null_ids IS NULL THEN
        RETURN;
    END IF;

    IF v_keys IS NOT NULL THEN
        -- Exactly one claimer owns a key at a time: the lock lasts until this claim commits, and
        -- the lease it writes carries the ownership while the rows are published. LIMIT stops
        -- taking locks once there are enough keys.
        SELECT array_agg(u.k) INTO v_keys
          FROM (SELECT k FROM unnest(v_keys) AS k
                 WHERE pg_try_advisory_xact_lock(p_lock_space, hashtext(k))
                 LIMIT greatest(1, ceil(p_limit / greatest(1, v_rows_per_key)))) u;
    END IF;
    v_per_key := ceil(p_limit::numeric / greatest(1, coalesce(cardinality(v_keys), 0)))::integer;

    RETURN QUERY
    WITH runs AS (
        SELECT w.id, w.k, row_number() OVER (PARTITION BY w.k ORDER BY w.id) AS n
          FROM unnest(v_ids, v_row_keys) AS w(id, k)
          JOIN unnest(coalesce(v_keys, '{}'::text[])) AS mine(k) ON mine.k = w.k
         WHERE NOT (p_block_on_dead AND EXISTS (  -- again, in this snapshot
                SELECT 1 FROM ${schema}.${table} d
                 WHERE d.ordering_key = w.k AND d.dead_at IS NOT NULL))
    ),
    picked AS (
        SELECT c.id, c.ordering_key
          FROM (SELECT r.id, r.k AS ordering_key FROM runs r WHERE r.n <= v_per_key
                UNION ALL
                SELECT n, NULL::text FROM unnest(coalesce(v_null_ids, '{}'::bigint[])) AS n) c
         ORDER BY c.id
         LIMIT p_limit
    ),
    locked AS (
        -- One primary-key probe per picked row, whatever the statistics say.
        SELECT x.id, x.ordering_key, x.old_lease
          FROM picked p
         CROSS JOIN LATERAL (
            SELECT o.id, o.ordering_key, o.lease_expires_at AS old_lease
              FROM ${schema}.${table} o
             WHERE o.id = p.id
               AND o.published_at IS NULL AND o.dead_at IS NULL
               AND (o.lease_expires_at IS NULL OR o.lease_expires_at <= now())
               AND o.next_attempt_at <= now()
               -- A row whose owners keep dying with it is left to the reclaimer to dead-letter.
               AND NOT (o.lease_expires_at IS NOT NULL AND o.attempts + 1 >= p_max_attempts)
               FOR UPDATE OF o SKIP LOCKED
         ) x
    ),
    gaps AS (
        SELECT p.ordering_key, min(p.id) AS first_gap
          FROM picked p
         WHERE p.ordering_key IS NOT NULL
           AND NOT EXISTS (SELECT 1 FROM locked l WHERE l.id = p.id)
         GROUP BY p.ordering_key
    ),
    taken AS (
        SELECT l.id, l.old_lease
          FROM locked l
          LEFT JOIN gaps g ON g.ordering_key = l.ordering_key
         WHERE g.first_gap IS NULL OR l.id < g.first_gap
    ),
    claimed AS (
        UPDATE ${schema}.${table} o
           SET lease_owner = p_owner,
               lease_token = v_token,
               lease_expires_at = now() + p_lease_seconds * interval '1 second',
               -- Taking over an expired lease means its owner died or hung mid-publish.
               attempts = o.attempts + CASE WHEN t.old_lease IS NULL THEN 0 ELSE 1 END
          FROM taken t
         WHERE o.id = t.id
     RETURNING o.id, o.topic, o.ordering_key, o.payload, o.headers, o.event_id, o.created_at,
               o.attempts, o.lease_token, o.lease_expires_at, t.old_lease IS NOT NULL
    )
    SELECT * FROM claimed ORDER BY 1;
END;
$fn$;

INSERT INTO ${schema}.${table}_schema_version (version, name) VALUES (3, 'operations')
    ON CONFLICT (version) DO NOTHING;
