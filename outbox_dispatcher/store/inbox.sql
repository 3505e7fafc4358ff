-- The consumer side's statement (inbox.py).
-- {schema}, {table}, {work} and the other names in braces are replaced once at startup by
-- validated, quoted identifiers; every value is a named parameter ($name), bound by name.

-- inbox_record --
-- Consumer side: remember an event id in the same transaction as the handler's writes; no row
-- back means it was processed before (or is being processed right now by another consumer, whose
-- commit this waits for).
INSERT INTO {inbox} (event_id, topic, kafka_partition, kafka_offset)
VALUES ($event_id, $topic, $partition, $offset)
ON CONFLICT (event_id) DO NOTHING
RETURNING event_id
