-- Version 14: each dispatcher reports its delivery mode (OUTBOX_DELIVERY) with its heartbeat, so
-- that `status` and the console name the mode the table is published in, and say when its live
-- dispatchers differ (exactly-once's fence relies on every dispatcher of a table being
-- transactional: docs/design/exactly-once.md). Additive like versions 12 and 13 (a nullable
-- column, no table rewrite), so `migrate` applies it whenever it runs. A dispatcher of an older
-- release, which may run beside the new one during a rolling upgrade, writes nothing here: NULL
-- is "not reported".
ALTER TABLE ${schema}.${table}_dispatchers ADD COLUMN delivery text;

COMMENT ON COLUMN ${schema}.${table}_dispatchers.delivery IS
    'The delivery mode the dispatcher runs (OUTBOX_DELIVERY: at-least-once, exactly-once), reported with each heartbeat; NULL: not reported (a release older than schema version 14).';

INSERT INTO ${schema}.${table}_schema_steps (version, name) VALUES (14, 'delivery_mode')
    ON CONFLICT (version) DO NOTHING;
INSERT INTO ${schema}.${table}_schema_version (version, name) VALUES (14, 'delivery_mode')
    ON CONFLICT (version) DO NOTHING;
