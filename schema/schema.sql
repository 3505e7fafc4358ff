-- outbox-dispatcher: the full current schema (version 10). Equivalent to applying every file in
-- migrations/ in order; tests/integration/test_schema.py proves it. Placeholders as in the migrations.

CREATE TABLE IF NOT EXISTS ${schema}.${table}_schema_version (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- Writers may only store headers the dispatcher can copy to Kafka unchanged. Strict mode: a lax
-- path would unwrap arrays and let {"a": ["x"]} pass.
CREATE FUNCTION ${schema}.${table}_headers_valid(headers jsonb) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN jsonb_typeof(headers) = 'object'
        AND NOT jsonb_path_exists(headers, 'strict $.* ? (@.type() != "string")');

CREATE TABLE ${schema}.${table} (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Writer-facing columns.
    topic text,
    ordering_key text,
    payload bytea,
    headers jsonb NOT NULL DEFAULT '{}'::jsonb,
    event_id uuid NOT NULL DEFAULT gen_random_uuid(),
    created_at timestamptz NOT NULL DEFAULT now(),
    -- Dispatcher-owned bookkeeping.
    attempts integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    lease_owner text,
    lease_token uuid,
    lease_expires_at timestamptz,
    published_at timestamptz,
    dead_at timestamptz,
    last_error text,
    pending_since timestamptz,
    CONSTRAINT ${table}_event_id_key UNIQUE (event_id),
    -- `+` and a length, not `{1,249}`: a bounded repetition makes PostgreSQL's regex automaton
    -- 249 states long, about 19 us per row, the largest single cost of a writer's INSERT.
    CONSTRAINT ${table}_topic_valid CHECK (
        topic ~ '^[A-Za-z0-9._-]+$' AND length(topic) <= 249 AND topic NOT IN ('.', '..')
    ),
    -- Internal topic names (__consumer_offsets, ...) belong to the broker.
    CONSTRAINT ${table}_topic_not_internal CHECK (left(topic, 2) <> '__'),
    CONSTRAINT ${table}_headers_valid CHECK (${schema}.${table}_headers_valid(headers)),
    -- Indexed twice; PostgreSQL's own refusal of long index entries names nothing useful.
    CONSTRAINT ${table}_ordering_key_length CHECK (octet_length(ordering_key) <= 2048),
    CONSTRAINT ${table}_not_published_and_dead CHECK (published_at IS NULL OR dead_at IS NULL)
);

-- A hot queue table: vacuum early and often, and leave room on each page so that claims
-- (which touch no indexed column) can be HOT updates.
ALTER TABLE ${schema}.${table} SET (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 1
);

COMMENT ON TABLE ${schema}.${table} IS
    'Transactional outbox: insert a row in the same transaction as the business change; outbox-dispatcher publishes it to Kafka.';
COMMENT ON COLUMN ${schema}.${table}.topic IS
    'Kafka topic (writer); NULL lets the dispatcher route the row by its topic template or default topic.';
COMMENT ON COLUMN ${schema}.${table}.ordering_key IS
    'Kafka record key and unit of ordering; NULL means no ordering (writer).';
COMMENT ON COLUMN ${schema}.${table}.payload IS 'Kafka record value, any serialization; NULL is a tombstone (writer).';
COMMENT ON COLUMN ${schema}.${table}.headers IS 'JSON object of string values, copied to Kafka headers (writer).';
COMMENT ON COLUMN ${schema}.${table}.event_id IS 'Idempotency key, sent in the event-id header (writer, defaulted).';
COMMENT ON COLUMN ${schema}.${table}.attempts IS
    'Failed publish attempts that count towards max_attempts (dispatcher). Broker outages do not count.';
COMMENT ON COLUMN ${schema}.${table}.next_attempt_at IS 'Earliest time of the next attempt, by the database clock (dispatcher).';
COMMENT ON COLUMN ${schema}.${table}.lease_owner IS 'Dispatcher instance that last claimed the row (dispatcher).';
COMMENT ON COLUMN ${schema}.${table}.lease_token IS 'Fencing token of the current claim; every update of a claimed row names it (dispatcher).';
COMMENT ON COLUMN ${schema}.${table}.lease_expires_at IS 'The claim ends at this database time unless its owner extends it (dispatcher).';
COMMENT ON COLUMN ${schema}.${table}.published_at IS 'Set only after the broker acknowledged the record (dispatcher).';
COMMENT ON COLUMN ${schema}.${table}.dead_at IS 'Dead-lettered: never published, see last_error (dispatcher).';
COMMENT ON COLUMN ${schema}.${table}.last_error IS 'Why the last attempt failed or why the row was dead-lettered (dispatcher).';
COMMENT ON COLUMN ${schema}.${table}.pending_since IS
    'When an operator made the row pending again (requeue, replay, release of a held row), by the database clock (dispatcher); NULL: pending since it was written.';

-- The claim reads pending rows per key (the head and the run; rows without a key have an index of
-- their own, below) and dead rows per key (the "block" policy). Nothing else is indexed.
CREATE INDEX ${table}_pending_key_idx ON ${schema}.${table} (ordering_key, id)
    WHERE published_at IS NULL AND dead_at IS NULL;
CREATE INDEX ${table}_dead_key_idx ON ${schema}.${table} (ordering_key)
    WHERE dead_at IS NOT NULL;

-- One call to enqueue from any language, inside the caller's transaction.
CREATE FUNCTION ${schema}.${table}_enqueue(
    topic text,
    ordering_key text,
    payload bytea,
    headers jsonb DEFAULT '{}'::jsonb
) RETURNS uuid
    LANGUAGE sql
AS $fn$
    INSERT INTO ${schema}.${table} (topic, ordering_key, payload, headers)
    VALUES (topic, ordering_key, payload, coalesce(headers, '{}'::jsonb))
    RETURNING event_id;
$fn$;

-- JSON convenience: the payload is stored as the document's UTF-8 text.
CREATE FUNCTION ${schema}.${table}_enqueue_json(
    topic text,
    ordering_key text,
    payload jsonb,
    headers jsonb DEFAULT '{}'::jsonb
) RETURNS uuid
    LANGUAGE sql
AS $fn$
    SELECT ${schema}.${table}_enqueue(
        topic,
        ordering_key,
        CASE WHEN payload IS NULL THEN NULL ELSE convert_to(payload::text, 'UTF8') END,
        coalesce(headers, '{}'::jsonb) || '{"content-type": "application/json"}'::jsonb
    );
$fn$;

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

-- Claim engine (version 6): a per-key registry, the claim, the settle, the lease keeper and the
-- release of a lost claim. See schema/migrations/0006_claim_engine.sql for the why of each part.

CREATE TABLE ${schema}.${table}_key (
    key_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Not unique on purpose: two writers adding the same new key at once each add a row rather
    -- than one waiting for the other's commit (a unique key would make writers of a new key wait
    -- for each other, and could deadlock writers whose transactions add several new keys). The
    -- claim takes whichever rows of a key it can lock and acts on those only; rows of a key are
    -- all forgotten together once it has nothing pending.
    ordering_key text NOT NULL,
    -- A hint of the key's oldest pending row: keys are claimed oldest first.
    head_id bigint NOT NULL,
    -- The topic of that row: keys whose head is in a paused topic are passed over.
    head_topic text,
    -- The key is not claimable before this (its head waits out a backoff or a replay hold).
    not_before timestamptz NOT NULL DEFAULT '-infinity',
    -- The key has a dead row (holds it under dead_letter_policy=block).
    has_dead boolean NOT NULL DEFAULT false,
    -- The key's owner: the lease of the batch that holds its rows (the rows carry the same lease).
    lease_owner text,
    lease_token uuid,
    lease_expires_at timestamptz
);

ALTER TABLE ${schema}.${table}_key SET (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 500,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 1
);

COMMENT ON TABLE ${schema}.${table}_key IS
    'outbox-dispatcher bookkeeping: a row per ordering key that may have pending rows (kept by a trigger and by the dispatcher; never written by hand).';

CREATE INDEX ${table}_key_ordering_key_idx ON ${schema}.${table}_key (ordering_key);

-- Unleased keys, oldest head first (the claim's scan), and leased keys by expiry (takeovers).
CREATE INDEX ${table}_key_ready_idx ON ${schema}.${table}_key (head_id) WHERE lease_token IS NULL;
CREATE INDEX ${table}_key_leased_idx ON ${schema}.${table}_key (lease_expires_at)
    WHERE lease_token IS NOT NULL;

-- Dispatchers that wait for a wake-up (each refreshes its row while it waits, so a crashed one
-- stops costing writers a notification once `until` passes). Replaces version 1's trigger, which
-- notified on every statement (at most once per 50 ms per session).
CREATE TABLE ${schema}.${table}_waiting (
    owner text PRIMARY KEY,
    until timestamptz NOT NULL
);

-- Rows without an ordering key have no order: claimed straight from this index.
CREATE INDEX ${table}_pending_keyless_idx ON ${schema}.${table} (id)
    WHERE ordering_key IS NULL AND published_at IS NULL AND dead_at IS NULL;

-- Bucket of a key for the registry's writer locks (512 buckets, so a bulk load of any number of
-- keys takes at most 512 locks).
CREATE FUNCTION ${schema}.${table}_key_bucket(k text) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN hashtext(k) & 511;

-- Writers: make sure every key they add rows to has a registry row. A statement trigger, so one
-- call per INSERT statement whatever its row count. Each transaction holds a shared lock on the
-- buckets of its keys until it commits; the dispatcher forgets an emptied key only under the
-- exclusive lock of its bucket and in a snapshot taken after it, so it can never forget a key
-- whose new rows are not committed yet. SECURITY DEFINER: writers need no grant on the registry.
CREATE FUNCTION ${schema}.${table}_key_track() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('${schema}.${table}_key'), b.bucket)
       FROM (SELECT DISTINCT ${schema}.${table}_key_bucket(n.ordering_key) AS bucket
               FROM new_rows n
              WHERE n.ordering_key IS NOT NULL
              ORDER BY 1) b;
    -- Keys not registered yet. No unique index to conflict on: a writer never waits for another.
    INSERT INTO ${schema}.${table}_key (ordering_key, head_id, head_topic)
    SELECT DISTINCT ON (n.ordering_key) n.ordering_key, n.id, n.topic
      FROM new_rows n
     WHERE n.ordering_key IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM ${schema}.${table}_key k
                        WHERE k.ordering_key = n.ordering_key)
     ORDER BY n.ordering_key, n.id;
    -- The wake-up: only while a dispatcher has said that it waits for one (it polls meanwhile
    -- anyway); a busy dispatcher finds the rows by itself, and writers skip the notification,
    -- whose commit-time lock is what capped their commit rate.
    IF EXISTS (SELECT 1 FROM ${schema}.${table}_waiting w WHERE w.until > now()) THEN
        PERFORM pg_notify(TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, '');
    END IF;
    RETURN NULL;
END;
$fn$;

CREATE TRIGGER ${table}_key_track
    AFTER INSERT ON ${schema}.${table}
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION ${schema}.${table}_key_track();

-- Rows that become pending again (a dead row requeued, a published row replayed, a held row
-- released) and dead rows that go away (discard): register their keys, wake them up (their
-- not_before and head hints are stale) and refresh the dead flag. SECURITY DEFINER for the same
-- reason as the writer trigger.
CREATE FUNCTION ${schema}.${table}_key_touch(p_keys text[]) RETURNS void
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('${schema}.${table}_key'), b.bucket)
       FROM (SELECT DISTINCT ${schema}.${table}_key_bucket(u.k) AS bucket
               FROM unnest(p_keys) AS u(k) WHERE u.k IS NOT NULL ORDER BY 1) b;
    WITH heads AS (
        SELECT u.k, h.id, h.topic,
               EXISTS (SELECT 1 FROM ${schema}.${table} d
                        WHERE d.ordering_key = u.k AND d.dead_at IS NOT NULL) AS has_dead
          FROM (SELECT DISTINCT k FROM unnest(p_keys) AS x(k) WHERE k IS NOT NULL) u(k)
         CROSS JOIN LATERAL (
            SELECT o.id, o.topic FROM ${schema}.${table} o
             WHERE o.ordering_key >= u.k AND o.ordering_key <= u.k
                   AND o.published_at IS NULL AND o.dead_at IS NULL
             ORDER BY o.ordering_key, o.id LIMIT 1) h
    ),
    touched AS (
        UPDATE ${schema}.${table}_key k
           SET head_id = h.id, head_topic = h.topic, not_before = '-infinity',
               has_dead = h.has_dead
          FROM heads h
         WHERE k.ordering_key = h.k
           -- A replay touches one key once per row: write a new version only when something
           -- changed, or the key's row would grow a chain of versions as long as the replay.
           AND (k.head_id, k.head_topic, k.not_before, k.has_dead)
               IS DISTINCT FROM (h.id, h.topic, '-infinity', h.has_dead)
        RETURNING k.ordering_key
    )
    INSERT INTO ${schema}.${table}_key (ordering_key, head_id, head_topic, has_dead)
    SELECT h.k, h.id, h.topic, h.has_dead
      FROM heads h
     WHERE NOT EXISTS (SELECT 1 FROM ${schema}.${table}_key k WHERE k.ordering_key = h.k)
       AND NOT EXISTS (SELECT 1 FROM touched t WHERE t.ordering_key = h.k);
END;
$fn$;

-- Fires only on those transitions (the dispatcher's own claims and settles never match the WHEN
-- clauses), so operator commands keep the registry right whatever statement they use.
CREATE FUNCTION ${schema}.${table}_key_rearm() RETURNS trigger
    LANGUAGE plpgsql
AS $fn$
DECLARE
    v_key text := CASE WHEN TG_OP = 'DELETE' THEN OLD.ordering_key ELSE NEW.ordering_key END;
BEGIN
    -- As a writer would (see <table>_key_track): the key cannot be forgotten under us.
    PERFORM pg_advisory_xact_lock_shared(hashtext('${schema}.${table}_key'),
                                         ${schema}.${table}_key_bucket(v_key));
    -- One command touches a key once per row: once the key points at or before this row and is
    -- free to move (or, for a dead row removed, is not marked dead), there is nothing to do.
    IF TG_OP = 'DELETE' THEN
        IF NOT EXISTS (SELECT 1 FROM ${schema}.${table}_key k
                        WHERE k.ordering_key = v_key AND k.has_dead) THEN
            RETURN NULL;
        END IF;
    ELSIF EXISTS (SELECT 1 FROM ${schema}.${table}_key k
                   WHERE k.ordering_key = v_key AND k.head_id <= NEW.id
                     AND k.not_before = '-infinity' AND NOT k.has_dead) THEN
        RETURN NULL;
    END IF;
    PERFORM ${schema}.${table}_key_touch(ARRAY[v_key]);
    RETURN NULL;
END;
$fn$;

CREATE TRIGGER ${table}_key_rearm
    AFTER UPDATE OF published_at, dead_at, next_attempt_at ON ${schema}.${table}
    FOR EACH ROW
    WHEN (NEW.ordering_key IS NOT NULL AND NEW.published_at IS NULL AND NEW.dead_at IS NULL
          AND (OLD.published_at IS NOT NULL OR OLD.dead_at IS NOT NULL
               OR (NEW.next_attempt_at < OLD.next_attempt_at AND NEW.lease_token IS NULL)))
    EXECUTE FUNCTION ${schema}.${table}_key_rearm();

CREATE TRIGGER ${table}_key_rearm_dead
    AFTER DELETE ON ${schema}.${table}
    FOR EACH ROW
    WHEN (OLD.ordering_key IS NOT NULL AND OLD.dead_at IS NOT NULL)
    EXECUTE FUNCTION ${schema}.${table}_key_rearm();

-- Forget registry rows of keys that have no pending row (at most 64 per call). Only under the
-- exclusive lock of the key's bucket (no writer of it is in flight) and in a snapshot taken after
-- the lock; a key whose bucket is busy stays and is tried again by a later claim.
CREATE FUNCTION ${schema}.${table}_key_forget(p_keys text[]) RETURNS void
    LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    v_locked text[];
BEGIN
    IF p_keys IS NULL OR cardinality(p_keys) = 0 THEN
        RETURN;
    END IF;
    SELECT array_agg(u.k) INTO v_locked
      FROM (SELECT k FROM unnest(p_keys[1:64]) AS x(k) ORDER BY k) u(k)
     WHERE pg_try_advisory_xact_lock(hashtext('${schema}.${table}_key'),
                                     ${schema}.${table}_key_bucket(u.k));
    IF v_locked IS NULL THEN
        RETURN;
    END IF;
    DELETE FROM ${schema}.${table}_key k
     WHERE k.ordering_key = ANY (v_locked)
       AND (k.lease_token IS NULL OR k.lease_expires_at <= now())
       AND NOT EXISTS (SELECT 1 FROM ${schema}.${table} o
                        WHERE o.ordering_key >= k.ordering_key
                          AND o.ordering_key <= k.ordering_key
                          AND o.published_at IS NULL AND o.dead_at IS NULL
                        ORDER BY o.ordering_key, o.id LIMIT 1);
END;
$fn$;

-- Per-key reads say `ordering_key >= k AND ordering_key <= k`, not `= k`, and order by
-- (ordering_key, id): with an equality the planner drops the key from the ordering and may walk the
-- primary key by id, filtering on the key, which reads every row of a stuck key (the oldest rows)
-- for every other key; the range keeps (ordering_key, id) the only order an index provides.

-- The claim: one round trip, one short transaction, several statements (each its own snapshot).
--
-- 1. Keys: up to p_max_keys unleased keys whose hints say they can move (due, not blocked under
--    `block`, head not in a paused topic), oldest head first, plus keys whose lease expired (their
--    owner died), each locked FOR UPDATE SKIP LOCKED: another claim's keys are skipped, never
--    waited for, and each claimer finds keys of its own. No advisory locks.
-- 2. Rows: each key's oldest pending rows (a fair share of p_limit per key), re-checked one by one
--    by primary key under FOR UPDATE SKIP LOCKED (pending, due, lease free or expired, topic not
--    paused, not a crash loop, no dead row of the key under `block`); a row that fails ends its
--    key's run here, so a run is always a prefix with no gap. Rows without a key come from their
--    own index. The oldest p_limit rows are leased (rows and keys, one token chosen by the
--    dispatcher, so that a claim whose reply was lost can be released by that token).
-- 3. Keys that yielded nothing get their hints repaired from their head row, or are forgotten if
--    they have no pending row.
CREATE FUNCTION ${schema}.${table}_claim_keys(
    p_limit integer,
    p_max_keys integer,
    p_owner text,
    p_lease_seconds double precision,
    p_token uuid,
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
    v_paused text[];
    v_keys text[];           -- the keys this claim locked, oldest head first
    v_key_ids bigint[];      -- the registry rows it locked (a key may have more than one)
    v_per_key integer;
    v_idle text[];
    v_empty text[];
BEGIN
    SELECT array_agg(p.topic) INTO v_paused FROM ${schema}.${table}_paused p;
    IF '*' = ANY (v_paused) THEN
        RETURN;
    END IF;

    WITH ready AS (
        SELECT k.key_id, k.ordering_key, k.head_id
          FROM ${schema}.${table}_key k
         WHERE k.lease_token IS NULL
           AND k.not_before <= now()
           AND NOT (p_block_on_dead AND k.has_dead)
           AND (v_paused IS NULL OR k.head_topic IS NULL OR k.head_topic <> ALL (v_paused))
         ORDER BY k.head_id
         LIMIT p_max_keys
           FOR UPDATE SKIP LOCKED
    ),
    expired AS (
        SELECT k.key_id, k.ordering_key, k.head_id
          FROM ${schema}.${table}_key k
         WHERE k.lease_token IS NOT NULL
           AND k.lease_expires_at <= now()
         ORDER BY k.lease_expires_at
         LIMIT p_max_keys
           FOR UPDATE SKIP LOCKED
    ),
    mine AS (
        SELECT * FROM ready UNION ALL SELECT * FROM expired
    )
    SELECT (SELECT array_agg(m.key_id) FROM mine m),
           (SELECT array_agg(g.k ORDER BY g.h)
              FROM (SELECT m.ordering_key AS k, min(m.head_id) AS h FROM mine m GROUP BY 1) g)
      INTO v_key_ids, v_keys;

    v_per_key := greatest(1, ceil(p_limit::numeric / greatest(1, coalesce(cardinality(v_keys), 0))))::integer;

    RETURN QUERY
    WITH cand AS (
        SELECT r.id, u.k AS ordering_key
          FROM unnest(coalesce(v_keys, '{}'::text[])) AS u(k)
         CROSS JOIN LATERAL (
            SELECT o.id FROM ${schema}.${table} o
             WHERE o.ordering_key >= u.k AND o.ordering_key <= u.k
               AND o.published_at IS NULL AND o.dead_at IS NULL
             ORDER BY o.ordering_key, o.id
             LIMIT v_per_key) r
         WHERE NOT (p_block_on_dead AND EXISTS (
                SELECT 1 FROM ${schema}.${table} d
                 WHERE d.ordering_key = u.k AND d.dead_at IS NOT NULL))
    ),
    locked AS (
        -- One primary-key probe per candidate row, whatever the statistics say.
        SELECT x.id, x.ordering_key, x.old_lease
          FROM cand c
         CROSS JOIN LATERAL (
            SELECT o.id, o.ordering_key, o.lease_expires_at AS old_lease
              FROM ${schema}.${table} o
             WHERE o.id = c.id
               AND o.published_at IS NULL AND o.dead_at IS NULL
               AND (o.lease_expires_at IS NULL OR o.lease_expires_at <= now())
               AND o.next_attempt_at <= now()
               AND (v_paused IS NULL OR o.topic IS NULL OR o.topic <> ALL (v_paused))
               -- A row whose owners keep dying with it is left to the reclaimer to dead-letter.
               AND NOT (o.lease_expires_at IS NOT NULL AND o.attempts + 1 >= p_max_attempts)
               FOR UPDATE OF o SKIP LOCKED
         ) x
    ),
    gaps AS (
        SELECT c.ordering_key, min(c.id) AS first_gap
          FROM cand c
         WHERE NOT EXISTS (SELECT 1 FROM locked l WHERE l.id = c.id)
         GROUP BY c.ordering_key
    ),
    keyless AS (
        SELECT o.id, NULL::text AS ordering_key, o.lease_expires_at AS old_lease
          FROM ${schema}.${table} o
         WHERE o.ordering_key IS NULL AND o.published_at IS NULL AND o.dead_at IS NULL
           AND (o.lease_expires_at IS NULL OR o.lease_expires_at <= now())
           AND o.next_attempt_at <= now()
           AND (v_paused IS NULL OR o.topic IS NULL OR o.topic <> ALL (v_paused))
           AND NOT (o.lease_expires_at IS NOT NULL AND o.attempts + 1 >= p_max_attempts)
         ORDER BY o.id
         LIMIT p_limit
           FOR UPDATE OF o SKIP LOCKED
    ),
    taken AS (
        -- The oldest p_limit rows: dropping a key's newest rows keeps its run a prefix.
        SELECT t.id, t.ordering_key, t.old_lease
          FROM (SELECT l.id, l.ordering_key, l.old_lease
                  FROM locked l
                  LEFT JOIN gaps g ON g.ordering_key = l.ordering_key
                 WHERE g.first_gap IS NULL OR l.id < g.first_gap
                UNION ALL
                SELECT n.id, n.ordering_key, n.old_lease FROM keyless n) t
         ORDER BY t.id
         LIMIT p_limit
    ),
    leased_keys AS (
        UPDATE ${schema}.${table}_key k
           SET lease_owner = p_owner,
               lease_token = p_token,
               lease_expires_at = now() + p_lease_seconds * interval '1 second'
         WHERE k.key_id = ANY (v_key_ids)
           AND k.ordering_key IN (SELECT t.ordering_key FROM taken t WHERE t.ordering_key IS NOT NULL)
    ),
    claimed AS (
        UPDATE ${schema}.${table} o
           SET lease_owner = p_owner,
               lease_token = p_token,
               lease_expires_at = now() + p_lease_seconds * interval '1 second',
               -- Taking over an expired lease means its owner died or hung mid-publish.
               attempts = o.attempts + CASE WHEN t.old_lease IS NULL THEN 0 ELSE 1 END
          FROM taken t
         WHERE o.id = t.id
     RETURNING o.id, o.topic, o.ordering_key, o.payload, o.headers, o.event_id, o.created_at,
               o.attempts, o.lease_token, o.lease_expires_at, t.old_lease IS NOT NULL
    )
    SELECT * FROM claimed ORDER BY 1;

    IF v_keys IS NULL THEN
        RETURN;
    END IF;

    -- Keys this claim locked but did not lease: their hints were stale. Point them at their head
    -- row (its due time, live lease, topic, dead flag), or forget them if they have none.
    SELECT array_agg(u.k) INTO v_idle
      FROM unnest(v_keys) AS u(k)
     WHERE NOT EXISTS (SELECT 1 FROM ${schema}.${table}_key k
                        WHERE k.key_id = ANY (v_key_ids) AND k.ordering_key = u.k
                          AND k.lease_token = p_token);
    IF v_idle IS NULL THEN
        RETURN;
    END IF;
    WITH heads AS (
        SELECT u.k, h.id, h.topic,
               greatest(h.next_attempt_at,
                        CASE WHEN h.lease_expires_at > now() THEN h.lease_expires_at END)
                   AS not_before
          FROM unnest(v_idle) AS u(k)
         CROSS JOIN LATERAL (
            SELECT o.id, o.topic, o.next_attempt_at, o.lease_expires_at
              FROM ${schema}.${table} o
             WHERE o.ordering_key >= u.k AND o.ordering_key <= u.k
               AND o.published_at IS NULL AND o.dead_at IS NULL
             ORDER BY o.ordering_key, o.id LIMIT 1) h
    )
    UPDATE ${schema}.${table}_key k
       SET head_id = h.id,
           head_topic = h.topic,
           not_before = coalesce(h.not_before, '-infinity'),
           has_dead = EXISTS (SELECT 1 FROM ${schema}.${table} d
                               WHERE d.ordering_key = h.k AND d.dead_at IS NOT NULL),
           lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
      FROM heads h
     WHERE k.ordering_key = h.k AND k.key_id = ANY (v_key_ids);

    SELECT array_agg(u.k) INTO v_empty
      FROM unnest(v_idle) AS u(k)
     WHERE NOT EXISTS (SELECT 1 FROM ${schema}.${table} o
                        WHERE o.ordering_key >= u.k AND o.ordering_key <= u.k
                          AND o.published_at IS NULL AND o.dead_at IS NULL
                        ORDER BY o.ordering_key, o.id LIMIT 1);
    PERFORM ${schema}.${table}_key_forget(v_empty);
END;
$fn$;

-- The settle: record one batch's outcomes, fenced by its token, then release its keys (pointing
-- each at its new head, or forgetting it when it has none). Lock order everywhere: registry rows
-- (sorted by key) before outbox rows, so the mark, the lease keeper and the claim never deadlock.
-- A row the reclaimer dead-lettered as a crash loop keeps the token of the lease it ended (version
-- 9): its owner was alive after all, and its late mark may record a publication (the broker
-- acknowledged it: the row is in Kafka), nothing else; its key's dead flag is then refreshed.
CREATE FUNCTION ${schema}.${table}_settle(
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

-- The lease keeper: extend only live leases of the caller's tokens (an expired lease may already
-- belong to someone else). Keys first, in key order, like the settle.
CREATE FUNCTION ${schema}.${table}_extend(
    p_ids bigint[],
    p_tokens uuid[],
    p_seconds double precision
) RETURNS SETOF bigint
    LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    PERFORM 1 FROM ${schema}.${table}_key k
      JOIN (SELECT DISTINCT o.ordering_key, r.token
              FROM unnest(p_ids, p_tokens) AS r(id, token)
              JOIN ${schema}.${table} o ON o.id = r.id
             WHERE o.ordering_key IS NOT NULL) x
        ON x.ordering_key = k.ordering_key AND x.token = k.lease_token
     WHERE k.lease_expires_at > now()
     ORDER BY k.ordering_key
       FOR UPDATE OF k;

    UPDATE ${schema}.${table}_key k
       SET lease_expires_at = now() + p_seconds * interval '1 second'
      FROM (SELECT DISTINCT o.ordering_key, r.token
              FROM unnest(p_ids, p_tokens) AS r(id, token)
              JOIN ${schema}.${table} o ON o.id = r.id
             WHERE o.ordering_key IS NOT NULL
               AND o.lease_token = r.token AND o.lease_expires_at > now()) x
     WHERE k.ordering_key = x.ordering_key AND k.lease_token = x.token
       AND k.lease_expires_at > now();

    RETURN QUERY
    UPDATE ${schema}.${table} o
       SET lease_expires_at = now() + p_seconds * interval '1 second'
      FROM unnest(p_ids, p_tokens) AS r(id, token)
     WHERE o.id = r.id AND o.lease_token = r.token AND o.lease_expires_at > now()
    RETURNING o.id;
END;
$fn$;

-- A claim whose reply never arrived (the connection dropped after the commit): its dispatcher
-- knows the token it chose and gives the rows back at once, instead of stalling their keys for
-- a whole lease and counting an attempt.
CREATE FUNCTION ${schema}.${table}_release(p_token uuid) RETURNS integer
    LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    v_rows integer;
BEGIN
    PERFORM 1 FROM ${schema}.${table}_key k
     WHERE k.lease_token = p_token
     ORDER BY k.ordering_key
       FOR UPDATE;
    UPDATE ${schema}.${table}_key k
       SET lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL
     WHERE k.lease_token = p_token;
    UPDATE ${schema}.${table} o
       SET lease_token = NULL, lease_expires_at = NULL
     WHERE o.lease_token = p_token AND o.published_at IS NULL AND o.dead_at IS NULL;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    RETURN v_rows;
END;
$fn$;

-- A dispatcher of an older version still running when this migration commits stops with this
-- message at its next claim (nothing is lost: its leases expire and are taken over).
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
BEGIN
    RAISE EXCEPTION 'the outbox schema of % was upgraded to version 6 (claim engine v2); this dispatcher is older: upgrade outbox-dispatcher',
        '${schema}.${table}'
        USING ERRCODE = 'feature_not_supported';
END;
$fn$;

-- Every operator command that changes something leaves a row here, in the database rather than on
-- the operator's terminal: who (the database roles, which a client cannot spoof the way it can
-- $USER), from where, when, the command, its filter and how many rows it changed.
CREATE TABLE ${schema}.${table}_operator_audit (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    db_role text NOT NULL DEFAULT current_user,
    session_role text NOT NULL DEFAULT session_user,
    client_addr inet DEFAULT inet_client_addr(),
    command text NOT NULL,
    filter jsonb NOT NULL DEFAULT '{}'::jsonb,
    rows bigint NOT NULL
);

COMMENT ON TABLE ${schema}.${table}_operator_audit IS
    'Operator actions on the outbox (outbox-dispatcher dead requeue/discard, replay, pause, resume, cleanup): who by database role and client address, when, what, how many rows.';

-- Each running dispatcher records itself and beats here, so that `status` tells whether any is
-- alive and reads blocked keys under the dead-letter policy the dispatchers actually run with.
CREATE TABLE ${schema}.${table}_dispatchers (
    owner text PRIMARY KEY,
    dead_letter_policy text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE ${schema}.${table}_dispatchers IS
    'Running outbox-dispatcher processes (lease owner id, dead-letter policy, last heartbeat by the database clock); a row whose heartbeat is old is a dispatcher that died.';

-- Lag from a time the database sets (version 7): see schema/migrations/0007_lag.sql.
-- (seq, at): at time `at` (the statement's start, before its snapshot), no row with an id above
-- `seq` was committed yet. seq never decreases (the highest id may be deleted by retention).
CREATE TABLE ${schema}.${table}_clock (
    seq bigint NOT NULL,
    at timestamptz NOT NULL
);

CREATE INDEX ${table}_clock_seq_idx ON ${schema}.${table}_clock (seq, at);

COMMENT ON TABLE ${schema}.${table}_clock IS
    'outbox-dispatcher bookkeeping: the highest committed id at a database time, noted by every dispatcher each metrics interval; the lag of a row is measured from these (never written by hand).';

-- When a pending row started waiting, by the database's clock: its created_at, but never before
-- the last clock entry that did not see it committed (a backdated created_at cannot fake lag) and
-- never after the first entry that did (a created_at in the future cannot hide it); a row an
-- operator made pending again waits from then (pending_since). Rows older than the first entry
-- (written before version 7) have no lower bound: their created_at is believed.
CREATE FUNCTION ${schema}.${table}_pending_since(
    p_id bigint,
    p_created_at timestamptz,
    p_pending_since timestamptz
) RETURNS timestamptz
    LANGUAGE sql STABLE PARALLEL SAFE
    RETURN greatest(
        CASE WHEN p_pending_since IS NOT NULL THEN least(p_pending_since, now())
             ELSE least(p_created_at,
                        coalesce((SELECT c.at FROM ${schema}.${table}_clock c
                                   WHERE c.seq >= p_id ORDER BY c.seq, c.at LIMIT 1), now()))
        END,
        (SELECT c.at FROM ${schema}.${table}_clock c
          WHERE c.seq < p_id ORDER BY c.seq DESC, c.at DESC LIMIT 1));

INSERT INTO ${schema}.${table}_clock (seq, at)
SELECT coalesce(max(o.id), 0), statement_timestamp() FROM ${schema}.${table} o;

-- The operator console v2 (version 10): see schema/migrations/0010_console.sql.

-- 1. An operator action is recorded before its first batch and kept true batch by batch: `rows`
-- is what the action changed so far, in the same transaction as each batch, and `status` says how
-- it ended. While it runs, the connection that runs it holds the advisory lock (key, id) (the key
-- is the table's, outbox_dispatcher.operate.session.audit_lock_key): a record still `running`
-- whose lock nobody holds was cut off (its process died), and is read as `interrupted`.
ALTER TABLE ${schema}.${table}_operator_audit
    ADD COLUMN status text NOT NULL DEFAULT 'done',
    ADD COLUMN expected bigint,
    ADD COLUMN bound jsonb,
    ADD COLUMN identity text,
    ADD COLUMN identity_source text,
    ADD COLUMN request_key text,
    ADD COLUMN updated_at timestamptz,
    ADD COLUMN finished_at timestamptz,
    ADD COLUMN detail text,
    ADD COLUMN first_id bigint,
    ADD COLUMN last_id bigint,
    ADD COLUMN abort_requested_at timestamptz,
    ADD COLUMN abort_requested_by text,
    ADD CONSTRAINT ${table}_operator_audit_status_valid
        CHECK (status IN ('running', 'done', 'aborted', 'interrupted', 'failed'));

COMMENT ON COLUMN ${schema}.${table}_operator_audit.rows IS
    'Rows the action changed: kept true batch by batch while it runs (status running).';
COMMENT ON COLUMN ${schema}.${table}_operator_audit.status IS
    'running, done, aborted (an operator stopped it), interrupted (its process was stopped or died), failed.';
COMMENT ON COLUMN ${schema}.${table}_operator_audit.bound IS
    'What the action was confirmed for: ids up to max_id, in their state before `before`, at most `rows` rows.';
COMMENT ON COLUMN ${schema}.${table}_operator_audit.identity IS
    'Who, as the console knows them: a user named by a trusted proxy (identity_source proxy), or a holder of the console token (login, bearer); NULL from the CLI (see db_role).';

-- A second click (or a retried request) with the same key finds the first run instead of
-- starting another.
CREATE UNIQUE INDEX ${table}_operator_audit_request_idx
    ON ${schema}.${table}_operator_audit (request_key) WHERE request_key IS NOT NULL;
CREATE INDEX ${table}_operator_audit_running_idx
    ON ${schema}.${table}_operator_audit (id) WHERE status = 'running';

-- A record changes only while it runs, and then only its progress: what was asked, by whom and
-- when stay as written, the count never goes down, and a finished record is final.
CREATE FUNCTION ${schema}.${table}_operator_audit_guard() RETURNS trigger
    LANGUAGE plpgsql
AS $fn$
BEGIN
    IF OLD.status <> 'running' THEN
        RAISE EXCEPTION 'operator audit record % is final (%): it cannot be changed', OLD.id, OLD.status
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF (NEW.id, NEW.at, NEW.db_role, NEW.session_role, NEW.client_addr, NEW.command, NEW.filter,
        NEW.expected, NEW.bound, NEW.identity, NEW.identity_source, NEW.request_key)
       IS DISTINCT FROM
       (OLD.id, OLD.at, OLD.db_role, OLD.session_role, OLD.client_addr, OLD.command, OLD.filter,
        OLD.expected, OLD.bound, OLD.identity, OLD.identity_source, OLD.request_key)
       OR NEW.rows < OLD.rows THEN
        RAISE EXCEPTION 'operator audit record %: only its progress and outcome may change', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END;
$fn$;

CREATE TRIGGER ${table}_operator_audit_guard
    BEFORE UPDATE ON ${schema}.${table}_operator_audit
    FOR EACH ROW EXECUTE FUNCTION ${schema}.${table}_operator_audit_guard();

-- 2. The console's logins: a session is a row here, so that logging out and expiry end it for
-- every copy of its cookie. `id` is the SHA-256 of the random key the cookie carries (the key
-- itself is stored nowhere); `token_tag` says which console token it logged in with, so that a
-- new token ends every session.
CREATE TABLE ${schema}.${table}_console_session (
    id bytea PRIMARY KEY,
    identity text NOT NULL,
    client_addr text,
    token_tag text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    ended_at timestamptz
);

CREATE INDEX ${table}_console_session_expires_idx
    ON ${schema}.${table}_console_session (expires_at);

COMMENT ON TABLE ${schema}.${table}_console_session IS
    'Operator console logins (outbox-dispatcher console): ended by logout, expiry or a new console token.';

-- 3. What each dispatcher reports with its heartbeat: its version, and its counters of rows
-- published and dead-lettered since it started (the console charts their rates).
ALTER TABLE ${schema}.${table}_dispatchers
    ADD COLUMN version text,
    ADD COLUMN published_total bigint,
    ADD COLUMN dead_total bigint;

-- 4. How often a row was published: a replay counts here (the row is published once more when it
-- goes out again). A constant default: no table rewrite, nothing for writers to write.
ALTER TABLE ${schema}.${table} ADD COLUMN replays integer NOT NULL DEFAULT 0;

COMMENT ON COLUMN ${schema}.${table}.replays IS
    'Times an operator replayed the row (outbox-dispatcher replay): it was published replays + 1 times once published again (dispatcher).';

-- 5. Dead rows by id and by time of death, for the console's pages (keyset paging, totals,
-- groups). Partial: a writer's row is never dead, so an insert only evaluates the predicate; a
-- row that dies gets two index entries (the settle that kills it already updates indexed
-- columns, so no update that was HOT stops being HOT).
CREATE INDEX ${table}_dead_id_idx ON ${schema}.${table} (id) WHERE dead_at IS NOT NULL;
CREATE INDEX ${table}_dead_at_idx ON ${schema}.${table} (dead_at, id) WHERE dead_at IS NOT NULL;

INSERT INTO ${schema}.${table}_schema_version (version, name) VALUES (1, 'initial'), (2, 'routed_topic'),
    (3, 'operations'), (4, 'stricter_writer_checks'), (5, 'operator_safety'),
    (6, 'claim_engine'), (7, 'lag'), (8, 'lighter_writes_and_settles'), (9, 'late_marks'),
    (10, 'console')
    ON CONFLICT (version) DO NOTHING;
