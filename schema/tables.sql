-- outbox-dispatcher: the full current schema (version @VERSION@). Equivalent to applying every file
-- in migrations/ in order; tests/integration/test_schema.py proves it. Placeholders as in the
-- migrations. The claim engine's functions come from schema/engine/ (schema/README.md).

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

-- The claim engine: its tables here, its functions in schema/engine/ (one file each), the model
-- in docs/design/claim-engine.md.

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
    -- The claim's last row (version 16): a row that commits late below the key's head lowers
    -- head_id while the claim still holds rows above it up to here.
    claim_last bigint,
    -- The highest id a discovery passed while this key had a work row (version 16): written by
    -- the claim that passes it, so that the key's settle, which locks this row after that claim,
    -- sees it although its snapshot is older (the steady path's one-statement settle).
    last_seen bigint,
    -- The reconcile duty (version 16; docs/design/exactly-once.md): not NULL once a claim found
    -- the key's lease expired, the owner whose outcome is then unknown (the first such owner
    -- while the duty stands). Every claim of the key returns its rows as reclaimed until an
    -- exactly-once takeover read the progress under a live lease of the key and cleared it
    -- (dispatch.sql `reconciled`); no pause, block, release, settle or reclaim clears it.
    reconcile_owner text,
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
-- Keys whose reconcile duty names an owner (exactly-once; few, and only until a takeover read
-- the progress): the sweep of dead dispatchers' progress keys leaves an owner a duty names to the
-- takeover (store/dispatch.sql `transactional_ids_silent`).
CREATE INDEX ${table}_work_duty_idx ON ${schema}.${table}_work (reconcile_owner)
    WHERE reconcile_owner IS NOT NULL;

CREATE TABLE ${schema}.${table}_cursor (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    position bigint NOT NULL DEFAULT 0,
    -- Holes: id ranges [lo, hi] at or below position not seen yet, and when each was found;
    -- hole_vx (version 16): each hole's transactions that were running then (see
    -- <table>_discover).
    hole_lo bigint[] NOT NULL DEFAULT '{}',
    hole_hi bigint[] NOT NULL DEFAULT '{}',
    hole_at timestamptz[] NOT NULL DEFAULT '{}',
    -- The sweep's place (it walks ids from here up to position, then starts over).
    swept bigint NOT NULL DEFAULT 0,
    sweep_started_at timestamptz NOT NULL DEFAULT now(),
    -- Bumped by every change of <table>_paused (a trigger): keys parked under older pauses are
    -- looked at again.
    pause_gen bigint NOT NULL DEFAULT 0,
    -- Each hole's running transactions, comma-separated (aligned with hole_lo).
    hole_vx text[] NOT NULL DEFAULT '{}',
    -- How many holes, and every transaction any of them waits for: what a claim reads each
    -- time (the arrays above only once a transaction of theirs ended).
    hole_count integer NOT NULL DEFAULT 0,
    hole_watch text[] NOT NULL DEFAULT '{}',
    -- Version 16 (issue 35, E5): who this outbox is in exactly-once's progress records, drawn
    -- at migrate time and drawn again by a TRUNCATE (its ids may start over): records of a
    -- table before a TRUNCATE, or of another database migrated the same way, never match.
    progress_id uuid NOT NULL DEFAULT gen_random_uuid()
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

-- A TRUNCATE empties the table (and may restart its ids): the engine's knowledge goes with it,
-- and the outbox takes a new identity in exactly-once's progress records (the old records list
-- ids that may come again).
CREATE FUNCTION ${schema}.${table}_truncated() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    DELETE FROM ${schema}.${table}_work;
    DELETE FROM ${schema}.${table}_changed;
    UPDATE ${schema}.${table}_cursor
       SET position = 0, hole_lo = '{}', hole_hi = '{}', hole_vx = '{}', hole_at = '{}',
           hole_count = 0, hole_watch = '{}', swept = 0, sweep_started_at = now(),
           progress_id = gen_random_uuid();
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


-- @engine last_id

-- @engine running

-- @engine discover

-- @engine claim_work

-- @engine settle_late

-- @engine settle_work

-- @engine extend_work

-- @engine release_work

-- @engine reclaim_work

-- @engine sweep

-- The rows a claim holds, with the claim's lease: what operators and checks read instead of the
-- rows' own lease columns (which the engine no longer writes). A key's claim holds its pending
-- rows from its first taken row to its last; a row that committed late inside that range (it
-- lowered the key's head) is listed with them until the claim ends (version 16: the view had
-- dropped the claim's rows above such a row).
CREATE VIEW ${schema}.${table}_leases AS
SELECT o.id, o.topic, o.ordering_key, w.claim_token AS lease_token, w.claim_owner AS lease_owner,
       w.claim_expires_at AS lease_expires_at, w.state = 'x' AS crash_looping
  FROM ${schema}.${table}_work w
  JOIN ${schema}.${table} o
    ON o.ordering_key = w.ordering_key AND o.id >= w.claim_first
   AND o.id <= greatest(w.head_id - 1, w.claim_last)
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

-- @versions
