-- The business table the writer examples change in the same transaction as their outbox row.
-- Apply it after `outbox-dispatcher migrate` (the tests do).
CREATE TABLE IF NOT EXISTS example_orders (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_key text NOT NULL,
    seq integer NOT NULL,
    writer text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
