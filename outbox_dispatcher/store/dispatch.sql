-- The statements the dispatcher runs: claim, settle, leases, wake-ups and upkeep, by name.
-- {schema}, {table}, {work} and the other names in braces are replaced once at startup by
-- validated, quoted identifiers; every value is a named parameter ($name), bound by name.

-- claim --
-- Lease up to $limit rows of at most $max_keys keys under the token $token the dispatcher chose,
-- looking at up to $scan new rows (see the claim function in schema/); one round trip. Exactly
-- OutboxRecord's fields, in its order (the function's order kept), each row's replay count among
-- them (schema version 16: exactly-once lists (id, replays) pairs in its progress records, issue
-- 35, E5), read by the function with the row's other columns.
SELECT c.id, c.topic, c.ordering_key, c.payload, c.headers, c.event_id, c.created_at,
       c.attempts, c.reclaimed, c.replays
  FROM {claim_fn}($limit, $max_keys, $owner, $lease_seconds, $token, $block_on_dead,
                  $max_attempts, $scan) c

-- claim_without_replays --
-- `claim` for a table below schema version 16, whose claim function returns no replay count (a
-- release beside its predecessor during an upgrade, docs/operations.md): 0 for every row. Only
-- exactly-once lists replays, and it needs version 16.
SELECT id, topic, ordering_key, payload, headers, event_id, created_at, attempts, reclaimed,
       0 AS replays
  FROM {claim_fn}($limit, $max_keys, $owner, $lease_seconds, $token, $block_on_dead,
                  $max_attempts, $scan)

-- claim_steady --
-- The steady path's claim (schema version 16; docs/design/claim-engine.md, "The steady path"):
-- one statement, for the common case only. Steady means no holes, an empty change log, no
-- pause, and no known work a claim would take (an expired lease, a due retry, a registered or
-- resumed key, a blocked key this dispatcher takes): each an index's first entry. Then the new
-- rows right above the cursor, as long as their ids run on without a gap and are due, are
-- leased to token $token: new keys get a work row; a key that has one (its claim is in flight,
-- or it waits) is not taken, and its work row records the highest id passed (last_seen) for its
-- settle, which locks that row after this claim, and a row passed below its head lowers the
-- head (see `leased`). When the state is not steady, or there are new
-- rows but none at the cursor's next id, or a backlog (a batch's worth of new rows or more), it
-- returns one row with a NULL id and nothing else: the dispatcher then runs the claim function
-- (`claim`). OutboxRecord's fields, in its order, then `more`: whether new rows were left above
-- the ones taken (a gap, a row that cannot go now); without, the loop may wait for the next
-- notification instead of claiming again at once.
WITH c AS (
    SELECT x.position, x.hole_count FROM {cursor} x WHERE x.one
),
probe AS (
    SELECT c.hole_count = 0
           AND (SELECT y.seq FROM {changed} y ORDER BY y.seq LIMIT 1) IS NULL
           AND (SELECT p.topic FROM {paused} p ORDER BY p.topic LIMIT 1) IS NULL
           AND (SELECT w.head_id FROM {work} w
                 WHERE w.claim_token IS NULL AND w.state = 'r' ORDER BY w.head_id LIMIT 1) IS NULL
           AND coalesce((SELECT w.not_before FROM {work} w
                          WHERE w.claim_token IS NULL AND w.state = 'w'
                          ORDER BY w.not_before LIMIT 1) > now(), true)
           AND coalesce((SELECT w.claim_expires_at FROM {work} w
                          WHERE w.claim_token IS NOT NULL
                          ORDER BY w.claim_expires_at LIMIT 1) > now(), true)
           AND (SELECT w.paused_gen FROM {work} w
                 WHERE w.claim_token IS NULL AND w.state = 'p'
                 ORDER BY w.paused_gen LIMIT 1) IS NULL
           AND ($block_on_dead::boolean OR (SELECT w.head_id FROM {work} w
                                             WHERE w.claim_token IS NULL AND w.state = 'b'
                                             ORDER BY w.head_id LIMIT 1) IS NULL) AS steady,
           (SELECT o.id FROM {table} o WHERE o.id > c.position ORDER BY o.id LIMIT 1) AS next_id,
           c.position
      FROM c
),
cur AS (
    -- Locked only when there is something to take (an empty claim takes no xid and writes
    -- nothing); held by another claim: nothing for this one. The lock reads the latest version.
    SELECT x.position FROM {cursor} x, probe p
     WHERE x.one AND p.steady AND p.next_id = p.position + 1
       FOR UPDATE OF x SKIP LOCKED
),
new AS (
    SELECT o.id, o.topic, o.ordering_key, o.payload, o.headers, o.event_id, o.created_at,
           o.attempts, o.replays, o.published_at IS NULL AND o.dead_at IS NULL AS pending,
           -- 0 while the ids run on from the cursor: a gap may be a writer still open, whose
           -- hole the claim function keeps
           o.id - cur.position - row_number() OVER (ORDER BY o.id) AS gap,
           -- The run stops at a row written with a delay (by the clock, not the statement's
           -- start) and, under dead_letter_policy = block, at a row of a key with a dead row
           -- (the claim function's): the cursor never passes a row nobody takes or registers.
           bool_and(o.published_at IS NOT NULL OR o.dead_at IS NOT NULL
                    OR (o.next_attempt_at <= clock_timestamp()
                        AND NOT ($block_on_dead::boolean AND o.ordering_key IS NOT NULL
                                 AND EXISTS (SELECT 1 FROM {table} d
                                              WHERE d.ordering_key = o.ordering_key
                                                AND d.dead_at IS NOT NULL))))
               OVER (ORDER BY o.id) AS run
      FROM cur CROSS JOIN LATERAL (
          SELECT * FROM {table} o WHERE o.id > cur.position ORDER BY o.id LIMIT $limit) o
),
take AS (
    -- A batch's worth of new rows or more is a backlog: the claim function takes it (each key's
    -- run in one lease, where this statement would lease a key per row: review 3's drain cost)
    SELECT * FROM new WHERE gap = 0 AND run AND (SELECT count(*) FROM new) < $limit
),
g AS (
    SELECT coalesce(t.ordering_key, t.id::text) AS wk, t.ordering_key IS NULL AS kl,
           min(t.id) AS first, max(t.id) AS last
      FROM take t WHERE t.pending GROUP BY 1, 2
),
leased AS (
    -- DO UPDATE, not DO NOTHING: the upsert locks and writes the latest version of a key's
    -- work row, also one this statement's snapshot does not see, so that its settle sees
    -- last_seen (review 3's floor: a settle's "no more rows" read in an older snapshot).
    -- A key this statement leases gets last_seen 0: a steady claim's key, whose settle is one
    -- statement and must see what a passing claim saw; a claim function's key has none (its
    -- settle is the settle function's two statements).
    -- A row passed below the key's head lowers the head (and a parked key may go: discovery's
    -- `lowered`). The settle function and the claim function's parked keys set a head at the
    -- key's next pending row in their snapshot, which may lie above the cursor, past a row of
    -- the key whose writer drew its id first and committed after that snapshot; this claim
    -- passes that row, and nobody else will register it: without this, the key's run started
    -- at the higher row (delivered first) and the row waited for the sweep.
    INSERT INTO {work} AS w (keyless, ordering_key, head_id, claim_token, claim_owner,
                             claim_expires_at, claim_first, claim_last, last_seen)
    SELECT g.kl, g.wk, CASE WHEN g.kl THEN g.first ELSE g.last + 1 END, $token::uuid,
           $owner::text, now() + $lease_seconds::float8 * interval '1 second', g.first, g.last, 0
      FROM g ORDER BY g.wk, g.kl
    ON CONFLICT (ordering_key, keyless) DO UPDATE
       SET last_seen = CASE WHEN w.last_seen IS NOT NULL
                            THEN greatest(w.last_seen, excluded.claim_last) END,
           head_id = least(w.head_id, excluded.claim_first),
           state = CASE WHEN excluded.claim_first >= w.head_id OR w.state IN ('b', 'x')
                             OR w.claim_token IS NOT NULL
                        THEN w.state ELSE 'r' END,
           not_before = CASE WHEN excluded.claim_first >= w.head_id OR w.state IN ('b', 'x')
                                  OR w.claim_token IS NOT NULL
                             THEN w.not_before ELSE '-infinity' END
     WHERE w.last_seen IS NOT NULL OR excluded.claim_first < w.head_id
    RETURNING w.ordering_key, w.keyless, w.claim_token IS NOT DISTINCT FROM $token::uuid AS mine
),
moved AS (
    UPDATE {cursor} x SET position = m.top
      FROM (SELECT max(t.id) AS top FROM take t) m
     WHERE x.one AND m.top IS NOT NULL AND EXISTS (SELECT 1 FROM cur)
)
SELECT t.id, t.topic, t.ordering_key, t.payload, t.headers, t.event_id, t.created_at,
       t.attempts, false AS reclaimed, t.replays,
       (SELECT count(*) FROM new) > (SELECT count(*) FROM take)
       OR (SELECT count(*) FROM new) >= $limit AS more
  FROM take t
  JOIN leased l ON l.mine AND l.ordering_key = coalesce(t.ordering_key, t.id::text)
               AND l.keyless = (t.ordering_key IS NULL)
 WHERE t.pending
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
  FROM probe p
 WHERE NOT p.steady
    OR (p.next_id IS NOT NULL AND EXISTS (SELECT 1 FROM cur) AND NOT EXISTS (SELECT 1 FROM take))
    OR (p.next_id IS NOT NULL AND p.next_id <> p.position + 1)
ORDER BY 1

-- settle_steady --
-- The steady path's settle (schema version 16): one statement for a batch whose rows were all
-- published (any other outcome, or delete-on-publish: `settle`). Fenced by $token: the batch's
-- work rows are locked in key order, each by its primary key; a key with a pending row left at
-- or below the cursor (or one a steady claim passed meanwhile: last_seen, seen in the locked
-- version) stays as ready work from its head, the others are dropped. Returns the rows marked;
-- the dispatcher hands any others to `settle` (a row the reclaimer dead-lettered under this
-- lease, whose publication stands).
WITH k AS (
    SELECT coalesce(u.k, u.id::text) AS wk, u.k IS NULL AS kl
      FROM unnest($ids::bigint[], $keys::text[]) AS u(id, k)
     GROUP BY 1, 2 ORDER BY 1, 2
),
mine AS MATERIALIZED (
    SELECT w.ordering_key, w.keyless, w.head_id, w.last_seen
      FROM k CROSS JOIN LATERAL (
           SELECT w.ordering_key, w.keyless, w.head_id, w.last_seen FROM {work} w
            WHERE w.ordering_key = k.wk AND w.keyless = k.kl AND w.claim_token = $token::uuid
              FOR UPDATE OF w) w
),
decide AS (
    SELECT m.ordering_key, m.keyless,
           -- (no last_seen: not a steady claim's key; kept, its next claim looks)
           NOT m.keyless AND (coalesce(m.last_seen >= m.head_id, true) OR EXISTS (
               SELECT 1 FROM {table} o
                WHERE o.ordering_key >= m.ordering_key AND o.ordering_key <= m.ordering_key
                  AND o.id >= m.head_id
                  AND o.id <= (SELECT x.position FROM {cursor} x WHERE x.one)
                  AND o.published_at IS NULL AND o.dead_at IS NULL)) AS more
      FROM mine m
),
gone AS (
    DELETE FROM {work} w USING decide d
     WHERE w.ordering_key = d.ordering_key AND w.keyless = d.keyless AND NOT d.more
),
kept AS (
    UPDATE {work} w
       SET claim_token = NULL, claim_owner = NULL, claim_expires_at = NULL, claim_first = NULL,
           claim_last = NULL, last_seen = NULL, state = 'r', not_before = '-infinity'
      FROM decide d
     WHERE w.ordering_key = d.ordering_key AND w.keyless = d.keyless AND d.more
)
UPDATE {table} o
   SET published_at = now(), lease_owner = $owner::text, attempts = o.attempts + u.counted
  FROM (SELECT u.id, u.counted
          FROM unnest($ids::bigint[], $keys::text[], $counted::integer[]) AS u(id, k, counted)
          JOIN mine m ON m.ordering_key = coalesce(u.k, u.id::text)
                     AND m.keyless = (u.k IS NULL)) u
 WHERE o.id = u.id AND o.dead_at IS NULL
RETURNING o.id

-- settle --
-- Record the outcome of one published batch and release its keys, fenced by the batch's lease
-- token: a dispatcher that lost its lease changes nothing. Returns the rows that were still ours.
SELECT * FROM {settle_fn}($token, $owner, $ids, $keys, $outcomes, $errors, $delays, $counted,
                          $delete_published, $block_on_dead)

-- already_settled --
-- After a settle whose first attempt went unanswered and whose retry changed fewer rows: how many
-- of the rows $ids that attempt settled (it committed; its reply was lost). They show the outcome
-- $outcomes with no lease, last leased by this dispatcher ($owner), with the attempts that settle
-- set ($attempts); under delete-on-publish ($delete_published) a published row is gone. A row
-- another dispatcher took over has that dispatcher as its owner, or one attempt more (the takeover
-- counts one); one the reclaimer dead-lettered as a crash loop keeps its token.
SELECT count(*)
  FROM unnest($ids::bigint[], $outcomes::text[], $attempts::integer[]) AS r(id, outcome, attempts)
  LEFT JOIN {table} o ON o.id = r.id
 WHERE CASE WHEN o.id IS NULL THEN r.outcome = 'published' AND $delete_published::boolean
            ELSE o.lease_token IS NULL AND o.lease_owner = $owner AND o.attempts = r.attempts
                 AND CASE r.outcome
                         WHEN 'published' THEN o.published_at IS NOT NULL
                         WHEN 'dead' THEN o.dead_at IS NOT NULL
                         ELSE o.published_at IS NULL AND o.dead_at IS NULL
                     END
       END

-- extend_leases --
-- Keep the leases of work still in flight while their owner is alive; a lease that already
-- expired is not revived. Returns the ids whose work is still held.
SELECT * FROM {extend_fn}($ids, $tokens, $seconds)

-- release_claim --
-- Give back whatever a claim whose reply was lost leased under token $token.
SELECT {release_fn}($token)

-- waiting_announce --
-- This dispatcher waits for a wake-up until $seconds seconds from now: writers' trigger notifies
-- while any dispatcher waits, and only then.
INSERT INTO {waiting} AS w (owner, until) VALUES ($owner, now() + $seconds * interval '1 second')
ON CONFLICT (owner) DO UPDATE SET until = EXCLUDED.until

-- waiting_withdraw --
DELETE FROM {waiting} WHERE owner = $owner

-- dead_letter_crash_loops --
-- Work whose every owner died or hung while publishing it (the claim that found its first row at
-- max_attempts $max_attempts left it to this): dead-letter those rows instead of taking them over
-- again. The token of the lease that ended stays on the row: an owner that was only slow may still
-- deliver the row, and its late mark then records the publication (see the settle function) instead
-- of leaving a dead row that is in Kafka. $block_on_dead: dead_letter_policy = block.
SELECT id, event_id, topic, ordering_key, lease_owner
  FROM {reclaim_fn}($max_attempts, $block_on_dead)

-- count_expired_leases --
-- Work whose owner died and that no claim took over yet, from the index of leased work.
SELECT count(*) FROM {work} w
 WHERE w.claim_token IS NOT NULL AND w.claim_expires_at <= now() AND w.state <> 'x'

-- outbox_identity --
-- Who this outbox is in exactly-once's progress records (kafka/exactly_once/progress.py): a uuid drawn at
-- migrate time and again by every TRUNCATE (schema version 16; issue 35, E5), so that the
-- records of a table made again or truncated (its ids start over), or of another database
-- migrated the same way, are never taken for this one's.
SELECT x.progress_id::text FROM {cursor} x WHERE x.one

-- outbox_oid --
-- The database and the table's oid: what names the outbox in its transactional ids (kept as
-- before version 16, so that a takeover still fences a dispatcher of an older release).
SELECT current_database() || '/' || '{table}'::regclass::oid::text

-- pending_rows --
-- exactly-once: the rows among the pairs ($ids, $replays) still pending with that replay count,
-- as a claim returns them (OutboxRecord's fields): those a lost claim committed in Kafka beyond
-- a takeover's batch (kafka/exactly_once/takeover.py). Nothing while the outbox's identity is no longer
-- $identity (a TRUNCATE since the progress was read: the pairs are another table's).
SELECT o.id, o.topic, o.ordering_key, o.payload, o.headers, o.event_id, o.created_at,
       o.attempts, true AS reclaimed, o.replays
  FROM unnest($ids::bigint[], $replays::integer[]) AS u(id, replays)
  JOIN {table} o ON o.id = u.id AND o.replays = u.replays
 WHERE o.published_at IS NULL AND o.dead_at IS NULL
   AND (SELECT x.progress_id::text FROM {cursor} x WHERE x.one) = $identity::text
 ORDER BY o.id

-- progress_needed --
-- exactly-once (issue 35, E8, E9): the outbox's identity now, and which of the pairs
-- ($ids, $replays) a progress record must keep listing: rows still pending with that replay
-- count, or dead-lettered by the crash-loop reclaimer and not yet checked against the progress
-- (their lease token kept: dispatch/leases.py). A pair that is neither (published, replayed
-- since, dead for good, deleted) can never be decided by a takeover again.
SELECT (SELECT x.progress_id::text FROM {cursor} x WHERE x.one) AS identity,
       array(SELECT o.id
               FROM unnest($ids::bigint[], $replays::integer[]) AS u(id, replays)
               JOIN {table} o ON o.id = u.id AND o.replays = u.replays
              WHERE (o.published_at IS NULL AND o.dead_at IS NULL)
                 OR (o.dead_at IS NOT NULL AND o.lease_token IS NOT NULL)) AS needed

-- crash_loops_unsettled --
-- exactly-once: rows the crash-loop reclaimer dead-lettered whose lost claim's outcome nobody
-- has read yet (the reclaim function keeps the lease's token on them; a late mark, or
-- `crash_loops_checked`, clears it), at most $limit, oldest first.
SELECT id, ordering_key, lease_token, lease_owner, replays
  FROM {table}
 WHERE dead_at IS NOT NULL AND lease_token IS NOT NULL
 ORDER BY id LIMIT $limit

-- crash_loops_checked --
-- exactly-once: the progress was read after a fence and these crash-loop rows ($ids) are not in
-- it: their lost claim never committed them (and, fenced, never will): dead for good, no late
-- mark is waited for. Returns how many.
WITH checked AS (
    UPDATE {table} SET lease_token = NULL
     WHERE id = ANY($ids::bigint[]) AND dead_at IS NOT NULL AND lease_token IS NOT NULL
    RETURNING 1
)
SELECT count(*) FROM checked

-- crash_loops_published --
-- exactly-once (review E13), in the reclaimer's transaction right after its dead-letter: the
-- crash-loop rows $ids that the lost claim committed (the progress, read after the claim's owner
-- was fenced, lists them) are published as that claim's late mark would record them (settle_late,
-- under the lease token the dead-letter kept: a key they blocked goes on), so that a committed row
-- is never shown dead, not even for a moment. Returns their ids.
SELECT p.id
  FROM (SELECT o.lease_token, min(o.lease_owner) AS owner, array_agg(o.id ORDER BY o.id) AS ids
          FROM {table} o
         WHERE o.id = ANY ($ids::bigint[]) AND o.dead_at IS NOT NULL AND o.lease_token IS NOT NULL
         GROUP BY o.lease_token) t
 CROSS JOIN LATERAL {settle_late_fn}(t.lease_token, t.owner, t.ids, $delete_published) AS p(id)

-- unsettled_work --
-- exactly-once, at start when the progress topic is missing: keys whose rows a claim holds or
-- held (a lease, live or expired) or whose lost owner's outcome nobody read (the reconcile duty).
-- Their committed batches are in the progress, so a missing topic then was deleted (or renamed
-- by a changed OUTBOX_PROGRESS_TOPIC), and creating it would forget them.
SELECT count(*) FROM {work} w WHERE w.claim_token IS NOT NULL OR w.reconcile_owner IS NOT NULL

-- reconciled --
-- exactly-once: a takeover read the progress and decided every row of these keys ($keys,
-- $keyless: the work rows' keys) a lost claim committed, under this dispatcher's ($owner) live
-- leases: their reconcile duty (<table>_work.reconcile_owner) is done. A lease that expired
-- meanwhile keeps it (its next claim sets it anew from the expiry). Locked in key order, as
-- every claim and settle locks work. Returns the keys cleared.
WITH mine AS (
    SELECT w.ordering_key, w.keyless
      FROM {work} w
      JOIN unnest($keys::text[], $keyless::boolean[]) AS u(k, kl)
        ON w.ordering_key = u.k AND w.keyless = u.kl
     WHERE w.claim_owner = $owner::text AND w.claim_expires_at > now() AND w.state <> 'x'
       AND w.reconcile_owner IS NOT NULL
     ORDER BY w.ordering_key, w.keyless
       FOR UPDATE OF w
),
cleared AS (
    UPDATE {work} w SET reconcile_owner = NULL
      FROM mine m
     WHERE w.ordering_key = m.ordering_key AND w.keyless = m.keyless
    RETURNING 1
)
SELECT count(*) FROM cleared

-- schema_version --
SELECT greatest((SELECT coalesce(max(version), 0) FROM {version_table}),
                (SELECT coalesce(max(version), 0) FROM {steps_table}))

-- gauges --
-- The table gauges behind /metrics, from what the engine knows, never a scan of the table: the rows
-- above the cursor (not looked at yet) and the pending rows of each piece of work, read from its
-- first row (its claim's first while leased) through the key index. Each is sorted by why it waits:
-- `paused` (its topic or the whole table is paused, or an earlier pending row's of its key is),
-- `held` (not due and never failed, or of a key waiting on such a row) and `due` (everything else:
-- ready, in flight, in backoff, behind a dead row). The lag that pages is the age of the oldest
-- `due` row; parked rows (paused, held) have their own count and age. Ages run from {since_fn} (a
-- time the database sets, not the writer's created_at): of the lowest id never made pending again,
-- and of every row an operator made pending again. Then counts of keys by why their first pending
-- row waits (backoff, held; behind a dead row under $block_on_dead: dead_letter_policy = block),
-- dead rows (their own index), and the pauses operators set.
WITH c AS MATERIALIZED (SELECT position FROM {cursor} WHERE one),
work AS MATERIALIZED (SELECT * FROM {work}),
seen AS MATERIALIZED (
    SELECT o.id, o.ordering_key, o.topic, o.created_at, o.pending_since, o.attempts,
           o.next_attempt_at
      FROM work w
     CROSS JOIN LATERAL (
        SELECT o.* FROM {table} o
         WHERE NOT w.keyless AND o.ordering_key >= w.ordering_key AND o.ordering_key <= w.ordering_key
           AND o.id >= least(w.claim_first, w.head_id) AND o.id <= (SELECT position FROM c)
           AND o.published_at IS NULL AND o.dead_at IS NULL
         ORDER BY o.ordering_key, o.id) o
    UNION ALL
    SELECT o.id, NULL, o.topic, o.created_at, o.pending_since, o.attempts, o.next_attempt_at
      FROM work w JOIN {table} o ON o.id = w.head_id
     WHERE w.keyless AND o.ordering_key IS NULL AND o.published_at IS NULL AND o.dead_at IS NULL
       AND o.id <= (SELECT position FROM c)
    UNION ALL
    SELECT o.id, o.ordering_key, o.topic, o.created_at, o.pending_since, o.attempts,
           o.next_attempt_at
      FROM {table} o
     WHERE o.id > (SELECT position FROM c) AND o.published_at IS NULL AND o.dead_at IS NULL
),
own AS MATERIALIZED (
    SELECT s.*, pt.topic IS NOT NULL AS topic_paused,
           s.attempts = 0 AND s.next_attempt_at > now() AS own_held
      FROM seen s
      LEFT JOIN {paused} pt ON pt.topic = s.topic
),
-- Each key's pending rows: its first, and its first paused, held and backing-off row
-- (the rows from a key's first paused or held row on wait behind it: parked too).
keys AS MATERIALIZED (
    SELECT ordering_key, min(id) AS first_id,
           min(id) FILTER (WHERE topic_paused) AS paused_from,
           min(id) FILTER (WHERE own_held) AS held_from,
           min(id) FILTER (WHERE attempts > 0 AND next_attempt_at > now()) AS backoff_from
      FROM own
     WHERE ordering_key IS NOT NULL
     GROUP BY ordering_key
),
pending AS (
    SELECT o.*,
           o.topic_paused OR coalesce(o.id >= m.paused_from, false)
               OR (SELECT EXISTS (SELECT FROM {paused} WHERE topic = '*')) AS paused,
           o.own_held OR coalesce(o.id >= m.held_from, false) AS held
      FROM own o
      LEFT JOIN keys m ON m.ordering_key = o.ordering_key
),
agg AS (
    SELECT count(*) AS rows, min(id) AS first_id,
           min(id) FILTER (WHERE NOT paused AND NOT held AND pending_since IS NULL) AS due_fresh,
           min(CASE WHEN NOT paused AND NOT held AND pending_since IS NOT NULL
                    THEN {since_fn}(id, created_at, pending_since) END) AS due_rearmed,
           count(*) FILTER (WHERE paused) AS paused_rows,
           min(id) FILTER (WHERE paused AND pending_since IS NULL) AS paused_fresh,
           min(CASE WHEN paused AND pending_since IS NOT NULL
                    THEN {since_fn}(id, created_at, pending_since) END) AS paused_rearmed,
           count(*) FILTER (WHERE held AND NOT paused) AS held_rows,
           min(id) FILTER (WHERE held AND NOT paused AND pending_since IS NULL) AS held_fresh,
           min(CASE WHEN held AND NOT paused AND pending_since IS NOT NULL
                    THEN {since_fn}(id, created_at, pending_since) END) AS held_rearmed
      FROM pending
)
SELECT a.rows AS pending,
       a.first_id AS first_pending_id,
       extract(epoch FROM now() - least(
           (SELECT {since_fn}(o.id, o.created_at, NULL) FROM {table} o WHERE o.id = a.due_fresh),
           a.due_rearmed))::float8 AS oldest_pending_age_seconds,
       a.paused_rows,
       extract(epoch FROM now() - least(
           (SELECT {since_fn}(o.id, o.created_at, NULL) FROM {table} o WHERE o.id = a.paused_fresh),
           a.paused_rearmed))::float8 AS oldest_paused_age_seconds,
       a.held_rows,
       extract(epoch FROM now() - least(
           (SELECT {since_fn}(o.id, o.created_at, NULL) FROM {table} o WHERE o.id = a.held_fresh),
           a.held_rearmed))::float8 AS oldest_held_age_seconds,
       (SELECT count(*) FROM {table} WHERE dead_at IS NOT NULL) AS dead,
       (SELECT count(*) FROM keys k WHERE k.backoff_from = k.first_id) AS backoff_keys,
       (SELECT count(*) FROM keys k WHERE k.held_from = k.first_id) AS held_keys,
       (SELECT count(*) FROM keys k
         WHERE $block_on_dead AND k.ordering_key IN (SELECT d.ordering_key FROM {table} d
                                          WHERE d.dead_at IS NOT NULL)) AS dead_blocked_keys,
       (SELECT count(*) FROM {paused} WHERE topic <> '*') AS paused_topics,
       EXISTS (SELECT FROM {paused} WHERE topic = '*') AS table_paused
  FROM agg a

-- clock_tick --
-- Note the highest committed id at the database's time (before this statement's snapshot): a
-- pending row above it was committed later, so its lag cannot start earlier (see {since_fn}).
-- Never lower than an earlier entry, as retention may have deleted the newest rows.
INSERT INTO {clock} (seq, at)
SELECT greatest((SELECT max(id) FROM {table}), (SELECT max(seq) FROM {clock}), 0),
       statement_timestamp()

-- clock_prune --
-- Forget entries that no pending row needs: those below the last entry under the lowest pending id
-- $first_pending_id (NULL: nothing pending), and only once a day old, so that a row of a long
-- transaction still uncommitted below that id keeps its bound.
DELETE FROM {clock}
 WHERE at < now() - interval '1 day'
   AND seq < (SELECT max(c.seq) FROM {clock} c
               WHERE c.seq < coalesce($first_pending_id::bigint, (SELECT max(seq) + 1 FROM {clock})))

-- dispatcher_beat --
-- A running dispatcher records itself, its dead-letter policy, the schema version it runs and a
-- heartbeat (by the database clock) for `status` and `migrate` (which waits for older ones to go
-- before the contract step of an upgrade). From version 10 on: a dispatcher beats with this one
-- until the schema has the counters (version 12, dispatcher_beat_counted).
INSERT INTO {dispatchers} AS d (owner, dead_letter_policy, version)
VALUES ($owner, $dead_letter_policy, $version)
ON CONFLICT (owner) DO UPDATE
   SET heartbeat_at = now(), dead_letter_policy = EXCLUDED.dead_letter_policy,
       version = EXCLUDED.version

-- dispatcher_beat_counted --
-- dispatcher_beat with the dispatcher's counters of rows published and dead-lettered since it
-- started (version 12: the console charts their rates), until the schema has the delivery mode
-- (version 14, dispatcher_beat_moded).
INSERT INTO {dispatchers} AS d (owner, dead_letter_policy, version, published_total, dead_total)
VALUES ($owner, $dead_letter_policy, $version, $published, $dead)
ON CONFLICT (owner) DO UPDATE
   SET heartbeat_at = now(), dead_letter_policy = EXCLUDED.dead_letter_policy,
       version = EXCLUDED.version, published_total = EXCLUDED.published_total,
       dead_total = EXCLUDED.dead_total

-- dispatcher_beat_moded --
-- dispatcher_beat_counted with the dispatcher's delivery mode (version 14: `status` and the
-- console name it, and say when the live dispatchers differ).
INSERT INTO {dispatchers} AS d (owner, dead_letter_policy, version, published_total, dead_total,
                                delivery)
VALUES ($owner, $dead_letter_policy, $version, $published, $dead, $delivery)
ON CONFLICT (owner) DO UPDATE
   SET heartbeat_at = now(), dead_letter_policy = EXCLUDED.dead_letter_policy,
       version = EXCLUDED.version, published_total = EXCLUDED.published_total,
       dead_total = EXCLUDED.dead_total, delivery = EXCLUDED.delivery

-- cleanup_window --
-- One retention batch: of the next $limit rows by id after $after, delete those published more than
-- $older_than_seconds seconds ago (never pending or dead rows). Rows already locked (a concurrent
-- retention run or an operator command) are skipped. older_rows says whether the window held rows
-- created before the cutoff; a window without any means the rest of the table is younger, and the
-- walk can stop.
WITH win AS (
    SELECT id, created_at FROM {table} WHERE id > $after ORDER BY id LIMIT $limit
),
doomed AS (
    SELECT o.id FROM {table} o JOIN win w ON w.id = o.id
     WHERE o.published_at < now() - $older_than_seconds * interval '1 second'
       FOR UPDATE OF o SKIP LOCKED
),
gone AS (
    DELETE FROM {table} o USING doomed d WHERE o.id = d.id RETURNING o.id
)
SELECT (SELECT max(id) FROM win) AS last_id,
       (SELECT count(*) FROM win) AS seen,
       (SELECT count(*) FROM gone) AS deleted,
       coalesce((SELECT min(created_at) FROM win) < now() - $older_than_seconds * interval '1 second', false)
           AS older_rows

-- schema_version_before_steps --
-- The version of a schema older than 10 (no <table>_schema_steps yet).
SELECT coalesce(max(version), 0) FROM {version_table}

-- sweep --
-- The anti-entropy sweep: the next $rows rows from its place; returns how many pending rows it
-- found that no work covered (now registered; a row a live claim's range holds waits $hold_seconds
-- seconds, a lease) and whether it finished a pass.
SELECT repaired, wrapped FROM {sweep_fn}($rows, $hold_seconds)

-- id_cache --
-- How many ids the outbox's identity hands a session at a time (1 unless altered): above 1, a
-- session's cached ids lie below ids others committed long before, and the claim's holes cannot
-- wait for them (docs/writers.md).
SELECT coalesce(max(s.seqcache), 1)
  FROM pg_catalog.pg_depend d
  JOIN pg_catalog.pg_sequence s ON s.seqrelid = d.objid
 WHERE d.classid = 'pg_catalog.pg_class'::regclass AND d.refobjid = '{table}'::regclass
   AND d.deptype IN ('a', 'i')

-- engine_drift --
-- `check`: pending rows at or below the cursor that no claim will look at (not in a hole, not in
-- the change log, at or after no head of their key's work): rows written around the engine's
-- bookkeeping that the sweep has not found yet. One pass over the table: an operator's command.
SELECT count(*) AS rows, count(DISTINCT coalesce(o.ordering_key, o.id::text)) AS keys,
       min(o.id) AS first_id
  FROM {table} o, {cursor} c
 WHERE c.one AND o.id <= c.position AND o.published_at IS NULL AND o.dead_at IS NULL
   AND NOT EXISTS (SELECT 1 FROM unnest(c.hole_lo, c.hole_hi) AS h(lo, hi)
                    WHERE o.id >= h.lo AND o.id <= h.hi)
   AND NOT EXISTS (SELECT 1 FROM {changed} x WHERE x.id = o.id)
   AND NOT EXISTS (
       SELECT 1 FROM {work} w
        WHERE w.ordering_key = coalesce(o.ordering_key, o.id::text)
          AND w.keyless = (o.ordering_key IS NULL)
          AND (w.head_id <= o.id OR (w.claim_token IS NOT NULL AND w.claim_first <= o.id)))

-- live_older_dispatchers --
-- Dispatchers that beat within $seconds seconds and run a version older than $version (version 9
-- and older record none).
SELECT count(*) FROM {dispatchers}
 WHERE heartbeat_at > now() - $seconds * interval '1 second'
   AND (version IS NULL OR version < $version)

-- transactional_ids_record --
-- Exactly-once (version 15): the transactional ids dispatcher $owner may have a transaction open
-- under, recorded before the first transaction of each, so that a takeover fences them
-- (kafka/exactly_once/lanes.py). Its heartbeat made its row first; returns nothing if it is gone.
UPDATE {dispatchers} SET transactional_ids = $ids::text[], heartbeat_at = now()
 WHERE owner = $owner
RETURNING owner

-- transactional_ids_silent --
-- Exactly-once (issue 35, E9): the dispatchers that no longer beat (no heartbeat within
-- $live_seconds seconds) and still list transactional ids, each with the heartbeat seen (its ids
-- are forgotten only while it is unchanged) and whether the table still names it (`named`): a key
-- leased by it (a lease live or expired: the key's takeover reads its progress and fences it
-- strictly) or a key whose reconcile duty names it. At most $limit, the longest silent first.
SELECT d.owner, d.heartbeat_at, d.transactional_ids,
       EXISTS (SELECT 1 FROM {work} w
                WHERE w.claim_token IS NOT NULL AND w.claim_owner = d.owner)
       OR EXISTS (SELECT 1 FROM {work} w WHERE w.reconcile_owner = d.owner) AS named
  FROM {dispatchers} d
 WHERE d.heartbeat_at <= now() - $live_seconds * interval '1 second'
   AND cardinality(d.transactional_ids) > 0
 ORDER BY d.heartbeat_at, d.owner
 LIMIT $limit

-- transactional_ids_forget --
-- Exactly-once (issue 35, E9): the ids $ids of dispatcher $owner were fenced and their progress
-- keys ended (kafka/exactly_once/orphans.py): forgotten, so that nobody fences or sweeps them
-- again. Only while its heartbeat is still $heartbeat_at: a dispatcher that was only paused and
-- came back beat since, or recorded its ids again (which it does before any producer starts
-- under one of them), and keeps them. Returns its owner if it forgot.
UPDATE {dispatchers} d
   SET transactional_ids = array(SELECT t FROM unnest(d.transactional_ids) AS t
                                  WHERE t <> ALL ($ids::text[]))
 WHERE d.owner = $owner AND d.heartbeat_at = $heartbeat_at::timestamptz
RETURNING d.owner

-- transactional_ids_live --
-- Exactly-once: the dispatchers that beat within $live_seconds seconds, each with its delivery
-- mode and the transactional ids it recorded (NULL: none; a release older than version 15).
SELECT owner, delivery, transactional_ids FROM {dispatchers}
 WHERE heartbeat_at > now() - $live_seconds * interval '1 second'
 ORDER BY owner

-- lost_owners --
-- Exactly-once: the owners whose claims a takeover stands in for, each with its delivery mode and
-- the transactional ids it recorded, whatever its heartbeat's age (a takeover fences them before
-- it reads the progress, and waits while it cannot: review E6, E7): those the reconcile duty of
-- these keys ($keys, $keyless) names, and $owners (the crash-loop reclaimer's lost claims). Every
-- registry row stays (nothing deletes one); an owner without one comes with NULLs.
WITH named AS (
    SELECT w.reconcile_owner AS owner
      FROM {work} w
      JOIN unnest($keys::text[], $keyless::boolean[]) AS u(k, kl)
        ON w.ordering_key = u.k AND w.keyless = u.kl
     WHERE w.reconcile_owner IS NOT NULL
    UNION
    SELECT o FROM unnest($owners::text[]) AS o WHERE o IS NOT NULL
)
SELECT n.owner, d.delivery, d.transactional_ids
  FROM named n LEFT JOIN {dispatchers} d ON d.owner = n.owner
 ORDER BY n.owner

-- crash_loop_candidates --
-- exactly-once (review E13): the rows the reclaim function would dead-letter now at $max_attempts
-- (the same work and rows it picks, unlocked), with the owner of the lease that ended: their
-- progress is read before they are dead-lettered, so that a row the lost claim committed is
-- never shown dead while the progress cannot be read.
-- Every read of the outbox is a LATERAL subquery per work row, fenced by OFFSET 0: the work
-- drives, and the outbox is read by key or by id only for the keys that loop. The function
-- gets that from enable_seqscan = off; this statement runs with the pool's generic plans, and
-- joins the planner may reorder were driven from the outbox on a table without statistics or
-- with stale ones (a scan of every row, published ones included, to find that nothing loops:
-- 1,505 buffers at 50,000 published rows, 219 at 5,000; tests/integration/
-- test_reclaimer_plans.py).
WITH looping AS (
    SELECT x.ordering_key, x.keyless, x.claim_owner, x.claim_first, x.head_id, x.claim_last
      FROM {work} x
     WHERE (x.ordering_key, x.keyless) IN (
               (SELECT l.ordering_key, l.keyless FROM {work} l
                 WHERE l.state = 'x' ORDER BY l.claim_expires_at LIMIT 500)
               UNION ALL
               (SELECT e.ordering_key, e.keyless
                  FROM {work} e
                 CROSS JOIN LATERAL (
                    SELECT FROM {table} o
                     WHERE o.id = e.claim_first AND o.attempts + 1 >= $max_attempts
                       AND o.published_at IS NULL AND o.dead_at IS NULL
                    OFFSET 0) f
                 WHERE e.claim_token IS NOT NULL AND e.claim_expires_at < now()
                   AND e.state <> 'x'
                 ORDER BY e.claim_expires_at LIMIT 500))
       AND (x.state = 'x' OR (x.claim_token IS NOT NULL AND x.claim_expires_at < now()))
)
SELECT r.id, r.replays, l.claim_owner AS lease_owner
  FROM looping l
 CROSS JOIN LATERAL (
    SELECT o.id, o.replays FROM {table} o
     WHERE NOT l.keyless
       AND o.ordering_key >= l.ordering_key AND o.ordering_key <= l.ordering_key
       AND o.id >= l.claim_first AND o.id <= greatest(l.head_id - 1, l.claim_last)
       AND o.published_at IS NULL AND o.dead_at IS NULL
       AND o.attempts + 1 >= $max_attempts
    UNION ALL
    SELECT o.id, o.replays FROM {table} o
     WHERE l.keyless AND o.id = l.claim_first AND o.ordering_key IS NULL
       AND o.published_at IS NULL AND o.dead_at IS NULL AND o.attempts + 1 >= $max_attempts
    OFFSET 0) r
