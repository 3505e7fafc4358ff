"""The real claimer, settler and claim loop over the in-memory store (tests/memory_store.py):
what the claim engine promises the loop (one owner per key, each key in id order, the lease token
as a fence, the takeover's attempt, backoff and the dead-letter policy), with no database or
broker. The fake's fidelity to the engine itself is the integration tests' (tests/integration/);
the last test keeps its signatures those of the real store."""

from __future__ import annotations

import asyncio
import inspect
import random
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest

from outbox_dispatcher import errors
from outbox_dispatcher.config.settings import Settings
from outbox_dispatcher.dispatch.batch import Settling
from outbox_dispatcher.dispatch.claim_loop import ClaimLoop, Shared
from outbox_dispatcher.dispatch.claimer import Claimer
from outbox_dispatcher.dispatch.leases import InFlight
from outbox_dispatcher.dispatch.settler import Settler
from outbox_dispatcher.dispatch.supervisor import configs_of
from outbox_dispatcher.dispatch.wakeup import Wakeup
from outbox_dispatcher.health import Heartbeats
from outbox_dispatcher.metrics import Metrics
from outbox_dispatcher.models import PUBLISHED, Batch, OutboxRecord, Outcome, Result
from outbox_dispatcher.retries import RetryPolicy
from outbox_dispatcher.store import DispatchStore, Row
from tests.fakes import FakeProducer, Submitted, publisher_with
from tests.memory_store import InMemoryDispatchStore, ManualClock


def claimer(store: DispatchStore, owner: str, **settings: Any) -> Claimer:
    return Claimer(store, Settings(**settings), owner)


def settler(store: DispatchStore, owner: str, *, block: bool = False) -> Settler:
    return Settler(store, retry_for=1.0, owner=owner, block_on_dead=block)


def ids(batch: Batch | None) -> list[int]:
    return [] if batch is None else [r.id for r in batch.records]


def works(batch: Batch) -> set[str | int]:
    """What a batch holds: its keys, and its rows without one."""
    return {r.id if r.ordering_key is None else r.ordering_key for r in batch.records}


async def claimed(c: Claimer) -> Batch:
    batch = await c.claim()
    assert batch is not None
    return batch


def dispatcher(store: DispatchStore, owner: str, log: list[Submitted], shared: Shared) -> ClaimLoop:
    """One dispatcher's claim loop: the real claimer, settler and publisher, over a producer
    whose broker acknowledges everything (into the shared `log`)."""
    settings = Settings(batch_size=5, lease_seconds=30, linger_poll_seconds=0.001)
    settling = Settling(settler(store, owner), RetryPolicy(settings), Metrics())
    return ClaimLoop(
        f"claim-{owner}",
        configs_of(settings).claim_loop,
        claimer=Claimer(store, settings, owner),
        publisher=publisher_with(FakeProducer(log=log)),
        settling=settling,
        in_flight=InFlight(),
        metrics=Metrics(),
        shared=shared,
    )


async def test_a_drain_of_several_keys_publishes_every_row_once_each_key_in_id_order() -> None:
    """Two dispatchers' claim loops drain four keys and some keyless rows in batches of five:
    each row reaches the broker once, each key's rows in id order, and every row is marked."""
    store = InMemoryDispatchStore()
    for n in range(6):
        for key in "abcd":
            store.add(key, f"{key}{n}".encode())
    keyless = [store.add(None, f"none{n}".encode()) for n in range(3)]
    log: list[Submitted] = []
    shared = Shared(asyncio.Event(), Wakeup(), Heartbeats(60))
    loops = [dispatcher(store, owner, log, shared) for owner in ("one", "two")]
    tasks = [asyncio.ensure_future(loop.run()) for loop in loops]
    async with asyncio.timeout(10):
        while store.pending():  # noqa: ASYNC110 (the fake's state)
            await asyncio.sleep(0.005)
        shared.stopping.set()
        await asyncio.gather(*tasks)
    sent = [(key, value) for s in log for key, value in s.batch.records]
    assert sorted(value or b"" for _, value in sent) == sorted(
        r.payload or b"" for r in store.rows.values()
    ), "every row once: none lost, none twice"
    for key in "abcd":
        assert [v for k, v in sent if k == key.encode()] == [f"{key}{n}".encode() for n in range(6)]
    assert {r.state for r in store.rows.values()} == {"published"}
    assert not store.leases, "every key released"
    assert {r.lease_owner for r in store.rows.values()} == {"one", "two"}, "both loops took part"
    assert {store.rows[i].lease_owner for i in keyless} <= {"one", "two"}


async def test_two_claimers_never_hold_the_same_key_at_once() -> None:
    """Claims interleaved before any settle: the second claimer skips every key the first holds
    (though those keys have rows left), and takes them once the first settled."""
    store = InMemoryDispatchStore()
    for _ in range(3):
        for key in "abcd":
            store.add(key)
    store.add(None)
    a, b = claimer(store, "a", batch_size=2), claimer(store, "b", batch_size=50)
    first = await claimed(a)
    assert works(first) == {"a", "b"} and ids(first) == [1, 2], "two keys' oldest rows"
    second = await claimed(b)
    assert works(second) == {"c", "d", 13}
    assert ids(second) == [3, 4, 7, 8, 11, 12, 13], "each key's rows, in id order"
    assert await b.claim() is None, "a's keys still have rows, and are a's"
    assert await a.claim() is None, "and b's are b's"
    assert await settler(store, "a").settle(first, [PUBLISHED] * 2) == 2
    third = await claimed(b)
    assert ids(third) == [5, 6, 9, 10], "a's keys go on from their next rows"


async def test_a_claim_shares_its_batch_between_at_most_max_keys_oldest_heads_first() -> None:
    """Keys a (rows 1-5), b (6), c (7-11), d (12-16); seven rows of at most three keys: the three
    oldest heads, two rows each (b has one), the room b left to the oldest head, a."""
    store = InMemoryDispatchStore()
    for key, count in (("a", 5), ("b", 1), ("c", 5), ("d", 5)):
        for _ in range(count):
            store.add(key)
    token = uuid.uuid4()
    rows = await store.claim(
        limit=7, max_keys=3, owner="o", lease_seconds=10, token=token, block_on_dead=False,
        max_attempts=10, scan=100,
    )  # fmt: skip
    assert [row["id"] for row in rows] == [1, 2, 3, 4, 6, 7, 8]
    records = [OutboxRecord.from_row(row) for row in rows]
    assert [r.ordering_key for r in records] == ["a"] * 4 + ["b", "c", "c"]
    assert not any(r.reclaimed for r in records)
    assert {key: lease.token for key, lease in store.leases.items()} == dict.fromkeys("abc", token)


async def test_a_settle_under_a_lost_lease_changes_nothing_and_the_takeover_counts() -> None:
    """Owner a hangs past its lease: b takes the key over (an attempt, `reclaimed`); a's late
    settle is fenced off by the token and changes nothing; b's publication is recorded with the
    attempt the takeover counted."""
    clock = ManualClock()
    store = InMemoryDispatchStore(clock)
    rows = [store.add("k"), store.add("k")]
    a, b = claimer(store, "a", lease_seconds=10), claimer(store, "b", lease_seconds=10)
    lost = await claimed(a)
    clock.advance(9)
    assert await b.claim() is None, "a live lease is not taken over"
    clock.advance(2)
    taken = await claimed(b)
    assert ids(taken) == rows
    assert all(r.reclaimed and r.attempts == 1 for r in taken.records)
    assert await settler(store, "a").settle(lost, [PUBLISHED] * 2) == 0
    assert [store.rows[i].state for i in rows] == ["pending"] * 2
    assert store.leases["k"].token == taken.token, "b still holds the key"
    assert await settler(store, "b").settle(taken, [PUBLISHED] * 2) == 2
    assert [(store.rows[i].state, store.rows[i].attempts) for i in rows] == [("published", 1)] * 2
    assert {store.rows[i].lease_owner for i in rows} == {"b"}


async def test_a_takeover_sends_the_orphans_first() -> None:
    """As the engine does (test_claim.py's test of the same name): the rows a dead owner held go
    before every other key's share, each with an attempt; the key's later row, never held,
    follows in a claim that is no takeover."""
    clock = ManualClock()
    store = InMemoryDispatchStore(clock)
    orphans = [store.add("k") for _ in range(3)]
    await claimed(claimer(store, "dead", batch_size=3, lease_seconds=10))
    later = store.add("k")
    others = [store.add(f"r{i}") for i in range(3)]
    clock.advance(11)
    taken = await claimed(claimer(store, "b", batch_size=3, lease_seconds=10))
    assert ids(taken) == orphans, "the orphans before the other keys' shares"
    assert all(r.reclaimed and r.attempts == 1 for r in taken.records)
    assert await settler(store, "b").settle(taken, [PUBLISHED] * 3) == 3
    rest = await claimed(claimer(store, "b", batch_size=10, lease_seconds=10))
    assert ids(rest) == [later, *others]
    assert not any(r.reclaimed or r.attempts for r in rest.records)


async def test_an_expired_lease_nobody_took_over_still_settles() -> None:
    """As in the engine, the fence is the token holding the key, not the clock: a slow owner
    whose lease expired settles its rows if no claim took the key over meanwhile."""
    clock = ManualClock()
    store = InMemoryDispatchStore(clock)
    row = store.add("k")
    batch = await claimed(claimer(store, "a", lease_seconds=10))
    clock.advance(60)
    assert await store.count_expired_leases() == 1
    assert await settler(store, "a").settle(batch, [PUBLISHED]) == 1
    assert store.rows[row].state == "published" and store.rows[row].attempts == 0


async def test_the_lease_keeper_extends_live_leases_and_never_revives_one() -> None:
    clock = ManualClock()
    store = InMemoryDispatchStore(clock)
    store.add("k")
    store.add(None)
    in_flight = InFlight()
    a, b = claimer(store, "a", lease_seconds=10), claimer(store, "b", lease_seconds=10)
    batch = await claimed(a)
    in_flight.add(batch.token, ids(batch))
    pairs = in_flight.pairs()
    clock.advance(8)
    assert await store.extend_leases(ids=pairs[0], tokens=pairs[1], seconds=10) == 2
    clock.advance(8)
    assert await b.claim() is None, "16 s after the claim, the extended lease holds"
    clock.advance(3)
    assert await store.extend_leases(ids=pairs[0], tokens=pairs[1], seconds=10) == 0
    assert ids(await b.claim()) == ids(batch), "expired: taken over, not revived"


class LosesOneReply(InMemoryDispatchStore):
    """A store whose next claim or settle commits and then loses its reply (a dropped
    connection), as the real one can."""

    def __init__(self, clock: ManualClock, lose: str) -> None:
        super().__init__(clock)
        self.lose = lose

    async def claim(self, **arguments: object) -> list[Row]:  # type: ignore[override]
        rows = await super().claim(**arguments)  # type: ignore[arg-type]
        self._maybe_lose("claim")
        return rows

    async def settle(self, **arguments: object) -> list[int]:  # type: ignore[override]
        changed = await super().settle(**arguments)  # type: ignore[arg-type]
        self._maybe_lose("settle")
        return changed

    def _maybe_lose(self, name: str) -> None:
        if self.lose == name:
            self.lose = ""
            raise ConnectionResetError("the reply was lost")


async def test_a_claim_whose_reply_was_lost_is_given_back_uncounted() -> None:
    """The claimer releases the token of a claim it never heard back from at its next claim:
    the rows come back at once, no lease to wait out, no attempt counted."""
    store = LosesOneReply(ManualClock(), lose="claim")
    rows = [store.add("k"), store.add(None)]
    c = claimer(store, "a", lease_seconds=10)
    with pytest.raises(ConnectionResetError):
        await c.claim()
    assert len(store.leases) == 2, "the lost claim committed"
    again = await claimed(c)
    assert ids(again) == rows
    assert not any(r.reclaimed or r.attempts for r in again.records)


async def test_a_settle_whose_reply_was_lost_is_not_reported_as_a_lost_lease() -> None:
    """The settler retries a settle that lost its reply; the retry changes nothing (the first
    committed), and already_settled finds the rows showing that settle's outcome."""
    store = LosesOneReply(ManualClock(), lose="settle")
    rows = [store.add("k"), store.add("k"), store.add(None)]
    batch = await claimed(claimer(store, "a"))
    retry = Result(Outcome.RETRY, "boom", delay=5.0, counted=True)
    assert await settler(store, "a").settle(batch, [PUBLISHED, retry, PUBLISHED]) == 3
    assert [store.rows[i].attempts for i in rows] == [0, 1, 0]
    outcomes, attempts = ["published", "retry", "published"], [0, 1, 0]
    for owner, shown in (("a", 3), ("b", 0)):
        assert (
            await store.already_settled(
                ids=rows, owner=owner, outcomes=outcomes, attempts=attempts, delete_published=False
            )
            == shown
        ), "only the owner that settled sees its settle"


async def test_a_retry_leaves_the_row_pending_with_its_backoff_and_its_key_waits() -> None:
    """Row 1 failed (the retry policy's answer to a row error), rows 2-3 were not attempted:
    all stay pending, row 1 with one attempt and its backoff; the key's later rows, due, are
    not taken before it, while another key goes on. Once the backoff ends, the key resumes at
    row 1."""
    clock = ManualClock()
    store = InMemoryDispatchStore(clock)
    rows = [store.add("k"), store.add("k"), store.add("k"), store.add("o")]
    c, s = claimer(store, "a"), settler(store, "a")
    batch = await claimed(c)
    assert ids(batch) == rows
    stopped = errors.NotAttempted("an earlier row of its key failed")
    policy = RetryPolicy(Settings(), random.Random(7))
    results = policy.results(batch.records, [RuntimeError("boom"), stopped, stopped, None])
    assert [r.outcome for r in results] == [Outcome.RETRY] * 3 + [Outcome.PUBLISHED]
    assert await s.settle(batch, results) == 4
    first = store.rows[1]
    assert (first.state, first.attempts) == ("pending", 1)
    assert first.next_attempt_at == clock.now + timedelta(seconds=results[0].delay) > clock.now
    assert first.last_error is not None and "boom" in first.last_error
    assert [(store.rows[i].state, store.rows[i].attempts) for i in (2, 3)] == [("pending", 0)] * 2
    store.add("o")
    assert ids(await c.claim()) == [5], "k waits behind row 1; o goes on"
    clock.advance(results[0].delay)
    resumed = await claimed(c)
    assert ids(resumed) == [1, 2, 3]
    assert [r.attempts for r in resumed.records] == [1, 0, 0] and not resumed.records[0].reclaimed


@pytest.mark.parametrize(("policy", "after"), [("block", [4]), ("skip", [2, 3, 4])])
async def test_a_dead_row_holds_its_key_under_block_and_not_under_skip(
    policy: str, after: Sequence[int]
) -> None:
    store = InMemoryDispatchStore()
    store.add("k")
    store.add("k")
    store.add("k")
    first = await claimed(claimer(store, "a", batch_size=1, dead_letter_policy=policy))
    assert ids(first) == [1]
    dead = Result(Outcome.DEAD, "permanent error, not retried", counted=True)
    assert await settler(store, "a", block=policy == "block").settle(first, [dead]) == 1
    assert store.rows[1].state == "dead" and store.rows[1].attempts == 1
    store.add("o")
    c = claimer(store, "a", dead_letter_policy=policy)
    assert ids(await c.claim()) == after
    if policy == "block":
        assert ids(await c.claim()) == [], "still held: only an operator moves it on"
        assert [store.rows[i].state for i in (2, 3)] == ["pending"] * 2 and "k" not in store.leases


def test_the_in_memory_store_keeps_the_real_stores_signatures() -> None:
    """Every method the fake overrides takes the real one's keyword-only parameters, with
    their annotations and defaults, and returns the same annotated type: a change of the seam
    fails here rather than leave the fake testing a store that no longer exists."""
    overridden = {
        name: member
        for name, member in vars(InMemoryDispatchStore).items()
        if not name.startswith("_") and callable(member) and hasattr(DispatchStore, name)
    }
    assert {"claim", "release_claim", "settle", "already_settled", "extend_leases"} <= set(
        overridden
    )
    for name, fake in overridden.items():
        real = getattr(DispatchStore, name)
        assert inspect.iscoroutinefunction(fake) == inspect.iscoroutinefunction(real), name
        fake_sig, real_sig = inspect.signature(fake), inspect.signature(real)
        assert list(fake_sig.parameters.values()) == list(real_sig.parameters.values()), name
        assert fake_sig.return_annotation == real_sig.return_annotation, name


async def test_statements_the_fake_does_not_model_refuse_to_pretend() -> None:
    """An inherited method would run SQL through an executor the fake does not have."""
    with pytest.raises(NotImplementedError, match="dead_letter_crash_loops"):
        await InMemoryDispatchStore().dead_letter_crash_loops(max_attempts=3, block_on_dead=False)
