-- Every SQL statement the dispatcher runs at run time, by name. {schema}, {table}, {version_table}
-- and {claim_fn} are replaced once at startup by validated, quoted identifiers; every value is a
-- $n parameter.

-- claim --
-- Lease up to $1 rows of at most $2 ready keys under the token $5 the dispatcher chose (see the
-- claim function in schema/); one round trip. Exactly OutboxRecord's fields, in its order.
SELECT id, topic, ordering_key, payload, headers, event_id, created_at, attempts, reclaimed
  FROM {claim_fn}($1, $2, $3, $4, $5, $6, $7)

-- settle --
-- Record the outcome of one published batch and release its keys, fenced by the batch's lease
-- token: a dispatcher that lost its lease changes nothing. Returns the rows that were still ours.
SELECT * FROM {settle_fn}($1, $2, $3, $4, $5, $6, $7, $8)

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
-- Keep the leases of rows (and their keys) still in flight while their owner is alive; a lease
-- that already expired is not revived.
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
-- Rows whose every owner died or hung while publishing them: dead-letter instead of taking them
-- over again (the claim leaves them alone). The token of the lease that ended stays on the row:
-- an owner that was only slow may still deliver the row, and its late mark then records the
-- publication (see the settle function) instead of leaving a dead row that is in Kafka. Found without reading the table: a key with such a
-- row has it first (a takeover starts at a key's first row and stops at one), and the claim that
-- found nothing to take points the key's hint at it; so one primary-key probe per registered key,
-- then that key's rows, plus rows without a key from their own index. (A scan of the table here
-- read every row, history included, every reclaim interval.)
WITH heads AS (
    SELECT DISTINCT h.ordering_key
      FROM {keys} k
     CROSS JOIN LATERAL (
        SELECT o.ordering_key FROM {table} o
         WHERE o.id = k.head_id
           AND o.published_at IS NULL AND o.dead_at IS NULL
           AND o.lease_expires_at <= now() AND o.attempts + 1 >= $1
         LIMIT 1) h
),
looping AS (
    SELECT r.id
      FROM heads h
     CROSS JOIN LATERAL (
        SELECT o.id FROM {table} o
         WHERE o.ordering_key >= h.ordering_key AND o.ordering_key <= h.ordering_key
           AND o.published_at IS NULL AND o.dead_at IS NULL
           AND o.lease_expires_at <= now() AND o.attempts + 1 >= $1
         ORDER BY o.ordering_key, o.id) r
    UNION ALL
    SELECT n.id FROM {table} n
     WHERE n.ordering_key IS NULL AND n.published_at IS NULL AND n.dead_at IS NULL
       AND n.lease_expires_at <= now() AND n.attempts + 1 >= $1
)
UPDATE {table} o
   SET dead_at = now(),
       attempts = o.attempts + 1,
       lease_expires_at = NULL,
       last_error = format('dead-lettered: the lease expired %s times (the dispatcher that held it '
                           'crashed or hung while publishing, last owner %s); last error: %s',
                           o.attempts + 1, o.lease_owner, coalesce(o.last_error, 'none'))
  FROM looping l
 WHERE o.id = l.id AND o.published_at IS NULL AND o.dead_at IS NULL
   AND o.lease_expires_at <= now() AND o.attempts + 1 >= $1
RETURNING o.id, o.event_id, o.topic, o.ordering_key, o.lease_owner

-- count_expired_leases --
-- Leases whose owner died and that no claim took over yet: keys (from the registry's index of
-- leases) and rows without a key (from their own index).
SELECT (SELECT count(*) FROM {keys} k
         WHERE k.lease_token IS NOT NULL AND k.lease_expires_at <= now())
     + (SELECT count(*) FROM {table} n
         WHERE n.ordering_key IS NULL AND n.published_at IS NULL AND n.dead_at IS NULL
           AND n.lease_expires_at <= now())

-- schema_version --
SELECT coalesce(max(version), 0) FROM {version_table}

-- status --
-- Per topic: pending (not yet published; in flight included), in flight (live lease), dead,
-- published; of the pending rows, those parked on purpose (topic or table paused, held without a
-- failure: as in gauges), and the age of the oldest due row (the lag) and of the oldest parked
-- row, from {since_fn} (a time the database sets) for the lowest fresh id and every row an
-- operator made pending again.
WITH waiting_keys AS MATERIALIZED (
    SELECT k.ordering_key,
           EXISTS (SELECT FROM {table} o
                    WHERE o.id = k.head_id AND o.published_at IS NULL AND o.dead_at IS NULL
                      AND (o.topic IN (SELECT topic FROM {paused})
                           OR (o.attempts = 0 AND o.next_attempt_at > now()
                               AND o.lease_token IS NULL))) AS parked
      FROM {keys} k
     WHERE k.head_topic IN (SELECT topic FROM {paused}) OR k.not_before > now()
),
parked_keys AS (
    SELECT DISTINCT ordering_key FROM waiting_keys WHERE parked
),
flagged AS (
    SELECT o.id, o.topic, o.created_at, o.pending_since, o.lease_expires_at,
           o.published_at, o.dead_at,
           o.published_at IS NULL AND o.dead_at IS NULL AS is_pending,
           (pt.topic IS NOT NULL OR pk.ordering_key IS NOT NULL
            OR (o.attempts = 0 AND o.next_attempt_at > now() AND o.lease_token IS NULL)
            OR (SELECT EXISTS (SELECT FROM {paused} WHERE topic = '*'))) AS parked
      FROM {table} o
      LEFT JOIN {paused} pt ON pt.topic = o.topic
      LEFT JOIN parked_keys pk ON pk.ordering_key = o.ordering_key
                              AND o.published_at IS NULL AND o.dead_at IS NULL
),
per_topic AS (
    SELECT topic,
           count(*) FILTER (WHERE is_pending) AS pending,
           count(*) FILTER (WHERE is_pending AND lease_expires_at > now()) AS in_flight,
           count(*) FILTER (WHERE dead_at IS NOT NULL) AS dead,
           count(*) FILTER (WHERE published_at IS NOT NULL) AS published,
           count(*) FILTER (WHERE is_pending AND parked) AS parked,
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
-- The table gauges behind /metrics. One pass over the pending rows sorts them by why they wait:
-- `paused` (their topic or the whole table is paused, or the head of their key is in a paused
-- topic), `held` (not due and never failed, or of a key whose head is: waiting on purpose, e.g.
-- what an interrupted replay of version 0.1 left) and `due` (everything else: ready, in flight,
-- in backoff, behind a dead row). Key heads come from the registry, checked by primary key.
-- The lag that pages is the age of the oldest `due` row; parked rows (paused, held) have their own
-- count and age. Ages run from {since_fn} (a time the database sets, not the writer's created_at):
-- of the lowest id never made pending again, and of every row an operator made pending again.
-- The same pass counts keys waiting out a backoff and keys held without a failure; then dead rows,
-- keys blocked by a dead row when $1 (dead_letter_policy = block), and the pauses operators set.
WITH waiting_keys AS MATERIALIZED (
    -- Keys the registry says wait (head in a paused topic, or not due), each checked against its
    -- head row by primary key: paused (true), held (false), or neither (NULL).
    SELECT k.ordering_key,
           (SELECT coalesce(o.topic IN (SELECT topic FROM {paused}), false) FROM {table} o
             WHERE o.id = k.head_id AND o.published_at IS NULL AND o.dead_at IS NULL
               AND (o.topic IN (SELECT topic FROM {paused})
                    OR (o.attempts = 0 AND o.next_attempt_at > now() AND o.lease_token IS NULL)))
               AS paused
      FROM {keys} k
     WHERE k.head_topic IN (SELECT topic FROM {paused}) OR k.not_before > now()
),
parked_keys AS (
    SELECT ordering_key, bool_or(paused) AS paused FROM waiting_keys
     WHERE paused IS NOT NULL GROUP BY ordering_key
),
pending AS (
    SELECT o.id, o.created_at, o.pending_since, o.ordering_key, o.attempts, o.next_attempt_at,
           o.lease_token,
           pt.topic IS NOT NULL OR coalesce(pk.paused, false)
               OR (SELECT EXISTS (SELECT FROM {paused} WHERE topic = '*')) AS paused,
           (o.attempts = 0 AND o.next_attempt_at > now() AND o.lease_token IS NULL)
               OR pk.ordering_key IS NOT NULL AS held
      FROM {table} o
      LEFT JOIN {paused} pt ON pt.topic = o.topic
      LEFT JOIN parked_keys pk ON pk.ordering_key = o.ordering_key
     WHERE o.published_at IS NULL AND o.dead_at IS NULL
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
                    THEN {since_fn}(id, created_at, pending_since) END) AS held_rearmed,
           count(DISTINCT ordering_key)
               FILTER (WHERE attempts > 0 AND next_attempt_at > now()) AS backoff_keys,
           count(DISTINCT ordering_key)
               FILTER (WHERE attempts = 0 AND next_attempt_at > now() AND lease_token IS NULL)
               AS held_keys
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
       a.backoff_keys,
       a.held_keys,
       (SELECT count(DISTINCT d.ordering_key) FROM {table} d
         WHERE $1 AND d.dead_at IS NOT NULL
           AND EXISTS (SELECT FROM {table} p
                        WHERE p.ordering_key = d.ordering_key
                          AND p.published_at IS NULL AND p.dead_at IS NULL)) AS dead_blocked_keys,
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
-- Per topic of a key's head (its oldest pending row): keys whose head waits out a backoff after a
-- failure, keys held (not due, but never failed: what an interrupted replay of version 0.1 left),
-- and keys held by a dead row when $1 (dead_letter_policy = block).
WITH heads AS (
    SELECT DISTINCT ON (ordering_key) ordering_key, topic, next_attempt_at, attempts
      FROM {table}
     WHERE published_at IS NULL AND dead_at IS NULL AND ordering_key IS NOT NULL
     ORDER BY ordering_key, id
),
flagged AS (
    SELECT h.topic,
           h.next_attempt_at > now() AND h.attempts > 0 AS backoff,
           h.next_attempt_at > now() AND h.attempts = 0 AS held,
           $1::boolean AND EXISTS (SELECT 1 FROM {table} d
                                    WHERE d.ordering_key = h.ordering_key
                                      AND d.dead_at IS NOT NULL) AS dead_blocked
      FROM heads h
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

-- resume --
DELETE FROM {paused} WHERE topic = $1
RETURNING topic, paused_at, paused_by, reason

-- in_flight_rows --
-- Rows under a live lease (being published right now), of topic $1 or all.
SELECT count(*) FROM {table}
 WHERE published_at IS NULL AND dead_at IS NULL AND lease_expires_at > now()
   AND ($1::text IS NULL OR topic = $1)

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
-- A running dispatcher records itself, its dead-letter policy, its version and its counters of
-- rows published and dead-lettered since it started, with a heartbeat (by the database clock).
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
-- Rows under a live lease, per owner (what each dispatcher is publishing right now): a read of
-- the pending rows only (their partial indexes).
SELECT lease_owner AS owner, count(*) AS rows
  FROM {table}
 WHERE published_at IS NULL AND dead_at IS NULL AND lease_expires_at > now()
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
-- Keys whose head (oldest pending row) waits, for the console: in backoff after a failure, held
-- without having failed, or, when $1 (dead_letter_policy = block), behind a dead row of the key,
-- whose error is the reason. Filtered by the head's topic ($2, '(routed)': none) and the key
-- ($3); the oldest heads first, at most $4.
WITH heads AS (
    SELECT DISTINCT ON (ordering_key) id, ordering_key, topic, attempts, next_attempt_at,
           created_at, last_error
      FROM {table}
     WHERE published_at IS NULL AND dead_at IS NULL AND ordering_key IS NOT NULL
       AND ($3::text IS NULL OR ordering_key = $3)
     ORDER BY ordering_key, id
)
SELECT h.ordering_key, h.topic, h.id AS head_id, h.attempts, h.next_attempt_at, h.created_at,
       h.last_error, d.dead_rows, d.first_dead_id,
       (SELECT x.last_error FROM {table} x WHERE x.id = d.first_dead_id) AS dead_error
  FROM heads h
  CROSS JOIN LATERAL (SELECT count(*) AS dead_rows, min(x.id) AS first_dead_id FROM {table} x
                       WHERE $1::boolean AND x.ordering_key = h.ordering_key
                         AND x.dead_at IS NOT NULL) d
 WHERE ($2::text IS NULL OR h.topic IS NOT DISTINCT FROM nullif($2, '(routed)'))
   AND (h.next_attempt_at > now() OR d.dead_rows > 0)
 ORDER BY h.id
 LIMIT $4

-- row_detail --
-- One row in any state, for the console. The payload leaves the database only when $2
-- (OUTBOX_CONSOLE_SHOW_PAYLOAD, to a person logged in), and then at most its first $3 bytes.
SELECT id, event_id, topic, ordering_key, headers, attempts, created_at, next_attempt_at,
       lease_owner, lease_expires_at, published_at, dead_at, last_error, replays, pending_since,
       octet_length(payload) AS payload_bytes,
       CASE WHEN $2::boolean THEN substring(payload FROM 1 FOR $3::integer) END AS payload
  FROM {table}
 WHERE id = $1

-- row_by_event --
SELECT id FROM {table} WHERE event_id = $1

-- rows_window --
-- Rows in any state, newest first, from the id window [$1 - $2, $1): a bounded scan of the primary
-- key whatever the filters, which the page continues window by window. In state $3 (pending,
-- published, dead; NULL: any), of key $4, topic $5 ('(routed)': none), event id $6, with a header
-- whose "name=value" contains $7 (any case), a payload containing the bytes $8, created at or
-- after $9 and before $10, ids from $11; at most $12 rows.
SELECT o.id, o.event_id, o.topic, o.ordering_key, o.attempts, o.created_at, o.published_at,
       o.dead_at, o.replays, o.lease_expires_at > now() AS leased, left(o.last_error, 400) AS last_error,
       o.headers
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
