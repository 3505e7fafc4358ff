"""The API's OpenAPI description, served at /api/v1/openapi.json: the request bodies are the JSON
schemas of the models that validate them, so the description cannot drift from the checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from outbox_dispatcher import __version__
from outbox_dispatcher.console.inputs import (
    AuditQuery,
    BlockedQuery,
    DeadQuery,
    GroupsQuery,
    RowsBrowse,
)

_PATHS = {
    "dead-requeue": ("/api/v1/dead/requeue", "Make matching dead rows pending again"),
    "dead-discard": ("/api/v1/dead/discard", "Delete matching dead rows"),
    "replay": ("/api/v1/replay", "Publish matching published rows again, with their event ids"),
    "pause": ("/api/v1/pause", "Stop claiming rows of a topic, or of the whole table"),
    "resume": ("/api/v1/resume", "Lift a pause"),
}

_ERROR = {
    "description": "refused: the body of every 4xx answer is {error, problems?}",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {
                    "error": {"type": "string"},
                    "problems": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "field": {"type": "string"},
                                "problem": {"type": "string"},
                            },
                        },
                    },
                },
                "required": ["error"],
            }
        }
    },
}
_OUTCOME = {
    "description": "how many rows changed (with dry_run: how many the action would affect, and "
    "the bound to send back in the body to act on those rows only); 202: still running, follow "
    "`job`",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {
                    "command": {"type": "string"},
                    "rows": {"type": "integer"},
                    "dry_run": {"type": "boolean"},
                    "detail": {"type": "string"},
                    "bound": {"type": "object"},
                    "record": {"type": "integer"},
                    "status": {"type": "string"},
                    "job": {"type": "string"},
                },
                "required": ["command", "rows", "dry_run", "detail"],
            }
        }
    },
}


def _query(model: type[BaseModel]) -> list[dict[str, Any]]:
    schema = model.model_json_schema()
    return [
        {"name": "id" if name == "ids" else name, "in": "query", "required": False, "schema": s}
        for name, s in schema["properties"].items()
        if name != "all"
    ]


def _get(summary: str, model: type[BaseModel] | None = None) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": "OK"}, "400": _ERROR},
    }
    if model is not None:
        operation["parameters"] = _query(model)
    return {"get": operation}


def _one(summary: str, name: str, kind: str) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "parameters": [
                {"name": name, "in": "path", "required": True, "schema": {"type": kind}}
            ],
            "responses": {"200": {"description": "OK"}, "404": _ERROR},
        }
    }


def document(actions: Mapping[str, tuple[type[BaseModel], object]]) -> dict[str, Any]:
    paths: dict[str, Any] = {
        "/api/v1/status": _get("The `status --json` report: topics, pauses, dispatchers; history"),
        "/api/v1/dead": _get(
            "A page of dead rows (keyset: after/before), with the total", DeadQuery
        ),
        "/api/v1/dead/groups": _get("Dead rows grouped by topic and cause", GroupsQuery),
        "/api/v1/rows": _get("Rows in any state, newest first, scanned in windows", RowsBrowse),
        "/api/v1/blocked": _get("Keys whose head waits, and why", BlockedQuery),
        "/api/v1/routed": _get("Rows without a topic, by the topic they are routed to"),
        "/api/v1/sources": _get(
            "With OUTBOX_SOURCES: every outbox of every source, its state and status (404 without)"
        ),
        "/api/v1/rows/{id}": _one(
            "One row (the payload only with OUTBOX_CONSOLE_SHOW_PAYLOAD)", "id", "integer"
        ),
        "/api/v1/events/{event_id}": _one(
            "The row of an event id (a redirect)", "event_id", "string"
        ),
        "/api/v1/audit": _get("Operator actions, newest first", AuditQuery),
        "/api/v1/jobs/{id}": _one(
            "One action's record: its progress, how it ended", "id", "integer"
        ),
        "/api/v1/jobs/{id}/abort": {
            "post": {
                "summary": "Ask a running action to stop after its current batch",
                "security": [{"token": []}],
                "parameters": [
                    {"name": "id", "in": "path", "required": True, "schema": {"type": "integer"}}
                ],
                "responses": {"200": {"description": "the record"}, "409": _ERROR, "401": _ERROR},
            }
        },
    }
    for name, (model, _) in actions.items():
        path, summary = _PATHS[name]
        paths[path] = {
            "post": {
                "summary": summary,
                "security": [{"token": []}],
                "parameters": [
                    {
                        "name": "dry_run",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "boolean", "default": False},
                    },
                    {
                        "name": "Idempotency-Key",
                        "in": "header",
                        "required": False,
                        "schema": {"type": "string"},
                        "description": "a second request with the same key finds the first run",
                    },
                ],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": model.model_json_schema()}},
                },
                "responses": {
                    "200": _OUTCOME,
                    "202": _OUTCOME,
                    "400": _ERROR,
                    "401": _ERROR,
                    "403": _ERROR,
                },
            }
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": "outbox-dispatcher console", "version": __version__},
        "paths": paths,
        "components": {
            "securitySchemes": {
                "token": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "OUTBOX_CONSOLE_TOKEN (reads need it too, unless "
                    "OUTBOX_CONSOLE_ANONYMOUS_READ)",
                }
            }
        },
    }
