"""Every runtime SQL statement (the dispatcher's and the consumer inbox's), parsed once at import
from queries.sql.

Statements name the table through placeholders; `Queries.for_table` fills them with validated,
quoted identifiers once at startup, so no name is ever pasted into SQL later.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

from outbox_dispatcher.settings import quote_identifier, validate_identifier

_HEADER = re.compile(r"^-- ([a-z_]+) --$", re.MULTILINE)


def parse(text: str) -> dict[str, str]:
    """Split a file of `-- name --` sections into {name: statement}, comments dropped."""
    parts = _HEADER.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
        statement = "\n".join(lines).strip()
        if not statement:
            msg = f"query {name!r} is empty"
            raise ValueError(msg)
        if name in queries:
            msg = f"query {name!r} is defined twice"
            raise ValueError(msg)
        queries[name] = statement
    return queries


QUERIES = parse(resources.files(__package__).joinpath("queries.sql").read_text("utf-8"))


@dataclass(frozen=True)
class Queries:
    """The statements for one outbox table, with its identifiers filled in."""

    claim: str
    settle: str
    already_settled: str
    extend_leases: str
    release_claim: str
    waiting_announce: str
    waiting_withdraw: str
    dead_letter_crash_loops: str
    count_expired_leases: str
    schema_version: str
    schema_version_before_steps: str
    sweep: str
    live_older_dispatchers: str
    engine_drift: str
    status: str
    gauges: str
    clock_tick: str
    clock_prune: str
    inbox_record: str
    # Operator commands and table hygiene.
    status_keys: str
    paused_list: str
    pause: str
    wait_for_pause_readers: str
    resume: str
    in_flight_rows: str
    wake: str
    max_id: str
    dead_list: str
    dead_requeue: str
    dead_discard: str
    replay_batch: str
    release_held: str
    dead_count: str
    replay_count: str
    cleanup_count: str
    audit: str
    dispatcher_beat: str
    dispatchers_live: str
    dead_topics: str
    cleanup_window: str
    pending_topics: str
    pending_routed_headers: str
    # The console.
    blocked_keys: str
    row_detail: str
    audit_list: str

    @classmethod
    def for_table(cls, schema: str, table: str, inbox: str = "inbox") -> Queries:
        validate_identifier(schema, "schema")
        validate_identifier(table, "table")
        validate_identifier(inbox, "inbox table")

        def qualified(name: str) -> str:
            return f"{quote_identifier(schema)}.{quote_identifier(name)}"

        names = {
            "schema": quote_identifier(schema),
            "table": qualified(table),
            "version_table": qualified(f"{table}_schema_version"),
            "steps_table": qualified(f"{table}_schema_steps"),
            "claim_fn": qualified(f"{table}_claim_work"),
            "settle_fn": qualified(f"{table}_settle_work"),
            "extend_fn": qualified(f"{table}_extend_work"),
            "release_fn": qualified(f"{table}_release_work"),
            "reclaim_fn": qualified(f"{table}_reclaim_work"),
            "sweep_fn": qualified(f"{table}_sweep"),
            "work": qualified(f"{table}_work"),
            "cursor": qualified(f"{table}_cursor"),
            "leases": qualified(f"{table}_leases"),
            "changed": qualified(f"{table}_changed"),
            "waiting": qualified(f"{table}_waiting"),
            "inbox": qualified(inbox),
            "paused": qualified(f"{table}_paused"),
            "audit": qualified(f"{table}_operator_audit"),
            "dispatchers": qualified(f"{table}_dispatchers"),
            "clock": qualified(f"{table}_clock"),
            "since_fn": qualified(f"{table}_pending_since"),
        }
        rendered = {name: sql.format_map(names) for name, sql in QUERIES.items()}
        return cls(**rendered)
