-- Version 11: claim engine v3, the contract step. `outbox-dispatcher migrate` applies it only
-- once no dispatcher older than version 10 has beaten for a while (docs/operations.md: the
-- upgrade order); a migration tool applying the files by hand must wait for the same. Version 9's
-- registry, its writer trigger and its functions go; writers then run no engine code on INSERT
-- but a wake-up check. Recorded in <table>_schema_version too: a version 9 dispatcher started
-- after this says it must be upgraded.

UPDATE ${schema}.${table}_cursor SET compat = false;

DROP TRIGGER IF EXISTS ${table}_key_track ON ${schema}.${table};
DROP TRIGGER IF EXISTS ${table}_key_rearm ON ${schema}.${table};
DROP TRIGGER IF EXISTS ${table}_key_rearm_dead ON ${schema}.${table};
DROP FUNCTION IF EXISTS ${schema}.${table}_key_track();
DROP FUNCTION IF EXISTS ${schema}.${table}_key_rearm();
DROP FUNCTION IF EXISTS ${schema}.${table}_key_touch(text[]);
DROP FUNCTION IF EXISTS ${schema}.${table}_key_forget(text[]);
DROP FUNCTION IF EXISTS ${schema}.${table}_extend(bigint[], uuid[], double precision);
DROP FUNCTION IF EXISTS ${schema}.${table}_release(uuid);
DROP FUNCTION IF EXISTS ${schema}.${table}_key_bucket(text);
DROP TABLE IF EXISTS ${schema}.${table}_key;

-- Version 9's partial indexes of pending rows: their predicate names the columns a settle
-- writes, so that every mark was a new index entry and a full new row in the WAL. The engine
-- reads a key's rows through <table>_key_rows_idx (version 10) and rows without a key through
-- its work.
DROP INDEX IF EXISTS ${schema}.${table}_pending_key_idx;
DROP INDEX IF EXISTS ${schema}.${table}_pending_keyless_idx;

-- Row leases meant something to version 9 only (a crash-loop row keeps its token: see
-- <table>_reclaim_work). One still live (its owner may be publishing those rows right now, or
-- it vanished) becomes its key's claim until it expires: nobody else takes those rows meanwhile,
-- and taking them over afterwards counts an attempt, as version 9 did. Version 9 leased a
-- prefix of each key, so the claim spans the key's leased rows.
INSERT INTO ${schema}.${table}_work AS w
       (keyless, ordering_key, head_id, claim_first, claim_token, claim_owner, claim_expires_at)
SELECT l.keyless, l.wk, CASE WHEN l.keyless THEN l.first ELSE l.last + 1 END, l.first,
       l.token, l.owner, l.expires
  FROM (SELECT o.ordering_key IS NULL AS keyless, coalesce(o.ordering_key, o.id::text) AS wk,
               min(o.id) AS first, max(o.id) AS last,
               (array_agg(o.lease_token ORDER BY o.id))[1] AS token,
               (array_agg(o.lease_owner ORDER BY o.id))[1] AS owner,
               max(o.lease_expires_at) AS expires
          FROM ${schema}.${table} o
         WHERE o.lease_token IS NOT NULL AND o.lease_expires_at > now()
           AND o.published_at IS NULL AND o.dead_at IS NULL
         GROUP BY 1, 2) l
 ORDER BY l.wk, l.keyless
ON CONFLICT (ordering_key, keyless) DO UPDATE
   SET claim_token = excluded.claim_token, claim_owner = excluded.claim_owner,
       claim_expires_at = excluded.claim_expires_at,
       claim_first = least(w.head_id, excluded.claim_first),
       head_id = greatest(w.head_id, excluded.head_id), state = 'r', not_before = '-infinity'
 WHERE w.claim_token IS NULL;

UPDATE ${schema}.${table}
   SET lease_token = NULL, lease_expires_at = NULL
 WHERE lease_token IS NOT NULL AND published_at IS NULL AND dead_at IS NULL;

-- A version 9 dispatcher still running stops with this message at its next claim or settle
-- (nothing is lost: its keys' work expires and is taken over).
CREATE OR REPLACE FUNCTION ${schema}.${table}_claim_keys(
    p_limit integer,
    p_max_keys integer,
    p_owner text,
    p_lease_seconds double precision,
    p_token uuid,
    p_block_on_dead boolean,
    p_max_attempts integer
) RETURNS TABLE (
    id bigint,
    topic text,
    ordering_key text,
    payload bytea,
    headers jsonb,
    event_id uuid,
    created_at timestamptz,
    attempts integer,
    lease_token uuid,
    lease_expires_at timestamptz,
    reclaimed boolean
)
    LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    RAISE EXCEPTION 'the outbox schema of % was upgraded to version 11 (claim engine v3); this dispatcher is older: upgrade outbox-dispatcher',
        '${schema}.${table}'
        USING ERRCODE = 'feature_not_supported';
END;
$fn$;

CREATE OR REPLACE FUNCTION ${schema}.${table}_settle(
    p_token uuid,
    p_keys text[],
    p_ids bigint[],
    p_outcomes text[],
    p_errors text[],
    p_delays double precision[],
    p_counted integer[],
    p_delete boolean
) RETURNS SETOF bigint
    LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    RAISE EXCEPTION 'the outbox schema of % was upgraded to version 11 (claim engine v3); this dispatcher is older: upgrade outbox-dispatcher',
        '${schema}.${table}'
        USING ERRCODE = 'feature_not_supported';
END;
$fn$;

-- The wake-up: only while a dispatcher has said that it waits for one (it polls meanwhile
-- anyway); a busy dispatcher finds new rows by itself, and writers skip the notification, whose
-- commit-time lock is what capped their commit rate. A statement trigger without a transition
-- table: nothing per row. SECURITY DEFINER: writers need no grant on <table>_waiting.
CREATE FUNCTION ${schema}.${table}_wake() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF EXISTS (SELECT 1 FROM ${schema}.${table}_waiting w WHERE w.until > now()) THEN
        PERFORM pg_notify(TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, '');
    END IF;
    RETURN NULL;
END;
$fn$;

CREATE TRIGGER ${table}_wake
    AFTER INSERT ON ${schema}.${table}
    FOR EACH STATEMENT EXECUTE FUNCTION ${schema}.${table}_wake();

-- Room on each page for the one update of a row's life, its mark, to be HOT (on the same page:
-- no index entry, only the changed bytes logged). Pages written from now on.
ALTER TABLE ${schema}.${table} SET (fillfactor = 50);

INSERT INTO ${schema}.${table}_schema_steps (version, name) VALUES (11, 'claim_engine_v3_contract');
INSERT INTO ${schema}.${table}_schema_version (version, name) VALUES (11, 'claim_engine_v3_contract');
