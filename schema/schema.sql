-- outbox-dispatcher: the full current schema (version 5). Equivalent to applying every file in
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
    CONSTRAINT ${table}_event_id_key UNIQUE (event_id),
    CONSTRAINT ${table}_topic_valid CHECK (
        topic ~ '^[A-Za-z0-9._-]{1,249}$' AND topic NOT IN ('.', '..')
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

-- The claim reads unpublished, live rows in id order (the scan window) and per key (the head
-- and the run); dead rows per key (the "block" policy). Nothing else is indexed.
CREATE INDEX ${table}_pending_idx ON ${schema}.${table} (id)
    WHERE published_at IS NULL AND dead_at IS NULL;
CREATE INDEX ${table}_pending_key_idx ON ${schema}.${table} (ordering_key, id)
    WHERE published_at IS NULL AND dead_at IS NULL;
CREATE INDEX ${table}_dead_key_idx ON ${schema}.${table} (ordering_key)
    WHERE dead_at IS NOT NULL;

-- Wake-up hint for dispatchers: a notification per inserting statement, but at most one per
-- session every outbox_dispatcher.notify_cooldown_ms (default 50; 0 notifies every statement).
-- A committing transaction that notified holds a cluster-wide lock through its commit, so
-- notifying on every commit caps the writers' commit rate; a dispatcher keeps polling briefly
-- after each batch (linger), so the rows a cooldown leaves unannounced are found all the same.
-- The session setting is transactional: a rolled-back notification does not start a cooldown.
CREATE FUNCTION ${schema}.${table}_notify() RETURNS trigger
    LANGUAGE plpgsql
AS $fn$
DECLARE
    v_now double precision := extract(epoch FROM clock_timestamp());
    v_last text := current_setting('outbox_dispatcher.last_notify', true);
    v_cooldown text := current_setting('outbox_dispatcher.notify_cooldown_ms', true);
BEGIN
    IF v_last IS NULL OR v_last = ''
       OR v_now - v_last::double precision
          >= coalesce(nullif(v_cooldown, '')::double precision, 50) / 1000 THEN
        PERFORM pg_notify(TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, '');
        PERFORM set_config('outbox_dispatcher.last_notify', v_now::text, false);
    END IF;
    RETURN NULL;
END;
$fn$;

CREATE TRIGGER ${table}_notify
    AFTER INSERT ON ${schema}.${table}
    FOR EACH STATEMENT EXECUTE FUNCTION ${schema}.${table}_notify();

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
CREATE FUNCTION ${schema}.${table}_claim(
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

INSERT INTO ${schema}.${table}_schema_version (version, name) VALUES (1, 'initial'), (2, 'routed_topic'),
    (3, 'operations'), (4, 'stricter_writer_checks'), (5, 'operator_safety')
    ON CONFLICT (version) DO NOTHING;
