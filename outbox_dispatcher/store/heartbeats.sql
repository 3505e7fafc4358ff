-- The registry heartbeat of many outboxes of one database in one statement (store/heartbeats.py,
-- dispatch/probe.py): each section below is one outbox's writable CTE, its braces filled with
-- that outbox's quoted names and its place in the arrays ({n}); they are joined after WITH. The
-- same upsert as dispatch.sql `dispatcher_beat_moded` (version 14 on), so `status` and the
-- console read these rows as any other dispatcher's.

-- beat --
b{n} AS (
INSERT INTO {dispatchers} AS d (owner, dead_letter_policy, version, published_total, dead_total,
                                delivery)
VALUES ($owner, $dead_letter_policy, $version, ($published::int8[])[{n}], ($dead::int8[])[{n}],
        $delivery)
ON CONFLICT (owner) DO UPDATE
   SET heartbeat_at = now(), dead_letter_policy = EXCLUDED.dead_letter_policy,
       version = EXCLUDED.version, published_total = EXCLUDED.published_total,
       dead_total = EXCLUDED.dead_total, delivery = EXCLUDED.delivery)
