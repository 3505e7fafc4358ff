-- Every SQL statement the dispatcher runs at run time, by name. {schema}, {table}, {work} and the
-- other names in braces are replaced once at startup by validated, quoted identifiers; every value
-- is a $n parameter.

-- claim --
-- Lease up to $1 rows of at most $2 keys under the token $5 the dispatcher chose, looking at up
-- to $8 new rows (see the claim function in schema/); one round trip. Exactly OutboxRecord's
-- fields, in its order.
SELECT id, topic, ordering_key, payload, headers, event_id, created_at, attempts, reclaimed
  FROM {claim_fn}($1, $2, $3, $4, $5, $6, $7, $8)

-- settle --
-- Record the outcome of one published batch and release its keys, fenced by the batch's lease
-- token: a dispatcher that lost its lease changes nothing. Returns the rows that were still ours.
SELECT * FROM {settle_fn}($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)

-- already_settled --
-- After a settle whose first attempt went unanswered and whose retry changed fewer rows: how many
-- of the rows $1 that attempt settled (it committed; its reply was lost). They show the outcome
-- $3 with no lease, last leased by this dispatcher ($2), with the attempts that settle set ($4);
-- under delete-on-publish ($5) a published row is gone. A row another dispatcher took over has
-- that dispatcher as its owner, or one attempt more (the takeover counts one); one the reclaimer
-- dead-lettered as a crash loop keeps its token.
SELECT count(*)
  FROM unnest($1::bigint[], $3::text[], $4::integer[]) AS r(id, outcome, attempts)
  LEFT JOIN {table} o ON o.id = r.id
 WHERE CASE WHEN o.id IS NULL THEN r.outcome = 'published' AND $5::boolean
            ELSE o.lease_token IS NULL AND o.lease_owner = $2 AND o.attempts = r.attempts
                 AND CASE r.outcome
                         WHEN 'published' THEN o.published_at IS NOT NULL
                         WHEN 'dead' THEN o.dead_at IS NOT NULL
                         ELSE o.published_at IS NULL AND o.dead_at IS NULL
                     END
       END

-- extend_leases --
-- Keep the leases of work still in flight while their owner is alive; a lease that already
-- expired is not revived. Returns the ids whose work is still held.
SELECT * FROM {extend_fn}($1, $2, $3)

-- release_claim --
-- Give back whatever a claim whose reply was lost leased under token $1.
SELECT {release_fn}($1)

-- waiting_announce --
-- This dispatcher waits for a wake-up until $2 seconds from now: writers' trigger notifies while
-- any dispatcher waits, and only then.
INSERT INTO {waiting} AS w (owner, until) VALUES ($1, now() + $2 * interval '1 second')
ON CONFLICT (owner) DO UPDATE SET until = EXCLUDED.until

-- waiting_withdraw --
DELETE FROM {waiting} WHERE owner = $1

-- dead_letter_crash_loops --
-- Work whose every owner died or hung while publishing it (the claim that found its first row at
-- max_attempts $1 left it to this): dead-letter those rows instead of taking them over again.
-- The token of the lease that ended stays on the row: an owner that was only slow may still
-- deliver the row, and its late mark then records the publication (see the settle function)
-- instead of leaving a dead row that is in Kafka. $2: dead_letter_policy = block.
SELECT id, event_id, topic, ordering_key, lease_owner FROM {reclaim_fn}($1, $2)

-- count_expired_leases --
-- Work whose owner died and that no claim took over yet, from the index of leased work.
SELECT count(*) FROM {work} w
 WHERE w.claim_token IS NOT NULL AND w.claim_expires_at <= now() AND w.state <> 'x'

-- schema_version --
SELECT greatest((SELECT coalesce(max(version), 0) FROM {version_table}),
                (SELECT coalesce(max(version), 0) FROM {steps_table}))

-- status --
-- Per topic: pending (not yet published; in flight included), in flight (held by a live claim),
-- dead, published; of the pending rows, those parked on purpose (topic or table paused, held
-- without a failure, or behind such a row of their key), and the age of the oldest due
-- row (the lag) and of the oldest parked row, from {since_fn} (a time the database sets) for the
-- lowest fresh id and every row an operator made pending again. One pass over the table: an
-- operator's command, not the dispatcher's.
WITH live AS MATERIALIZED (
    SELECT w.ordering_key, w.keyless, w.claim_first, w.head_id
      FROM {work} w
     WHERE w.claim_token IS NOT NULL AND w.claim_expires_at > now()
),
rows AS MATERIALIZED (
    SELECT o.id, o.ordering_key, o.topic, o.created_at, o.pending_since, o.published_at,
           o.dead_at, o.published_at IS NULL AND o.dead_at IS NULL AS is_pending,
           pt.topic IS NOT NULL OR (o.attempts = 0 AND o.next_attempt_at > now()) AS own_parked,
           l.ordering_key IS NOT NULL
               AND (l.keyless OR (o.id >= l.claim_first AND o.id < l.head_id)) AS in_flight
      FROM {table} o
      LEFT JOIN {paused} pt ON pt.topic = o.topic
      LEFT JOIN live l
        ON l.ordering_key = coalesce(o.ordering_key, o.id::text) AND l.keyless = (o.ordering_key IS NULL)
),
-- A key's rows from its first parked pending row on wait behind it: parked too.
marks AS (
    SELECT ordering_key, min(id) AS parked_from
      FROM rows
     WHERE is_pending AND own_parked AND ordering_key IS NOT NULL
     GROUP BY ordering_key
),
flagged AS (
    SELECT r.*,
           r.own_parked OR coalesce(r.id >= m.parked_from, false)
               OR (SELECT EXISTS (SELECT FROM {paused} WHERE topic = '*')) AS parked
      FROM rows r
      LEFT JOIN marks m ON m.ordering_key = r.ordering_key
),
per_topic AS (
    SELECT topic,
           count(*) FILTER (WHERE is_pending) AS pending,
           count(*) FILTER (WHERE is_pending AND in_flight) AS in_flight,
           count(*) FILTER (WHERE dead_at IS NOT NULL) AS dead,
           count(*) FILTER (WHERE published_at IS NOT NULL) AS published,
           count(*) FILTER (WHERE is_pending AND parked AND NOT in_flight) AS parked,
           min(id) FILTER (WHERE is_pending AND NOT parked AND pending_since IS NULL) AS due_fresh,
           min(CASE WHEN is_pending AND NOT parked AND pending_since IS NOT NULL
                    THEN {since_fn}(id, created_at, pending_since) END) AS due_rearmed,
           min(id) FILTER (WHERE is_pending AND parked AND pending_since IS NULL) AS parked_fresh,
           min(CASE WHEN is_pending AND parked AND pending_since IS NOT NULL
                    THEN {since_fn}(id, created_at, pending_since) END) AS parked_rearmed
      FROM flagged
     GROUP BY topic
)
SELECT t.topic, t.pending, t.in_flight, t.dead, t.published, t.parked,
       extract(epoch FROM now() - least(
           (SELECT {since_fn}(o.id, o.created_at, NULL) FROM {table} o WHERE o.id = t.due_fresh),
           t.due_rearmed))::float8 AS oldest_pending_age_seconds,
       extract(epoch FROM now() - least(
           (SELECT {since_fn}(o.id, o.created_at, NULL) FROM {table} o WHERE o.id = t.parked_fresh),
           t.parked_rearmed))::float8 AS oldest_parked_age_seconds
  FROM per_topic t
 ORDER BY t.topic

-- gauges --
-- The table gauges behind /metrics, from what the engine knows, never a scan of the table: the
-- rows above the cursor (not looked at yet) and the pending rows of each piece of work, read from
-- its first row (its claim's first while leased) through the key index. Each is sorted by why it
-- waits: `paused` (its topic or the whole table is paused, or an earlier pending row's of its key
-- is), `held` (not due and never failed, or of a key waiting on such a row) and `due` (everything else:
-- ready, in flight, in backoff, behind a dead row). The lag that pages is the age of the oldest
-- `due` row; parked rows (paused, held) have their own count and age. Ages run from {since_fn}
-- (a time the database sets, not the writer's created_at): of the lowest id never made pending
-- again, and of every row an operator made pending again. Then counts of keys by why their first
-- pending row waits (backoff, held; behind a dead row under $1: dead_letter_policy = block), dead
-- rows (their own index), and the pauses operators set.
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
         WHERE $1 AND k.ordering_key IN (SELECT d.ordering_key FROM {table} d
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
-- Forget entries that no pending row needs: those below the last entry under the lowest pending
-- id $1 (NULL: nothing pending), and only once a day old, so that a row of a long transaction
-- still uncommitted below that id keeps its bound.
DELETE FROM {clock}
 WHERE at < now() - interval '1 day'
   AND seq < (SELECT max(c.seq) FROM {clock} c
               WHERE c.seq < coalesce($1::bigint, (SELECT max(seq) + 1 FROM {clock})))

-- inbox_record --
-- Consumer side: remember an event id in the same transaction as the handler's writes; no row
-- back means it was processed before (or is being processed right now by another consumer, whose
-- commit this waits for).
INSERT INTO {inbox} (event_id, topic, kafka_partition, kafka_offset)
VALUES ($1, $2, $3, $4)
ON CONFLICT (event_id) DO NOTHING
RETURNING event_id

-- Operator commands and table hygiene (admin.py, cleanup.py, status.py). Filters are $n
-- parameters: NULL means "any". Mutating commands work in batches, each its own short
-- transaction, walking ids upwards from a cursor ($after) to a bound fixed when the command starts.

-- status_keys --
-- Per topic of a key's next row: keys waiting out a backoff after a failure, keys held (not
-- due, but never failed: what an interrupted replay of version 0.1 left), and keys held by a dead
-- row when $1 (dead_letter_policy = block). From the rows themselves (keys no claim has looked at
-- yet count too): an operator's command, one pass over the pending rows.
WITH heads AS (
    SELECT DISTINCT ON (o.ordering_key) o.ordering_key, o.topic, o.next_attempt_at, o.attempts
      FROM {table} o
     WHERE o.ordering_key IS NOT NULL AND o.published_at IS NULL AND o.dead_at IS NULL
     ORDER BY o.ordering_key, o.id
),
dead AS (
    SELECT DISTINCT d.ordering_key FROM {table} d
     WHERE $1::boolean AND d.dead_at IS NOT NULL AND d.ordering_key IS NOT NULL
),
flagged AS (
    SELECT h.topic,
           h.next_attempt_at > now() AND h.attempts > 0 AS backoff,
           h.next_attempt_at > now() AND h.attempts = 0 AS held,
           d.ordering_key IS NOT NULL AS dead_blocked
      FROM heads h
      LEFT JOIN dead d ON d.ordering_key = h.ordering_key
)
SELECT topic,
       count(*) FILTER (WHERE backoff OR held OR dead_blocked) AS blocked_keys,
       count(*) FILTER (WHERE dead_blocked) AS dead_blocked_keys,
       count(*) FILTER (WHERE held AND NOT dead_blocked) AS held_keys
  FROM flagged
 GROUP BY topic

-- paused_list --
SELECT topic, paused_at, paused_by, reason FROM {paused} ORDER BY topic

-- pause --
-- Pausing again keeps the first paused_at and records the latest who and why. Who is the
-- database's login role and the client's address, which a client cannot make up.
INSERT INTO {paused} AS p (topic, paused_by, reason)
VALUES ($1, session_user || coalesce('@' || host(inet_client_addr()), ''), $2)
ON CONFLICT (topic) DO UPDATE SET paused_by = EXCLUDED.paused_by, reason = EXCLUDED.reason
RETURNING topic, paused_at, paused_by, reason

-- wait_for_pause_readers --
-- After a pause committed: wait until every transaction that read the pauses before it has ended
-- (each claim reads them first and holds them until it commits, so a claim that began before the
-- pause may still lease rows of the topic). Bounded: a lock_timeout error leaves the count as it
-- was.
DO $$ BEGIN SET LOCAL lock_timeout = '5s'; LOCK TABLE {paused} IN ACCESS EXCLUSIVE MODE; END $$

-- resume --
DELETE FROM {paused} WHERE topic = $1
RETURNING topic, paused_at, paused_by, reason

-- in_flight_rows --
-- Rows held by a live claim (being published right now), of topic $1 or all.
SELECT count(*) FROM {leases}
 WHERE lease_expires_at > now() AND ($1::text IS NULL OR topic = $1)

-- wake --
-- The same hint the insert trigger sends: idle dispatchers claim at once.
SELECT pg_notify($1, '')

-- max_id --
SELECT coalesce(max(id), 0) FROM {table}

-- dead_list --
SELECT id, event_id, topic, ordering_key, attempts, created_at, dead_at, last_error
  FROM {table}
 WHERE dead_at IS NOT NULL
   AND ($1::bigint[] IS NULL OR id = ANY ($1))
   AND ($2::text IS NULL OR ordering_key = $2)
   AND ($3::text IS NULL OR topic IS NOT DISTINCT FROM nullif($3, '(routed)'))
   AND ($4::timestamptz IS NULL OR created_at >= $4)
   AND ($5::timestamptz IS NULL OR created_at < $5)
   AND ($6::boolean IS NULL OR ordering_key IS NULL)
   AND ($7::timestamptz IS NULL OR dead_at >= $7)
   AND ($8::timestamptz IS NULL OR dead_at < $8)
   AND ($9::text IS NULL OR strpos(lower(last_error), lower($9)) > 0)
 ORDER BY id
 LIMIT $10

-- dead_requeue --
-- One batch: dead rows with ids in ($10, $11], up to $12, become pending again (due now, attempts
-- reset); last_error keeps a trace. Dead rows are never leased, so no dispatcher races this.
WITH batch AS (
    SELECT id FROM {table}
     WHERE dead_at IS NOT NULL
       AND ($1::bigint[] IS NULL OR id = ANY ($1))
       AND ($2::text IS NULL OR ordering_key = $2)
       AND ($3::text IS NULL OR topic IS NOT DISTINCT FROM nullif($3, '(routed)'))
       AND ($4::timestamptz IS NULL OR created_at >= $4)
       AND ($5::timestamptz IS NULL OR created_at < $5)
       AND ($6::boolean IS NULL OR ordering_key IS NULL)
       AND ($7::timestamptz IS NULL OR dead_at >= $7)
       AND ($8::timestamptz IS NULL OR dead_at < $8)
       AND ($9::text IS NULL OR strpos(lower(last_error), lower($9)) > 0)
       AND id > $10 AND id <= $11
     ORDER BY id
     LIMIT $12
),
done AS (
    UPDATE {table} o
       SET dead_at = NULL,
           attempts = 0,
           next_attempt_at = now(),
           pending_since = now(),
           lease_token = NULL,
           lease_expires_at = NULL,
           last_error = format('requeued by operator at %s (dead since %s: %s)',
                               now(), o.dead_at, coalesce(o.last_error, 'no error recorded'))
      FROM batch b
     WHERE o.id = b.id AND o.dead_at IS NOT NULL
    RETURNING o.id
)
SELECT (SELECT max(id) FROM batch) AS last_id, (SELECT count(*) FROM done) AS rows

-- dead_discard --
-- One batch: delete dead rows with ids in ($10, $11], up to $12.
WITH batch AS (
    SELECT id FROM {table}
     WHERE dead_at IS NOT NULL
       AND ($1::bigint[] IS NULL OR id = ANY ($1))
       AND ($2::text IS NULL OR ordering_key = $2)
       AND ($3::text IS NULL OR topic IS NOT DISTINCT FROM nullif($3, '(routed)'))
       AND ($4::timestamptz IS NULL OR created_at >= $4)
       AND ($5::timestamptz IS NULL OR created_at < $5)
       AND ($6::boolean IS NULL OR ordering_key IS NULL)
       AND ($7::timestamptz IS NULL OR dead_at >= $7)
       AND ($8::timestamptz IS NULL OR dead_at < $8)
       AND ($9::text IS NULL OR strpos(lower(last_error), lower($9)) > 0)
       AND id > $10 AND id <= $11
     ORDER BY id
     LIMIT $12
),
done AS (
    DELETE FROM {table} o USING batch b
     WHERE o.id = b.id AND o.dead_at IS NOT NULL
    RETURNING o.id
)
SELECT (SELECT max(id) FROM batch) AS last_id, (SELECT count(*) FROM done) AS rows

-- replay_batch --
-- One batch of a replay: published rows with ids in ($7, $8], up to $9, become pending again with
-- their event id, due now. The whole replay runs in one transaction (admin.replay), so dispatchers
-- see all of its rows at once at commit, in id order per key, or, if the command is interrupted,
-- none. Published rows are never leased, so no dispatcher races this.
WITH batch AS (
    SELECT id FROM {table}
     WHERE published_at IS NOT NULL
       AND ($1::bigint IS NULL OR id >= $1)
       AND ($2::bigint IS NULL OR id <= $2)
       AND ($3::text IS NULL OR ordering_key = $3)
       AND ($4::text IS NULL OR topic = $4)
       AND ($5::timestamptz IS NULL OR created_at >= $5)
       AND ($6::timestamptz IS NULL OR created_at < $6)
       AND id > $7 AND id <= $8
     ORDER BY id
     LIMIT $9
),
done AS (
    UPDATE {table} o
       SET published_at = NULL,
           attempts = 0,
           next_attempt_at = now(),
           pending_since = now(),
           lease_token = NULL,
           lease_expires_at = NULL,
           last_error = format('replayed by operator at %s (published before at %s)',
                               now(), o.published_at)
      FROM batch b
     WHERE o.id = b.id AND o.published_at IS NOT NULL
    RETURNING o.id
)
SELECT (SELECT max(id) FROM batch) AS last_id, (SELECT count(*) FROM done) AS rows

-- release_held --
-- Rows that an interrupted replay of version 0.1 (which held rows pending but not due for ten
-- minutes, then released them batch by batch) left held: due now, in topic $1 or all.
WITH released AS (
    UPDATE {table} SET next_attempt_at = now(), pending_since = now()
     WHERE published_at IS NULL AND dead_at IS NULL AND lease_token IS NULL
       AND attempts = 0 AND next_attempt_at > now()
       AND last_error LIKE 'replayed by operator at %'
       AND ($1::text IS NULL OR topic = $1)
    RETURNING id
)
SELECT count(*) FROM released

-- dead_count --
-- How many dead rows a requeue or discard with these filters would change (--dry-run, progress).
SELECT count(*) FROM {table}
 WHERE dead_at IS NOT NULL
   AND ($1::bigint[] IS NULL OR id = ANY ($1))
   AND ($2::text IS NULL OR ordering_key = $2)
   AND ($3::text IS NULL OR topic IS NOT DISTINCT FROM nullif($3, '(routed)'))
   AND ($4::timestamptz IS NULL OR created_at >= $4)
   AND ($5::timestamptz IS NULL OR created_at < $5)
   AND ($6::boolean IS NULL OR ordering_key IS NULL)
   AND ($7::timestamptz IS NULL OR dead_at >= $7)
   AND ($8::timestamptz IS NULL OR dead_at < $8)
   AND ($9::text IS NULL OR strpos(lower(last_error), lower($9)) > 0)

-- replay_count --
SELECT count(*) FROM {table}
 WHERE published_at IS NOT NULL
   AND ($1::bigint IS NULL OR id >= $1)
   AND ($2::bigint IS NULL OR id <= $2)
   AND ($3::text IS NULL OR ordering_key = $3)
   AND ($4::text IS NULL OR topic = $4)
   AND ($5::timestamptz IS NULL OR created_at >= $5)
   AND ($6::timestamptz IS NULL OR created_at < $6)

-- cleanup_count --
SELECT count(*) FROM {table} WHERE published_at < now() - $1 * interval '1 second'

-- audit --
-- One operator action; who (current_user, session_user), from where (inet_client_addr()) and
-- when are the column defaults, set by the database, not by the client.
INSERT INTO {audit} (command, filter, rows) VALUES ($1, $2::text::jsonb, $3)

-- dispatcher_beat --
-- A running dispatcher records itself, its dead-letter policy, the schema version it runs and a
-- heartbeat (by the database clock) for `status` and `migrate` (which waits for older ones to go
-- before the contract step of an upgrade).
INSERT INTO {dispatchers} AS d (owner, dead_letter_policy, version) VALUES ($1, $2, $3)
ON CONFLICT (owner) DO UPDATE
   SET heartbeat_at = now(), dead_letter_policy = EXCLUDED.dead_letter_policy,
       version = EXCLUDED.version

-- dispatchers_live --
-- Dispatchers whose heartbeat is younger than $1 seconds.
SELECT owner, dead_letter_policy, started_at, heartbeat_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age_seconds
  FROM {dispatchers}
 WHERE heartbeat_at > now() - $1 * interval '1 second'
 ORDER BY owner

-- cleanup_window --
-- One retention batch: of the next $3 rows by id after $1, delete those published more than $2
-- seconds ago (never pending or dead rows). Rows already locked (a concurrent retention run or an
-- operator command) are skipped. older_rows says whether the window held rows created before the
-- cutoff; a window without any means the rest of the table is younger, and the walk can stop.
WITH win AS (
    SELECT id, created_at FROM {table} WHERE id > $1 ORDER BY id LIMIT $3
),
doomed AS (
    SELECT o.id FROM {table} o JOIN win w ON w.id = o.id
     WHERE o.published_at < now() - $2 * interval '1 second'
       FOR UPDATE OF o SKIP LOCKED
),
gone AS (
    DELETE FROM {table} o USING doomed d WHERE o.id = d.id RETURNING o.id
)
SELECT (SELECT max(id) FROM win) AS last_id,
       (SELECT count(*) FROM win) AS seen,
       (SELECT count(*) FROM gone) AS deleted,
       coalesce((SELECT min(created_at) FROM win) < now() - $2 * interval '1 second', false)
           AS older_rows

-- pending_topics --
SELECT DISTINCT topic FROM {table}
 WHERE published_at IS NULL AND dead_at IS NULL AND topic IS NOT NULL

-- dead_topics --
-- Topics of dead rows: check says which do not exist, so that a requeue would not die again.
SELECT DISTINCT topic FROM {table} WHERE dead_at IS NOT NULL AND topic IS NOT NULL

-- pending_routed_headers --
-- The oldest $1 pending rows the dispatcher routes itself (check routes them as the publisher would).
SELECT headers FROM {table}
 WHERE published_at IS NULL AND dead_at IS NULL AND topic IS NULL
 ORDER BY id
 LIMIT $1

-- blocked_keys --
-- Keys whose next row waits, for the console: in backoff after a failure, held without having
-- failed (an interrupted replay of version 0.1), or, when $1 (dead_letter_policy = block), behind
-- a dead row of the key. Filtered by that row's topic ($2, '(routed)': none) and the key ($3);
-- the oldest first, at most $4. From the engine's work and the rows above its cursor (keys no
-- claim has looked at yet): no scan of the table.
WITH c AS MATERIALIZED (SELECT position FROM {cursor} WHERE one),
heads AS (
    SELECT w.ordering_key, w.head_id AS id
      FROM {work} w
     WHERE NOT w.keyless AND w.claim_token IS NULL AND ($3::text IS NULL OR w.ordering_key = $3)
    UNION ALL
    (SELECT DISTINCT ON (o.ordering_key) o.ordering_key, o.id
       FROM {table} o
      WHERE o.id > (SELECT position FROM c) AND o.ordering_key IS NOT NULL
        AND o.published_at IS NULL AND o.dead_at IS NULL
        AND ($3::text IS NULL OR o.ordering_key = $3)
        AND NOT EXISTS (SELECT 1 FROM {work} w
                         WHERE w.ordering_key = o.ordering_key AND NOT w.keyless)
      ORDER BY o.ordering_key, o.id)
),
dead AS (
    SELECT d.ordering_key, count(*) AS dead_rows, min(d.id) AS first_dead_id
      FROM {table} d
     WHERE $1::boolean AND d.dead_at IS NOT NULL AND d.ordering_key IS NOT NULL
     GROUP BY d.ordering_key
)
SELECT k.ordering_key, h.topic, h.id AS head_id, h.attempts, h.next_attempt_at, h.created_at,
       h.last_error, coalesce(d.dead_rows, 0) AS dead_rows, d.first_dead_id
  FROM heads k
  JOIN {table} h ON h.id = k.id AND h.published_at IS NULL AND h.dead_at IS NULL
  LEFT JOIN dead d ON d.ordering_key = k.ordering_key
 WHERE ($2::text IS NULL OR h.topic IS NOT DISTINCT FROM nullif($2, '(routed)'))
   AND (h.next_attempt_at > now() OR d.dead_rows > 0)
 ORDER BY h.id
 LIMIT $4

-- row_detail --
-- One row in any state, for the console, with the claim that holds it (if one does). The payload
-- leaves the database only when $2 (OUTBOX_CONSOLE_SHOW_PAYLOAD), and then at most its first $3
-- bytes.
SELECT o.id, o.event_id, o.topic, o.ordering_key, o.headers, o.attempts, o.created_at,
       o.next_attempt_at,
       coalesce(w.claim_owner, o.lease_owner) AS lease_owner,
       coalesce(w.claim_expires_at, o.lease_expires_at) AS lease_expires_at,
       o.published_at, o.dead_at, o.last_error,
       octet_length(o.payload) AS payload_bytes,
       CASE WHEN $2::boolean THEN substring(o.payload FROM 1 FOR $3::integer) END AS payload
  FROM {table} o
  LEFT JOIN {work} w
    ON w.ordering_key = coalesce(o.ordering_key, o.id::text) AND w.keyless = (o.ordering_key IS NULL)
   AND w.claim_token IS NOT NULL
   AND ((w.keyless) OR (o.id >= w.claim_first AND o.id < w.head_id))
   AND o.published_at IS NULL AND o.dead_at IS NULL
 WHERE o.id = $1

-- audit_list --
-- Operator actions, newest first: of command $1 (any when NULL), at most $2.
SELECT id, at, db_role, session_role, host(client_addr) AS client_addr, command,
       filter::text AS filter, rows
  FROM {audit}
 WHERE ($1::text IS NULL OR command = $1)
 ORDER BY id DESC
 LIMIT $2
-- schema_version_before_steps --
-- The version of a schema older than 10 (no <table>_schema_steps yet).
SELECT coalesce(max(version), 0) FROM {version_table}

-- sweep --
-- The anti-entropy sweep: the next $1 rows from its place; returns how many pending rows it found
-- that no work covered (now registered; a row a live claim's range holds waits $2 seconds, a
-- lease) and whether it finished a pass.
SELECT repaired, wrapped FROM {sweep_fn}($1, $2)

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
-- Dispatchers that beat within $1 seconds and run a version older than $2 (version 9 and older
-- record none).
SELECT count(*) FROM {dispatchers}
 WHERE heartbeat_at > now() - $1 * interval '1 second'
   AND (version IS NULL OR version < $2)
