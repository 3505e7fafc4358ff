"""What the console accepts: the CLI's filters as JSON bodies and query strings, validated before
anything reaches the database, with errors that name the field."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from outbox_dispatcher import routing
from outbox_dispatcher.models import picked
from outbox_dispatcher.operate.filters import FIELDS, ROUTED, Bound, Filters, refusal
from outbox_dispatcher.operate.listings import RowsQuery

M = TypeVar("M", bound=BaseModel)

MAX_IDS = 10_000
MAX_TEXT = 4096  # keys, error text, reasons
MAX_LIMIT = 1000


class InputError(Exception):
    """A request the console refuses (HTTP 400): `problems` name the fields."""

    def __init__(self, message: str, problems: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.problems = problems or []

    def as_json(self) -> dict[str, object]:
        return {"error": self.message, "problems": self.problems}


def _no_nul(value: str | None) -> str | None:
    # PostgreSQL text cannot hold NUL: refuse it here rather than as a driver error.
    if value is not None and "\x00" in value:
        msg = "must not contain a NUL character"
        raise ValueError(msg)
    return value


def _kafka_topic(value: str | None) -> str | None:
    if value is not None and not routing.valid_topic(value):
        msg = "not a valid Kafka topic name"
        raise ValueError(msg)
    return value


def _utc(value: datetime | None) -> datetime | None:
    """Without a UTC offset a time is taken as UTC, as in the CLI."""
    return value if value is None or value.tzinfo else value.replace(tzinfo=UTC)


class _Input(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_max_length=MAX_TEXT)


class BoundBody(_Input):
    """What an operator confirmed (the dry run's `bound`): ids up to `max_id`, dead (or
    published) before `before`, at most `rows` of them."""

    max_id: int = Field(ge=0)
    before: datetime
    rows: int = Field(ge=0)

    _times = field_validator("before")(_utc)

    def bound(self) -> Bound:
        return Bound(self.max_id, self.before, self.rows)


class DeadFilter(_Input):
    """Which dead rows: the filters of `dead requeue|discard` (`all` for every dead row), and
    the bound they were confirmed for."""

    ids: list[int] | None = Field(default=None, min_length=1, max_length=MAX_IDS)
    key: str | None = None
    topic: str | None = Field(default=None, description="'(routed)': rows without a topic")
    keyless: bool | None = Field(default=None, description="true: rows without a key")
    since: datetime | None = Field(default=None, description="created at or after (UTC if bare)")
    until: datetime | None = Field(default=None, description="created before")
    dead_since: datetime | None = None
    dead_until: datetime | None = None
    error: str | None = Field(default=None, min_length=1, description="last_error contains")
    cause: str | None = Field(default=None, description="a group of /dead/groups")
    all: bool = False
    bound: BoundBody | None = Field(default=None, description="the dry run's bound")

    _text = field_validator("key", "error", "cause")(_no_nul)
    _times = field_validator("since", "until", "dead_since", "dead_until")(_utc)

    @field_validator("topic")
    @classmethod
    def _topic(cls, value: str | None) -> str | None:
        if value is not None and value != ROUTED and not routing.valid_topic(value):
            msg = f"not a valid Kafka topic name (or {ROUTED!r})"
            raise ValueError(msg)
        return value

    def filters(self) -> Filters:
        return picked(Filters, self, keyless=True if self.keyless else None)

    def checked(self, what: str) -> Filters:
        """The filters of an action; an empty filter without `all` is refused, as in the CLI."""
        filters = self.filters()
        _refuse_unfiltered(filters, self.all, what, replay=False)
        return filters


class DeadQuery(DeadFilter):
    """A page of dead rows: the same filters, none needed, an order, a cursor and a limit."""

    sort: Literal["id", "-id", "dead_at", "-dead_at"] = "id"
    after: str | None = Field(default=None, description="the next page's cursor")
    before: str | None = Field(default=None, description="the previous page's cursor")
    limit: int = Field(default=100, ge=1, le=MAX_LIMIT)


class GroupsQuery(DeadFilter):
    """Dead rows grouped by topic and cause: the same filters, and how many groups."""

    limit: int = Field(default=50, ge=1, le=MAX_LIMIT)


class RowsBrowse(_Input):
    """Rows in any state, newest first, from bounded scans of ids."""

    state: Literal["pending", "published", "dead"] | None = None
    key: str | None = None
    topic: str | None = None
    event_id: uuid.UUID | None = None
    header: str | None = Field(default=None, min_length=1, description='"name=value" contains')
    payload: str | None = Field(default=None, min_length=1, description="payload contains")
    since: datetime | None = None
    until: datetime | None = None
    from_id: int | None = Field(default=None, ge=1)
    to_id: int | None = Field(default=None, ge=1)
    before: int | None = Field(default=None, ge=1, description="continue below this id")
    limit: int = Field(default=100, ge=1, le=MAX_LIMIT)

    _text = field_validator("key", "header", "payload")(_no_nul)
    _times = field_validator("since", "until")(_utc)

    def query(self) -> RowsQuery:
        return picked(
            RowsQuery, self, payload=None if self.payload is None else self.payload.encode()
        )


class ReplayFilter(_Input):
    """Which published rows: the filters of `replay` (`all` for every published row)."""

    from_id: int | None = None
    to_id: int | None = None
    key: str | None = None
    topic: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    all: bool = False
    bound: BoundBody | None = Field(default=None, description="the dry run's bound")

    _text = field_validator("key")(_no_nul)
    _times = field_validator("since", "until")(_utc)

    _topic = field_validator("topic")(_kafka_topic)

    def checked(self, what: str) -> Filters:
        filters = picked(Filters, self)
        _refuse_unfiltered(filters, self.all, what, replay=True)
        return filters


class _Target(_Input):
    """A topic, or `all` for the whole table (routed rows too)."""

    topic: str | None = None
    all: bool = False

    _topic = field_validator("topic")(_kafka_topic)

    def target(self) -> str | None:
        """The topic, or None for the whole table."""
        if (self.topic is None) == (not self.all):
            raise InputError('give "topic", or "all": true for the whole table (not both)')
        return self.topic


class PauseBody(_Target):
    """A topic, or the whole table, and why (for whoever resumes)."""

    reason: str | None = None

    _text = field_validator("reason")(_no_nul)


class ResumeBody(_Target):
    """A topic, or the whole table."""


class AuditQuery(_Input):
    command: str | None = None
    status: Literal["running", "done", "aborted", "interrupted", "failed"] | None = None
    who: str | None = Field(default=None, description="a person or database role")
    since: datetime | None = None
    until: datetime | None = None
    before: int | None = Field(default=None, ge=1, description="records older than this id")
    limit: int = Field(default=100, ge=1, le=MAX_LIMIT)

    _times = field_validator("since", "until")(_utc)


class SourcesQuery(_Input):
    """The sources page's filter, as `status --source --schema` filters (a schema name or a
    pattern with '*'): hundreds of tenants are read only when asked for."""

    source: str | None = Field(default=None, description="a source's name or an outbox's label")
    schema_: str | None = Field(
        default=None, alias="schema", description="a schema, or a pattern such as tenant_*"
    )

    _text = field_validator("source", "schema_")(_no_nul)


class BlockedQuery(_Input):
    topic: str | None = None
    key: str | None = None
    limit: int = Field(default=100, ge=1, le=MAX_LIMIT)

    _text = field_validator("key")(_no_nul)


def _refuse_unfiltered(filters: Filters, everything: bool, what: str, *, replay: bool) -> None:
    """The refusals of the actions (operate.filters), in the body's own names."""
    problem = refusal(filters, everything=everything, what=what, names=FIELDS, replay=replay)
    if problem is not None:
        raise InputError(problem)


def parse(model: type[M], data: object) -> M:
    """`data` as `model`, or an InputError naming each bad field."""
    if not isinstance(data, Mapping):
        raise InputError("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = [
            {
                "field": ".".join(str(part) for part in error["loc"]) or "(body)",
                "problem": _problem(error),
            }
            for error in exc.errors()
        ]
        fields = ", ".join(p["field"] for p in problems)
        raise InputError(f"invalid input: {fields}", problems) from None


def _problem(error: Any) -> str:
    """A field's problem in the CLI's words where the CLI has them."""
    if str(error["type"]).startswith(("datetime_", "date_")):
        return f"{error['input']!r} is not an ISO-8601 time (e.g. 2026-11-30T12:00:00Z)"
    return str(error["msg"]).removeprefix("Value error, ")


# Fields of the page forms that are not filters.
_FORM_ONLY = ("id", "csrf", "action", "scope", "filter", "body", "expected", "request", "typed")


def from_query(params: Mapping[str, str], multi: Mapping[str, list[str]]) -> dict[str, Any]:
    """A query string or form as model input: empty fields dropped (a form sends them), `id`
    repeated for ids, a checkbox's "on" as true."""
    data: dict[str, Any] = {}
    for name, value in params.items():
        if name in _FORM_ONLY or not value:
            continue
        data[name] = True if value == "on" else value
    ids = [value for value in multi.get("id", []) if value]
    if ids:
        data["ids"] = ids
    return data


def action_body(name: str, form: Any) -> dict[str, Any]:
    """A page's action form as the API's body. Dead-row forms say their scope: the rows ticked
    (ids), every row matching the filter, or every dead row."""
    data = from_query(form, {"id": form.getlist("id")})
    if not name.startswith("dead-"):
        return data
    scope = form.get("scope", "selected")
    if scope == "selected":
        return {"ids": data["ids"]} if "ids" in data else {}
    if scope == "all":
        return {"all": True}
    # The page's filter, carried as JSON (exact, whatever characters a key holds).
    try:
        current = orjson.loads(str(form.get("filter", "{}")))
    except orjson.JSONDecodeError:
        raise InputError("the form's filter is not JSON") from None
    if not isinstance(current, dict):
        raise InputError("the form's filter is not a JSON object")
    return current
