"""The fleet's membership table (store/fleet.sql) in the home database: created by `migrate`,
beaten by every member, read for the live members."""

from __future__ import annotations

from collections.abc import Sequence

from outbox_dispatcher.config.names import FLEET_SCHEMA, quote_identifier, validate_identifier
from outbox_dispatcher.store import db
from outbox_dispatcher.store.named import NamedStore, load

MEMBER_TABLE = "member"


def _names(schema: str) -> dict[str, str]:
    validate_identifier(schema, "fleet schema")
    return {
        "schema": quote_identifier(schema),
        "member": f"{quote_identifier(schema)}.{quote_identifier(MEMBER_TABLE)}",
    }


class FleetStore(NamedStore):
    """The membership table of `schema` over one connection."""

    def __init__(self, executor: db.Executor, schema: str = FLEET_SCHEMA) -> None:
        self.names = _names(schema)
        super().__init__(executor, load("fleet.sql", **self.names))

    async def create(self) -> bool:
        """Create the table if it is missing; whether it was."""
        if await self.exists():
            return False
        await self.executor.execute(self.statements["create"].sql)
        return True

    async def exists(self) -> bool:
        return bool(await self._value("exists", relation=self.names["member"]))

    async def heartbeat(
        self, owner: str, *, lease_seconds: float, forget_seconds: float, hot: Sequence[str] = ()
    ) -> list[tuple[str, list[str]]]:
        """Renew `owner`'s row; the live members, sorted (`owner` among them), each with the
        outboxes it lists as hot."""
        rows = await self._fetch(
            "heartbeat",
            owner=owner,
            hot=list(hot),
            lease_seconds=lease_seconds,
            forget_seconds=forget_seconds,
        )
        return [(row["owner"], list(row["hot"])) for row in rows]

    async def leave(self, owner: str) -> None:
        await self._fetch("leave", owner=owner)
