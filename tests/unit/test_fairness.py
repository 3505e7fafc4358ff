"""Weighted deficit round-robin (sources/fairness.py): no outbox starves, grants follow the
weights, a huge backlog takes no more than its share while others have work, and an idle or
backing-off outbox costs nothing. A small simulation drives it: claims end in any order, each
with a full batch while its outbox has a backlog."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox_dispatcher.sources.fairness import PROBE_EVERY, DeficitRoundRobin

BATCH = 100


class Simulation:
    """Outboxes with backlogs (rows), a scheduler, claims in flight ending in an order `pick`
    chooses; counts rows claimed per outbox."""

    def __init__(
        self, budget: int, weights: dict[str, int], backlog: dict[str, int], reserve: int = 0
    ) -> None:
        self.drr: DeficitRoundRobin[str] = DeficitRoundRobin(budget, BATCH, reserve)
        self.backlog = dict(backlog)
        self.rows: Counter[str] = Counter()
        self.order: list[str] = []
        self.in_flight: list[tuple[str, int]] = []
        for key, weight in weights.items():
            self.drr.add(key, weight)
            if self.backlog.get(key, 0) > 0:
                self.drr.wake(key)

    def fill(self) -> None:
        while (key := self.drr.grant()) is not None:
            rows = min(BATCH, self.backlog[key])
            self.backlog[key] -= rows
            self.rows[key] += rows
            self.order.append(key)
            self.in_flight.append((key, rows))

    def end_one(self, pick: int) -> None:
        key, rows = self.in_flight.pop(pick % len(self.in_flight))
        self.drr.finished(key, rows)

    def run(self, claims: int, rng: random.Random) -> None:
        while len(self.order) < claims:
            self.fill()
            if not self.in_flight:
                return
            self.end_one(rng.randrange(len(self.in_flight)))


def test_grants_follow_the_weights_over_many_claims() -> None:
    weights = {"a": 1, "b": 2, "c": 5}
    sim = Simulation(4, weights, dict.fromkeys(weights, 10**9))
    sim.run(10_000, random.Random(1))
    total = sum(sim.rows.values())
    for key, weight in weights.items():
        assert sim.rows[key] / total == pytest.approx(weight / 8, rel=0.01)


def test_a_huge_backlog_takes_one_quantum_per_round_while_another_has_work() -> None:
    sim = Simulation(2, {"noisy": 1, "quiet": 1}, {"noisy": 10**9, "quiet": 0})
    sim.run(50, random.Random(2))
    assert set(sim.rows) == {"noisy"}  # alone, it may use every slot
    sim.backlog["quiet"] = 5 * BATCH
    sim.drr.wake("quiet")
    before = len(sim.order)
    sim.run(before + 10, random.Random(3))
    after = sim.order[before:]
    # From the quiet outbox's first claim on, the two alternate until it is drained.
    first = after.index("quiet")
    assert first <= 1
    assert after[first : first + 10] == ["quiet", "noisy"] * 5


def test_a_woken_outbox_is_granted_within_one_round_of_the_others() -> None:
    weights = {f"o{n}": 1 + n % 3 for n in range(20)}
    sim = Simulation(3, weights, dict.fromkeys(weights, 10**9))
    sim.run(500, random.Random(4))
    sim.drr.add("late", 1)
    sim.backlog["late"] = BATCH * 3
    sim.drr.wake("late")
    before = len(sim.order)
    sim.run(before + sum(weights.values()) + 1, random.Random(5))
    assert "late" in sim.order[before:]


def test_an_idle_or_backing_off_outbox_is_never_visited_nor_granted() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(2, BATCH)
    for n in range(500):
        drr.add(f"idle{n}")
    drr.add("busy")
    drr.add("failing")
    drr.wake("busy")
    drr.wake("failing")
    drr.sleep("failing")  # backing off
    for _ in range(1000):
        key = drr.grant()
        assert key == "busy"
        drr.finished(key, BATCH)
    assert drr.visits <= 2 * 1000  # O(1) per grant, whatever the 500 idle ones
    assert drr.active == ["busy"]
    assert {drr.flows[k].granted for k in drr.flows if k != "busy"} == {0}


def test_the_budget_bounds_the_slots_and_a_drained_outbox_sleeps() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(3, BATCH)
    drr.add("a", 10)
    drr.wake("a")
    assert [drr.grant() for _ in range(4)] == ["a", "a", "a", None]
    drr.finished("a", 7)  # fewer than a batch: drained
    assert drr.active == []
    assert drr.grant() is None
    assert drr.in_flight == 2
    drr.forget("a")
    drr.finished("a", BATCH)  # a claim of a forgotten outbox still frees its slot
    assert drr.in_flight == 1


def test_a_sleeping_outbox_keeps_no_credit_to_burst_with() -> None:
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(10, BATCH)
    drr.add("a", 5)
    drr.add("b", 1)
    drr.wake("a")
    assert drr.grant() == "a"  # credited 5 claims, spent 1
    drr.sleep("a")
    assert drr.flows["a"].deficit == 0
    drr.wake("b")
    drr.wake("a")
    assert [drr.grant() for _ in range(7)] == ["b", "a", "a", "a", "a", "a", "b"]


def test_the_reserve_keeps_the_last_grants_for_outboxes_with_nothing_in_flight() -> None:
    """Budget 4, reserve 2: a backlog gets two batches in flight, not more; two quiet outboxes
    woken meanwhile each get one of the reserved grants at once, out of the round."""
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(4, BATCH, reserve=2)
    for key in ("big", "q1", "q2", "q3"):
        drr.add(key, 10)  # a quantum of ten claims: the ring would give `big` ten in a row
    drr.wake("big")
    assert [drr.grant(), drr.grant(), drr.grant()] == ["big", "big", None]
    drr.wake("q1")
    drr.wake("q2")
    assert [drr.grant(), drr.grant()] == ["q1", "q2"]
    drr.wake("q3")
    assert drr.grant() is None  # the budget is spent
    drr.finished("q1", 1)  # drained: asleep; its grant back
    assert drr.grant() == "q3"  # nothing in flight: the reserve's
    drr.finished("big", BATCH)
    drr.finished("q2", 1)
    drr.finished("q3", 1)
    assert drr.in_flight == 1
    assert [drr.grant(), drr.grant()] == ["big", None]  # its credit of the round kept
    assert drr.flows["big"].granted == 3
    assert drr.visits <= 20


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.integers(1, 8), min_size=2, max_size=6),
    extra=st.integers(2, 8),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_weights_hold_among_backlogs_beside_the_reserve(
    weights: list[int], extra: int, seed: int
) -> None:
    """Every outbox always backlogged, and once it has a batch in flight it keeps one (the
    reserve is for outboxes with none: each takes a reserved grant at most once, its first):
    the grants follow the weights as without a reserve, within the budget outside it."""
    budget, reserve = len(weights) + extra, 2
    keys = {f"o{n}": w for n, w in enumerate(weights)}
    sim = Simulation(budget, keys, dict.fromkeys(keys, 10**12), reserve)
    rng = random.Random(seed)
    while len(sim.order) < 40 * sum(weights):
        sim.fill()
        if not sim.in_flight:
            return
        # the claims end in a random order, but never an outbox's last one
        ending = [i for i, (key, _) in enumerate(sim.in_flight) if sim.drr.flows[key].in_flight > 1]
        if not ending:
            break
        sim.end_one(rng.choice(ending))
    assert sim.drr.in_flight <= budget
    total_weight = sum(weights)
    counts: Counter[str] = Counter()
    for index, key in enumerate(sim.order):
        counts[key] += 1
        rounds = (index + 1) / total_weight
        for other, weight in keys.items():
            assert abs(counts[other] - rounds * weight) <= 2 * weight + 1


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        DeficitRoundRobin(0, BATCH)
    with pytest.raises(ValueError, match="reserve"):
        DeficitRoundRobin(2, BATCH, reserve=2)
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(1, BATCH)
    with pytest.raises(ValueError, match="weight"):
        drr.add("a", 0)
    with pytest.raises(KeyError, match="add it first"):
        drr.wake("nobody")


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.integers(1, 8), min_size=1, max_size=8),
    budget=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_backlogged_outboxes_share_by_weight_and_none_starves(
    weights: list[int], budget: int, seed: int
) -> None:
    """Every outbox always backlogged, claims ending in a random order: after any number of
    grants, each outbox's grants are its weighted share of the rounds so far within one quantum
    (its weight), and between two grants of one outbox no more than one round of the others."""
    keys = {f"o{n}": w for n, w in enumerate(weights)}
    sim = Simulation(budget, keys, dict.fromkeys(keys, 10**12))
    sim.run(40 * sum(weights), random.Random(seed))
    total_weight = sum(weights)
    counts: Counter[str] = Counter()
    last_seen = dict.fromkeys(keys, -1)
    for index, key in enumerate(sim.order):
        counts[key] += 1
        gap = index - last_seen[key] - 1
        assert gap <= total_weight, f"{key} waited {gap} grants"
        last_seen[key] = index
        rounds = (index + 1) / total_weight
        for other, weight in keys.items():
            assert abs(counts[other] - rounds * weight) <= 2 * weight + 1


@settings(max_examples=200, deadline=None)
@given(
    budget=st.integers(1, 6),
    quiet=st.lists(st.integers(0, 6), min_size=1, max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_a_huge_backlog_never_takes_more_than_its_share_while_others_have_work(
    budget: int, quiet: list[int], seed: int
) -> None:
    """A noisy outbox of weight 1 beside quiet ones with small backlogs (in batches): while any
    quiet one has work, the noisy one gets at most one grant more than the quiet one with the
    fewest grants; the quiet ones all drain."""
    keys = {"noisy": 1} | {f"q{n}": 1 for n in range(len(quiet))}
    backlog = {"noisy": 10**12} | {f"q{n}": b * BATCH for n, b in enumerate(quiet)}
    sim = Simulation(budget, keys, backlog)
    sim.run(sum(quiet) * 2 + 4 * budget + 10, random.Random(seed))
    counts: Counter[str] = Counter()
    for key in sim.order:
        counts[key] += 1
        waiting = [q for q in keys if q != "noisy" and counts[q] < quiet[int(q[1:])]]
        if waiting:
            assert counts["noisy"] <= min(counts[q] for q in waiting) + 1
    for n, b in enumerate(quiet):
        assert sim.rows[f"q{n}"] == b * BATCH


def test_polls_take_a_slot_only_after_outboxes_with_work() -> None:
    """An idle outbox polled in case a notification was lost waits in the polls' lane: a slot
    goes to an outbox with work first, and to a poll only when none wants it or once every
    PROBE_EVERY grants while they keep the ring busy."""
    drr: DeficitRoundRobin[str] = DeficitRoundRobin(1, BATCH)
    for key in ("busy", "idle-1", "idle-2", "quiet"):
        drr.add(key)
    drr.wake("busy")
    drr.probe("idle-1")
    drr.probe("idle-2")
    drr.probe("busy")  # in the ring already: not a poll
    granted = []
    for _ in range(2 * PROBE_EVERY):
        key = drr.grant()
        assert key is not None
        granted.append(key)
        drr.finished(key, BATCH if key == "busy" else 0)
        if key == "busy":
            drr.wake("busy")
        if len(granted) == 2:
            drr.wake("quiet")  # notified: out of the polls' lane if it was in it, into the ring
    assert granted.count("idle-1") == granted.count("idle-2") == 1
    assert granted.index("idle-1") == PROBE_EVERY - 1
    assert granted.index("quiet") <= 3  # within a round of the busy outbox, before the polls
    # With the ring empty, polls go at once; a woken outbox leaves the polls' lane.
    drr.sleep("busy")
    drr.sleep("quiet")
    drr.probe("idle-1")
    drr.probe("quiet")
    drr.wake("quiet")
    assert drr.grant() == "quiet"
    drr.finished("quiet", 0)
    assert drr.grant() == "idle-1"
    drr.finished("idle-1", 0)
    assert drr.grant() is None
