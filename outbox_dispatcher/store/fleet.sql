-- The fleet's membership table in the home database (sources/fleet.py), by name. {schema} and
-- {member} are filled once with validated, quoted names; values are named parameters.

-- create --
-- Run by `migrate` in the home database: one row per member, its heartbeat the database's clock
-- (members' clocks never compared). `hot`: outboxes whose backlog wants a second member.
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {member} (
    owner        text PRIMARY KEY,
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    started_at   timestamptz NOT NULL DEFAULT now(),
    hot          text[] NOT NULL DEFAULT ARRAY[]::text[]
)

-- exists --
SELECT to_regclass($relation) IS NOT NULL

-- heartbeat --
-- One round trip per beat: the member's row renewed (with the outboxes it lists as hot), rows dead
-- for `forget_seconds` removed, and the live members read with theirs (the beat's own row through
-- `beat`: a statement does not see its own insert).
WITH beat AS (
    INSERT INTO {member} AS m (owner, heartbeat_at, hot) VALUES ($owner, now(), $hot::text[])
    ON CONFLICT (owner) DO UPDATE SET heartbeat_at = now(), hot = EXCLUDED.hot
    RETURNING owner, hot
), gone AS (
    DELETE FROM {member}
     WHERE heartbeat_at < now() - make_interval(secs => $forget_seconds::float8) AND owner <> $owner
)
SELECT owner, hot FROM beat
UNION ALL
SELECT owner, hot FROM {member}
 WHERE heartbeat_at > now() - make_interval(secs => $lease_seconds::float8) AND owner <> $owner
ORDER BY 1

-- leave --
-- A member that stops removes its row: the others take its outboxes at their next beat.
DELETE FROM {member} WHERE owner = $owner
