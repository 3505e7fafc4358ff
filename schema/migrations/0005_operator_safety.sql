-- Version 5: operator safety. Internal topic names refused at write time, an audit table of
-- operator actions, and a registry of running dispatchers (their policy and a heartbeat).
-- Internal topic names (__consumer_offsets, __transaction_state, ...) belong to the broker: a
-- writer's row naming one is refused at write time by this named constraint, not dead-lettered
-- later by the broker. (Rows stored before this version that name one were dead-lettered; the
-- validation below fails while such a row is still in the table: discard it first.)
ALTER TABLE ${schema}.${table}
    ADD CONSTRAINT ${table}_topic_not_internal CHECK (left(topic, 2) <> '__') NOT VALID;
ALTER TABLE ${schema}.${table} VALIDATE CONSTRAINT ${table}_topic_not_internal;

-- Every operator command that changes something leaves a row here, in the database rather than on
-- the operator's terminal: who (the database roles, which a client cannot spoof the way it can
-- $USER), from where, when, the command, its filter and how many rows it changed.
CREATE TABLE ${schema}.${table}_operator_audit (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    db_role text NOT NULL DEFAULT current_user,
    session_role text NOT NULL DEFAULT session_user,
    client_addr inet DEFAULT inet_client_addr(),
    command text NOT NULL,
    filter jsonb NOT NULL DEFAULT '{}'::jsonb,
    rows bigint NOT NULL
);

COMMENT ON TABLE ${schema}.${table}_operator_audit IS
    'Operator actions on the outbox (outbox-dispatcher dead requeue/discard, replay, pause, resume, cleanup): who by database role and client address, when, what, how many rows.';

-- Each running dispatcher records itself and beats here, so that `status` tells whether any is
-- alive and reads blocked keys under the dead-letter policy the dispatchers actually run with.
CREATE TABLE ${schema}.${table}_dispatchers (
    owner text PRIMARY KEY,
    dead_letter_policy text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE ${schema}.${table}_dispatchers IS
    'Running outbox-dispatcher processes (lease owner id, dead-letter policy, last heartbeat by the database clock); a row whose heartbeat is old is a dispatcher that died.';

INSERT INTO ${schema}.${table}_schema_version (version, name) VALUES (5, 'operator_safety')
    ON CONFLICT (version) DO NOTHING;
