-- What tells the idle probe (dispatch/probe.py) which outboxes to look at between two full
-- probes: PostgreSQL's cumulative statistics of the tables an outbox's work is written to. One
-- statement per database and interval, whatever the number of outboxes: no table is opened.

-- relations --
-- The oids of the relations named in $names (quoted, qualified), in order; 0 for one that is
-- not there (dropped meanwhile: its counters stay 0, and the full probe is the guarantee).
SELECT array(SELECT coalesce(to_regclass(u.name)::oid, 0::oid)
               FROM unnest($names::text[]) WITH ORDINALITY AS u(name, n)
              ORDER BY u.n) AS relations

-- counters --
-- Rows inserted, updated and deleted in each of $relations since the statistics were reset,
-- in order; counting says whether the server counts them at all (track_counts). A backend
-- reports its counts after its transaction ends (within a second or so while it is idle; at
-- most a minute later when another holds the entry's lock): a hint, never a guarantee.
SELECT current_setting('track_counts')::bool AS counting,
       array(SELECT pg_stat_get_tuples_inserted(u.r) + pg_stat_get_tuples_updated(u.r)
                    + pg_stat_get_tuples_deleted(u.r)
               FROM unnest($relations::oid[]) WITH ORDINALITY AS u(r, n)
              ORDER BY u.n) AS changes
