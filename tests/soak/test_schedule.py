from __future__ import annotations

import itertools

import pytest

from tests.soak.schedule import KINDS, LANES, plan

pytestmark = pytest.mark.unit


def test_a_seed_replays_its_schedule_and_lanes_differ() -> None:
    for lane in LANES:
        a = list(itertools.islice(plan(7, lane), 30))
        assert a == list(itertools.islice(plan(7, lane), 30))
        assert a != list(itertools.islice(plan(8, lane), 30))
        assert {p.lane for p in a} == {lane}


def test_every_kind_comes_in_the_first_round_then_by_weight() -> None:
    for lane, spec in LANES.items():
        kinds = [p.kind for p in itertools.islice(plan(1, lane), 2000)]
        assert sorted(kinds[:len(spec.kinds)]) == sorted(spec.kinds)
        heavy = max(spec.kinds, key=lambda k: spec.kinds[k])
        light = min(spec.kinds, key=lambda k: spec.kinds[k])
        if spec.kinds[heavy] > spec.kinds[light]:
            assert kinds.count(heavy) > kinds.count(light)
        low, high = spec.gap_s
        assert all(low <= p.gap_s <= high for p in itertools.islice(plan(1, lane), 200))
    assert len(KINDS) == len(set(KINDS))


def test_kinds_left_out() -> None:
    kinds = {p.kind for p in itertools.islice(
        plan(3, "roles", without=frozenset({"spark-kill", "spark-commit-kill"})), 300)}
    assert kinds == set(LANES["roles"].kinds) - {"spark-kill", "spark-commit-kill"}
    assert list(plan(3, "database", without=frozenset(LANES["database"].kinds))) == []
