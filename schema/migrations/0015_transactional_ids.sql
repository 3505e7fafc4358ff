-- Version 15: each exactly-once dispatcher records the transactional ids it publishes under, so
-- that a takeover fences exactly those (docs/design/exactly-once.md). A lane whose transaction
-- waits on a partition that does not acknowledge (NotEnoughReplicas) is given a new id, since
-- the old one cannot begin another transaction until that partition takes the transaction's
-- markers; the new id is recorded here before its first transaction, the old one dropped once
-- its producer is closed (it can never commit). Additive like versions 12 to 14 (a nullable
-- column), so `migrate` applies it whenever it runs. NULL: an at-least-once dispatcher, or a
-- release older than version 15 (a takeover then fences the ids that release used).
ALTER TABLE ${schema}.${table}_dispatchers ADD COLUMN transactional_ids text[];

COMMENT ON COLUMN ${schema}.${table}_dispatchers.transactional_ids IS
    'Exactly-once: the Kafka transactional ids the dispatcher may have a transaction open under, recorded before each is first used (a takeover fences them); NULL: none recorded (at-least-once, or a release older than schema version 15).';

INSERT INTO ${schema}.${table}_schema_steps (version, name) VALUES (15, 'transactional_ids')
    ON CONFLICT (version) DO NOTHING;
INSERT INTO ${schema}.${table}_schema_version (version, name) VALUES (15, 'transactional_ids')
    ON CONFLICT (version) DO NOTHING;
