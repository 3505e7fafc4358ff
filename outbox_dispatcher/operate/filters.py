"""Which rows an operator action touches, and the refusals that keep a mass change deliberate.

No face here: the CLI builds Filters from its flags, the console from its JSON bodies, and each
names its own inputs in the refusals (`Names`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

# How dead rows show a NULL topic or key (and what a topic or key filter accepts for them).
ROUTED = "(routed)"
NO_KEY = "(none)"


@dataclass(frozen=True)
class Filters:
    """Which rows a command touches; None means any. Times compare with created_at."""

    ids: list[int] | None = None
    key: str | None = None
    topic: str | None = None  # ROUTED: rows with no topic (routed by the dispatcher)
    since: datetime | None = None
    until: datetime | None = None
    from_id: int | None = None
    to_id: int | None = None
    keyless: bool | None = None  # True: rows with no ordering key
    dead_since: datetime | None = None  # dead_at, for dead rows
    dead_until: datetime | None = None
    error: str | None = None  # dead rows whose last_error contains this, in any case
    cause: str | None = None  # dead rows of this cause (a group of reads.dead_groups)

    def empty(self) -> bool:
        return all(value is None for value in vars(self).values())

    def dead_values(self, bound: Bound | None = None) -> dict[str, object]:
        """The dead-row statements' filter values by name (_dead_filter in
        store/operator.sql), within `bound` if given."""
        return {
            "ids": self.ids,
            "key": self.key,
            "topic": self.topic,
            "since": self.since,
            "until": self.until,
            "keyless": self.keyless,
            "dead_since": self.dead_since,
            "dead_until": self.dead_until,
            "error": self.error,
            "cause": self.cause,
            **Bound.values_of(bound),
        }

    def replay_values(self, bound: Bound | None = None) -> dict[str, object]:
        """The replay statements' filter values by name (_replay_filter)."""
        return {
            "from_id": self.from_id,
            "to_id": self.to_id,
            "key": self.key,
            "topic": self.topic,
            "since": self.since,
            "until": self.until,
            **Bound.values_of(bound),
        }

    def as_json(self) -> dict[str, object]:
        """The filter for the audit table: only what was given, times in ISO 8601."""
        return {
            name: value.isoformat() if isinstance(value, datetime) else value
            for name, value in vars(self).items()
            if value is not None
        }


@dataclass(frozen=True)
class Bound:
    """What an operator confirmed a mass change for: the rows its count saw (ids up to `max_id`,
    dead or published before `before`, by the database's clock) and how many there were. The
    change then touches no other row and no more than `rows` of them: a row that died (or was
    published) after the count is not among them, whenever the operator says yes."""

    max_id: int
    before: datetime
    rows: int

    @staticmethod
    def values_of(bound: Bound | None) -> dict[str, object]:
        """The bound's statement values by name; no bound: NULLs (any row)."""
        if bound is None:
            return {"max_id": None, "before": None}
        return {"max_id": bound.max_id, "before": bound.before}

    def as_json(self) -> dict[str, object]:
        return {"max_id": self.max_id, "before": self.before.isoformat(), "rows": self.rows}


@dataclass(frozen=True)
class Names:
    """How a face names the inputs a refusal mentions: flags (CLI) or body fields (console)."""

    every: str  # the "every row" input, as a subject: --all / "all"
    every_given: str  # ... as something to give: --all / "all": true
    dead_filters: str  # the filters of the dead-row actions
    replay_filters: str  # the filters of replay
    from_id: str
    to_id: str


# The inputs by their own names, as the console's JSON bodies give them.
FIELDS = Names(
    every='"all"',
    every_given='"all": true',
    dead_filters="ids, key, keyless, topic, since, until, dead_since, dead_until, error, cause",
    replay_filters="from_id, to_id, key, topic, since, until",
    from_id="from_id",
    to_id="to_id",
)


def refusal(
    filters: Filters, *, everything: bool, what: str, names: Names, replay: bool
) -> str | None:
    """Why a mass change is refused: `everything` with filters, no filter without it, or an
    empty id range. None: it may go on."""
    if everything and not filters.empty():
        return f"{names.every} cannot be combined with filters"
    if not everything and filters.empty():
        given = names.replay_filters if replay else names.dead_filters
        return f"refusing to {what} without a filter: give {given}, or {names.every_given}"
    first, last = filters.from_id, filters.to_id
    if first is not None and last is not None and first > last:
        return f"{names.from_id} {first} is after {names.to_id} {last}: no row is between"
    return None
