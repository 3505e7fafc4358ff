"""Rendezvous assignment of outboxes to fleet members (sources/fleet.py): every member computes
the same owner, adding a member moves outboxes only to it, removing one moves only its own, and
the shares are even."""

from __future__ import annotations

from collections import Counter

from pydantic import SecretStr

from outbox_dispatcher.config.outboxes import Outbox, Source
from outbox_dispatcher.sources.fleet import FleetView, assigned, outbox_key, owner_of, second_of

KEYS = [f"db1:5432/app/tenant_{n:03}.outbox" for n in range(600)]


def owners(members: list[str]) -> dict[str, str | None]:
    return {key: owner_of(key, members) for key in KEYS}


def test_every_member_computes_the_same_owner_whatever_the_order() -> None:
    assert owners(["a", "b", "c"]) == owners(["c", "a", "b"])
    assert owner_of("x", []) is None


def test_the_shares_are_even() -> None:
    shares = Counter(owners(["a", "b", "c"]).values())
    assert all(150 <= shares[m] <= 250 for m in "abc"), shares


def test_a_member_added_takes_outboxes_only_from_others_to_itself() -> None:
    before, after = owners(["a", "b", "c"]), owners(["a", "b", "c", "d"])
    moved = [key for key in KEYS if before[key] != after[key]]
    assert moved and all(after[key] == "d" for key in moved)
    assert 100 <= len(moved) <= 200  # about 1/4


def test_a_member_removed_hands_over_only_its_own() -> None:
    before, after = owners(["a", "b", "c"]), owners(["a", "c"])
    moved = [key for key in KEYS if before[key] != after[key]]
    assert moved and all(before[key] == "b" for key in moved)
    assert all(after[key] in ("a", "c") for key in KEYS)


def test_the_assignment_is_a_partition() -> None:
    members = ["m1", "m2", "m3"]
    parts = [assigned(KEYS, members, m, str) for m in members]
    assert sorted(k for part in parts for k in part) == sorted(KEYS)


def test_a_view_assigns_outboxes_by_database_schema_and_table() -> None:
    source = Source(SecretStr("postgresql://u:secret@db1:5432/app"), "tenant_*", "outbox")
    outboxes = [Outbox(source, f"tenant_{n}") for n in range(50)]
    assert outbox_key(outboxes[0]) == "db1:5432/app/tenant_0.outbox"
    alone = FleetView("me", (), None, None, None)
    assert alone.mine(outboxes) == outboxes  # before its first beat it knows only itself
    two = [FleetView(m, ("me", "you"), 0.0, None, None).mine(outboxes) for m in ("me", "you")]
    assert sorted(o.schema for part in two for o in part) == sorted(o.schema for o in outboxes)
    assert all(two)


def test_a_hot_outbox_is_served_by_its_owner_and_the_next_member_only() -> None:
    """An outbox its owner lists as hot is served by the next member in its hash order too;
    nobody else, and not when the listing comes from a member that no longer owns it (a view
    read across a membership change)."""
    source = Source(SecretStr("postgresql://u:secret@db1:5432/app"), "tenant_*", "outbox")
    outboxes = [Outbox(source, f"tenant_{n}") for n in range(60)]
    members = ("a", "b", "c")
    hot = outboxes[7]
    key = outbox_key(hot)
    owner = owner_of(key, members)
    second = second_of(key, members)
    assert owner is not None and second is not None and owner != second
    listed = {key: owner}
    views = {m: FleetView(m, members, 0.0, None, None, listed) for m in members}
    serving = [m for m in members if hot in views[m].mine(outboxes)]
    assert sorted(serving) == sorted([owner, second])
    assert views[owner].owns(hot) and not views[second].owns(hot)
    # Every other outbox is still served by its owner alone.
    for o in outboxes:
        if o is not hot:
            assert [m for m in members if o in views[m].mine(outboxes)] == [
                owner_of(outbox_key(o), members)
            ]
    # Listed by a member that is not (or no longer) its owner: nobody serves it twice.
    stale = {key: second}
    serving = [
        m for m in members if hot in FleetView(m, members, 0.0, None, None, stale).mine([hot])
    ]
    assert serving == [owner]
    # Alone, nobody is second.
    assert second_of(key, ("a",)) is None
