"""Every runtime SQL statement (the dispatcher's and the consumer inbox's), parsed once at import
from queries.sql.

Statements name the table through placeholders; `Queries.for_table` fills them with validated,
quoted identifiers once at startup, so no name is ever pasted into SQL later. A section whose name
starts with `_` is a fragment, not a statement: statements include it as `{_name}` (the dead-row
filter, written once for every statement that selects dead rows).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

from outbox_dispatcher.config.names import quote_identifier, validate_identifier

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


_SECTIONS = parse(resources.files(__package__).joinpath("queries.sql").read_text("utf-8"))
QUERIES = {name: sql for name, sql in _SECTIONS.items() if not name.startswith("_")}
FRAGMENTS = {name: sql for name, sql in _SECTIONS.items() if name.startswith("_")}


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
    dead_requeue: str
    dead_discard: str
    replay_batch: str
    release_held: str
    dead_count: str
    dead_bound: str
    replay_count: str
    replay_bound: str
    cleanup_count: str
    dispatcher_beat: str
    dispatcher_beat_counted: str
    dispatchers_live: str
    in_flight_by_owner: str
    dead_topics: str
    cleanup_window: str
    pending_topics: str
    pending_routed_headers: str
    # The audit record of an action while it runs (operate/jobs.py).
    audit_open: str
    audit_by_request: str
    audit_progress: str
    audit_aborting: str
    audit_close: str
    audit_release: str
    audit_abort: str
    audit_sweep: str
    # Reads of the console (and the CLI's dead list).
    dead_page_id: str
    dead_page_id_desc: str
    dead_page_dead_at: str
    dead_page_dead_at_desc: str
    dead_groups: str
    rows_window: str
    row_by_event: str
    max_id: str
    routed_groups: str
    blocked_keys: str
    row_detail: str
    audit_list: str
    audit_get: str
    # The console's logins.
    session_open: str
    session_get: str
    session_end: str
    session_prune: str

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
            "sessions": qualified(f"{table}_console_session"),
        }
        for name, fragment in FRAGMENTS.items():  # in file order: a fragment may use earlier ones
            names[name] = fragment.format_map(names)
        rendered = {name: sql.format_map(names) for name, sql in QUERIES.items()}
        return cls(**rendered)
