-- Version 2: the topic may be left NULL when the dispatcher routes the row itself, by
-- OUTBOX_TOPIC_TEMPLATE (from the row's headers) or OUTBOX_DEFAULT_TOPIC.

ALTER TABLE ${schema}.${table} ALTER COLUMN topic DROP NOT NULL;

COMMENT ON COLUMN ${schema}.${table}.topic IS
    'Kafka topic (writer); NULL lets the dispatcher route the row by its topic template or default topic.';

INSERT INTO ${schema}.${table}_schema_version (version, name) VALUES (2, 'routed_topic')
    ON CONFLICT (version) DO NOTHING;
