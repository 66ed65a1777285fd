"""The soak's fault schedule: four lanes, each injecting its own kinds of fault one after
another with a random gap before each, all four at once (so faults overlap). Which kind comes
next and the gaps are drawn from the seed, per lane; the first round of every lane is each of
its kinds once, in a random order, then kinds are drawn by weight."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Lane:
    """Kinds of fault (with their weights) that never run at the same time as each other."""

    kinds: Mapping[str, int]
    gap_s: tuple[float, float]


LANES: dict[str, Lane] = {
    # SIGKILL (the coordinator of a role's id, a partition leader, any broker) and start again;
    # SIGSTOP past the clients' request timeout, SIGCONT; a clean restart of all three in turn.
    "brokers": Lane({"coordinator-kill": 3, "leader-kill": 2, "broker-kill": 2,
                     "broker-pause": 3, "rolling-restart": 1}, (4.0, 12.0)),
    # Through the proxies: a broker's or the database's connections cut (new ones refused a
    # moment, or not) or held a few seconds; an EndTxn answer lost; a Produce held past the
    # request timeout; the answer to a database COMMIT lost.
    "network": Lane({"kafka-cut": 3, "kafka-delay": 2, "endtxn-lost": 2, "produce-held": 2,
                     "database-cut": 3, "database-delay": 2}, (3.0, 8.0)),
    "database": Lane({"database-restart": 2, "database-sessions": 3}, (8.0, 20.0)),
    # SIGKILL at a random moment, or right after the role's next database COMMIT.
    "roles": Lane({"service-kill": 2, "service-commit-kill": 2, "consumer-kill": 2,
                   "consumer-commit-kill": 2, "spark-kill": 1, "spark-commit-kill": 1,
                   "daemon-kill": 2}, (5.0, 12.0)),
}
KINDS = tuple(kind for lane in LANES.values() for kind in lane.kinds)


@dataclass(frozen=True)
class Planned:
    lane: str
    gap_s: float
    """Seconds to wait, after the lane's previous fault ended, before this one."""
    kind: str


def plan(seed: int, lane: str, *, without: frozenset[str] = frozenset()) -> Iterator[Planned]:
    """Lane ``lane``'s faults, endlessly; ``without``: kinds left out (e.g. Spark's, when the
    soak runs without Spark)."""
    spec = LANES[lane]
    kinds = [k for k in spec.kinds if k not in without]
    if not kinds:
        return
    rng = random.Random(f"{seed}:{lane}")
    first = rng.sample(kinds, len(kinds))
    weights = [spec.kinds[k] for k in kinds]
    n = 0
    while True:
        kind = first[n] if n < len(first) else rng.choices(kinds, weights)[0]
        yield Planned(lane, rng.uniform(*spec.gap_s), kind)
        n += 1
