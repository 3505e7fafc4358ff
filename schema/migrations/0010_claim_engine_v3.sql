-- Version 10: claim engine v3, the expand step (docs/design/claim-engine.md).
--
-- The table is the truth; what the dispatchers keep per key is a cache they write themselves.
-- Writers run no engine code on INSERT: no registry trigger, no advisory locks, nothing that
-- depends on their isolation level or on triggers firing (version 9's registry stranded rows of
-- REPEATABLE READ writers, of restores with triggers off and of key updates, and one open writer
-- transaction could halt every claim: review N1-N5). Instead:
--
-- * <table>_cursor: every row above `position` is new to the dispatchers. A claim that holds the
--   cursor reads the rows above it (primary key order, at most p_scan) and the ids it skipped
--   because their transaction had not committed yet ("holes", probed again by every later
--   claim until an open transaction can no longer fill them), and moves it on.
-- * <table>_work: a row per ordering key with rows that may be pending (and per pending row
--   without a key): where its next rows start (head_id), why it waits (state), and its lease.
--   Only dispatchers write it; a key's row exists while the key has work, and its lease is the
--   key's one owner (primary key: one row per key).
-- * <table>_changed: ids of rows whose key or topic a writer changed, that became pending again
--   or that an operator removed while dead; a row trigger (firing only on those transitions,
--   never on an insert or a settle) appends them, the claim holding the cursor takes them in.
-- * A sweep walks the table in id order within a budget and registers any pending row nothing
--   knows of (rows written with explicit ids below the cursor, triggers disabled during a key
--   update): <table>_sweep, run by the reclaimer and by `outbox-dispatcher check --repair`.
--
-- The engine's functions run with jit and bitmap scans off (SET clauses): their statements read a
-- few index entries each, and a burst written before autovacuum has analyzed it mis-costs them
-- (a JIT compile of 100+ ms per statement, a bitmap scan of a whole index) if the planner may.
--
-- This step keeps version 9 working beside it (a rolling upgrade): its registry, trigger and
-- functions stay, and version 10's claims also write and respect the row leases version 9 uses
-- (<table>_cursor.compat). The contract step (version 11) drops version 9's objects once no
-- dispatcher older than 10 runs. It records itself in <table>_schema_steps, not in
-- <table>_schema_version, so that a version 9 dispatcher still finds the version it expects,
-- stays ready and can restart.

CREATE TABLE IF NOT EXISTS ${schema}.${table}_schema_steps (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE ${schema}.${table}_schema_steps IS
    'outbox-dispatcher schema versions from 10 on (version 9 and older read <table>_schema_version, which only a change that older dispatchers cannot run beside records).';

-- Which schema version each running dispatcher understands (version 9 and older record none):
-- `migrate` applies the contract step only once none older than 10 beats.
ALTER TABLE ${schema}.${table}_dispatchers ADD COLUMN IF NOT EXISTS version integer;

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

-- Rows already in the table are known to no claim yet: the cursor starts below the oldest
-- pending row (version 9's registry serves version 9 meanwhile), so the first claims look at
-- them all.
INSERT INTO ${schema}.${table}_cursor (position, compat)
SELECT coalesce((SELECT min(o.id) - 1 FROM ${schema}.${table} o
                  WHERE o.published_at IS NULL AND o.dead_at IS NULL), (SELECT max(o.id) FROM ${schema}.${table} o), 0),
       true;

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
    v_xmin xid8 := pg_snapshot_xmin(pg_current_snapshot());
    v_xmax xid8 := pg_snapshot_xmax(pg_current_snapshot());
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
           max(s.id) FILTER (WHERE s.fresh)
      INTO v_ids, v_keys, v_ok, v_fresh, v_pending, v_touched, v_top
      FROM ((SELECT o.id, o.ordering_key, o.published_at IS NULL AND o.dead_at IS NULL AS pending,
                    o.next_attempt_at <= now()
                    AND (p_paused IS NULL OR o.topic IS NULL OR o.topic <> ALL (p_paused))
                    AND NOT (c.compat AND coalesce(o.lease_expires_at > now(), false)) AS ok,
                    true AS fresh, false AS touched
               FROM ${schema}.${table} o
              WHERE o.id > c.position
              ORDER BY o.id LIMIT p_scan)
            UNION ALL
            (SELECT o.id, o.ordering_key, o.published_at IS NULL AND o.dead_at IS NULL,
                    o.next_attempt_at <= now()
                    AND (p_paused IS NULL OR o.topic IS NULL OR o.topic <> ALL (p_paused))
                    AND NOT (c.compat AND coalesce(o.lease_expires_at > now(), false)),
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
                        SELECT v_xmax, now(), int8range(g.prev + 1, g.id - 1, '[]')
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
                   AND NOT (c.compat AND coalesce(o.lease_expires_at > now(), false)
                            AND o.lease_token IS DISTINCT FROM p_token)
                   AND o.id <> ALL (v_held) AS ok,
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
                   AND NOT (c.compat AND coalesce(o.lease_expires_at > now(), false)
                            AND o.lease_token IS DISTINCT FROM p_token)
                   AND o.id <> ALL (v_held) AS ok,
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
               AND NOT (c.compat AND coalesce(o.lease_expires_at > now(), false))
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

INSERT INTO ${schema}.${table}_schema_steps (version, name) VALUES (10, 'claim_engine_v3');
