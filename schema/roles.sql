-- Least-privilege roles for outbox-dispatcher (docs/security.md).
--
--   ${owner_role}       owns the outbox objects: runs `outbox-dispatcher migrate` (or your migration
--                       tool) and `outbox-dispatcher pause`; writers may use it or get INSERT.
--   ${dispatcher_role}  what `outbox-dispatcher run` and `status` connect as: it reads rows, changes
--                       only the dispatcher's bookkeeping columns, and deletes published rows
--                       (retention). No INSERT, no writer columns, no DDL, no TRUNCATE.
--
-- Placeholders: ${schema} and ${table} as in schema/migrations, ${owner_role} and
-- ${dispatcher_role}. `outbox_dispatcher.migrations.render_roles` fills them with validated,
-- quoted names; with psql, e.g.
--   sed -e 's/${schema}/public/g; s/${table}/outbox/g' \
--       -e 's/${owner_role}/outbox_owner/g; s/${dispatcher_role}/outbox_dispatcher/g' \
--       schema/roles.sql | psql -v ON_ERROR_STOP=1 "$ADMIN_URL"
--
-- Run it as a superuser, or as a role with CREATEROLE that owns the database (it then makes
-- itself a member of the owner role so that it may grant on the owner's objects). Idempotent;
-- run it twice: before the first migration (creates the roles, lets the owner create objects in
-- the schema) and again after every migration (grants the dispatcher role on what the migration
-- created). The roles are NOLOGIN: give them LOGIN and a password, or grant them to login roles:
--   ALTER ROLE outbox_dispatcher LOGIN PASSWORD '...';
--   CREATE ROLE dispatcher_app LOGIN PASSWORD '...' IN ROLE outbox_dispatcher;

-- 1. The roles.
DO $roles$
BEGIN
    IF to_regrole('${owner_role}') IS NULL THEN
        CREATE ROLE ${owner_role} NOLOGIN;
    END IF;
    IF to_regrole('${dispatcher_role}') IS NULL THEN
        CREATE ROLE ${dispatcher_role} NOLOGIN;
    END IF;
    -- A non-superuser administrator grants on the owner's objects (part 4) as a member of the
    -- owner role. PostgreSQL 16+ already makes the creator of a role its admin.
    IF NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
       AND NOT pg_has_role(current_user, to_regrole('${owner_role}')::oid, 'MEMBER') THEN
        GRANT ${owner_role} TO CURRENT_USER;
    END IF;
END
$roles$;

-- Bounds for every dispatcher session, whatever a statement does (the dispatcher also sets
-- idle_in_transaction_session_timeout itself). Lock waits are retried by the dispatcher.
ALTER ROLE ${dispatcher_role} SET statement_timeout = '60s';
ALTER ROLE ${dispatcher_role} SET lock_timeout = '10s';
ALTER ROLE ${dispatcher_role} SET idle_in_transaction_session_timeout = '60s';

-- 2. The database: connecting (PUBLIC usually may; some clusters revoke it).
DO $db$
BEGIN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO %s, %s',
                   current_database(), '${owner_role}', '${dispatcher_role}');
END
$db$;

-- 3. The schema: the owner creates the outbox objects in it, the dispatcher only looks them up.
CREATE SCHEMA IF NOT EXISTS ${schema};
GRANT USAGE, CREATE ON SCHEMA ${schema} TO ${owner_role};
GRANT USAGE ON SCHEMA ${schema} TO ${dispatcher_role};

-- 4. The dispatcher's rights on the outbox objects, once they exist (after migrating).
DO $grants$
DECLARE
    v_fn regprocedure;
BEGIN
    IF to_regclass('${schema}.${table}') IS NULL THEN
        RAISE NOTICE 'no table ${schema}.${table} yet: run outbox-dispatcher migrate as ${owner_role}, then run this script again';
        RETURN;
    END IF;

    -- Claim, status and metrics read rows; the startup check reads the schema version.
    GRANT SELECT ON ${schema}.${table}, ${schema}.${table}_schema_version TO ${dispatcher_role};

    -- Only the bookkeeping columns: never topic, ordering_key, payload, headers, event_id,
    -- created_at (what writers wrote). Column UPDATE also lets the claim lock rows FOR UPDATE.
    GRANT UPDATE (attempts, next_attempt_at, lease_owner, lease_token, lease_expires_at,
                  published_at, dead_at, last_error)
        ON ${schema}.${table} TO ${dispatcher_role};

    -- DELETE: retention removes published rows older than OUTBOX_RETENTION_SECONDS (default
    -- 7 days), and OUTBOX_DELETE_ON_PUBLISH removes rows once Kafka acknowledged them. With
    -- OUTBOX_RETENTION_SECONDS=0 and no delete_on_publish the dispatcher deletes nothing:
    --   REVOKE DELETE ON <schema>.<table> FROM <dispatcher_role>;
    GRANT DELETE ON ${schema}.${table} TO ${dispatcher_role};

    -- The claim, settle, lease, release, reclaim and sweep functions. They are SECURITY INVOKER
    -- (the default) on purpose: they run with the dispatcher role's own rights (SELECT, the
    -- column UPDATEs above, the engine's bookkeeping tables), so a SECURITY DEFINER function,
    -- which would lend the owner's rights to every caller, is not needed. Only the dispatcher may call it; writers'
    -- functions (<table>_enqueue...) keep PUBLIC EXECUTE and fail for the dispatcher role
    -- anyway, as they run with the caller's rights and it has no INSERT.
    FOR v_fn IN
        SELECT p.oid::regprocedure FROM pg_proc p
         WHERE p.pronamespace = to_regnamespace('${schema}')
           AND p.proname IN ('${table}_claim', '${table}_claim_keys', '${table}_settle',
                             '${table}_extend', '${table}_release', '${table}_key_forget',
                             '${table}_discover', '${table}_claim_work', '${table}_settle_work',
                             '${table}_settle_late', '${table}_extend_work',
                             '${table}_release_work', '${table}_reclaim_work', '${table}_sweep')
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', v_fn);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s', v_fn, '${dispatcher_role}');
    END LOOP;

    -- Migration 0005 (claim engine v2): the per-key registry is the dispatcher's own
    -- bookkeeping (writers reach it only through SECURITY DEFINER trigger functions).
    IF to_regclass('${schema}.${table}_key') IS NOT NULL THEN
        GRANT SELECT, INSERT, UPDATE, DELETE ON ${schema}.${table}_key TO ${dispatcher_role};
    END IF;
    IF to_regclass('${schema}.${table}_waiting') IS NOT NULL THEN
        GRANT SELECT, INSERT, UPDATE, DELETE ON ${schema}.${table}_waiting TO ${dispatcher_role};
    END IF;

    -- Migration 0010 (claim engine v3): the work per key, the cursor over new rows and the log
    -- of changed rows are the dispatcher's bookkeeping (writers append to the log only through
    -- a SECURITY DEFINER trigger function); the steps table says which steps of a rolling
    -- upgrade ran.
    IF to_regclass('${schema}.${table}_work') IS NOT NULL THEN
        GRANT SELECT, INSERT, UPDATE, DELETE ON ${schema}.${table}_work TO ${dispatcher_role};
        GRANT SELECT, UPDATE ON ${schema}.${table}_cursor TO ${dispatcher_role};
        GRANT SELECT, DELETE ON ${schema}.${table}_changed TO ${dispatcher_role};
        GRANT SELECT ON ${schema}.${table}_schema_steps TO ${dispatcher_role};
        GRANT SELECT ON ${schema}.${table}_leases TO ${dispatcher_role};
    END IF;

    -- Migration 0003 (paused topics): the claim reads <table>_paused, so the dispatcher role
    -- needs SELECT on it; `outbox-dispatcher pause` writes it and runs as the owner role.
    IF to_regclass('${schema}.${table}_paused') IS NOT NULL THEN
        GRANT SELECT ON ${schema}.${table}_paused TO ${dispatcher_role};
    END IF;

    -- Migration 0005: a dispatcher records itself and its heartbeat in <table>_dispatchers
    -- (and removes its row when it stops). The operator commands the dispatcher role may run
    -- (dead requeue/discard, replay, cleanup) record themselves in <table>_operator_audit: INSERT only,
    -- so that no one but the owner can rewrite that record.
    IF to_regclass('${schema}.${table}_dispatchers') IS NOT NULL THEN
        GRANT SELECT, INSERT, UPDATE, DELETE ON ${schema}.${table}_dispatchers TO ${dispatcher_role};
        GRANT INSERT ON ${schema}.${table}_operator_audit TO ${dispatcher_role};
    END IF;

    -- Migration 0007 (lag from a time the database sets): requeue and replay record when they made
    -- a row pending again (a bookkeeping column), and every dispatcher notes the highest committed
    -- id in <table>_clock each metrics interval (and forgets entries no pending row needs).
    IF to_regclass('${schema}.${table}_clock') IS NOT NULL THEN
        GRANT UPDATE (pending_since) ON ${schema}.${table} TO ${dispatcher_role};
        GRANT SELECT, INSERT, DELETE ON ${schema}.${table}_clock TO ${dispatcher_role};
    END IF;

    -- Migration 0012 (operator console v2): an operator action's audit record is written before
    -- its first batch and kept true batch by batch, so the role updates its progress and outcome
    -- columns (a trigger keeps what was asked, by whom and when as written, and a finished record
    -- final) and reads it back; a replay counts in `replays`; the console keeps its logins in
    -- <table>_console_session (only a console whose people log in with its token writes there).
    IF to_regclass('${schema}.${table}_console_session') IS NOT NULL THEN
        GRANT SELECT, UPDATE (rows, status, updated_at, finished_at, detail, first_id, last_id,
                              abort_requested_at, abort_requested_by)
            ON ${schema}.${table}_operator_audit TO ${dispatcher_role};
        GRANT UPDATE (replays) ON ${schema}.${table} TO ${dispatcher_role};
        GRANT SELECT, INSERT, UPDATE, DELETE ON ${schema}.${table}_console_session
            TO ${dispatcher_role};
    END IF;
END
$grants$;
