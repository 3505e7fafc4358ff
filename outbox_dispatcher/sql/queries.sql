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

-- Operator commands and table hygiene (operate/, cleanup.py). Filters are $n parameters: NULL
-- means "any". Mutating commands work in batches, each its own short transaction (a replay's are
-- one), walking ids upwards from a cursor, within the bound the operator confirmed.

-- _cause --
-- A dead row's cause, for grouping dead rows by error: the first 160 characters of last_error,
-- each run of hex digits that holds a digit (ids, sizes, times, owners) written as '#'.
regexp_replace(left(coalesce(o.last_error, ''), 160), '[0-9A-Fa-f]*[0-9][0-9A-Fa-f]*', '#', 'g')

-- _dead_filter --
-- The dead rows (alias o) an operator's filter selects, in every statement that reads or changes
-- dead rows: $1..$9 the filters of `dead list|requeue|discard`, $10 a cause (as _cause writes it),
-- and the bound an action was confirmed for: ids up to $11, dead before $12.
o.dead_at IS NOT NULL
   AND ($1::bigint[] IS NULL OR o.id = ANY ($1))
   AND ($2::text IS NULL OR o.ordering_key = $2)
   AND ($3::text IS NULL OR o.topic IS NOT DISTINCT FROM nullif($3, '(routed)'))
   AND ($4::timestamptz IS NULL OR o.created_at >= $4)
   AND ($5::timestamptz IS NULL OR o.created_at < $5)
   AND ($6::boolean IS NULL OR o.ordering_key IS NULL)
   AND ($7::timestamptz IS NULL OR o.dead_at >= $7)
   AND ($8::timestamptz IS NULL OR o.dead_at < $8)
   AND ($9::text IS NULL OR strpos(lower(o.last_error), lower($9)) > 0)
   AND ($10::text IS NULL OR {_cause} = $10)
   AND ($11::bigint IS NULL OR o.id <= $11)
   AND ($12::timestamptz IS NULL OR o.dead_at < $12)

-- _replay_filter --
-- The published rows (alias o) a replay's filter selects: $1..$6 the filters of `replay`, and
-- the bound it was confirmed for: ids up to $7, published before $8.
o.published_at IS NOT NULL
   AND ($1::bigint IS NULL OR o.id >= $1)
   AND ($2::bigint IS NULL OR o.id <= $2)
   AND ($3::text IS NULL OR o.ordering_key = $3)
   AND ($4::text IS NULL OR o.topic = $4)
   AND ($5::timestamptz IS NULL OR o.created_at >= $5)
   AND ($6::timestamptz IS NULL OR o.created_at < $6)
   AND ($7::bigint IS NULL OR o.id <= $7)
   AND ($8::timestamptz IS NULL OR o.published_at < $8)

-- _dead_columns --
o.id, o.event_id, o.topic, o.ordering_key, o.attempts, o.created_at, o.dead_at, o.last_error,
       o.headers

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
-- database's login role and the client's address, which a client cannot make up, after the
-- person the console knows ($3: "alice via console"; NULL from the CLI).
INSERT INTO {paused} AS p (topic, paused_by, reason)
VALUES ($1, coalesce($3 || ' as ', '') || session_user
            || coalesce('@' || host(inet_client_addr()), ''), $2)
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

-- dead_count --
-- How many dead rows a requeue or discard with these filters (and bound) would change.
SELECT count(*) FROM {table} o WHERE {_dead_filter}

-- dead_bound --
-- The count an action is confirmed for, and its bound: the matching dead rows that died before
-- this statement began, their highest id, and that time. The action then changes only rows with
-- ids up to that id that were dead before that time, and no more of them than were counted.
SELECT count(*) AS rows, max(o.id) AS max_id, statement_timestamp() AS before
  FROM {table} o
 WHERE {_dead_filter} AND o.dead_at < statement_timestamp()

-- dead_page_id --
-- Dead rows matching the filter, by id, after the cursor $13 (NULL: the first page), at most
-- $14. The _desc and dead_at variants are the other orders of the same page (keyset paging over
-- the partial indexes of dead rows).
SELECT {_dead_columns}
  FROM {table} o
 WHERE {_dead_filter} AND ($13::bigint IS NULL OR o.id > $13)
 ORDER BY o.id
 LIMIT $14

-- dead_page_id_desc --
SELECT {_dead_columns}
  FROM {table} o
 WHERE {_dead_filter} AND ($13::bigint IS NULL OR o.id < $13)
 ORDER BY o.id DESC
 LIMIT $14

-- dead_page_dead_at --
SELECT {_dead_columns}
  FROM {table} o
 WHERE {_dead_filter} AND ($13::timestamptz IS NULL OR (o.dead_at, o.id) > ($13, $14::bigint))
 ORDER BY o.dead_at, o.id
 LIMIT $15

-- dead_page_dead_at_desc --
SELECT {_dead_columns}
  FROM {table} o
 WHERE {_dead_filter} AND ($13::timestamptz IS NULL OR (o.dead_at, o.id) < ($13, $14::bigint))
 ORDER BY o.dead_at DESC, o.id DESC
 LIMIT $15

-- dead_groups --
-- Dead rows matching the filter, grouped by topic and cause (_cause): how many, the first and the
-- last death, and the group's first row, whose whole error is its sample; the largest groups
-- first, at most $13, each with the number of groups in all.
WITH g AS (
    SELECT o.topic, {_cause} AS cause, count(*) AS rows, min(o.dead_at) AS oldest_dead_at,
           max(o.dead_at) AS newest_dead_at, min(o.id) AS first_id
      FROM {table} o
     WHERE {_dead_filter}
     GROUP BY 1, 2
)
SELECT g.topic, g.cause, g.rows, g.oldest_dead_at, g.newest_dead_at, g.first_id,
       (SELECT x.last_error FROM {table} x WHERE x.id = g.first_id) AS sample_error,
       count(*) OVER () AS groups
  FROM g
 ORDER BY g.rows DESC, g.first_id
 LIMIT $13

-- dead_requeue --
-- One batch: matching dead rows with ids after $13, up to $14, become pending again (due now,
-- attempts reset); last_error keeps a trace. Dead rows are never leased, so no dispatcher races
-- this.
WITH batch AS (
    SELECT o.id FROM {table} o
     WHERE {_dead_filter} AND o.id > $13
     ORDER BY o.id
     LIMIT $14
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
SELECT (SELECT max(id) FROM batch) AS last_id, (SELECT count(*) FROM done) AS rows,
       (SELECT min(id) FROM done) AS first_id

-- dead_discard --
-- One batch: delete matching dead rows with ids after $13, up to $14.
WITH batch AS (
    SELECT o.id FROM {table} o
     WHERE {_dead_filter} AND o.id > $13
     ORDER BY o.id
     LIMIT $14
),
done AS (
    DELETE FROM {table} o USING batch b
     WHERE o.id = b.id AND o.dead_at IS NOT NULL
    RETURNING o.id
)
SELECT (SELECT max(id) FROM batch) AS last_id, (SELECT count(*) FROM done) AS rows,
       (SELECT min(id) FROM done) AS first_id

-- replay_count --
SELECT count(*) FROM {table} o WHERE {_replay_filter}

-- replay_bound --
-- As dead_bound, for a replay: matching rows published before this statement began.
SELECT count(*) AS rows, max(o.id) AS max_id, statement_timestamp() AS before
  FROM {table} o
 WHERE {_replay_filter} AND o.published_at < statement_timestamp()

-- replay_batch --
-- One batch of a replay: matching published rows with ids after $9, up to $10, become pending
-- again with their event id, due now, counted in `replays`. The whole replay runs in one
-- transaction (operate/actions.py), so dispatchers see all of its rows at once at commit, in id
-- order per key, or, if it is interrupted, none. Published rows are never leased, so no
-- dispatcher races this.
WITH batch AS (
    SELECT o.id FROM {table} o
     WHERE {_replay_filter} AND o.id > $9
     ORDER BY o.id
     LIMIT $10
),
done AS (
    UPDATE {table} o
       SET published_at = NULL,
           attempts = 0,
           next_attempt_at = now(),
           pending_since = now(),
           lease_token = NULL,
           lease_expires_at = NULL,
           replays = o.replays + 1,
           last_error = format('replayed by operator at %s (published before at %s)',
                               now(), o.published_at)
      FROM batch b
     WHERE o.id = b.id AND o.published_at IS NOT NULL
    RETURNING o.id
)
SELECT (SELECT max(id) FROM batch) AS last_id, (SELECT count(*) FROM done) AS rows,
       (SELECT min(id) FROM done) AS first_id

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

-- cleanup_count --
SELECT count(*) FROM {table} WHERE published_at < now() - $1 * interval '1 second'

-- _audit_live --
-- Whether the action of audit record a (status running) still runs: the connection that runs it
-- holds the advisory lock ($1, id) until it ends, and a connection that is gone holds nothing.
EXISTS (SELECT FROM pg_locks l
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
           AND l.classid = $1::integer::oid AND l.objid = a.id::integer::oid)

-- _audit_columns --
-- An audit record as operators read it: a record still running whose process died reads as
-- interrupted (its rows are those its last batch recorded).
a.id, a.at, a.db_role, a.session_role, host(a.client_addr) AS client_addr, a.command,
       a.filter::text AS filter, a.rows, a.expected, a.bound::text AS bound, a.identity,
       a.identity_source, a.updated_at, a.finished_at, a.detail, a.first_id, a.last_id,
       a.abort_requested_at, a.abort_requested_by,
       CASE WHEN a.status = 'running' AND NOT {_audit_live} THEN 'interrupted'
            ELSE a.status END AS status

-- audit_open --
-- An operator action is recorded before it changes anything (status running, rows 0), by the
-- database's who, where and when (the column defaults), and the connection that runs it takes
-- the advisory lock ($1, id). A request key ($9) already recorded inserts nothing: the action
-- was started before (a second click, a retried request).
INSERT INTO {audit} AS a (command, filter, rows, status, expected, bound, identity,
                          identity_source, request_key, updated_at)
VALUES ($2, $3::text::jsonb, 0, 'running', $4, $5::text::jsonb, $6, $7, $8, now())
ON CONFLICT (request_key) WHERE request_key IS NOT NULL DO NOTHING
RETURNING a.id, pg_try_advisory_lock($1, a.id::integer) AS locked

-- audit_by_request --
SELECT id FROM {audit} WHERE request_key = $1

-- audit_progress --
-- One batch done, in the batch's own transaction: the record's count is the rows changed so far
-- ($2), among ids $3..$4. Answers whether an operator asked the action to stop; no row: the
-- record is no longer running (the batch must not commit).
UPDATE {audit}
   SET rows = $2, updated_at = now(), first_id = coalesce(first_id, $3),
       last_id = greatest(last_id, $4)
 WHERE id = $1 AND status = 'running'
RETURNING abort_requested_at IS NOT NULL AS aborting

-- audit_aborting --
SELECT abort_requested_at IS NOT NULL FROM {audit} WHERE id = $1

-- audit_close --
-- The action ended: how ($2), with the rows it changed ($3) and the words its faces showed ($4).
UPDATE {audit}
   SET status = $2, rows = greatest(rows, $3), detail = $4, first_id = coalesce(first_id, $5),
       last_id = coalesce(greatest(last_id, $6), last_id, $6), updated_at = now(),
       finished_at = now()
 WHERE id = $1 AND status = 'running'
RETURNING id

-- audit_release --
SELECT pg_advisory_unlock($1, $2::integer)

-- audit_abort --
-- An operator asks a running action to stop after its current batch; the first asker is kept.
UPDATE {audit}
   SET abort_requested_at = coalesce(abort_requested_at, now()),
       abort_requested_by = coalesce(abort_requested_by, $2)
 WHERE id = $1 AND status = 'running'
RETURNING id

-- audit_sweep --
-- Records of actions whose process died (nobody holds their lock) are closed as interrupted, with
-- the rows their last batch recorded.
UPDATE {audit} a
   SET status = 'interrupted', finished_at = now(),
       detail = 'interrupted: its process stopped or lost its database connection'
 WHERE a.status = 'running' AND NOT {_audit_live}
RETURNING a.id

-- audit_list --
-- Operator actions, newest first, before id $2 (NULL: from the newest): of command $3, in status
-- $4 (as read), by a person or database role $5, at or after $6 and before $7; at most $8.
SELECT {_audit_columns}
  FROM {audit} a
 WHERE ($2::bigint IS NULL OR a.id < $2)
   AND ($3::text IS NULL OR a.command = $3)
   AND ($4::text IS NULL OR (CASE WHEN a.status = 'running' AND NOT {_audit_live}
                                  THEN 'interrupted' ELSE a.status END) = $4)
   AND ($5::text IS NULL OR $5 IN (a.identity, a.session_role, a.db_role))
   AND ($6::timestamptz IS NULL OR a.at >= $6)
   AND ($7::timestamptz IS NULL OR a.at < $7)
 ORDER BY a.id DESC
 LIMIT $8

-- audit_get --
SELECT {_audit_columns} FROM {audit} a WHERE a.id = $2

-- dispatcher_beat --
-- A running dispatcher records itself, its dead-letter policy, the schema version it runs and a
-- heartbeat (by the database clock) for `status` and `migrate` (which waits for older ones to go
-- before the contract step of an upgrade). From version 10 on: a dispatcher beats with this one
-- until the schema has the counters (version 12, dispatcher_beat_counted).
INSERT INTO {dispatchers} AS d (owner, dead_letter_policy, version) VALUES ($1, $2, $3)
ON CONFLICT (owner) DO UPDATE
   SET heartbeat_at = now(), dead_letter_policy = EXCLUDED.dead_letter_policy,
       version = EXCLUDED.version

-- dispatcher_beat_counted --
-- dispatcher_beat with the dispatcher's counters of rows published and dead-lettered since it
-- started (version 12: the console charts their rates).
INSERT INTO {dispatchers} AS d (owner, dead_letter_policy, version, published_total, dead_total)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (owner) DO UPDATE
   SET heartbeat_at = now(), dead_letter_policy = EXCLUDED.dead_letter_policy,
       version = EXCLUDED.version, published_total = EXCLUDED.published_total,
       dead_total = EXCLUDED.dead_total

-- dispatchers_live --
-- Dispatchers whose heartbeat is younger than $1 seconds.
SELECT owner, dead_letter_policy, started_at, heartbeat_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age_seconds,
       version, published_total, dead_total
  FROM {dispatchers}
 WHERE heartbeat_at > now() - $1 * interval '1 second'
 ORDER BY owner

-- in_flight_by_owner --
-- Rows held by a live claim, per owner (what each dispatcher is publishing right now): from the
-- claimed work (its index) and the rows of each claim.
SELECT lease_owner AS owner, count(*) AS rows
  FROM {leases}
 WHERE lease_expires_at > now()
 GROUP BY lease_owner

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
-- a dead row of the key, whose error is the reason. Filtered by that row's topic ($2,
-- '(routed)': none) and the key ($3); the oldest first, at most $4. From the engine's work and
-- the rows above its cursor (keys no claim has looked at yet): no scan of the table.
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
       h.last_error, coalesce(d.dead_rows, 0) AS dead_rows, d.first_dead_id,
       (SELECT x.last_error FROM {table} x WHERE x.id = d.first_dead_id) AS dead_error
  FROM heads k
  JOIN {table} h ON h.id = k.id AND h.published_at IS NULL AND h.dead_at IS NULL
  LEFT JOIN dead d ON d.ordering_key = k.ordering_key
 WHERE ($2::text IS NULL OR h.topic IS NOT DISTINCT FROM nullif($2, '(routed)'))
   AND (h.next_attempt_at > now() OR d.dead_rows > 0)
 ORDER BY h.id
 LIMIT $4

-- row_detail --
-- One row in any state, for the console, with the claim that holds it (if one does). The payload
-- leaves the database only when $2 (OUTBOX_CONSOLE_SHOW_PAYLOAD, to a person logged in), and
-- then at most its first $3 bytes.
SELECT o.id, o.event_id, o.topic, o.ordering_key, o.headers, o.attempts, o.created_at,
       o.next_attempt_at,
       coalesce(w.claim_owner, o.lease_owner) AS lease_owner,
       coalesce(w.claim_expires_at, o.lease_expires_at) AS lease_expires_at,
       o.published_at, o.dead_at, o.last_error, o.replays, o.pending_since,
       octet_length(o.payload) AS payload_bytes,
       CASE WHEN $2::boolean THEN substring(o.payload FROM 1 FOR $3::integer) END AS payload
  FROM {table} o
  LEFT JOIN {work} w
    ON w.ordering_key = coalesce(o.ordering_key, o.id::text) AND w.keyless = (o.ordering_key IS NULL)
   AND w.claim_token IS NOT NULL
   AND ((w.keyless) OR (o.id >= w.claim_first AND o.id < w.head_id))
   AND o.published_at IS NULL AND o.dead_at IS NULL
 WHERE o.id = $1

-- row_by_event --
SELECT id FROM {table} WHERE event_id = $1

-- rows_window --
-- Rows in any state, newest first, from the id window [$1 - $2, $1): a bounded scan of the primary
-- key whatever the filters, which the page continues window by window. In state $3 (pending,
-- published, dead; NULL: any), of key $4, topic $5 ('(routed)': none), event id $6, with a header
-- whose "name=value" contains $7 (any case), a payload containing the bytes $8, created at or
-- after $9 and before $10, ids from $11; at most $12 rows. `leased`: a live claim holds the row
-- (its key's work, by primary key, as in row_detail).
SELECT o.id, o.event_id, o.topic, o.ordering_key, o.attempts, o.created_at, o.published_at,
       o.dead_at, o.replays,
       o.published_at IS NULL AND o.dead_at IS NULL AND EXISTS (
           SELECT FROM {work} w
            WHERE w.ordering_key = coalesce(o.ordering_key, o.id::text)
              AND w.keyless = (o.ordering_key IS NULL)
              AND w.claim_token IS NOT NULL AND w.claim_expires_at > now()
              AND (w.keyless OR (o.id >= w.claim_first AND o.id < w.head_id))) AS leased,
       left(o.last_error, 400) AS last_error, o.headers
  FROM {table} o
 WHERE o.id < $1 AND o.id >= $1 - $2
   AND ($11::bigint IS NULL OR o.id >= $11)
   AND ($3::text IS NULL OR CASE $3 WHEN 'published' THEN o.published_at IS NOT NULL
                                    WHEN 'dead' THEN o.dead_at IS NOT NULL
                                    ELSE o.published_at IS NULL AND o.dead_at IS NULL END)
   AND ($4::text IS NULL OR o.ordering_key = $4)
   AND ($5::text IS NULL OR o.topic IS NOT DISTINCT FROM nullif($5, '(routed)'))
   AND ($6::uuid IS NULL OR o.event_id = $6)
   AND ($7::text IS NULL OR EXISTS (SELECT FROM jsonb_each_text(o.headers) h
                                     WHERE strpos(lower(h.key || '=' || h.value), lower($7)) > 0))
   AND ($8::bytea IS NULL OR position($8 IN o.payload) > 0)
   AND ($9::timestamptz IS NULL OR o.created_at >= $9)
   AND ($10::timestamptz IS NULL OR o.created_at < $10)
 ORDER BY o.id DESC
 LIMIT $12

-- routed_groups --
-- Rows without a topic, grouped by the values of the headers $1 the topic template names (the
-- console routes each group as the dispatcher would): pending, dead and published rows of each;
-- at most $2 groups.
SELECT v.header_values,
       count(*) FILTER (WHERE o.published_at IS NULL AND o.dead_at IS NULL) AS pending,
       count(*) FILTER (WHERE o.dead_at IS NOT NULL) AS dead,
       count(*) FILTER (WHERE o.published_at IS NOT NULL) AS published
  FROM {table} o
 CROSS JOIN LATERAL (SELECT array_agg(o.headers ->> u.n ORDER BY u.i) AS header_values
                       FROM unnest($1::text[]) WITH ORDINALITY AS u(n, i)) v
 WHERE o.topic IS NULL
 GROUP BY v.header_values
 ORDER BY count(*) DESC
 LIMIT $2

-- session_open --
-- A login: the session's id (the SHA-256 of its cookie's key), who, from where, with which token
-- ($4: a tag of it), for $5 seconds.
INSERT INTO {sessions} (id, identity, client_addr, token_tag, expires_at)
VALUES ($1, $2, $3, $4, now() + $5 * interval '1 second')

-- session_get --
-- A session that still counts: not ended, not expired, logged in with the current token.
SELECT identity, created_at, expires_at FROM {sessions}
 WHERE id = $1 AND ended_at IS NULL AND expires_at > now() AND token_tag = $2

-- session_end --
UPDATE {sessions} SET ended_at = now() WHERE id = $1 AND ended_at IS NULL

-- session_prune --
-- Forget sessions that ended or expired a day ago.
DELETE FROM {sessions}
 WHERE expires_at < now() - interval '1 day' OR ended_at < now() - interval '1 day'

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
