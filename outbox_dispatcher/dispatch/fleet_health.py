"""What `/readyz` says of a process serving many outboxes (OUTBOX_SOURCES, dispatch/fleet.py),
and its first pass over them.

**The first pass.** A process is ready only once every outbox it served at start has been looked
at once: probed by its database's idle probe (dispatch/probe.py, one statement per 100 outboxes;
those with work or an expired lease claimed at once) or claimed once (an outbox the probe cannot
read). Ready at its first sync, a 500-outbox process still spent its next seconds on a claim of
each, and a rollout routed load onto it meanwhile (`make bench`'s fleet_quiet_*: the p99's seconds
were all in its first 6 s). Outboxes served later (a tenant migrated while it runs) never make it
not ready again: each is probed at once (`IdleProbe.look_soon`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from outbox_dispatcher.health import Readiness

if TYPE_CHECKING:
    from outbox_dispatcher.dispatch.fleet import FleetDispatcher
    from outbox_dispatcher.dispatch.outboxes import Shared
    from outbox_dispatcher.dispatch.slots import ClaimSlots
    from outbox_dispatcher.sources.registry import SourceRegistry

log = structlog.get_logger(__name__)


class FirstPass:
    """The first look at every outbox served at start: done once each was probed or claimed."""

    def __init__(self, slots: ClaimSlots) -> None:
        self._slots = slots
        self._started = time.monotonic()
        self.synced = asyncio.Event()  # the first sync served what the registry reported
        self.done = False
        self.seconds: float | None = None  # from the dispatcher's making to the pass's end

    async def run(self, then: Callable[[], None] = lambda: None) -> None:
        """Wait for the first sync, then for every outbox served so far to be looked at; then
        call `then`."""
        await self.synced.wait()
        await self._slots.all_looked.wait()
        self.done = True
        then()
        self.seconds = time.monotonic() - self._started
        log.info(
            "first_pass_done", outboxes=len(self._slots.outboxes), seconds=round(self.seconds, 3)
        )

    def progress(self) -> str:
        if self.done:
            return "done"
        if not self.synced.is_set():
            return "reading the sources"
        served = len(self._slots.outboxes)
        return f"{served - len(self._slots.unlooked)} of {served} outboxes looked at"


async def readiness(fleet: FleetDispatcher, registry: SourceRegistry, shared: Shared) -> Readiness:
    """Ready while the broker answers, the first pass is done and an outbox is served (or none
    is failing); the detail names each failing outbox and database, never a URL."""
    view = registry.view()
    checks: dict[str, str] = {}
    if fleet.stopping.is_set():
        checks["dispatcher"] = "shutting down"
    checks["broker"] = "ok" if await shared.publisher.reachable(3.0) else "unreachable"
    for database in view.databases:
        if not database.reachable:
            checks[f"database {database.database}"] = f"unreachable: {database.reason}"
    for failing in view.failing():
        checks[f"source {failing.label}"] = f"{failing.state.value}: {failing.reason}"
    for label, reason in fleet.refused.values():
        checks[f"source {label}"] = f"refused: {reason}"
    if fleet.member is not None:
        members = fleet.member.view()
        checks["fleet"] = (
            f"{len(members.members)} member(s), {len(members.hot)} hot outbox(es)"
            if members.stale_since is None
            else f"view stale since {members.stale_since:.0f}: {members.reason}"
        )
    served = len(fleet.slots.outboxes)
    failures = len(view.failing()) + len(fleet.refused)
    checks["outboxes"] = f"{served} served, {failures} failing"
    checks["first pass"] = fleet.first_pass.progress()
    ready = (
        not fleet.stopping.is_set()
        and checks["broker"] == "ok"
        and fleet.first_pass.done
        and (served > 0 or not failures)
    )
    fleet.metrics.ready.set(int(ready))
    return Readiness(ready, checks)
