"""Issue 22: the writer's database session lost under load — its lease goes with it.

A private PostgreSQL server (its sessions are terminated and it is restarted; synchronous
commits, so an immediate shutdown loses no acknowledged COMMIT) and the shared Kafka broker.

- Between a writer's two commits, ``pg_ctl stop -m immediate`` and start: recovery takes the
  freed lease and sends EndTxn by (producer id, epoch), delayed; the writer must not begin its
  next transaction on that (producer id, epoch) (the same as the pg_terminate_backend case in
  ``tests/writer/test_protocol.py``).
- The proof loop: two ``tests/support/workers/fault_worker.py`` processes (one transactional id
  each) and ``dualwrite.recover`` in a loop, while every client session of the database is
  terminated every few seconds (``pg_terminate_backend``), or the server is restarted immediately.
  Then: read_committed records == rows, nothing duplicated or lost, nothing left open, no heuristic
  outcome anywhere, only typed retriable or recoverable errors reaching the application. The
  sessions killed and the transactions committed are printed. ``--soak``: five minutes each.
"""

from __future__ import annotations

import importlib.util
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import dualwrite
from dualwrite.dev import LocalPostgres
from dualwrite.dev.kafka_cluster import KafkaTarget
from dualwrite.writer import StateStore
from tests.support.db import pg_ctl, private_postgres
from tests.support.fault_runner import Fault, FaultRunner
from tests.support.kafka import unique
from tests.support.recipe import lapsed_lease
from tests.support.tables import add_fault_rows_table, add_value_table

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def private_pg() -> Iterator[LocalPostgres]:
    """A PostgreSQL server of this module's own, with dualwrite's tables, ``app_rows`` (the
    recipe tests' table) and ``fault_rows`` (the fault workers')."""
    with private_postgres(synchronous_commit="on") as pg:
        dualwrite.upgrade_database(pg.url)
        add_value_table(pg.url, "app_rows")
        add_fault_rows_table(pg.url)
        yield pg


def _ensure_running(pg: LocalPostgres) -> None:
    try:
        pg_ctl(pg, "status")
    except Exception:
        assert pg.data_dir is not None
        pg_ctl(pg, "start", "-w", "-l", str(pg.data_dir / "postgres.log"))


def _restart(pg: LocalPostgres, down_s: float = 0.0) -> None:
    """``pg_ctl stop -m immediate`` (every backend killed, no shutdown checkpoint), then start."""
    pg_ctl(pg, "stop", "-m", "immediate", "-w")
    time.sleep(down_s)
    assert pg.data_dir is not None
    pg_ctl(pg, "start", "-w", "-l", str(pg.data_dir / "postgres.log"))


def _client_backends(pg: LocalPostgres, *, terminate: bool) -> int:
    """The client sessions of the database other than this one; terminated if asked."""
    what = "pg_terminate_backend(pid)" if terminate else "pid"
    with psycopg.connect(pg.dsn, autocommit=True, connect_timeout=5) as admin:
        found = admin.execute(
            f"SELECT count({what}) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend'").fetchone()
    return int(found[0]) if found else 0


# -- the lapsed lease, by an immediate restart ---------------------------------------------


def test_an_immediate_restart_between_the_two_commits_cannot_reach_the_next_transaction(
        writers: Any, private_pg: LocalPostgres, bootstrap: str, topic: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer is between its two commits of t1 when PostgreSQL is restarted (immediate):
    the lease is gone with its session. Recovery takes it and commits t1 by (producer id,
    epoch), delayed. Before: the writer began t2 in the same session and that EndTxn committed
    t2 ahead of its rows (HeuristicCommitError). Now its check after the Kafka commit of t1
    finds the session gone: a new producer session, lock first; rows == records."""
    _ensure_running(private_pg)
    engine = dualwrite.create_engine(private_pg.url, connect_args={"connect_timeout": 3})
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM app_rows")
        writer = writers(engine, unique("restarted"))
        lapsed_lease(writer, engine, bootstrap, topic, monkeypatch,
                     lambda: _restart(private_pg))
    finally:
        engine.dispose()


# -- the proof loop ---------------------------------------------------------------------------


class _SessionKiller:
    """Ends every client session of the database every few seconds, in a thread: by
    ``pg_terminate_backend`` (``terminate``) or by an immediate restart (``restart``)."""

    def __init__(self, pg: LocalPostgres, runner: FaultRunner, how: str,
                 every_s: tuple[float, float], rng: random.Random) -> None:
        self.pg, self.runner, self.how, self.every_s, self.rng = pg, runner, how, every_s, rng
        self.sessions_killed = 0
        self.rounds = 0
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="session-killer")

    def _run(self) -> None:
        try:
            while not self.stop.wait(self.rng.uniform(*self.every_s)):
                fault = Fault(f"postgres-{self.how}", "", time.time())
                if self.how == "terminate":
                    killed = _client_backends(self.pg, terminate=True)
                else:
                    killed = _client_backends(self.pg, terminate=False)
                    _restart(self.pg, self.rng.uniform(0.2, 1.0))
                fault.target = f"{killed} sessions"
                fault.ended = time.time()
                fault.returns.append(fault.ended)
                self.runner.faults.append(fault)
                self.sessions_killed += killed
                self.rounds += 1
        except BaseException as exc:
            self.errors.append(exc)


class _RecoverLoop:
    """``dualwrite.recover`` of the run's ids, again and again, in a thread."""

    def __init__(self, url: str, kafka: dict[str, Any], tids: list[str]) -> None:
        self.url, self.kafka, self.tids = url, kafka, tids
        self.outcomes: Counter[str] = Counter()
        self.passes = 0
        self.raised: Counter[str] = Counter()
        self.heuristic: list[str] = []
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="recover-loop")

    def _run(self) -> None:
        engine = dualwrite.create_engine(self.url, connect_args={"connect_timeout": 3})
        try:
            while not self.stop.is_set():
                try:
                    report = dualwrite.recover(engine, self.kafka, self.tids, timeout_s=10)
                except dualwrite.DualWriteError as exc:  # the database going away under it
                    self.raised[type(exc).__name__] += 1
                    self.stop.wait(0.2)
                    continue
                self.passes += 1
                for r in report.results:
                    self.outcomes[r.outcome.value] += 1
                self.heuristic += [f"{r.transactional_id}: {r.outcome.value} {r.detail}"
                                   for r in report.heuristic]
                self.stop.wait(0.05)
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            engine.dispose()


def _soak(request: pytest.FixtureRequest, default_s: float) -> float:
    return 300.0 if request.config.getoption("--soak") else default_s


# Before issue 22's hole 4 (CommitInquiry.commit_status), a COMMIT cut by an immediate restart was
# asked about by txid_status of the restarted server, which can hand that id to another
# transaction: "committed" for rows that were lost (seen here: HeuristicAbortError when recovery
# had aborted the Kafka side already, records without rows when it had not).
_XID_REUSE = pytest.mark.xfail(
    not hasattr(StateStore, "commit_status")
    and importlib.util.find_spec("dualwrite.writer.commit_inquiry") is None, strict=False,
    reason="issue 22 hole 4: txid_status of a restarted server may answer for a reused xid")


@pytest.mark.parametrize("how,every_s,default_s", [
    ("terminate", (1.5, 3.0), 25.0),
    pytest.param("restart", (4.0, 6.0), 25.0, marks=_XID_REUSE),
])
def test_two_writers_and_recover_in_a_loop_while_every_session_is_killed(
        private_pg: LocalPostgres, kafka: KafkaTarget, tmp_path: Path,
        request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str], how: str,
        every_s: tuple[float, float], default_s: float) -> None:
    _ensure_running(private_pg)
    seconds = _soak(request, default_s)
    seed = random.randrange(1 << 30)
    run = f"lost-{how}-{uuid.uuid4().hex[:8]}"
    topic = kafka.create_topic(f"{run}-topic", 3)
    tids = [f"{run}-w{k}" for k in range(2)]
    # The runner needs only the cluster's address here (no broker faults).
    runner = FaultRunner(kafka, private_pg, topic, tids, tmp_path,  # type: ignore[arg-type]
                         seed=seed)
    killer = _SessionKiller(private_pg, runner, how, every_s, random.Random(seed))
    recovering = _RecoverLoop(private_pg.url, runner.kafka, tids)
    runner.start_workers()
    try:
        warm = runner.wait_for_commits(0.0, timeout=60)
        assert not warm, f"workers never committed: {warm}"
        recovering.thread.start()
        killer.thread.start()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not killer.errors and not recovering.errors:
            dead = runner.dead_workers()
            assert not dead, f"workers exited on their own: {dead}"
            time.sleep(0.5)
        killer.stop.set()
        killer.thread.join(60)
        last = runner.faults[-1].ended if runner.faults else 0.0
        stalled = runner.wait_for_commits(last, timeout=60)
        recovering.stop.set()
        recovering.thread.join(120)
    finally:
        killer.stop.set()
        recovering.stop.set()
        runner.stop_workers()
        _ensure_running(private_pg)
    assert not killer.errors and not recovering.errors, (killer.errors, recovering.errors)
    metrics = runner.verify(stalled)
    summary = (f"session loss by {how} (seed {seed}): {seconds:.0f} s, {killer.rounds} rounds, "
               f"{killer.sessions_killed} sessions killed, {metrics.committed} transactions "
               f"committed; recover: {recovering.passes} passes, outcomes "
               f"{dict(recovering.outcomes)}, raised {dict(recovering.raised)}")
    with capsys.disabled():
        print(f"\n{summary}\n{metrics.report()}")
    # The invariant. A COMMIT cut by a restart may leave its outcome to recovery
    # (OutcomeUnknownError, recoverable): allowed here, unlike a heuristic outcome.
    bad = {k: v for k, v in metrics.anomalies.items()
           if v and k != "non-retriable dualwrite errors"}
    assert not bad, f"anomalies {bad}:\n{metrics.report()}"
    families = Counter(e["family"] for e in runner.events() if e["e"] == "error")
    assert set(families) <= {"retriable", "recoverable"}, f"{families}\n{metrics.report()}"
    assert recovering.heuristic == []
    assert killer.rounds >= 3 and killer.sessions_killed >= killer.rounds
    assert metrics.committed > 20 and recovering.passes > 3
