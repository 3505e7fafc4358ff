-- Version 7: lag measured from a time the database sets, and rows waiting on purpose kept apart
-- from the lag that pages (issue 12: a planned pause or a replay of old rows paged as lag, and a
-- writer's backdated created_at showed as days of lag).
--
-- created_at is a writer's column: any writer that can INSERT can set it. Writers' contract and
-- cost are unchanged (same columns, plain INSERT, no new trigger or index for them): the database's
-- own record of time comes from the dispatchers instead. Every metrics interval a dispatcher notes
-- the highest id any transaction had committed and the time it looked (<table>_clock); a pending
-- row whose id is above an entry's was not committed when that entry was taken. So each row's
-- commit is known to lie between two entries, and created_at is believed only inside them.

-- When an operator made the row pending again (dead requeue, replay, a held row released): from
-- then on it waits, not from its first write days ago. NULL: pending since it was written.
-- Dispatcher bookkeeping (writers never set it; one that does can only make its rows look younger,
-- never older: see <table>_pending_since).
ALTER TABLE ${schema}.${table} ADD COLUMN pending_since timestamptz;

COMMENT ON COLUMN ${schema}.${table}.pending_since IS
    'When an operator made the row pending again (requeue, replay, release of a held row), by the database clock (dispatcher); NULL: pending since it was written.';

-- (seq, at): at time `at` (the statement's start, before its snapshot), no row with an id above
-- `seq` was committed yet. seq never decreases (the highest id may be deleted by retention).
CREATE TABLE ${schema}.${table}_clock (
    seq bigint NOT NULL,
    at timestamptz NOT NULL
);

CREATE INDEX ${table}_clock_seq_idx ON ${schema}.${table}_clock (seq, at);

COMMENT ON TABLE ${schema}.${table}_clock IS
    'outbox-dispatcher bookkeeping: the highest committed id at a database time, noted by every dispatcher each metrics interval; the lag of a row is measured from these (never written by hand).';

-- When a pending row started waiting, by the database's clock: its created_at, but never before
-- the last clock entry that did not see it committed (a backdated created_at cannot fake lag) and
-- never after the first entry that did (a created_at in the future cannot hide it); a row an
-- operator made pending again waits from then (pending_since). Rows older than the first entry
-- (written before version 7) have no lower bound: their created_at is believed.
CREATE FUNCTION ${schema}.${table}_pending_since(
    p_id bigint,
    p_created_at timestamptz,
    p_pending_since timestamptz
) RETURNS timestamptz
    LANGUAGE sql STABLE PARALLEL SAFE
    RETURN greatest(
        CASE WHEN p_pending_since IS NOT NULL THEN least(p_pending_since, now())
             ELSE least(p_created_at,
                        coalesce((SELECT c.at FROM ${schema}.${table}_clock c
                                   WHERE c.seq >= p_id ORDER BY c.seq, c.at LIMIT 1), now()))
        END,
        (SELECT c.at FROM ${schema}.${table}_clock c
          WHERE c.seq < p_id ORDER BY c.seq DESC, c.at DESC LIMIT 1));

-- The first entry: every row already here is at or below it.
INSERT INTO ${schema}.${table}_clock (seq, at)
SELECT coalesce(max(o.id), 0), statement_timestamp() FROM ${schema}.${table} o;

INSERT INTO ${schema}.${table}_schema_version (version, name) VALUES (7, 'lag')
    ON CONFLICT (version) DO NOTHING;
