-- The inbox: a consumer's record of the events it has processed, in the consumer's own database.
-- A consumer inserts the event id in the same transaction as its handler's writes; a redelivered
-- event (at-least-once delivery) then conflicts on the primary key and is skipped. Plain SQL, usable
-- from any language (docs/consumers.md); `outbox_dispatcher.inbox.Inbox.create()` applies it with
-- ${schema} and ${table} filled in (defaults public / inbox).

CREATE TABLE IF NOT EXISTS ${schema}.${table} (
    event_id uuid PRIMARY KEY,
    topic text NOT NULL,
    kafka_partition integer NOT NULL,
    kafka_offset bigint NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now()
);

-- Old entries can go once redeliveries of them are impossible (longer than the topic's retention).
CREATE INDEX IF NOT EXISTS ${table}_processed_at_idx ON ${schema}.${table} (processed_at);
