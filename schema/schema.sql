-- outbox-dispatcher: the full current schema (version 14). Equivalent to applying every file in
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

-- A hot queue table: vacuum early and often, and leave room on each page for the one update of a
-- row's life, its mark, to be HOT (same page: no index entry, only the changed bytes logged).
ALTER TABLE ${schema}.${table} SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 1,
    fillfactor = 50
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

-- The engine reads a key's rows in id order through <table>_key_rows_idx (below, with the rest of
-- the engine) and dead rows per key (the "block" policy; operators' lists). No index names a
-- column the settle writes: the mark of a published row is a HOT update.
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

-- Dispatchers that wait for a wake-up (each refreshes its row while it waits, so a crashed one
-- stops costing writers a notification once `until` passes). Replaces version 1's trigger, which
-- notified on every statement (at most once per 50 ms per session).
CREATE TABLE ${schema}.${table}_waiting (
    owner text PRIMARY KEY,
    until timestamptz NOT NULL
);

-- Claim engine v3 (versions 10 and 11): see schema/migrations/0010_claim_engine_v3.sql and
-- 0011_claim_engine_v3_contract.sql for the why of each part.

CREATE TABLE IF NOT EXISTS ${schema}.${table}_schema_steps (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE ${schema}.${table}_schema_steps IS
    'outbox-dispatcher schema versions from 10 on (version 9 and older read <table>_schema_version, which only a change that older dispatchers cannot run beside records).';

CREATE TABLE ${schema}.${table}_work (
    keyless boolean NOT NULL,
    -- The key; for a row without one, its id as text.
    ordering_key text NOT NULL,
    -- No pending row of the key below this one, except one that came late (a transaction that
    -- committed after a higher id of its key was seen: the claim that finds it lowers head_id).
    -- While leased: the row after the claim's last.
    head_id bigint NOT NULL,
    -- r: ready; w: waiting until not_before (backoff, a held row, a lease of version 9); p: its
    -- next row's topic (head_topic) is paused; b: blocked by a dead row (dead_letter_policy =
    -- block); x: its owners kept dying while publishing it (the reclaimer dead-letters the rows).
    state "char" NOT NULL DEFAULT 'r',
    not_before timestamptz NOT NULL DEFAULT '-infinity',
    head_topic text,
    -- State p: the pauses it was parked under (<table>_cursor.pause_gen then); once the pauses
    -- change, it is looked at again.
    paused_gen bigint,
    -- The key's owner: the claim whose batch holds its rows from claim_first to head_id - 1.
    claim_token uuid,
    claim_owner text,
    claim_expires_at timestamptz,
    claim_first bigint,
    PRIMARY KEY (ordering_key, keyless),
    CONSTRAINT ${table}_work_state_valid CHECK (state IN ('r', 'w', 'p', 'b', 'x'))
);

-- Updated twice per claim (lease, release): leave room for HOT updates.
ALTER TABLE ${schema}.${table}_work SET (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 500,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 1
);

COMMENT ON TABLE ${schema}.${table}_work IS
    'outbox-dispatcher bookkeeping: a row per ordering key (or per row without a key) with rows that may be pending, where they start and who holds them; written by dispatchers only, rebuilt from the table by outbox-dispatcher check --repair.';

-- What a claim takes, each in its order: ready keys oldest head first, waiting keys by due time,
-- leases that expired (their owner died) by expiry. Parked work (paused, blocked, crash loops) is
-- in none of them: a claim's cost does not grow with it.
CREATE INDEX ${table}_work_ready_idx ON ${schema}.${table}_work (head_id)
    WHERE claim_token IS NULL AND state = 'r';
CREATE INDEX ${table}_work_waiting_idx ON ${schema}.${table}_work (not_before)
    WHERE claim_token IS NULL AND state = 'w';
CREATE INDEX ${table}_work_claimed_idx ON ${schema}.${table}_work (claim_expires_at)
    WHERE claim_token IS NOT NULL;
-- Paused keys by the pauses they were parked under (after a pause or resume, those parked
-- before it are looked at again, once); blocked keys (a dispatcher that does not block takes
-- them); crash loops (the reclaimer).
CREATE INDEX ${table}_work_paused_idx ON ${schema}.${table}_work (paused_gen)
    WHERE claim_token IS NULL AND state = 'p';
CREATE INDEX ${table}_work_blocked_idx ON ${schema}.${table}_work (head_id)
    WHERE claim_token IS NULL AND state = 'b';
CREATE INDEX ${table}_work_looping_idx ON ${schema}.${table}_work (claim_expires_at)
    WHERE state = 'x';

CREATE TABLE ${schema}.${table}_cursor (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    position bigint NOT NULL DEFAULT 0,
    -- Holes: id ranges [lo, hi] at or below position not seen yet, each with the xmax of the
    -- snapshot that first found it and when (dropped once no transaction open then can still
    -- commit and hole_margin has passed).
    hole_lo bigint[] NOT NULL DEFAULT '{}',
    hole_hi bigint[] NOT NULL DEFAULT '{}',
    hole_xmax xid8[] NOT NULL DEFAULT '{}',
    hole_at timestamptz[] NOT NULL DEFAULT '{}',
    -- The sweep's place (it walks ids from here up to position, then starts over).
    swept bigint NOT NULL DEFAULT 0,
    sweep_started_at timestamptz NOT NULL DEFAULT now(),
    -- Version 9 dispatchers may run beside this one: claims also write and respect row leases.
    compat boolean NOT NULL DEFAULT false,
    -- Bumped by every change of <table>_paused (a trigger): keys parked under older pauses are
    -- looked at again.
    pause_gen bigint NOT NULL DEFAULT 0
);

COMMENT ON TABLE ${schema}.${table}_cursor IS
    'outbox-dispatcher bookkeeping: how far the dispatchers have looked at new rows (one row).';

INSERT INTO ${schema}.${table}_cursor DEFAULT VALUES;

CREATE TABLE ${schema}.${table}_changed (
    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id bigint NOT NULL,
    ordering_key text,
    -- The key before the change: a claim of that key may hold the row right now.
    old_key text
);

-- A row's earlier changes, for discovery (a row moved twice while in flight).
CREATE INDEX ${table}_changed_id_idx ON ${schema}.${table}_changed (id, seq);

COMMENT ON TABLE ${schema}.${table}_changed IS
    'outbox-dispatcher bookkeeping: rows whose key or topic changed, that became pending again, or dead rows removed; appended by a trigger, taken in by the next claim.';

-- The index the engine reads a key's rows through: every row of a key in id order, whatever its
-- state. No predicate on a column a settle writes, so that once version 9's partial indexes are
-- gone (version 11) the mark of a published row is a HOT update: no index entry, only the change
-- logged.
CREATE INDEX IF NOT EXISTS ${table}_key_rows_idx ON ${schema}.${table} (ordering_key, id)
    WHERE ordering_key IS NOT NULL;

-- Writers: appends the rows the engine must look at again. Fires only on those transitions.
CREATE FUNCTION ${schema}.${table}_note_change() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO ${schema}.${table}_changed (id, ordering_key, old_key)
        VALUES (OLD.id, OLD.ordering_key, OLD.ordering_key);
    ELSE
        INSERT INTO ${schema}.${table}_changed (id, ordering_key, old_key)
        VALUES (NEW.id, NEW.ordering_key, OLD.ordering_key);
    END IF;
    RETURN NULL;
END;
$fn$;

CREATE TRIGGER ${table}_note_change
    AFTER UPDATE OF ordering_key, topic, published_at, dead_at, next_attempt_at ON ${schema}.${table}
    FOR EACH ROW
    WHEN (NEW.published_at IS NULL AND NEW.dead_at IS NULL
          AND (OLD.ordering_key IS DISTINCT FROM NEW.ordering_key
               OR OLD.topic IS DISTINCT FROM NEW.topic
               OR OLD.published_at IS NOT NULL OR OLD.dead_at IS NOT NULL
               OR NEW.next_attempt_at < OLD.next_attempt_at))
    EXECUTE FUNCTION ${schema}.${table}_note_change();

CREATE TRIGGER ${table}_note_removed_dead
    AFTER DELETE ON ${schema}.${table}
    FOR EACH ROW
    WHEN (OLD.dead_at IS NOT NULL AND OLD.ordering_key IS NOT NULL)
    EXECUTE FUNCTION ${schema}.${table}_note_change();

-- A TRUNCATE empties the table (and may restart its ids): the engine's knowledge goes with it.
CREATE FUNCTION ${schema}.${table}_truncated() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    DELETE FROM ${schema}.${table}_work;
    DELETE FROM ${schema}.${table}_changed;
    UPDATE ${schema}.${table}_cursor
       SET position = 0, hole_lo = '{}', hole_hi = '{}', hole_xmax = '{}', hole_at = '{}',
           swept = 0, sweep_started_at = now();
    RETURN NULL;
END;
$fn$;

CREATE TRIGGER ${table}_truncated
    AFTER TRUNCATE ON ${schema}.${table}
    FOR EACH STATEMENT EXECUTE FUNCTION ${schema}.${table}_truncated();

-- Operators' pauses: any change, whoever makes it (the CLI, the console, plain SQL), makes the
-- claims look again at keys parked under the pauses before it. One write per statement.
CREATE FUNCTION ${schema}.${table}_pauses_changed() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    UPDATE ${schema}.${table}_cursor SET pause_gen = pause_gen + 1 WHERE one;
    RETURN NULL;
END;
$fn$;

CREATE TRIGGER ${table}_pauses_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON ${schema}.${table}_paused
    FOR EACH STATEMENT EXECUTE FUNCTION ${schema}.${table}_pauses_changed();


-- ---------------------------------------------------------------------------------------------
-- Discovery, by the claim that holds the cursor row (`c`): the rows above the cursor (at most
-- p_scan, in id order), the rows that filled a hole and the rows writers or operators changed.
-- Keys nobody knows yet are leased to this claim with their new rows, while the batch has room
-- (when every such row can go now), the others registered as ready work; keys already known are
-- locked FOR SHARE, so that no claim or settle drops one in an older snapshot while this
-- discovery relies on it, and their head is lowered for a row that came late. Returns the rows
-- leased.
CREATE FUNCTION ${schema}.${table}_discover(
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

-- ---------------------------------------------------------------------------------------------
-- The claim: one round trip, one short transaction.
-- 1. New rows, by the claim that gets the cursor when there are some (see <table>_discover).
-- 2. Known work, while the batch has room: keys whose lease expired (their owner died), due
--    waiting ones, ready ones oldest head first, paused ones whose topic was resumed, blocked
--    ones when this dispatcher does not block; each locked SKIP LOCKED (another claim's work is
--    skipped, never waited for). Then, in a new snapshot (taken after those locks: what a
--    previous owner settled is seen), each key's pending run from its head, cut at the first row
--    not due, in a paused topic, held by a version 9 lease, or (after a takeover) one whose
--    owners kept dying: a run is a prefix, never with a gap. A key taken over sends its orphans
--    (the rows its lost claim held, below the key's head) first, as far as the batch goes; then
--    each key gets its share of the batch, and the room that keys with fewer rows leave goes to
--    the oldest heads. Each key is then
--    leased with one write, or, when it yielded nothing, given the state of the row it stopped at,
--    or dropped when it has no pending row.
CREATE FUNCTION ${schema}.${table}_claim_work(
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

-- ---------------------------------------------------------------------------------------------
-- The settle: record one batch's outcomes, fenced by its token: only rows whose work (key, or
-- the row itself without one) is still held by the token change (locked first, in key order: the
-- claim, the lease keeper and discovery never deadlock with it). A row the reclaimer
-- dead-lettered as a crash loop keeps the token of the lease it ended: its owner was alive after
-- all, and its late mark may record a publication (the broker acknowledged it), nothing else.
-- Then, in a new snapshot, each key goes on from its first row of the batch still pending (a
-- retry, a row not attempted), else from its head: the state of that row, or the work is dropped
-- when no pending row is left. p_keys: each row's key (NULL: none), aligned with p_ids.
-- A late publication of rows the reclaimer dead-lettered under lease p_token (see settle_work):
-- recorded as published (or deleted), and a key that waited only on them is ready again.
CREATE FUNCTION ${schema}.${table}_settle_late(
    p_token uuid,
    p_owner text,
    p_ids bigint[],
    p_delete boolean
) RETURNS SETOF bigint
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off
AS $fn$
#variable_conflict use_column
DECLARE
    v_keys text[];
BEGIN
    SELECT array_agg(DISTINCT o.ordering_key) INTO v_keys
      FROM ${schema}.${table} o WHERE o.id = ANY (p_ids) AND o.ordering_key IS NOT NULL;
    PERFORM 1 FROM ${schema}.${table}_work x
     WHERE NOT x.keyless AND x.ordering_key = ANY (v_keys)
     ORDER BY x.ordering_key
       FOR UPDATE OF x;
    IF p_delete THEN
        RETURN QUERY
        DELETE FROM ${schema}.${table} o
         WHERE o.id = ANY (p_ids) AND o.dead_at IS NOT NULL AND o.lease_token = p_token
        RETURNING o.id;
    ELSE
        RETURN QUERY
        UPDATE ${schema}.${table} o
           SET published_at = now(), dead_at = NULL, lease_owner = p_owner,
               lease_token = NULL, lease_expires_at = NULL
         WHERE o.id = ANY (p_ids) AND o.dead_at IS NOT NULL AND o.lease_token = p_token
        RETURNING o.id;
    END IF;
    UPDATE ${schema}.${table}_work x
       SET state = 'r', not_before = '-infinity'
     WHERE NOT x.keyless AND x.ordering_key = ANY (v_keys)
       AND x.state = 'b' AND x.claim_token IS NULL
       AND NOT EXISTS (SELECT 1 FROM ${schema}.${table} d
                        WHERE d.ordering_key = x.ordering_key AND d.dead_at IS NOT NULL);
END;
$fn$;

CREATE FUNCTION ${schema}.${table}_settle_work(
    p_token uuid,
    p_owner text,
    p_ids bigint[],
    p_keys text[],
    p_outcomes text[],
    p_errors text[],
    p_delays double precision[],
    p_counted integer[],
    p_delete boolean,
    p_block_on_dead boolean
) RETURNS SETOF bigint
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off
AS $fn$
#variable_conflict use_column
DECLARE
    v_paused text[];
    v_compat boolean;
    v_gen bigint;
    v_late bigint[];
BEGIN
    SELECT x.compat INTO v_compat FROM ${schema}.${table}_cursor x WHERE x.one;

    -- Rows the reclaimer dead-lettered under this lease (review F14): their owner was only slow,
    -- and a publication (nothing else) it reports stands. Their work is locked first, as every
    -- claim and settle does, then the rows; a key blocked only by them goes on.
    SELECT array_agg(o.id ORDER BY o.id) INTO v_late
      FROM unnest(p_ids, p_outcomes) AS u(id, outcome)
      JOIN ${schema}.${table} o ON o.id = u.id
     WHERE u.outcome = 'published' AND o.dead_at IS NOT NULL AND o.lease_token = p_token;
    IF v_late IS NOT NULL THEN
        RETURN QUERY SELECT * FROM ${schema}.${table}_settle_late(p_token, p_owner, v_late, p_delete);
    END IF;

    IF p_delete THEN
        RETURN QUERY
        WITH batch AS (
            SELECT u.id, coalesce(u.k, u.id::text) AS wk, u.k IS NULL AS kl
              FROM unnest(p_ids, p_keys, p_outcomes) AS u(id, k, outcome)
             WHERE u.outcome = 'published'
        ),
        mine AS (
            SELECT x.ordering_key, x.keyless FROM ${schema}.${table}_work x
             WHERE (x.ordering_key, x.keyless) IN (SELECT b.wk, b.kl FROM batch b)
               AND x.claim_token = p_token
             ORDER BY x.ordering_key, x.keyless
               FOR UPDATE OF x
        )
        DELETE FROM ${schema}.${table} o
         USING batch b
         WHERE o.id = b.id AND o.dead_at IS NULL
           AND EXISTS (SELECT 1 FROM mine m WHERE m.ordering_key = b.wk AND m.keyless = b.kl)
        RETURNING o.id;
    END IF;

    RETURN QUERY
    WITH batch AS (
        SELECT u.id, u.outcome, u.error, u.delay, u.attempt,
               coalesce(u.k, u.id::text) AS wk, u.k IS NULL AS kl
          FROM unnest(p_ids, p_keys, p_outcomes, p_errors, p_delays, p_counted)
               AS u(id, k, outcome, error, delay, attempt)
         WHERE NOT (p_delete AND u.outcome = 'published')
    ),
    mine AS (
        SELECT x.ordering_key, x.keyless FROM ${schema}.${table}_work x
         WHERE (x.ordering_key, x.keyless) IN (SELECT b.wk, b.kl FROM batch b)
           AND x.claim_token = p_token
         ORDER BY x.ordering_key, x.keyless
           FOR UPDATE OF x
    )
    UPDATE ${schema}.${table} o
       SET published_at = CASE WHEN b.outcome = 'published' THEN now() END,
           dead_at = CASE WHEN b.outcome = 'dead' THEN now()
                          WHEN b.outcome = 'published' THEN NULL
                          ELSE o.dead_at END,
           last_error = CASE WHEN b.outcome = 'published' THEN o.last_error
                             ELSE coalesce(b.error, o.last_error) END,
           attempts = o.attempts + b.attempt,
           next_attempt_at = CASE WHEN b.outcome = 'retry'
                                  THEN now() + b.delay * interval '1 second'
                                  ELSE o.next_attempt_at END,
           lease_owner = p_owner,
           lease_token = CASE WHEN v_compat THEN NULL ELSE o.lease_token END,
           lease_expires_at = CASE WHEN v_compat THEN NULL ELSE o.lease_expires_at END
      FROM batch b
     WHERE o.id = b.id AND o.dead_at IS NULL
       AND EXISTS (SELECT 1 FROM mine m WHERE m.ordering_key = b.wk AND m.keyless = b.kl)
    RETURNING o.id;

    SELECT (SELECT array_agg(p.topic) FROM ${schema}.${table}_paused p), x.pause_gen
      INTO v_paused, v_gen
      FROM ${schema}.${table}_cursor x WHERE x.one;
    WITH batch AS (
        SELECT coalesce(u.k, u.id::text) AS wk, u.k IS NULL AS kl,
               min(u.id) FILTER (WHERE u.outcome NOT IN ('published', 'dead')) AS again
          FROM unnest(p_ids, p_keys, p_outcomes) AS u(id, k, outcome)
         GROUP BY 1, 2
    ),
    mine AS (
        SELECT x.ordering_key AS k, x.keyless AS kl,
               least(x.head_id, b.again) AS h
          FROM ${schema}.${table}_work x JOIN batch b ON x.ordering_key = b.wk AND x.keyless = b.kl
         WHERE x.claim_token = p_token
    ),
    heads AS (
        SELECT m.k, m.kl, h.id, h.topic, h.next_attempt_at,
               p_block_on_dead AND EXISTS (
                   SELECT 1 FROM ${schema}.${table} d
                    WHERE d.ordering_key = m.k AND d.dead_at IS NOT NULL) AS blocked
          FROM mine m
          LEFT JOIN LATERAL (
            SELECT o.id, o.topic, o.next_attempt_at FROM ${schema}.${table} o
             WHERE o.ordering_key >= m.k AND o.ordering_key <= m.k AND o.id >= m.h
               AND o.published_at IS NULL AND o.dead_at IS NULL
             ORDER BY o.ordering_key, o.id LIMIT 1) h ON true
         WHERE NOT m.kl
        UNION ALL
        SELECT m.k, m.kl, o.id, o.topic, o.next_attempt_at, false
          FROM mine m
          LEFT JOIN ${schema}.${table} o
            ON o.id = m.h AND o.ordering_key IS NULL
           AND o.published_at IS NULL AND o.dead_at IS NULL
         WHERE m.kl
    ),
    gone AS (
        DELETE FROM ${schema}.${table}_work x USING heads h
         WHERE x.ordering_key = h.k AND x.keyless = h.kl AND h.id IS NULL AND NOT h.blocked
    )
    UPDATE ${schema}.${table}_work x
       SET head_id = coalesce(h.id, x.head_id), head_topic = h.topic,
           state = CASE WHEN h.blocked THEN 'b'
                        WHEN v_paused IS NOT NULL AND h.topic = ANY (v_paused) THEN 'p'
                        WHEN h.next_attempt_at > now() THEN 'w' ELSE 'r' END,
           paused_gen = v_gen,
           not_before = CASE WHEN NOT h.blocked AND h.next_attempt_at > now()
                             THEN h.next_attempt_at ELSE '-infinity' END,
           claim_token = NULL, claim_owner = NULL, claim_expires_at = NULL, claim_first = NULL
      FROM heads h
     WHERE x.ordering_key = h.k AND x.keyless = h.kl AND (h.id IS NOT NULL OR h.blocked);
END;
$fn$;

-- The lease keeper: extend only live leases of the caller's tokens (an expired one may belong to
-- someone else already); under version 9 beside it, the rows' leases too. Returns the ids whose
-- work is still held.
CREATE FUNCTION ${schema}.${table}_extend_work(
    p_ids bigint[],
    p_tokens uuid[],
    p_seconds double precision
) RETURNS SETOF bigint
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off
AS $fn$
DECLARE
    v_held uuid[];
BEGIN
    -- Locked in key order first, as claims and settles lock work: an update in scan order
    -- deadlocked with a settle of the same claim and with discovery.
    WITH mine AS (
        SELECT x.ordering_key, x.keyless FROM ${schema}.${table}_work x
         WHERE x.claim_token = ANY (p_tokens) AND x.claim_expires_at > now() AND x.state <> 'x'
         ORDER BY x.ordering_key, x.keyless
           FOR UPDATE OF x
    ),
    extended AS (
        UPDATE ${schema}.${table}_work x
           SET claim_expires_at = now() + p_seconds * interval '1 second'
          FROM mine m
         WHERE x.ordering_key = m.ordering_key AND x.keyless = m.keyless
           AND x.claim_token = ANY (p_tokens) AND x.claim_expires_at > now() AND x.state <> 'x'
        RETURNING x.claim_token
    )
    SELECT array_agg(DISTINCT e.claim_token) INTO v_held FROM extended e;
    IF (SELECT x.compat FROM ${schema}.${table}_cursor x WHERE x.one) THEN
        UPDATE ${schema}.${table} o
           SET lease_expires_at = now() + p_seconds * interval '1 second'
          FROM unnest(p_ids, p_tokens) AS r(id, token)
         WHERE o.id = r.id AND o.lease_token = r.token AND o.lease_expires_at > now();
    END IF;
    RETURN QUERY SELECT r.id FROM unnest(p_ids, p_tokens) AS r(id, token)
                  WHERE r.token = ANY (v_held);
END;
$fn$;

-- A claim whose reply never arrived (the connection dropped after the commit): its dispatcher
-- knows the token it chose and gives the work back at once, instead of stalling its keys for a
-- whole lease and counting an attempt. Returns how many keys (and rows without one) it held.
CREATE FUNCTION ${schema}.${table}_release_work(p_token uuid) RETURNS integer
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off
AS $fn$
DECLARE
    v_rows integer;
BEGIN
    WITH mine AS (
        SELECT x.ordering_key, x.keyless FROM ${schema}.${table}_work x
         WHERE x.claim_token = p_token AND x.state <> 'x'
         ORDER BY x.ordering_key, x.keyless
           FOR UPDATE OF x
    ),
    released AS (
        UPDATE ${schema}.${table}_work x
           SET claim_token = NULL, claim_owner = NULL, claim_expires_at = NULL,
               head_id = least(x.claim_first, x.head_id), claim_first = NULL,
               state = 'r', not_before = '-infinity'
          FROM mine m
         WHERE x.ordering_key = m.ordering_key AND x.keyless = m.keyless
           AND x.claim_token = p_token AND x.state <> 'x'
        RETURNING 1
    )
    SELECT count(*) INTO v_rows FROM released;
    UPDATE ${schema}.${table} o
       SET lease_token = NULL, lease_expires_at = NULL
     WHERE o.lease_token = p_token AND o.published_at IS NULL AND o.dead_at IS NULL;
    RETURN v_rows;
END;
$fn$;

-- Work whose owners kept dying while publishing it (the claim that found its first row at
-- max_attempts left it in state x, lease kept; or a lease that expired on a first row at its
-- last attempt before any claim came by): its rows of that lease at their last attempt are
-- dead-lettered,
-- keeping the lease token (a late mark of an owner that was only slow may still record the
-- publication); the key then goes on (skip) or stays blocked (block).
CREATE FUNCTION ${schema}.${table}_reclaim_work(p_max_attempts integer, p_block_on_dead boolean)
RETURNS TABLE (id bigint, event_id uuid, topic text, ordering_key text, lease_owner text)
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off
AS $fn$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH looping AS (
        SELECT x.ordering_key, x.keyless, x.claim_token, x.claim_owner, x.claim_first, x.head_id
          FROM ${schema}.${table}_work x
         WHERE (x.ordering_key, x.keyless) IN (
                   (SELECT l.ordering_key, l.keyless FROM ${schema}.${table}_work l
                     WHERE l.state = 'x' ORDER BY l.claim_expires_at LIMIT 500)
                   UNION ALL
                   (SELECT e.ordering_key, e.keyless
                      FROM ${schema}.${table}_work e
                      JOIN ${schema}.${table} o ON o.id = e.claim_first
                     WHERE e.claim_token IS NOT NULL AND e.claim_expires_at < now()
                       AND e.state <> 'x' AND o.attempts + 1 >= p_max_attempts
                       AND o.published_at IS NULL AND o.dead_at IS NULL
                     ORDER BY e.claim_expires_at LIMIT 500))
           AND (x.state = 'x' OR (x.claim_token IS NOT NULL AND x.claim_expires_at < now()))
           FOR UPDATE OF x SKIP LOCKED
    ),
    rows AS (
        SELECT r.id, l.claim_token, l.claim_owner
          FROM looping l
         CROSS JOIN LATERAL (
            SELECT o.id FROM ${schema}.${table} o
             WHERE o.ordering_key >= l.ordering_key AND o.ordering_key <= l.ordering_key
               AND o.id >= l.claim_first AND o.id < l.head_id
               AND o.published_at IS NULL AND o.dead_at IS NULL
               AND o.attempts + 1 >= p_max_attempts
             ORDER BY o.ordering_key, o.id) r
         WHERE NOT l.keyless
        UNION ALL
        SELECT o.id, l.claim_token, l.claim_owner
          FROM looping l
          JOIN ${schema}.${table} o ON o.id = l.claim_first
         WHERE l.keyless AND o.ordering_key IS NULL
           AND o.published_at IS NULL AND o.dead_at IS NULL AND o.attempts + 1 >= p_max_attempts
    ),
    dead AS (
        UPDATE ${schema}.${table} o
           SET dead_at = now(),
               attempts = o.attempts + 1,
               lease_token = r.claim_token, lease_owner = r.claim_owner,
               lease_expires_at = NULL,
               last_error = format('dead-lettered: the lease expired %s times (the dispatcher '
                                   'that held it crashed or hung while publishing, last owner '
                                   '%s); last error: %s',
                                   o.attempts + 1, r.claim_owner, coalesce(o.last_error, 'none'))
          FROM rows r
         WHERE o.id = r.id
        RETURNING o.id, o.event_id, o.topic, o.ordering_key, o.lease_owner
    ),
    moved AS (
        UPDATE ${schema}.${table}_work x
           SET state = CASE WHEN p_block_on_dead AND NOT l.keyless THEN 'b' ELSE 'r' END,
               head_id = least(l.claim_first, l.head_id), not_before = '-infinity',
               claim_token = NULL, claim_owner = NULL, claim_expires_at = NULL, claim_first = NULL
          FROM looping l
         WHERE x.ordering_key = l.ordering_key AND x.keyless = l.keyless
    )
    SELECT * FROM dead;
END;
$fn$;

-- The anti-entropy sweep: from the sweep's place, the next p_rows ids at or below the cursor, in
-- id order; any pending row there that no work covers (a key with no work, or work whose head is
-- above it and whose claim does not hold it) is registered. Rows get there only by paths that
-- bypass the cursor: ids written below it (explicit ids, a restore into a live table, a
-- sequence set back), a key update with triggers disabled. Returns how many it registered and
-- whether it finished a pass over the table.
CREATE FUNCTION ${schema}.${table}_sweep(
    p_rows integer,
    p_hold_seconds double precision,
    OUT repaired integer,
    OUT wrapped boolean
)
    LANGUAGE plpgsql VOLATILE
    SET jit = off SET enable_bitmapscan = off
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
                                    AND p.id < l.head_id))))
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
    SELECT (SELECT count(*) FROM fixed), (SELECT max(p.id) FROM part p)
      INTO repaired, v_last;
    IF v_last IS NULL OR v_last >= c.position THEN
        wrapped := true;
        UPDATE ${schema}.${table}_cursor x SET swept = 0, sweep_started_at = now() WHERE x.one;
    ELSE
        UPDATE ${schema}.${table}_cursor x SET swept = v_last WHERE x.one;
    END IF;
END;
$fn$;

-- The rows a claim holds, with the claim's lease: what operators and checks read instead of the
-- rows' own lease columns (which the engine no longer writes, except beside version 9). A
-- key's claim holds its pending rows from its first taken row to its head.
CREATE VIEW ${schema}.${table}_leases AS
SELECT o.id, o.topic, o.ordering_key, w.claim_token AS lease_token, w.claim_owner AS lease_owner,
       w.claim_expires_at AS lease_expires_at, w.state = 'x' AS crash_looping
  FROM ${schema}.${table}_work w
  JOIN ${schema}.${table} o
    ON o.ordering_key = w.ordering_key AND o.id >= w.claim_first AND o.id < w.head_id
 WHERE NOT w.keyless AND w.claim_token IS NOT NULL
   AND o.published_at IS NULL AND o.dead_at IS NULL
UNION ALL
SELECT o.id, o.topic, o.ordering_key, w.claim_token, w.claim_owner, w.claim_expires_at,
       w.state = 'x'
  FROM ${schema}.${table}_work w
  JOIN ${schema}.${table} o ON o.id = w.claim_first
 WHERE w.keyless AND w.claim_token IS NOT NULL
   AND o.published_at IS NULL AND o.dead_at IS NULL;

COMMENT ON VIEW ${schema}.${table}_leases IS
    'outbox-dispatcher: the rows claims hold right now, with their lease (token, owner, expiry).';

-- A version 9 dispatcher still running stops with this message at its next claim or settle
-- (nothing is lost: its keys' work expires and is taken over).
CREATE OR REPLACE FUNCTION ${schema}.${table}_claim_keys(
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
BEGIN
    RAISE EXCEPTION 'the outbox schema of % was upgraded to version 11 (claim engine v3); this dispatcher is older: upgrade outbox-dispatcher',
        '${schema}.${table}'
        USING ERRCODE = 'feature_not_supported';
END;
$fn$;

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
BEGIN
    RAISE EXCEPTION 'the outbox schema of % was upgraded to version 11 (claim engine v3); this dispatcher is older: upgrade outbox-dispatcher',
        '${schema}.${table}'
        USING ERRCODE = 'feature_not_supported';
END;
$fn$;

-- The wake-up: only while a dispatcher has said that it waits for one (it polls meanwhile
-- anyway); a busy dispatcher finds new rows by itself, and writers skip the notification, whose
-- commit-time lock is what capped their commit rate. A statement trigger without a transition
-- table: nothing per row. SECURITY DEFINER: writers need no grant on <table>_waiting.
CREATE FUNCTION ${schema}.${table}_wake() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF EXISTS (SELECT 1 FROM ${schema}.${table}_waiting w WHERE w.until > now()) THEN
        PERFORM pg_notify(TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, '');
    END IF;
    RETURN NULL;
END;
$fn$;

CREATE TRIGGER ${table}_wake
    AFTER INSERT ON ${schema}.${table}
    FOR EACH STATEMENT EXECUTE FUNCTION ${schema}.${table}_wake();

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
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    -- The schema version it understands (version 10 on; `migrate` waits for older ones to go
    -- before the contract step of an upgrade).
    version integer
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

-- The operator console v2 (version 12): see schema/migrations/0012_console.sql.

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

-- 3. What each dispatcher reports with its heartbeat: beside the schema version it runs (the
-- `version` column of version 10), its counters of rows published and dead-lettered since it
-- started (the console charts their rates).
ALTER TABLE ${schema}.${table}_dispatchers
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

-- Each dispatcher's delivery mode (version 14): see schema/migrations/0014_delivery_mode.sql.
-- NULL: not reported (a release older than version 14, during a rolling upgrade).
ALTER TABLE ${schema}.${table}_dispatchers ADD COLUMN delivery text;

COMMENT ON COLUMN ${schema}.${table}_dispatchers.delivery IS
    'The delivery mode the dispatcher runs (OUTBOX_DELIVERY: at-least-once, exactly-once), reported with each heartbeat; NULL: not reported (a release older than schema version 14).';

-- Each exactly-once dispatcher's transactional ids (version 15): see
-- schema/migrations/0015_transactional_ids.sql.
ALTER TABLE ${schema}.${table}_dispatchers ADD COLUMN transactional_ids text[];

COMMENT ON COLUMN ${schema}.${table}_dispatchers.transactional_ids IS
    'Exactly-once: the Kafka transactional ids the dispatcher may have a transaction open under, recorded before each is first used (a takeover fences them); NULL: none recorded (at-least-once, or a release older than schema version 15).';

INSERT INTO ${schema}.${table}_schema_version (version, name) VALUES (1, 'initial'), (2, 'routed_topic'),
    (3, 'operations'), (4, 'stricter_writer_checks'), (5, 'operator_safety'),
    (6, 'claim_engine'), (7, 'lag'), (8, 'lighter_writes_and_settles'), (9, 'late_marks'),
    (11, 'claim_engine_v3_contract'), (12, 'console'), (13, 'late_rows'), (14, 'delivery_mode'),
    (15, 'transactional_ids')
    ON CONFLICT (version) DO NOTHING;
INSERT INTO ${schema}.${table}_schema_steps (version, name) VALUES (10, 'claim_engine_v3'),
    (11, 'claim_engine_v3_contract'), (12, 'console'), (13, 'late_rows'),
    (14, 'delivery_mode'), (15, 'transactional_ids')
    ON CONFLICT (version) DO NOTHING;
