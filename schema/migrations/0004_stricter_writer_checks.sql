-- Version 4: two writer checks that let bad rows through or refused them unclearly.
--
-- Headers: the check used a lax JSON path, which unwraps arrays, so {"a": ["x"]} and {"a": []}
-- passed as "string values" and could not be copied to Kafka headers. Strict mode sees them.
-- Rows stored before this version are not re-checked; the dispatcher dead-letters them.
CREATE OR REPLACE FUNCTION ${schema}.${table}_headers_valid(headers jsonb) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN jsonb_typeof(headers) = 'object'
        AND NOT jsonb_path_exists(headers, 'strict $.* ? (@.type() != "string")');

-- Ordering key: it is indexed (per-key pending rows, dead rows per key), and PostgreSQL refuses
-- an index entry over about 2.7 kB with a message that names neither the column nor a limit
-- ("index row requires 282760 bytes, maximum size is 8191"), while a long but compressible key
-- slips through. 2048 bytes is more than a Kafka record key needs; a longer key is refused by
-- this named constraint.
ALTER TABLE ${schema}.${table}
    ADD CONSTRAINT ${table}_ordering_key_length CHECK (octet_length(ordering_key) <= 2048) NOT VALID;
ALTER TABLE ${schema}.${table} VALIDATE CONSTRAINT ${table}_ordering_key_length;

INSERT INTO ${schema}.${table}_schema_version (version, name) VALUES (4, 'stricter_writer_checks')
    ON CONFLICT (version) DO NOTHING;
