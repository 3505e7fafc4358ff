-- The batched idle probe (store/probe.py, dispatch/probe.py): one statement per database and
-- interval (per chunk) asks every served outbox of this member whether it has anything to do. Each section is
-- one outbox's branch, its braces filled with that outbox's quoted names and its place in the
-- list ({n}); the branches are joined by UNION ALL. A branch returns a row only when the outbox
-- has something: the claim function's own tests for work (schema/engine/claim_work.sql), each
-- the first entry of an index or of the one-row cursor, so that an idle outbox costs a handful
-- of index probes and no write.

-- branch --
-- expired: a lease that expired (its owner died or hung): a takeover for the claim, and the
-- reclaimer's duty (crash loops). work: what makes a claim find rows: ids above the cursor, a
-- change waiting in the change log, a hole whose transactions have ended, a due retry, a ready
-- key, a key parked under older pauses, a blocked key when this dispatcher does not block;
-- nothing while the whole table is paused.
SELECT {n} AS outbox, e.expired, e.work
  FROM (SELECT coalesce((SELECT w.claim_expires_at FROM {work} w
                          WHERE w.claim_token IS NOT NULL
                          ORDER BY w.claim_expires_at LIMIT 1) <= now(), false) AS expired,
               NOT EXISTS (SELECT FROM {paused} p WHERE p.topic = '*') AND (
                 (SELECT o.id FROM {table} o WHERE o.id > c.position ORDER BY o.id LIMIT 1)
                     IS NOT NULL
                 OR (SELECT x.seq FROM {changed} x ORDER BY x.seq LIMIT 1) IS NOT NULL
                 OR CASE WHEN c.hole_count > 0 THEN NOT (c.hole_watch <@ {running_fn}())
                         ELSE false END
                 OR coalesce((SELECT w.not_before FROM {work} w
                               WHERE w.claim_token IS NULL AND w.state = 'w'
                               ORDER BY w.not_before LIMIT 1) <= now(), false)
                 OR (SELECT w.head_id FROM {work} w
                      WHERE w.claim_token IS NULL AND w.state = 'r'
                      ORDER BY w.head_id LIMIT 1) IS NOT NULL
                 OR coalesce((SELECT w.paused_gen FROM {work} w
                               WHERE w.claim_token IS NULL AND w.state = 'p'
                               ORDER BY w.paused_gen LIMIT 1) < c.pause_gen, false)
                 OR ({takes_blocked} AND (SELECT w.head_id FROM {work} w
                                           WHERE w.claim_token IS NULL AND w.state = 'b'
                                           ORDER BY w.head_id LIMIT 1) IS NOT NULL)
               ) AS work
          FROM {cursor} c WHERE c.one) e
 WHERE e.expired OR e.work
