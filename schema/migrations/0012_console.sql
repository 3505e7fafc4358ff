-- Version 12: the operator console v2 (issue 22). Additive only: new tables, new columns with
-- constant defaults (no table rewrite), and partial indexes over dead rows. After the claim
-- engine's contract step (version 11): `migrate` applies it once no dispatcher older than
-- version 10 runs. Dispatchers run on versions 10 and 11 too (a rolling upgrade); the operator
-- commands and the console need this one.

-- 1. An operator action is recorded before its first batch and kept true batch by batch: `rows`
-- is what the action changed so far, in the same transaction as each batch, and `status` says how
-- it ended. While it runs, the connection that runs it holds the advisory lock (key, id) (the key
-- is the table's, outbox_dispatcher.operate.session.audit_lock_key): a record still `running`
-- whose lock nobody holds was cut off (its process died), and is read as `interrupted`.
ALTER TABLE ${schema}.${table}_operator_audit
    ADD COLUMN status text NOT NULL DEFAULT 'done',
    ADD COLUMN expected bigint,
    ADD COLUMN bound jsonb,
    ADD COLUMN identity text,
    ADD COLUMN identity_source text,
    ADD COLUMN request_key text,
    ADD COLUMN updated_at timestamptz,
    ADD COLUMN finished_at timestamptz,
    ADD COLUMN detail text,
    ADD COLUMN first_id bigint,
    ADD COLUMN last_id bigint,
    ADD COLUMN abort_requested_at timestamptz,
    ADD COLUMN abort_requested_by text,
    ADD CONSTRAINT ${table}_operator_audit_status_valid
        CHECK (status IN ('running', 'done', 'aborted', 'interrupted', 'failed'));

COMMENT ON COLUMN ${schema}.${table}_operator_audit.rows IS
    'Rows the action changed: kept true batch by batch while it runs (status running).';
COMMENT ON COLUMN ${schema}.${table}_operator_audit.status IS
    'running, done, aborted (an operator stopped it), interrupted (its process was stopped or died), failed.';
COMMENT ON COLUMN ${schema}.${table}_operator_audit.bound IS
    'What the action was confirmed for: ids up to max_id, in their state before `before`, at most `rows` rows.';
COMMENT ON COLUMN ${schema}.${table}_operator_audit.identity IS
    'Who, as the console knows them: a user named by a trusted proxy (identity_source proxy), or a holder of the console token (login, bearer); NULL from the CLI (see db_role).';

-- A second click (or a retried request) with the same key finds the first run instead of
-- starting another.
CREATE UNIQUE INDEX ${table}_operator_audit_request_idx
    ON ${schema}.${table}_operator_audit (request_key) WHERE request_key IS NOT NULL;
CREATE INDEX ${table}_operator_audit_running_idx
    ON ${schema}.${table}_operator_audit (id) WHERE status = 'running';

-- A record changes only while it runs, and then only its progress: what was asked, by whom and
-- when stay as written, the count never goes down, and a finished record is final.
CREATE FUNCTION ${schema}.${table}_operator_audit_guard() RETURNS trigger
    LANGUAGE plpgsql
AS $fn$
BEGIN
    IF OLD.status <> 'running' THEN
        RAISE EXCEPTION 'operator audit record % is final (%): it cannot be changed', OLD.id, OLD.status
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    IF (NEW.id, NEW.at, NEW.db_role, NEW.session_role, NEW.client_addr, NEW.command, NEW.filter,
        NEW.expected, NEW.bound, NEW.identity, NEW.identity_source, NEW.request_key)
       IS DISTINCT FROM
       (OLD.id, OLD.at, OLD.db_role, OLD.session_role, OLD.client_addr, OLD.command, OLD.filter,
        OLD.expected, OLD.bound, OLD.identity, OLD.identity_source, OLD.request_key)
       OR NEW.rows < OLD.rows THEN
        RAISE EXCEPTION 'operator audit record %: only its progress and outcome may change', OLD.id
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END;
$fn$;

CREATE TRIGGER ${table}_operator_audit_guard
    BEFORE UPDATE ON ${schema}.${table}_operator_audit
    FOR EACH ROW EXECUTE FUNCTION ${schema}.${table}_operator_audit_guard();

-- 2. The console's logins: a session is a row here, so that logging out and expiry end it for
-- every copy of its cookie. `id` is the SHA-256 of the random key the cookie carries (the key
-- itself is stored nowhere); `token_tag` says which console token it logged in with, so that a
-- new token ends every session.
CREATE TABLE ${schema}.${table}_console_session (
    id bytea PRIMARY KEY,
    identity text NOT NULL,
    client_addr text,
    token_tag text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    ended_at timestamptz
);

CREATE INDEX ${table}_console_session_expires_idx
    ON ${schema}.${table}_console_session (expires_at);

COMMENT ON TABLE ${schema}.${table}_console_session IS
    'Operator console logins (outbox-dispatcher console): ended by logout, expiry or a new console token.';

-- 3. What each dispatcher reports with its heartbeat: beside the schema version it runs (the
-- `version` column of version 10), its counters of rows published and dead-lettered since it
-- started (the console charts their rates).
ALTER TABLE ${schema}.${table}_dispatchers
    ADD COLUMN published_total bigint,
    ADD COLUMN dead_total bigint;

-- 4. How often a row was published: a replay counts here (the row is published once more when it
-- goes out again). A constant default: no table rewrite, nothing for writers to write.
ALTER TABLE ${schema}.${table} ADD COLUMN replays integer NOT NULL DEFAULT 0;

COMMENT ON COLUMN ${schema}.${table}.replays IS
    'Times an operator replayed the row (outbox-dispatcher replay): it was published replays + 1 times once published again (dispatcher).';

-- 5. Dead rows by id and by time of death, for the console's pages (keyset paging, totals,
-- groups). Partial: a writer's row is never dead, so an insert only evaluates the predicate; a
-- row that dies gets two index entries (the settle that kills it already updates indexed
-- columns, so no update that was HOT stops being HOT).
-- Building them reads the table once while writers wait (a SHARE lock): both took 0.55 s on a
-- table of 1,000,000 rows (461 MB) on the 2-core test machine, warm.
CREATE INDEX ${table}_dead_id_idx ON ${schema}.${table} (id) WHERE dead_at IS NOT NULL;
CREATE INDEX ${table}_dead_at_idx ON ${schema}.${table} (dead_at, id) WHERE dead_at IS NOT NULL;

INSERT INTO ${schema}.${table}_schema_steps (version, name) VALUES (12, 'console')
    ON CONFLICT (version) DO NOTHING;
INSERT INTO ${schema}.${table}_schema_version (version, name) VALUES (12, 'console')
    ON CONFLICT (version) DO NOTHING;
