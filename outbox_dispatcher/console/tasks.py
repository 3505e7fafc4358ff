"""The actions this console runs in the background, each on a database connection of its own: the
request that starts one is answered as soon as its audit record exists (with that record), so no
proxy timeout, closed tab or second click cuts it off or runs it twice. Its progress is read from
the record (operate/jobs.py), so any console shows it; stopping the console interrupts what runs,
and the records say so, with the rows each changed."""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.operate.actions import Action, perform
from outbox_dispatcher.operate.jobs import Ledger, Origin
from outbox_dispatcher.operate.session import connected

log = structlog.get_logger(__name__)


class Jobs:
    """Running actions by their audit record."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._tasks: dict[int, asyncio.Task[None]] = {}

    async def start(self, action: Action, origin: Origin, key: str | None) -> int:
        """Start `action`; its audit record, once it exists. A refusal (or a key that started
        an action before: operate.jobs.DuplicateRunError) is raised here, before anything
        changed."""
        opened: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._run(action, origin, key, opened))
        try:
            record = await asyncio.shield(opened)
        except BaseException:
            with contextlib.suppress(BaseException):
                await task
            raise
        self._tasks[record] = task
        task.add_done_callback(lambda _: self._tasks.pop(record, None))
        return record

    async def _run(
        self, action: Action, origin: Origin, key: str | None, opened: asyncio.Future[int]
    ) -> None:
        def told(ledger: Ledger) -> None:
            opened.set_result(ledger.id)

        try:
            async with connected(self.settings) as session:
                result = await perform(action, session, origin=origin, key=key, opened=told)
        except BaseException as exc:
            if not opened.done():
                opened.set_exception(exc)
            elif not isinstance(exc, asyncio.CancelledError):
                # perform recorded it as failed; the record's page says why.
                log.warning("console_action_failed", error=errors.describe(exc))
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        log.info("console_action", **result.logged(), identity=origin.identity)

    def running(self, record: int) -> bool:
        return record in self._tasks

    async def settle(self, record: int, seconds: float) -> None:
        """Wait up to `seconds` for the action of `record` to end (a small one is done before
        its page is shown)."""
        task = self._tasks.get(record)
        if task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), seconds)

    async def stop(self) -> None:
        """Interrupt what still runs; each record is closed as interrupted with its rows."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
