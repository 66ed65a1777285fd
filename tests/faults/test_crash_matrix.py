"""The crash matrix ("Proof"): real processes, a real broker and database, SIGKILL at every step.

``tests/support/workers/crash_worker.py`` runs DualWriter transactions (rows in ``events`` and
the same ids as Kafka records) and stops dead at a crash point; this module SIGKILLs it there, runs
``dualwrite recover --json`` as an operator would, lets a new worker go on, and finally checks the
invariant: the keys a read_committed consumer sees are exactly the ids in the database, with no
duplicates and no transaction left open.

One transactional id per test; each round of a test kills one worker, so a worker also proves that
writing continues after the previous round's recovery. Every point runs ``DUALWRITE_CRASH_ROUNDS``
rounds (default 3) on PostgreSQL, once on SQLite, once at three points on MariaDB (every point,
``DUALWRITE_CRASH_ROUNDS`` rounds, with ``--mariadb-full``), and once in the first transaction of a
new id. A
meta-test shows the invariant check fails when recovery aborts what the database committed. The
random-point soak (``--soak``) runs ``DUALWRITE_SOAK_ROUNDS`` (default 100; seed
``DUALWRITE_SOAK_SEED``).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dualwrite.participant import ControlPlane
from tests.support.crash_loop import ROWS, CrashLoop
from tests.support.workers.crash_worker import POINTS

ROUNDS = int(os.environ.get("DUALWRITE_CRASH_ROUNDS", "3"))
SOAK_ROUNDS = int(os.environ.get("DUALWRITE_SOAK_ROUNDS", "100"))
# MariaDB's quick form: a kill before the lock (the lease), after the database's commit, and
# during Kafka's (tests/database/test_mariadb.py loses a COMMIT's answer with the decision written).
MARIADB_QUICK_POINTS = {"before-lock", "after-db-commit", "during-kafka-commit"}


# -- fixtures (the databases, pg_db_url and the like, are in tests/support/fixtures/) ---------

LoopFactory = Callable[[str], CrashLoop]


@pytest.fixture
def make_loop(kafka: Any, new_topic: Any, tmp_path: Path) -> Iterator[LoopFactory]:
    """``make_loop(db_url)``: a CrashLoop on a new topic. At teardown an in-flight transaction of
    its id is fenced, so one failing test does not fail the others' checks."""
    loops: list[CrashLoop] = []

    def make(db_url: str) -> CrashLoop:
        loop = CrashLoop(db_url, kafka.bootstrap_servers, new_topic(kafka, partitions=3),
                         tmp_path)
        loops.append(loop)
        return loop

    yield make
    with ControlPlane({"bootstrap.servers": kafka.bootstrap_servers}, timeout_s=15) as cp:
        for loop in loops:
            desc = cp.describe_transaction(loop.tid)
            if desc is not None and desc.state.in_flight:
                cp.fence(loop.tid)


# -- tests -------------------------------------------------------------------------------------

@pytest.mark.timeout(120 + 15 * ROUNDS)
@pytest.mark.parametrize("point", POINTS)
def test_crash_matrix_postgres(point: str, pg_db_url: str, make_loop: LoopFactory) -> None:
    """``ROUNDS`` kills at ``point``, in the 2nd, 3rd, 4th … transaction of a worker."""
    loop = make_loop(pg_db_url)
    for r in range(ROUNDS):
        loop.crash_round(point, k=2 + r % 3)
    loop.run_worker(2)
    loop.check_invariant()
    print(f"{loop.tid}: recover outcomes {dict(loop.outcomes)}")


@pytest.mark.parametrize("point", POINTS)
def test_crash_matrix_sqlite(point: str, sqlite_db_url: str, make_loop: LoopFactory) -> None:
    """One kill at ``point`` on SQLite, the embedded default."""
    loop = make_loop(sqlite_db_url)
    loop.crash_round(point, k=2)
    loop.run_worker(2)
    loop.check_invariant()


@pytest.mark.timeout(120 + 15 * ROUNDS)
@pytest.mark.parametrize("point", POINTS)
def test_crash_matrix_mariadb(point: str, mariadb_db_url: str, make_loop: LoopFactory,
                              request: pytest.FixtureRequest) -> None:
    """A kill at ``point`` on MariaDB (:data:`MARIADB_QUICK_POINTS`, one kill each; every
    point, ``ROUNDS`` kills, with ``--mariadb-full``): the recipe, ``dualwrite recover`` and
    the next writer on InnoDB's row locks and GET_LOCK leases."""
    full = request.config.getoption("--mariadb-full")
    if not full and point not in MARIADB_QUICK_POINTS:
        pytest.skip("MariaDB crash matrix, full form: run with --mariadb-full")
    loop = make_loop(mariadb_db_url)
    for r in range(ROUNDS if full else 1):
        loop.crash_round(point, k=2 + r % 3)
    loop.run_worker(2)
    loop.check_invariant()
    print(f"{loop.tid}: recover outcomes {dict(loop.outcomes)}")


@pytest.mark.parametrize(
    "point", [p for p in POINTS
              # the first transaction of a session locks first: no "before-lock" in it
              if p not in ("before-lock", "during-kafka-commit", "after-kafka-commit")])
def test_crash_in_first_transaction_of_new_id(point: str, pg_db_url: str,
                                              make_loop: LoopFactory) -> None:
    """A kill in the very first transaction of a transactional id: recovery must still find it
    (the writer registers the id with a committed state row before Kafka opens anything)."""
    loop = make_loop(pg_db_url)
    loop.crash_round(point, k=1)
    loop.check_invariant()
    loop.run_worker(2)
    loop.check_invariant()


# `dualwrite recover` with a sabotaged control plane: every EndTxn aborts, whatever was asked.
ABORTING_RECOVER = """
import dualwrite.participant.control_plane as cp
end = cp.ControlPlane.end_transaction
cp.ControlPlane.end_transaction = lambda self, tid, pid, epoch, commit: end(
    self, tid, pid, epoch, commit=False)
from dualwrite.cli import main
main()
"""


def test_invariant_check_catches_a_recovery_that_aborts(pg_db_url: str,
                                                        make_loop: LoopFactory) -> None:
    """The harness can fail: a recovery that aborts a DB-committed transaction is caught."""
    loop = make_loop(pg_db_url)
    loop.recover_program = ABORTING_RECOVER
    loop.crash_round("after-db-commit", k=2)  # the sabotaged recover still says "committed"
    with pytest.raises(AssertionError, match="in the DB but not visible in Kafka") as failure:
        loop.check_invariant()
    assert all(f"t2-{i}" in str(failure.value) for i in range(ROWS)), failure.value


@pytest.mark.slow
@pytest.mark.timeout(300 + 15 * SOAK_ROUNDS)
def test_crash_soak_random_points(pg_db_url: str, make_loop: LoopFactory) -> None:
    """``SOAK_ROUNDS`` kills at random points and transactions, checking the invariant often.

    One round in four skips ``dualwrite recover``: the next writer must finish the in-doubt
    transaction itself. ``DUALWRITE_SOAK_SEED`` replays a run (the seed is in the failure text).
    """
    seed = int(os.environ.get("DUALWRITE_SOAK_SEED", str(random.randrange(2**32))))
    rng = random.Random(seed)
    loop = make_loop(pg_db_url)
    loop.history.append(f"seed {seed}")
    for r in range(SOAK_ROUNDS):
        point = rng.choice(POINTS)
        k = rng.randint(2 if point == "before-lock" else 1, 4)
        if rng.random() < 0.25:
            loop.run_worker(k, point)
            loop.history.append("(no recover: the next writer finishes it)")
        else:
            loop.crash_round(point, k)
        if r % 10 == 9:
            loop.run_worker(1)
            loop.check_invariant()
    loop.run_worker(2)
    loop.check_invariant()
    print(f"soak: {SOAK_ROUNDS} rounds, seed {seed}, {loop.next_txn - 1} transactions, "
          f"recover outcomes {dict(loop.outcomes)}")
