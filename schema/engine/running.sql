-- The transactions running now, other than the caller's: each holds the lock on its own virtual
-- transaction id from its start, with or without an xid (pg_locks: readable by any role); and
-- prepared transactions (two-phase commit), which hold none, by their xid. A hole keeps the list
-- of those running when it was found (see <table>_discover).
CREATE OR REPLACE FUNCTION ${schema}.${table}_running() RETURNS text[]
    LANGUAGE sql VOLATILE
AS $fn$
SELECT coalesce(array_agg(r.t ORDER BY r.t), '{}')
  FROM (SELECT l.virtualxid AS t
          FROM pg_catalog.pg_locks l
         WHERE l.locktype = 'virtualxid' AND l.mode = 'ExclusiveLock' AND l.granted
           AND l.pid IS DISTINCT FROM pg_catalog.pg_backend_pid()
        UNION ALL
        SELECT 'prepared ' || p.transaction::text FROM pg_catalog.pg_prepared_xacts p) r;
$fn$;
