-- Every SQL statement the dispatcher runs at run time, by name. {schema}, {table}, {version_table}
-- and {claim_fn} are replaced once at startup by validated, quoted identifiers; every value is a
-- $n parameter.

-- claim --
-- Lease up to $1 rows (see the claim function in schema/); one round trip.
SELECT id, topic, ordering_key, payload, headers, event_id, created_at, attempts, lease_token,
       lease_expires_at, reclaimed
  FROM {claim_fn}($1, $2, $3, $4, $5, $6, $7)

-- settle --
-- Record the outcome of one published batch in one statement, fenced by the batch's lease token:
-- a dispatcher that lost its lease changes nothing.
UPDATE {table} o
   SET published_at = CASE WHEN r.outcome = 'published' THEN now() END,
       dead_at = CASE WHEN r.outcome = 'dead' THEN now() END,
       last_error = CASE WHEN r.outcome = 'published' THEN o.last_error ELSE coalesce(r.error, o.last_error) END,
       attempts = o.attempts + r.attempt,
       next_attempt_at = CASE WHEN r.outcome = 'retry'
                              THEN now() + r.delay * interval '1 second'
                              ELSE o.next_attempt_at END,
       lease_token = NULL,
       lease_expires_at = NULL
  FROM unnest($1::bigint[], $2::text[], $3::text[], $4::double precision[], $5::integer[])
       AS r(id, outcome, error, delay, attempt)
 WHERE o.id = r.id AND o.lease_token = $6
RETURNING o.id

-- mark_published --
-- The common case of settle: every row of the batch acknowledged. Same fencing, fewer arrays.
UPDATE {table}
   SET published_at = now(), lease_token = NULL, lease_expires_at = NULL
 WHERE id = ANY($1::bigint[]) AND lease_token = $2
RETURNING id

-- delete_published --
-- With delete_on_publish: acknowledged rows go away instead of being marked. Same fencing.
DELETE FROM {table}
 WHERE id = ANY($1::bigint[]) AND lease_token = $2
RETURNING id

-- extend_leases --
-- Keep the leases of rows still in flight while their owner is alive.
UPDATE {table} o
   SET lease_expires_at = now() + $3 * interval '1 second'
  FROM unnest($1::bigint[], $2::uuid[]) AS r(id, token)
 WHERE o.id = r.id AND o.lease_token = r.token
RETURNING o.id

-- dead_letter_crash_loops --
-- Rows whose every owner died or hung while publishing them: dead-letter instead of taking them
-- over again (the claim leaves them alone).
UPDATE {table}
   SET dead_at = now(),
       attempts = attempts + 1,
       lease_token = NULL,
       lease_expires_at = NULL,
       last_error = format('dead-lettered: the lease expired %s times (the dispatcher that held it '
                           'crashed or hung while publishing, last owner %s); last error: %s',
                           attempts + 1, lease_owner, coalesce(last_error, 'none'))
 WHERE published_at IS NULL AND dead_at IS NULL
   AND lease_expires_at <= now() AND attempts + 1 >= $1
RETURNING id, event_id, topic, ordering_key, lease_owner

-- count_expired_leases --
SELECT count(*) FROM {table}
 WHERE published_at IS NULL AND dead_at IS NULL AND lease_expires_at <= now()

-- schema_version --
SELECT coalesce(max(version), 0) FROM {version_table}

-- status --
-- Per topic: pending (not yet published), in flight (live lease), dead, oldest pending age.
SELECT topic,
       count(*) FILTER (WHERE published_at IS NULL AND dead_at IS NULL) AS pending,
       count(*) FILTER (WHERE published_at IS NULL AND dead_at IS NULL
                          AND lease_expires_at > now()) AS in_flight,
       count(*) FILTER (WHERE dead_at IS NOT NULL) AS dead,
       count(*) FILTER (WHERE published_at IS NOT NULL) AS published,
       extract(epoch FROM now() - min(created_at)
                              FILTER (WHERE published_at IS NULL AND dead_at IS NULL))::float8
           AS oldest_pending_age_seconds
  FROM {table}
 GROUP BY topic
 ORDER BY topic

-- gauges --
-- The table gauges behind /metrics, each from a partial index: pending rows, the age of the oldest
-- (by id, the claim's order), dead rows, keys waiting out a backoff, and keys blocked by a dead row
-- when $1 (dead_letter_policy = block).
SELECT (SELECT count(*) FROM {table} WHERE published_at IS NULL AND dead_at IS NULL) AS pending,
       (SELECT extract(epoch FROM now() - created_at)::float8 FROM {table}
         WHERE published_at IS NULL AND dead_at IS NULL ORDER BY id LIMIT 1)
           AS oldest_pending_age_seconds,
       (SELECT count(*) FROM {table} WHERE dead_at IS NOT NULL) AS dead,
       (SELECT count(DISTINCT ordering_key) FROM {table}
         WHERE published_at IS NULL AND dead_at IS NULL AND attempts > 0
           AND next_attempt_at > now()) AS backoff_keys,
       (SELECT count(DISTINCT d.ordering_key) FROM {table} d
         WHERE $1 AND d.dead_at IS NOT NULL
           AND EXISTS (SELECT FROM {table} p
                        WHERE p.ordering_key = d.ordering_key
                          AND p.published_at IS NULL AND p.dead_at IS NULL)) AS dead_blocked_keys

-- inbox_record --
-- Consumer side: remember an event id in the same transaction as the handler's writes; no row
-- back means it was processed before (or is being processed right now by another consumer, whose
-- commit this waits for).
INSERT INTO {inbox} (event_id, topic, kafka_partition, kafka_offset)
VALUES ($1, $2, $3, $4)
ON CONFLICT (event_id) DO NOTHING
RETURNING event_id
