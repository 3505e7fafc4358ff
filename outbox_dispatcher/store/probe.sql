-- The batched idle probe (store/probe.py, dispatch/probe.py): one statement per chunk of a
-- database's served outboxes asks each of them whether it has anything to do. Each section is
-- one outbox's branch, its braces filled with that outbox's quoted names and its place in the
-- list ({n}); the branches are joined by UNION ALL. A branch returns a row only when the outbox
-- has something, now or later: the claim function's own tests for work
-- (schema/engine/claim_work.sql), each the first entry of an index or of the one-row cursor, so
-- that an idle outbox costs a handful of index probes and no write.

-- branch --
-- expired: a lease that expired (its owner died or hung): a takeover for the claim, and the
-- reclaimer's duty (crash loops). work: what makes a claim find rows: ids above the cursor, a
-- change waiting in the change log, a hole whose transactions have ended, a due retry, a ready
-- key, a key parked under older pauses, a blocked key when this dispatcher does not block;
-- nothing while the whole table is paused. And what will need a look without any write to the
-- outbox's tables (dispatch/probe.py asks only the outboxes whose tables were written between
-- two full probes): hole, a hole of the cursor whose transactions still run; due_in, the seconds
-- until the first live lease expires or the first waiting retry is due. OFFSET 0 keeps each
-- subquery evaluated once (a subquery pulled up would be evaluated at each reference).
SELECT {n} AS outbox, e.expired, e.work, coalesce(e.holes_running, false) AS hole,
       extract(epoch FROM least(e.lease_ends, e.retry_at) - now())::float8 AS due_in
  FROM (SELECT d.holes_running, d.lease_ends, d.retry_at,
               coalesce(d.lease_ends <= now(), false) AS expired,
               NOT EXISTS (SELECT FROM {paused} p WHERE p.topic = '*') AND (
                 (SELECT o.id FROM {table} o WHERE o.id > d.position ORDER BY o.id LIMIT 1)
                     IS NOT NULL
                 OR (SELECT x.seq FROM {changed} x ORDER BY x.seq LIMIT 1) IS NOT NULL
                 OR NOT coalesce(d.holes_running, true)
                 OR coalesce(d.retry_at <= now(), false)
                 OR (SELECT w.head_id FROM {work} w
                      WHERE w.claim_token IS NULL AND w.state = 'r'
                      ORDER BY w.head_id LIMIT 1) IS NOT NULL
                 OR coalesce((SELECT w.paused_gen FROM {work} w
                               WHERE w.claim_token IS NULL AND w.state = 'p'
                               ORDER BY w.paused_gen LIMIT 1) < d.pause_gen, false)
                 OR ({takes_blocked} AND (SELECT w.head_id FROM {work} w
                                           WHERE w.claim_token IS NULL AND w.state = 'b'
                                           ORDER BY w.head_id LIMIT 1) IS NOT NULL)
               ) AS work
          FROM (SELECT c.position, c.pause_gen,
                       CASE WHEN c.hole_count > 0 THEN c.hole_watch <@ {running_fn}() END
                           AS holes_running,
                       (SELECT w.claim_expires_at FROM {work} w
                         WHERE w.claim_token IS NOT NULL
                         ORDER BY w.claim_expires_at LIMIT 1) AS lease_ends,
                       (SELECT w.not_before FROM {work} w
                         WHERE w.claim_token IS NULL AND w.state = 'w'
                         ORDER BY w.not_before LIMIT 1) AS retry_at
                  FROM {cursor} c WHERE c.one OFFSET 0) d
        OFFSET 0) e
 WHERE e.expired OR e.work OR e.holes_running OR e.lease_ends IS NOT NULL
    OR e.retry_at IS NOT NULL

-- announce --
-- The waits of outboxes the probe looks at for the first time (dispatch/probe.py): one writable
-- CTE per outbox ({n}: its place in the list), the statement of dispatch.sql `waiting_announce`,
-- so that writers notify from now on; the probe that follows finds the rows committed before.
a{n} AS (INSERT INTO {waiting} AS w (owner, until)
         VALUES ($owner, now() + $seconds * interval '1 second')
         ON CONFLICT (owner) DO UPDATE SET until = EXCLUDED.until)
