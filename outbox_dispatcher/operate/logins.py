"""The console's logins, as the database keeps them: a row of <table>_console_session per login,
found by the digest of the random key its cookie carries (the key itself is stored nowhere), and
ended by logout, expiry or a new token (each login records which token it used)."""

from __future__ import annotations

from outbox_dispatcher.operate.session import Session


async def open_login(
    session: Session,
    *,
    digest: bytes,
    identity: str,
    client: str | None,
    token_tag: str,
    seconds: float,
) -> None:
    """A new login for `seconds`; logins that ended or expired a day ago are forgotten."""
    store = session.store
    await store.session_prune()
    await store.session_open(
        id=digest, identity=identity, client=client, token_tag=token_tag, seconds=seconds
    )


async def find_login(session: Session, *, digest: bytes, token_tag: str) -> str | None:
    """Who is logged in with this key, if the login still counts (not ended, not expired,
    with the current token)."""
    found = await session.store.session_get(id=digest, token_tag=token_tag)
    return None if found is None else str(found["identity"])


async def end_login(session: Session, *, digest: bytes) -> None:
    await session.store.session_end(id=digest)
