"""The parameters of the statements that take many, typed once (River's per-command params):
the component that builds them and the store that binds them by name share one declaration."""

from __future__ import annotations

import uuid
from typing import NotRequired, TypedDict


class ClaimArguments(TypedDict):
    """dispatch.sql `claim`: lease up to `limit` rows of at most `max_keys` keys under `token`,
    looking at up to `scan` new rows."""

    limit: int
    max_keys: int
    owner: str
    lease_seconds: float
    token: uuid.UUID
    block_on_dead: bool
    max_attempts: int
    scan: int


class SettleArguments(TypedDict):
    """dispatch.sql `settle`: one batch's outcomes, aligned with `ids` (and each row's key).
    `steady`: the batch was claimed by the steady path's claim (only such a batch may be settled
    by its one statement, `settle_steady`); not a statement parameter."""

    token: uuid.UUID
    owner: str
    ids: list[int]
    keys: list[str | None]
    outcomes: list[str]
    errors: list[str | None]
    delays: list[float]
    counted: list[int]
    delete_published: bool
    block_on_dead: bool
    steady: NotRequired[bool]


class AuditOpenArguments(TypedDict):
    """operator.sql `audit_open`: the record of an action that starts; `lock` is the table's
    advisory-lock key of running actions."""

    lock: int
    command: str
    filter_json: str
    expected: int | None
    bound_json: str | None
    identity: str | None
    identity_source: str | None
    request_key: str | None


class AuditCloseArguments(TypedDict):
    """operator.sql `audit_close`: how an action ended."""

    id: int
    status: str
    rows: int
    detail: str
    first_id: int | None
    last_id: int | None
