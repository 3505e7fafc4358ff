-- The statements the dispatcher runs: claim, settle, leases, wake-ups and upkeep, by name.
-- {schema}, {table}, {work} and the other names in braces are replaced once at startup by
-- validated, quoted identifiers; every value is a named parameter ($name), bound by name.

-- claim --
-- Lease up to $limit rows of at most $max_keys keys under the token $token the dispatcher chose,
-- looking at up to $scan new rows (see the claim function in schema/); one round trip. Exactly
-- OutboxRecord's fields, in its order.
SELECT id, topic, ordering_key, payload, headers, event_id, created_at, attempts, reclaimed
  FROM {claim_fn}($limit, $max_keys, $owner, $lease_seconds, $token, $block_on_dead,
                  $max_attempts, $scan)

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
-- Who this outbox is in exactly-once's progress records (kafka/progress.py): the database and
-- the table's oid, so that the records of a table dropped and made again (its ids start over)
-- are never taken for this one's.
SELECT current_database() || '/' || '{table}'::regclass::oid::text

-- pending_rows --
-- exactly-once: the rows among $ids still pending, as a claim returns them (OutboxRecord's
-- fields): those a lost claim committed in Kafka beyond a takeover's batch (kafka/transactions.py).
SELECT id, topic, ordering_key, payload, headers, event_id, created_at, attempts, true AS reclaimed
  FROM {table}
 WHERE id = ANY($ids::bigint[]) AND published_at IS NULL AND dead_at IS NULL
 ORDER BY id

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
-- (kafka/lanes.py). Its heartbeat made its row first; returns nothing if it is gone.
UPDATE {dispatchers} SET transactional_ids = $ids::text[], heartbeat_at = now()
 WHERE owner = $owner
RETURNING owner

-- transactional_ids_live --
-- Exactly-once: the dispatchers that beat within $live_seconds seconds, each with its delivery
-- mode and the transactional ids it recorded (NULL: none; a release older than version 15).
SELECT owner, delivery, transactional_ids FROM {dispatchers}
 WHERE heartbeat_at > now() - $live_seconds * interval '1 second'
 ORDER BY owner
