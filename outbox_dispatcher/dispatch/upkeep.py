"""The upkeep loops a table's dispatcher runs beside its claims, the same for the single-table
dispatcher and for each outbox of many (dispatch/outboxes.py): its registry heartbeat and its
retention."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NoReturn

from outbox_dispatcher import cleanup, registry
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.every import Warn, every
from outbox_dispatcher.store import DispatchStore, db


async def heartbeat(
    heartbeat: registry.Heartbeat,
    due: Callable[[], bool] | None = None,
    phase: float | None = None,
    **context: Any,
) -> NoReturn:
    """The dispatcher's row in `<table>_dispatchers`, every HEARTBEAT_SECONDS (the ticks `due`
    allows; `phase`: its place beside the process's other loops, every.spread); a role without
    the grant warns once (with the hint and `context`) and dispatching goes on."""
    await every(
        registry.HEARTBEAT_SECONDS,
        heartbeat.beat,
        log=registry.log,
        failed="heartbeat_failed",
        tolerated=registry.Heartbeat.TOLERATED,
        wait_first=False,
        warn=Warn.ONCE,
        context=lambda: {"hint": registry.Heartbeat.HINT, **context},
        due=due,
        phase=phase,
    )


def wants_retention(settings: Settings) -> bool:
    """Published rows are kept (not deleted on publish) and a retention is set."""
    return settings.retention_seconds > 0 and not settings.delete_on_publish


async def retention(
    store: DispatchStore,
    settings: Settings,
    due: Callable[[], bool] | None = None,
    phase: float | None = None,
) -> NoReturn:
    """Published rows older than the retention removed, a batch every cleanup interval (the
    ticks `due` allows; `phase`: its place beside the process's other loops, every.spread)."""
    await every(
        settings.cleanup_interval_seconds,
        functools.partial(cleanup.retention_step, store, settings),
        log=cleanup.log,
        failed="retention_failed",
        tolerated=db.RETRIABLE_ERRORS,
        due=due,
        phase=phase,
    )
