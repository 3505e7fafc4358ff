-- The statements of the operator layer (operate/) and the console, by name.
-- {schema}, {table}, {work} and the other names in braces are replaced once at startup by
-- validated, quoted identifiers; every value is a named parameter ($name), bound by name.

-- Operator commands and table hygiene (operate/, cleanup.py). Filters are parameters: NULL
-- means "any". Mutating commands work in batches, each its own short transaction (a replay's are
-- one), walking ids upwards from a cursor, within the bound the operator confirmed.

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

-- _cause --
-- A dead row's cause, for grouping dead rows by error: the first 160 characters of last_error,
-- each run of hex digits that holds a digit (ids, sizes, times, owners) written as '#'.
regexp_replace(left(coalesce(o.last_error, ''), 160), '[0-9A-Fa-f]*[0-9][0-9A-Fa-f]*', '#', 'g')

-- _dead_filter --
-- The dead rows (alias o) an operator's filter selects, in every statement that reads or changes
-- dead rows: $ids..$error the filters of `dead list|requeue|discard`, $cause a cause (as _cause
-- writes it), and the bound an action was confirmed for: ids up to $max_id, dead before $before.
o.dead_at IS NOT NULL
   AND ($ids::bigint[] IS NULL OR o.id = ANY ($ids))
   AND ($key::text IS NULL OR o.ordering_key = $key)
   AND ($topic::text IS NULL OR o.topic IS NOT DISTINCT FROM nullif($topic, '(routed)'))
   AND ($since::timestamptz IS NULL OR o.created_at >= $since)
   AND ($until::timestamptz IS NULL OR o.created_at < $until)
   AND ($keyless::boolean IS NULL OR o.ordering_key IS NULL)
   AND ($dead_since::timestamptz IS NULL OR o.dead_at >= $dead_since)
   AND ($dead_until::timestamptz IS NULL OR o.dead_at < $dead_until)
   AND ($error::text IS NULL OR strpos(lower(o.last_error), lower($error)) > 0)
   AND ($cause::text IS NULL OR {_cause} = $cause)
   AND ($max_id::bigint IS NULL OR o.id <= $max_id)
   AND ($before::timestamptz IS NULL OR o.dead_at < $before)

-- _replay_filter --
-- The published rows (alias o) a replay's filter selects: $from_id..$until the filters of `replay`,
-- and the bound it was confirmed for: ids up to $max_id, published before $before.
o.published_at IS NOT NULL
   AND ($from_id::bigint IS NULL OR o.id >= $from_id)
   AND ($to_id::bigint IS NULL OR o.id <= $to_id)
   AND ($key::text IS NULL OR o.ordering_key = $key)
   AND ($topic::text IS NULL OR o.topic = $topic)
   AND ($since::timestamptz IS NULL OR o.created_at >= $since)
   AND ($until::timestamptz IS NULL OR o.created_at < $until)
   AND ($max_id::bigint IS NULL OR o.id <= $max_id)
   AND ($before::timestamptz IS NULL OR o.published_at < $before)

-- _dead_columns --
o.id, o.event_id, o.topic, o.ordering_key, o.attempts, o.created_at, o.dead_at, o.last_error,
       o.headers

-- _dead_batch --
-- The next batch of an operator's bulk action on dead rows: matching ids after $after, up to
-- $limit, in id order.
batch AS (
    SELECT o.id FROM {table} o
     WHERE {_dead_filter} AND o.id > $after
     ORDER BY o.id
     LIMIT $limit
)

-- _replay_batch --
-- The next batch of a replay: matching published ids after $after, up to $limit, in id order.
batch AS (SELECT o.id FROM {table} o WHERE {_replay_filter} AND o.id > $after
           ORDER BY o.id LIMIT $limit)

-- _pending_again --
-- What makes a dead or published row pending again (an operator's requeue or replay): due now,
-- attempts reset, no lease, and lag counted from now.
attempts = 0,
           next_attempt_at = now(),
           pending_since = now(),
           lease_token = NULL,
           lease_expires_at = NULL

-- _batch_result --
-- What one batch of an operator's bulk action returns (CTEs batch and done): the last id it
-- looked at (where the next batch starts), and the rows it changed with the first of their ids.
SELECT (SELECT max(id) FROM batch) AS last_id, (SELECT count(*) FROM done) AS rows,
       (SELECT min(id) FROM done) AS first_id

-- status_keys --
-- Per topic of a key's next row: keys waiting out a backoff after a failure, keys held (not due,
-- but never failed: what an interrupted replay of version 0.1 left), and keys held by a dead row
-- when $block_on_dead (dead_letter_policy = block). From the rows themselves (keys no claim has
-- looked at yet count too): an operator's command, one pass over the pending rows.
WITH heads AS (
    SELECT DISTINCT ON (o.ordering_key) o.ordering_key, o.topic, o.next_attempt_at, o.attempts
      FROM {table} o
     WHERE o.ordering_key IS NOT NULL AND o.published_at IS NULL AND o.dead_at IS NULL
     ORDER BY o.ordering_key, o.id
),
dead AS (
    SELECT DISTINCT d.ordering_key FROM {table} d
     WHERE $block_on_dead::boolean AND d.dead_at IS NOT NULL AND d.ordering_key IS NOT NULL
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
-- person the console knows ($by: "alice via console"; NULL from the CLI).
INSERT INTO {paused} AS p (topic, paused_by, reason)
VALUES ($topic, coalesce($by || ' as ', '') || session_user
            || coalesce('@' || host(inet_client_addr()), ''), $reason)
ON CONFLICT (topic) DO UPDATE SET paused_by = EXCLUDED.paused_by, reason = EXCLUDED.reason
RETURNING topic, paused_at, paused_by, reason

-- wait_for_pause_readers --
-- After a pause committed: wait until every transaction that read the pauses before it has ended
-- (each claim reads them first and holds them until it commits, so a claim that began before the
-- pause may still lease rows of the topic). Those are the transactions holding a lock on the
-- pauses now; each is watched in pg_locks until it ends. Never a LOCK request: one queued behind
-- an open reader (pg_dump, a report, a console transaction) made every claim and settle queue
-- behind it (engine review 3, P5). A transaction that takes its lock after this look began after
-- the pause committed, and reads it. Bounded: after 5 s a lock_not_available error leaves the
-- count as it was.
DO $$
DECLARE
    v_readers text[];
    v_until timestamptz := clock_timestamp() + interval '5 seconds';
BEGIN
    SELECT array_agg(DISTINCT l.virtualtransaction) INTO v_readers
      FROM pg_locks l
     WHERE l.locktype = 'relation' AND l.relation = '{paused}'::regclass
       AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
       AND l.pid IS DISTINCT FROM pg_backend_pid();
    WHILE v_readers IS NOT NULL AND EXISTS (
        SELECT 1 FROM pg_locks l
         WHERE l.locktype = 'relation' AND l.relation = '{paused}'::regclass
           AND l.virtualtransaction = ANY (v_readers)) LOOP
        IF clock_timestamp() >= v_until THEN
            RAISE EXCEPTION 'transactions that read the pauses before the pause are still open'
                USING ERRCODE = 'lock_not_available';
        END IF;
        PERFORM pg_sleep(0.01);
    END LOOP;
END $$

-- resume --
DELETE FROM {paused} WHERE topic = $topic
RETURNING topic, paused_at, paused_by, reason

-- in_flight_rows --
-- Rows held by a live claim (being published right now), of topic $topic or all.
SELECT count(*) FROM {leases}
 WHERE lease_expires_at > now() AND ($topic::text IS NULL OR topic = $topic)

-- wake --
-- The same hint the insert trigger sends: idle dispatchers claim at once.
SELECT pg_notify($channel, '')

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
-- Dead rows matching the filter, by id, after the cursor $after_id (NULL: the first page), at most
-- $limit. The _desc and dead_at variants are the other orders of the same page (keyset paging over
-- the partial indexes of dead rows).
SELECT {_dead_columns}
  FROM {table} o
 WHERE {_dead_filter} AND ($after_id::bigint IS NULL OR o.id > $after_id)
 ORDER BY o.id
 LIMIT $limit

-- dead_page_id_desc --
SELECT {_dead_columns}
  FROM {table} o
 WHERE {_dead_filter} AND ($after_id::bigint IS NULL OR o.id < $after_id)
 ORDER BY o.id DESC
 LIMIT $limit

-- dead_page_dead_at --
SELECT {_dead_columns}
  FROM {table} o
 WHERE {_dead_filter}
   AND ($after_dead_at::timestamptz IS NULL OR (o.dead_at, o.id) > ($after_dead_at, $after_id::bigint))
 ORDER BY o.dead_at, o.id
 LIMIT $limit

-- dead_page_dead_at_desc --
SELECT {_dead_columns}
  FROM {table} o
 WHERE {_dead_filter}
   AND ($after_dead_at::timestamptz IS NULL OR (o.dead_at, o.id) < ($after_dead_at, $after_id::bigint))
 ORDER BY o.dead_at DESC, o.id DESC
 LIMIT $limit

-- dead_groups --
-- Dead rows matching the filter, grouped by topic and cause (_cause): how many, the first and the
-- last death, and the group's first row, whose whole error is its sample; the largest groups
-- first, at most $limit, each with the number of groups in all.
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
 LIMIT $limit

-- dead_requeue --
-- One batch: matching dead rows with ids after $after, up to $limit, become pending again (due now,
-- attempts reset); last_error keeps a trace. Dead rows are never leased, so no dispatcher races
-- this.
WITH {_dead_batch},
done AS (
    UPDATE {table} o
       SET dead_at = NULL,
           {_pending_again},
           last_error = format('requeued by operator at %s (dead since %s: %s)',
                               now(), o.dead_at, coalesce(o.last_error, 'no error recorded'))
      FROM batch b
     WHERE o.id = b.id AND o.dead_at IS NOT NULL
    RETURNING o.id
)
{_batch_result}

-- dead_discard --
-- One batch: delete matching dead rows with ids after $after, up to $limit.
WITH {_dead_batch},
done AS (
    DELETE FROM {table} o USING batch b
     WHERE o.id = b.id AND o.dead_at IS NOT NULL
    RETURNING o.id
)
{_batch_result}

-- replay_count --
SELECT count(*) FROM {table} o WHERE {_replay_filter}

-- replay_bound --
-- As dead_bound, for a replay: matching rows published before this statement began.
SELECT count(*) AS rows, max(o.id) AS max_id, statement_timestamp() AS before
  FROM {table} o
 WHERE {_replay_filter} AND o.published_at < statement_timestamp()

-- replay_batch --
-- One batch of a replay: matching published rows with ids after $after, up to $limit, become
-- pending again with their event id, due now, counted in `replays`. The whole replay runs in one
-- transaction (operate/actions.py), so dispatchers see all of its rows at once at commit, in id
-- order per key, or, if it is interrupted, none. Published rows are never leased, so no dispatcher
-- races this.
WITH {_replay_batch},
done AS (
    UPDATE {table} o
       SET published_at = NULL,
           {_pending_again},
           replays = o.replays + 1,
           last_error = format('replayed by operator at %s (published before at %s)',
                               now(), o.published_at)
      FROM batch b
     WHERE o.id = b.id AND o.published_at IS NOT NULL
    RETURNING o.id
)
{_batch_result}

-- release_held --
-- Rows that an interrupted replay of version 0.1 (which held rows pending but not due for ten
-- minutes, then released them batch by batch) left held: due now, in topic $topic or all.
WITH released AS (
    UPDATE {table} SET next_attempt_at = now(), pending_since = now()
     WHERE published_at IS NULL AND dead_at IS NULL AND lease_token IS NULL
       AND attempts = 0 AND next_attempt_at > now()
       AND last_error LIKE 'replayed by operator at %'
       AND ($topic::text IS NULL OR topic = $topic)
    RETURNING id
)
SELECT count(*) FROM released

-- cleanup_count --
SELECT count(*) FROM {table} WHERE published_at < now() - $older_than_seconds * interval '1 second'

-- _audit_live --
-- Whether the action of audit record a (status running) still runs: the connection that runs it
-- holds the advisory lock ($lock, id) until it ends, and a connection that is gone holds nothing.
EXISTS (SELECT FROM pg_locks l
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
           AND l.classid = $lock::integer::oid AND l.objid = a.id::integer::oid)

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
-- database's who, where and when (the column defaults), and the connection that runs it takes the
-- advisory lock ($lock, id). A request key ($request_key) already recorded inserts nothing: the
-- action was started before (a second click, a retried request).
INSERT INTO {audit} AS a (command, filter, rows, status, expected, bound, identity,
                          identity_source, request_key, updated_at)
VALUES ($command, $filter_json::text::jsonb, 0, 'running', $expected, $bound_json::text::jsonb,
        $identity, $identity_source, $request_key, now())
ON CONFLICT (request_key) WHERE request_key IS NOT NULL DO NOTHING
RETURNING a.id, pg_try_advisory_lock($lock, a.id::integer) AS locked

-- audit_by_request --
SELECT id FROM {audit} WHERE request_key = $request_key

-- audit_progress --
-- One batch done, in the batch's own transaction: the record's count is the rows changed so far
-- ($rows), among ids $first_id..$last_id. Answers whether an operator asked the action to stop; no
-- row: the record is no longer running (the batch must not commit).
UPDATE {audit}
   SET rows = $rows, updated_at = now(), first_id = coalesce(first_id, $first_id),
       last_id = greatest(last_id, $last_id)
 WHERE id = $id AND status = 'running'
RETURNING abort_requested_at IS NOT NULL AS aborting

-- audit_aborting --
SELECT abort_requested_at IS NOT NULL FROM {audit} WHERE id = $id

-- audit_rows --
-- The rows the record says its action changed: each batch's count is written in the batch's own
-- transaction, so after a stop that cancelled a commit whose outcome the process cannot know,
-- this count, not the process's, is the true one.
SELECT rows FROM {audit} WHERE id = $id

-- audit_close --
-- The action ended: how ($status), with the rows it changed ($rows) and the words its faces showed
-- ($detail).
UPDATE {audit}
   SET status = $status, rows = greatest(rows, $rows), detail = $detail,
       first_id = coalesce(first_id, $first_id),
       last_id = coalesce(greatest(last_id, $last_id), last_id, $last_id), updated_at = now(),
       finished_at = now()
 WHERE id = $id AND status = 'running'
RETURNING id

-- audit_release --
SELECT pg_advisory_unlock($lock, $id::integer)

-- audit_abort --
-- An operator asks a running action to stop after its current batch; the first asker is kept.
UPDATE {audit}
   SET abort_requested_at = coalesce(abort_requested_at, now()),
       abort_requested_by = coalesce(abort_requested_by, $by)
 WHERE id = $id AND status = 'running'
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
-- Operator actions, newest first, before id $before_id (NULL: from the newest): of command
-- $command, in status $status (as read), by a person or database role $who, at or after $since and
-- before $until; at most $limit.
SELECT {_audit_columns}
  FROM {audit} a
 WHERE ($before_id::bigint IS NULL OR a.id < $before_id)
   AND ($command::text IS NULL OR a.command = $command)
   AND ($status::text IS NULL OR (CASE WHEN a.status = 'running' AND NOT {_audit_live}
                                  THEN 'interrupted' ELSE a.status END) = $status)
   AND ($who::text IS NULL OR $who IN (a.identity, a.session_role, a.db_role))
   AND ($since::timestamptz IS NULL OR a.at >= $since)
   AND ($until::timestamptz IS NULL OR a.at < $until)
 ORDER BY a.id DESC
 LIMIT $limit

-- audit_get --
SELECT {_audit_columns} FROM {audit} a WHERE a.id = $id

-- dispatchers_live --
-- Dispatchers whose heartbeat is younger than $live_seconds seconds.
SELECT owner, dead_letter_policy, started_at, heartbeat_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age_seconds,
       version, published_total, dead_total
  FROM {dispatchers}
 WHERE heartbeat_at > now() - $live_seconds * interval '1 second'
 ORDER BY owner

-- dispatchers_live_moded --
-- dispatchers_live with the delivery mode each reported (version 14; NULL: an older release).
SELECT owner, dead_letter_policy, started_at, heartbeat_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age_seconds,
       version, published_total, dead_total, delivery
  FROM {dispatchers}
 WHERE heartbeat_at > now() - $live_seconds * interval '1 second'
 ORDER BY owner

-- in_flight_by_owner --
-- Rows held by a live claim, per owner (what each dispatcher is publishing right now): from the
-- claimed work (its index) and the rows of each claim.
SELECT lease_owner AS owner, count(*) AS rows
  FROM {leases}
 WHERE lease_expires_at > now()
 GROUP BY lease_owner

-- pending_topics --
SELECT DISTINCT topic FROM {table}
 WHERE published_at IS NULL AND dead_at IS NULL AND topic IS NOT NULL

-- dead_topics --
-- Topics of dead rows: check says which do not exist, so that a requeue would not die again.
SELECT DISTINCT topic FROM {table} WHERE dead_at IS NOT NULL AND topic IS NOT NULL

-- pending_routed_headers --
-- The oldest $limit pending rows the dispatcher routes itself (check routes them as the publisher
-- would).
SELECT headers FROM {table}
 WHERE published_at IS NULL AND dead_at IS NULL AND topic IS NULL
 ORDER BY id
 LIMIT $limit

-- blocked_keys --
-- Keys whose next row waits, for the console: in backoff after a failure, held without having
-- failed (an interrupted replay of version 0.1), or, when $block_on_dead (dead_letter_policy =
-- block), behind a dead row of the key, whose error is the reason. Filtered by that row's topic
-- ($topic, '(routed)': none) and the key ($key); the oldest first, at most $limit. From the
-- engine's work and the rows above its cursor (keys no claim has looked at yet): no scan of the
-- table.
WITH c AS MATERIALIZED (SELECT position FROM {cursor} WHERE one),
heads AS (
    SELECT w.ordering_key, w.head_id AS id
      FROM {work} w
     WHERE NOT w.keyless AND w.claim_token IS NULL AND ($key::text IS NULL OR w.ordering_key = $key)
    UNION ALL
    (SELECT DISTINCT ON (o.ordering_key) o.ordering_key, o.id
       FROM {table} o
      WHERE o.id > (SELECT position FROM c) AND o.ordering_key IS NOT NULL
        AND o.published_at IS NULL AND o.dead_at IS NULL
        AND ($key::text IS NULL OR o.ordering_key = $key)
        AND NOT EXISTS (SELECT 1 FROM {work} w
                         WHERE w.ordering_key = o.ordering_key AND NOT w.keyless)
      ORDER BY o.ordering_key, o.id)
),
dead AS (
    SELECT d.ordering_key, count(*) AS dead_rows, min(d.id) AS first_dead_id
      FROM {table} d
     WHERE $block_on_dead::boolean AND d.dead_at IS NOT NULL AND d.ordering_key IS NOT NULL
     GROUP BY d.ordering_key
)
SELECT k.ordering_key, h.topic, h.id AS head_id, h.attempts, h.next_attempt_at, h.created_at,
       h.last_error, coalesce(d.dead_rows, 0) AS dead_rows, d.first_dead_id,
       (SELECT x.last_error FROM {table} x WHERE x.id = d.first_dead_id) AS dead_error
  FROM heads k
  JOIN {table} h ON h.id = k.id AND h.published_at IS NULL AND h.dead_at IS NULL
  LEFT JOIN dead d ON d.ordering_key = k.ordering_key
 WHERE ($topic::text IS NULL OR h.topic IS NOT DISTINCT FROM nullif($topic, '(routed)'))
   AND (h.next_attempt_at > now() OR d.dead_rows > 0)
 ORDER BY h.id
 LIMIT $limit

-- row_detail --
-- One row in any state, for the console, with the claim that holds it (if one does). The payload
-- leaves the database only when $payload (OUTBOX_CONSOLE_SHOW_PAYLOAD, to a person logged in), and
-- then at most its first $payload_max_bytes bytes.
SELECT o.id, o.event_id, o.topic, o.ordering_key, o.headers, o.attempts, o.created_at,
       o.next_attempt_at,
       coalesce(w.claim_owner, o.lease_owner) AS lease_owner,
       coalesce(w.claim_expires_at, o.lease_expires_at) AS lease_expires_at,
       o.published_at, o.dead_at, o.last_error, o.replays, o.pending_since,
       octet_length(o.payload) AS payload_bytes,
       CASE WHEN $payload::boolean THEN substring(o.payload FROM 1 FOR $payload_max_bytes::integer) END AS payload
  FROM {table} o
  LEFT JOIN {work} w
    ON w.ordering_key = coalesce(o.ordering_key, o.id::text) AND w.keyless = (o.ordering_key IS NULL)
   AND w.claim_token IS NOT NULL
   AND ((w.keyless) OR (o.id >= w.claim_first AND o.id < w.head_id))
   AND o.published_at IS NULL AND o.dead_at IS NULL
 WHERE o.id = $id

-- row_by_event --
SELECT id FROM {table} WHERE event_id = $event_id

-- rows_window --
-- Rows in any state, newest first, from the id window [$before - $window, $before): a bounded scan
-- of the primary key whatever the filters, which the page continues window by window. In state
-- $state (pending, published, dead; NULL: any), of key $key, topic $topic ('(routed)': none), event
-- id $event_id, with a header whose "name=value" contains $header (any case), a payload containing
-- the bytes $payload, created at or after $since and before $until, ids from $from_id; at most
-- $limit rows. `leased`: a live claim holds the row (its key's work, by primary key, as in
-- row_detail).
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
 WHERE o.id < $before AND o.id >= $before - $window
   AND ($from_id::bigint IS NULL OR o.id >= $from_id)
   AND ($state::text IS NULL OR CASE $state WHEN 'published' THEN o.published_at IS NOT NULL
                                    WHEN 'dead' THEN o.dead_at IS NOT NULL
                                    ELSE o.published_at IS NULL AND o.dead_at IS NULL END)
   AND ($key::text IS NULL OR o.ordering_key = $key)
   AND ($topic::text IS NULL OR o.topic IS NOT DISTINCT FROM nullif($topic, '(routed)'))
   AND ($event_id::uuid IS NULL OR o.event_id = $event_id)
   AND ($header::text IS NULL OR EXISTS (SELECT FROM jsonb_each_text(o.headers) h
                                     WHERE strpos(lower(h.key || '=' || h.value), lower($header)) > 0))
   AND ($payload::bytea IS NULL OR position($payload IN o.payload) > 0)
   AND ($since::timestamptz IS NULL OR o.created_at >= $since)
   AND ($until::timestamptz IS NULL OR o.created_at < $until)
 ORDER BY o.id DESC
 LIMIT $limit

-- routed_groups --
-- Rows without a topic, grouped by the values of the headers $header_names the topic template names
-- (the console routes each group as the dispatcher would): pending, dead and published rows of
-- each; at most $limit groups.
SELECT v.header_values,
       count(*) FILTER (WHERE o.published_at IS NULL AND o.dead_at IS NULL) AS pending,
       count(*) FILTER (WHERE o.dead_at IS NOT NULL) AS dead,
       count(*) FILTER (WHERE o.published_at IS NOT NULL) AS published
  FROM {table} o
 CROSS JOIN LATERAL (SELECT array_agg(o.headers ->> u.n ORDER BY u.i) AS header_values
                       FROM unnest($header_names::text[]) WITH ORDINALITY AS u(n, i)) v
 WHERE o.topic IS NULL
 GROUP BY v.header_values
 ORDER BY count(*) DESC
 LIMIT $limit

-- session_open --
-- A login: the session's id (the SHA-256 of its cookie's key), who, from where, with which token
-- ($token_tag: a tag of it), for $seconds seconds.
INSERT INTO {sessions} (id, identity, client_addr, token_tag, expires_at)
VALUES ($id, $identity, $client, $token_tag, now() + $seconds * interval '1 second')

-- session_get --
-- A session that still counts: not ended, not expired, logged in with the current token.
SELECT identity, created_at, expires_at FROM {sessions}
 WHERE id = $id AND ended_at IS NULL AND expires_at > now() AND token_tag = $token_tag

-- session_end --
UPDATE {sessions} SET ended_at = now() WHERE id = $id AND ended_at IS NULL

-- session_prune --
-- Forget sessions that ended or expired a day ago.
DELETE FROM {sessions}
 WHERE expires_at < now() - interval '1 day' OR ended_at < now() - interval '1 day'
