"""Issue 10: the fault suite. DualWriter workers on a 3-broker cluster and PostgreSQL, under faults.

A fresh cluster of three broker+controller nodes (topic RF 3, min ISR 2; transaction log RF 3,
min ISR 2) and a private PostgreSQL server (synchronous commits: an immediate shutdown must not
lose an acknowledged COMMIT). ``tests/support/workers/fault_worker.py`` processes run transactions
without pause while :class:`tests.support.fault_runner.FaultRunner` injects, at random moments:
SIGKILL of the transaction coordinator of a worker's id, of a partition leader, of a random broker
(each started again); SIGSTOP/SIGCONT of a broker for a few seconds longer than the clients' request
timeout; a clean rolling restart of the three brokers; SIGKILL of a worker (a new process of the
same transactional id takes over); ``pg_ctl stop -m immediate`` and start.

The workers reach each broker only through a Kafka-framing loopback proxy
(:class:`tests.support.tcp_proxy.TcpProxy`; the cluster's EXTERNAL listeners advertise the proxies'
ports) and PostgreSQL through another, so the runner can also: cut every connection of a broker
(its coordinator's or a random one), refusing new ones a moment or not; lose the response to the
next EndTxn at a worker's coordinator; hold the next Produce to a partition leader past the
request timeout, then deliver it; cut every database connection, half the time just after a
COMMIT went out (its outcome unknown to the worker).

After the run: ``dualwrite.recover``, then the invariant (read_committed records == committed
rows, no duplicate, nothing a worker saw commit lost, nothing left open at any coordinator) and
the rule that only ``RetriableError`` reaches the application. The metrics are printed.

``pytest --faults-full`` runs a short schedule (every kind of fault; CI runs the soak instead,
``tests/soak``, which injects every kind of these with its roles); ``pytest --faults N`` runs a long
one of N mixed faults and reports RSS, threads and open fds of a worker that lives through it.
``DUALWRITE_FAULT_SEED`` replays a schedule; ``DUALWRITE_FAULT_DIR`` keeps the workers' journals
(one JSON line per commit or error, with its stack) and ``errors.txt`` (one stack per error type).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite.dev import LocalKafkaCluster, LocalPostgres, read_committed
from dualwrite.participant import (
    ControlPlane,
    PreparedTxnState,
    TransactionDescription,
    TxnState,
)
from dualwrite.writer import PhaseHooks
from tests.support.db import ensure_running, private_postgres
from tests.support.fault_runner import (
    KINDS,
    Fault,
    FaultRunner,
    Metrics,
    coordinator_unanswering,
    heal_brokers,
)
from tests.support.settings import KAFKA_VERSION
from tests.support.tables import add_fault_rows_table
from tests.support.tcp_proxy import TcpProxy

WEIGHTS = {"coordinator-kill": 3, "leader-kill": 3, "broker-kill": 2, "broker-pause": 3,
           "rolling-restart": 1, "worker-kill": 3, "database-restart": 2, "kafka-cut": 2,
           "endtxn-lost": 2, "produce-held": 2, "database-cut": 2}
WORKERS = 3


@pytest.fixture(scope="module")
def fault_cluster() -> Iterator[LocalKafkaCluster]:
    """Three nodes of this module's own: its faults must not disturb the shared broker."""
    with LocalKafkaCluster(brokers=3, kafka_version=KAFKA_VERSION, backend="jars",
                           heap="512m", startup_timeout=300, proxied=True) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def kafka_proxies(fault_cluster: LocalKafkaCluster) -> Iterator[list[TcpProxy]]:
    """One proxy per broker, on the port its EXTERNAL listener advertises."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(TcpProxy(external, port=advertised, kafka_framing=True))
               for external, advertised in zip(fault_cluster.external_ports,
                                               fault_cluster.proxy_ports, strict=True)]


@pytest.fixture(scope="module")
def fault_pg() -> Iterator[LocalPostgres]:
    """A PostgreSQL server of this module's own (it is restarted), with synchronous commits."""
    with private_postgres(synchronous_commit="on") as pg:
        dualwrite.upgrade_database(pg.url)
        add_fault_rows_table(pg.url)
        yield pg


@pytest.fixture(scope="module")
def pg_proxy(fault_pg: LocalPostgres) -> Iterator[TcpProxy]:
    """In front of the private PostgreSQL (its port stays the same across restarts)."""
    port = sa.engine.make_url(fault_pg.url).port
    assert port is not None
    with TcpProxy(port) as proxy:
        yield proxy


def _heal(cluster: LocalKafkaCluster, pg: LocalPostgres) -> None:
    """Every broker running and not paused, PostgreSQL up (after a run that failed midway)."""
    heal_brokers(cluster)
    ensure_running(pg)


def run_suite(cluster: LocalKafkaCluster, pg: LocalPostgres, proxies: list[TcpProxy],
              db_proxy: TcpProxy, tmp_path: Path, schedule: list[str], *, seed: int,
              sample: bool = False) -> Metrics:
    _heal(cluster, pg)
    run = f"fault-{uuid.uuid4().hex[:8]}"
    keep = os.environ.get("DUALWRITE_FAULT_DIR")
    workdir = Path(keep) / run if keep else tmp_path
    workdir.mkdir(parents=True, exist_ok=True)
    topic = cluster.create_topic(f"{run}-topic", partitions=6)
    tids = [f"{run}-w{k}" for k in range(WORKERS)]
    runner = FaultRunner(cluster, pg, topic, tids, workdir, seed=seed,
                         protected=tids[0] if sample else None, kafka_proxies=proxies,
                         db_proxy=db_proxy)
    runner.heal_proxies()
    accepted = [p.accepted for p in (*proxies, db_proxy)]
    runner.start_workers()
    try:
        warm = runner.wait_for_commits(0.0, timeout=120)
        assert not warm, f"workers never committed before any fault: {warm}"
        runner.sample("start")
        runner.run(schedule)
        stalled = runner.wait_for_commits(runner.faults[-1].ended, timeout=60)
        runner.sample("end")
    finally:
        runner.stop_workers()
        runner.heal_proxies()
        _heal(cluster, pg)
    metrics = runner.verify(stalled)
    through = [p.accepted - a for p, a in zip((*proxies, db_proxy), accepted, strict=True)]
    metrics.details["connections through the proxies (brokers 1..3, database)"] = [
        ", ".join(map(str, through))]
    (workdir / "errors.txt").write_text("\n\n".join(runner.error_samples()), encoding="utf-8")
    metrics.details["workdir"] = [str(workdir)]
    return metrics


def _check(metrics: Metrics, capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print(f"\n{metrics.report()}")
    bad = {k: v for k, v in metrics.anomalies.items() if v}
    assert not bad, f"anomalies {bad}:\n{metrics.report()}"


def _seed() -> int:
    return int(os.environ.get("DUALWRITE_FAULT_SEED") or random.randrange(1 << 30))


@pytest.mark.faults_full
@pytest.mark.timeout(480)
def test_fault_suite_short(fault_cluster: LocalKafkaCluster, fault_pg: LocalPostgres,
                           kafka_proxies: list[TcpProxy], pg_proxy: TcpProxy,
                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seed = _seed()
    schedule = list(KINDS)  # every kind once; --faults N repeats them
    random.Random(seed).shuffle(schedule)
    with capsys.disabled():
        print(f"\nfault suite seed {seed}: {schedule}")
    metrics = run_suite(fault_cluster, fault_pg, kafka_proxies, pg_proxy, tmp_path, schedule,
                        seed=seed)
    assert set(metrics.faults) == set(KINDS)
    _check(metrics, capsys)


@pytest.mark.timeout(6 * 3600)
def test_fault_suite_long(fault_cluster: LocalKafkaCluster, fault_pg: LocalPostgres,
                          kafka_proxies: list[TcpProxy], pg_proxy: TcpProxy,
                          tmp_path: Path, capsys: pytest.CaptureFixture[str],
                          request: pytest.FixtureRequest) -> None:
    count = int(request.config.getoption("--faults"))
    if count <= 0:
        pytest.skip("long fault suite: run with --faults N")
    seed = _seed()
    rng = random.Random(seed)
    kinds = list(WEIGHTS)
    schedule = list(KINDS)[:count]
    rng.shuffle(schedule)
    schedule += rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds],
                            k=max(0, count - len(schedule)))
    with capsys.disabled():
        print(f"\nlong fault suite seed {seed}: {count} faults")
    started = time.monotonic()
    metrics = run_suite(fault_cluster, fault_pg, kafka_proxies, pg_proxy, tmp_path, schedule,
                        seed=seed, sample=True)
    with capsys.disabled():
        print(f"long fault suite took {time.monotonic() - started:.0f} s")
    assert sum(metrics.faults.values()) == count
    _check(metrics, capsys)
    assert set(metrics.resources) == {"start", "end"}



def _kill_the_coordinator(cluster: LocalKafkaCluster, cp: ControlPlane,
                          tid: str) -> tuple[TransactionDescription, int]:
    """SIGKILL the coordinator of ``tid``'s open transaction: (the transaction as that
    coordinator described it, the broker's index)."""
    described = cp.describe_transaction(tid)
    assert described is not None and described.state is TxnState.ONGOING
    index = next(n.index for n in cluster.nodes if n.node_id == described.coordinator_id)
    cluster.kill_broker(index)
    return described, index


@pytest.mark.timeout(300)
def test_the_control_plane_follows_a_moved_coordinator(fault_cluster: LocalKafkaCluster) -> None:
    """SIGKILL the coordinator the control plane has cached: the next DescribeTransactions finds
    the new one (the Spark fault runs saw a dead coordinator asked until the timeout)."""
    cluster = fault_cluster
    heal_brokers(cluster)
    topic = cluster.create_topic(f"cp-move-{uuid.uuid4().hex[:8]}", partitions=1)
    tid = f"cp-move-{uuid.uuid4().hex[:8]}"
    conf = {"bootstrap.servers": cluster.bootstrap_servers}
    producer = dualwrite.TwoPhaseProducer({**conf, "transactional.id": tid}, timeout_s=60)
    try:
        producer.init_transactions()
        producer.begin_transaction()
        producer.produce(topic, b"open")
        producer.flush_and_state()
        with ControlPlane(conf, timeout_s=40) as cp:
            before, index = _kill_the_coordinator(cluster, cp, tid)  # cached by cp
            try:
                started = time.monotonic()
                after = cp.describe_transaction(tid)
                took = time.monotonic() - started
            finally:
                cluster.restart_broker(index)
        print(f"\nnew coordinator found in {took:.1f} s")
        assert after is not None and after.coordinator_id != before.coordinator_id
        assert after.state is TxnState.ONGOING
        producer.abort_transaction()
    finally:
        producer.close()


class _StopAfterTheDecision(PhaseHooks):
    """The writer dies between the database COMMIT and Kafka's."""

    def database_committed(self, state: PreparedTxnState) -> None:
        raise _WriterDied(str(state))


class _WriterDied(Exception):
    pass


@pytest.mark.timeout(300)
def test_status_and_recover_with_the_coordinator_down(fault_cluster: LocalKafkaCluster,
                                                      fault_pg: LocalPostgres) -> None:
    """A decided transaction left prepared; its coordinator SIGKILLed (one broker of three
    down): ``dualwrite status`` shows it in doubt and ``dualwrite recover`` commits it."""
    cluster, pg = fault_cluster, fault_pg
    _heal(cluster, pg)
    topic = cluster.create_topic(f"down-{uuid.uuid4().hex[:8]}", partitions=3)
    tid = f"down-{uuid.uuid4().hex[:8]}"
    conf = {"bootstrap.servers": cluster.bootstrap_servers}
    writer = dualwrite.DualWriter(pg.url, conf, transactional_id=tid, timeout_s=30,
                                  hooks=_StopAfterTheDecision())
    with pytest.raises(_WriterDied), writer.transaction() as tx:
        tx.produce(topic, value=tid, key=tid)
        tx.connection.execute(sa.text("INSERT INTO fault_rows (id, worker) VALUES (:i, :w)"),
                              {"i": tid, "w": tid})
    writer.close()  # the transaction stays open at the coordinator
    with ControlPlane(conf, timeout_s=30) as cp:
        described, index = _kill_the_coordinator(cluster, cp, tid)
    try:
        started = time.monotonic()
        report = dualwrite.status(pg.url, conf, prefix=tid, timeout_s=60)
        status_s = time.monotonic() - started
        assert [r.transactional_id for r in report.rows if r.in_doubt] == [tid]
        started = time.monotonic()
        recovered = dualwrite.recover(pg.url, conf, [tid], timeout_s=60)
        recover_s = time.monotonic() - started
        assert recovered.ok, recovered.as_dict()
    finally:
        cluster.restart_broker(index)
    print(f"\nbroker {described.coordinator_id} down: status {status_s:.1f} s, "
          f"recover {recover_s:.1f} s")
    records, unreadable = read_committed(cluster.bootstrap_servers, topic, timeout_s=60)
    assert unreadable == []
    assert [v for _, v in records] == [tid.encode()]


def test_an_unanswering_coordinator_is_allowed_only_within_a_broker_fault() -> None:
    """The suite's allowance for OutcomeUnknownError when the coordinator could not be asked:
    only for a call that overlapped a fault stopping a broker."""
    msg = ("commit of transactional_id=w2 ... has an unknown outcome and the coordinator could "
           "not be asked (DescribeTransactions: ... NOT_COORDINATOR); run `dualwrite recover`")
    error = {"type": "OutcomeUnknownError", "msg": msg, "t0": 120.0, "t": 141.0}
    kill = Fault("coordinator-kill", "broker 1", started=122.6, ended=123.3)
    assert coordinator_unanswering(error, [kill])
    assert not coordinator_unanswering(error, [Fault("database-cut", "db", 122.6, 125.0)])
    assert not coordinator_unanswering(error, [Fault("broker-kill", "broker 3", 100.0, 102.0)])
    assert not coordinator_unanswering(error, [Fault("broker-kill", "broker 3", 150.0, 152.0)])
    other = {**error, "msg": "the database COMMIT ... has an unknown outcome"}
    assert not coordinator_unanswering(other, [kill])
    assert not coordinator_unanswering({**error, "type": "FatalError"}, [kill])
