"""The exactly-once consumer on real Kafka and PostgreSQL: every input's effect (a row) and
output record once, across SIGKILLs at each phase, a rebalance under load and a zombie."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from confluent_kafka import Producer
from prometheus_client import REGISTRY

import dualwrite
from dualwrite import ConsumedMessage, DualWriteTransaction, ExactlyOnceConsumer
from dualwrite.dev import KafkaTarget, LocalKafkaCluster
from dualwrite.participant import ControlPlane, TxnState
from tests.support.crash_loop import read_committed_keys
from tests.support.db import fresh_mariadb_database, fresh_schema
from tests.support.settings import BACKEND, KAFKA_VERSION
from tests.support.workers import CONSUMER_WORKER, worker_env

EFFECTS = sa.table("effects", sa.column("input_id", sa.String), sa.column("worker", sa.Integer))
GROUP_CONFIG = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}


@dataclass
class Setup:
    bootstrap: str
    db: str
    group: str
    input: str
    output: str

    def produce_inputs(self, ids: Sequence[str], pause_every: int = 0,
                       pause_s: float = 0.05) -> None:
        # Idempotent: a broker killed after it appended a batch but before it answered would
        # otherwise get the batch again from librdkafka's retry (inputs twice in the topic).
        producer = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 5,
                             "enable.idempotence": True})
        for i, value in enumerate(ids):
            producer.produce(self.input, value=value, key=value)
            if pause_every and i % pause_every == pause_every - 1:
                producer.flush()
                time.sleep(pause_s)
        assert producer.flush(30) == 0

    def effects(self) -> Counter[str]:
        engine = dualwrite.create_engine(self.db)
        try:
            with engine.connect() as conn:
                return Counter(r.input_id for r in conn.execute(sa.select(EFFECTS)))
        finally:
            engine.dispose()

    def check_once(self, ids: Sequence[str]) -> None:
        """Each input's row once, its output record once (read_committed), nothing open."""
        effects = self.effects()
        assert sorted(effects) == sorted(ids), "an input has no effect, or one too many"
        assert [k for k, n in effects.items() if n != 1] == []
        outputs = Counter(read_committed_keys(self.bootstrap, self.output))
        assert sorted(outputs) == sorted(ids)
        assert [k for k, n in outputs.items() if n != 1] == []
        with ControlPlane({"bootstrap.servers": self.bootstrap}, timeout_s=15) as cp:
            open_states = [TxnState.ONGOING, TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT]
            assert cp.list_transactions(states=open_states,
                                        prefix=f"dualwrite-consumer-{self.group}") == []

    def worker(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, str(CONSUMER_WORKER), "--db", self.db, "--bootstrap", self.bootstrap,
             "--group", self.group, "--input", self.input, "--output", self.output, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=worker_env())


@pytest.fixture(params=["postgresql", pytest.param("mariadb", marks=pytest.mark.mariadb_full)])
def setup(kafka: KafkaTarget, new_topic: object,
          request: pytest.FixtureRequest) -> Iterator[Setup]:
    """PostgreSQL; MariaDB too with ``--mariadb-full``."""
    create = new_topic  # the conftest factory
    database = (fresh_schema(request.getfixturevalue("postgres_url"), "dw_consumer")
                if request.param == "postgresql" else
                fresh_mariadb_database(request.getfixturevalue("mariadb_url"), "dw_consumer"))
    with database as url:
        dualwrite.upgrade_database(url)
        engine = dualwrite.create_engine(url)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE effects (input_id VARCHAR(100) NOT NULL, "
                                 "worker INT)"))
        engine.dispose()
        yield Setup(kafka.bootstrap_servers, url, f"g-{uuid.uuid4().hex[:8]}",
                    create(kafka, partitions=3), create(kafka, partitions=3))  # type: ignore


def handler_for(setup: Setup, slow_s: float = 0.0):  # type: ignore[no-untyped-def]
    def handler(messages: Sequence[ConsumedMessage], tx: DualWriteTransaction) -> None:
        for m in messages:
            value = (m.value or b"").decode()
            tx.connection.execute(sa.insert(EFFECTS).values(input_id=value, worker=0))
            tx.produce(setup.output, value=value, key=value)
        if slow_s:
            time.sleep(slow_s)
    return handler


def consumer_of(setup: Setup, **kw: object) -> ExactlyOnceConsumer:
    config = {**GROUP_CONFIG, **kw.pop("consumer_config", {})}  # type: ignore[dict-item]
    return ExactlyOnceConsumer(setup.db, {"bootstrap.servers": setup.bootstrap},
                               group_id=setup.group, topics=[setup.input], timeout_s=20,
                               consumer_config=config, **kw)  # type: ignore[arg-type]


def test_each_input_decided_once_with_its_rows_records_and_position(setup: Setup) -> None:
    ids = [f"m{i}" for i in range(300)]
    setup.produce_inputs(ids)
    with consumer_of(setup, max_batch=50) as consumer:
        assert consumer.run(handler_for(setup), stop_after=len(ids)) == len(ids)
        assert consumer.transactional_id == f"dualwrite-consumer-{setup.group}-0"
        assert sum(consumer.positions().values()) == len(ids)
        assert consumer.lag() == {(setup.input, p): 0 for p in range(3)}
        # The metrics extra records the lag per partition and each batch under role=consumer.
        for p in range(3):
            assert REGISTRY.get_sample_value("dualwrite_consumer_lag", {
                "group": setup.group, "topic": setup.input, "partition": str(p)}) == 0
        assert (REGISTRY.get_sample_value("dualwrite_transactions_total",
                                          {"role": "consumer", "outcome": "committed"}) or 0) >= 6
    setup.check_once(ids)
    # A restart resumes at the decided positions: nothing is consumed again.
    with consumer_of(setup) as again:
        assert again.run(handler_for(setup), idle_s=2) == 0
    setup.check_once(ids)


def test_sigkill_at_each_phase_then_restart(setup: Setup) -> None:
    """Three workers in turn SIGKILLed in their second batch: after the handler's rows, after
    the Kafka prepare, after the database COMMIT (before Kafka's); each next one starts on what
    the last left. A last one finishes; every input once, nothing open."""
    ids = [f"k{i}" for i in range(150)]
    setup.produce_inputs(ids)
    for phase in ("rows", "prepared", "database_committed"):
        killed = setup.worker("--kill-phase", phase, "--kill-at-batch", "2", "--max-batch", "20")
        out, _ = killed.communicate(timeout=90)
        assert killed.returncode == -9, out
        assert "KILLED" in out and f"STARTED dualwrite-consumer-{setup.group}-0" in out
    resumed = setup.worker("--idle-s", "2", "--max-batch", "20")
    out, _ = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, out
    setup.check_once(ids)


def test_two_workers_rebalance_under_load(setup: Setup) -> None:
    ids = [f"r{i}" for i in range(600)]
    feeder = threading.Thread(target=setup.produce_inputs, args=(ids, 10, 0.15))  # ~10 s
    feeder.start()
    first = setup.worker("--idle-s", "6", "--max-batch", "10", "--slow-s", "0.02")
    time.sleep(2)
    second = setup.worker("--idle-s", "6", "--max-batch", "10", "--slow-s", "0.02")
    feeder.join()
    out1, _ = first.communicate(timeout=120)
    out2, _ = second.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, out1 + out2
    ids_of = {out1.split("STARTED ")[1].split()[0], out2.split("STARTED ")[1].split()[0]}
    assert len(ids_of) == 2, "two workers of one group share a transactional id"
    assert "DECIDED" in out1 and "DECIDED" in out2, "a worker never got a partition"
    setup.check_once(ids)


def test_a_zombie_after_revocation_cannot_commit(setup: Setup) -> None:
    """A stalls in its handler past max.poll.interval.ms; the group gives its partitions to B,
    which decides them; A's late decision is refused (PartitionFencedError) and rolled back."""
    ids = [f"z{i}" for i in range(30)]
    setup.produce_inputs(ids)
    stalled = threading.Event()
    zombie = consumer_of(setup, max_batch=100,
                         consumer_config={"max.poll.interval.ms": 6000})
    slow = handler_for(setup, slow_s=12.0)

    def zombie_handler(messages: Sequence[ConsumedMessage], tx: DualWriteTransaction) -> None:
        stalled.set()
        slow(messages, tx)

    def fenced_metric() -> float:
        return REGISTRY.get_sample_value("dualwrite_consumer_fenced_batches_total",
                                         {"group": setup.group}) or 0.0

    fenced_before = fenced_metric()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(zombie.run(zombie_handler)))
    thread.start()
    assert stalled.wait(30)
    with consumer_of(setup, max_batch=100) as owner:
        assert owner.run(handler_for(setup), stop_after=len(ids)) == len(ids)
        zombie.stop()
        thread.join(60)
    zombie.close()
    setup.check_once(ids)
    assert zombie.fenced_batches == 1
    assert fenced_metric() - fenced_before == 1  # dualwrite_consumer_fenced_batches_total
    assert result == [0]


def test_recover_finishes_a_crashed_workers_decided_batch(setup: Setup) -> None:
    """SIGKILL between the database COMMIT and Kafka's: ``dualwrite recover`` finds the
    worker's transactional id in the state table and commits the decided batch's records; a
    restart then goes on from the decided positions."""
    ids = [f"c{i}" for i in range(60)]
    setup.produce_inputs(ids)
    killed = setup.worker("--kill-phase", "database_committed", "--kill-at-batch", "2",
                          "--max-batch", "20")
    out, _ = killed.communicate(timeout=90)
    assert killed.returncode == -9, out
    report = dualwrite.recover(setup.db, {"bootstrap.servers": setup.bootstrap})
    tid = f"dualwrite-consumer-{setup.group}-0"
    assert [(r.transactional_id, r.outcome) for r in report.results] == [
        (tid, dualwrite.Outcome.COMMITTED)]
    decided = Counter(setup.effects())
    assert Counter(read_committed_keys(setup.bootstrap, setup.output)) == decided
    resumed = setup.worker("--idle-s", "3", "--max-batch", "20")
    out, _ = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, out
    setup.check_once(ids)


@pytest.fixture(scope="module")
def private_kafka() -> Iterator[LocalKafkaCluster]:
    """A broker of this module's own, to SIGKILL (the shared one is never stopped)."""
    with LocalKafkaCluster(brokers=1, kafka_version=KAFKA_VERSION, backend=BACKEND) as cluster:
        yield cluster


@pytest.mark.slow  # a broker of its own: ~50 s to start, ~45 s to run (./run.sh test --soak)
def test_broker_bounce_under_load(private_kafka: LocalKafkaCluster, new_topic: object,
                                  postgres_url: str) -> None:
    """SIGKILL of the only broker while a consumer decides batches and a producer feeds it;
    the application's loop calls run() again on a typed retriable/recoverable error. In the
    end each input's row and output record once, nothing open."""
    def bounce() -> None:
        private_kafka.kill_broker(0)
        time.sleep(2)
        private_kafka.restart_broker(0)
    bounce_under_load(private_kafka, bounce, new_topic, postgres_url)


def test_rolling_broker_kills_under_load(kafka3: LocalKafkaCluster, new_topic: object,
                                         postgres_url: str) -> None:
    """The same on the session's three-broker cluster (RF 3): SIGKILL and restart of each broker
    in turn (group, transaction coordinators and partition leaders move) under load."""
    def bounce() -> None:
        for index in range(3):
            kafka3.kill_broker(index)
            time.sleep(2)
            kafka3.restart_broker(index)
    bounce_under_load(kafka3, bounce, new_topic, postgres_url)


def bounce_under_load(cluster: LocalKafkaCluster, bounce: Callable[[], None],
                      new_topic: object, postgres_url: str) -> None:
    create = new_topic
    with fresh_schema(postgres_url, "dw_consumer") as url:
        dualwrite.upgrade_database(url)
        engine = dualwrite.create_engine(url)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE effects (input_id TEXT NOT NULL, worker INT)"))
        engine.dispose()
        setup = Setup(cluster.bootstrap_servers, url, f"g-{uuid.uuid4().hex[:8]}",
                      create(cluster, partitions=3),  # type: ignore[operator]
                      create(cluster, partitions=3))  # type: ignore[operator]
        ids = [f"b{i}" for i in range(400)]
        feeder = threading.Thread(target=setup.produce_inputs, args=(ids, 20))
        feeder.start()
        errors: list[str] = []
        stop = threading.Event()

        def loop() -> None:
            with consumer_of(setup, max_batch=20) as consumer:
                while not stop.is_set():
                    try:
                        consumer.run(handler_for(setup), idle_s=1)
                    except (dualwrite.RetriableError, dualwrite.RecoverableError) as exc:
                        errors.append(type(exc).__name__)
                        time.sleep(0.5)

        thread = threading.Thread(target=loop)
        thread.start()
        time.sleep(4)
        bounce()
        feeder.join(120)

        def all_done() -> bool:
            return len(setup.effects()) == len(ids)
        deadline = time.monotonic() + 90
        while not all_done() and time.monotonic() < deadline:
            time.sleep(0.5)
        stop.set()
        thread.join(60)
        print("errors the loop saw:", Counter(errors))
        setup.check_once(ids)


@pytest.mark.unit
@pytest.mark.parametrize("kw", [
    {"group_id": "", "topics": ["a"]},
    {"group_id": "x" * 201, "topics": ["a"]},
    {"group_id": "g", "topics": "a"},
    {"group_id": "g", "topics": ["a"], "max_batch": 0},
    {"group_id": "g", "topics": ["a"], "max_batch_s": 0},
    {"group_id": "g", "topics": ["a"],
     "consumer_config": {"partition.assignment.strategy": "cooperative-sticky"}},
    {"group_id": "g", "topics": ["a"], "consumer_config": {"group.protocol": "consumer"}},
])
def test_settings_it_cannot_honour_are_refused_at_once(kw: dict[str, object]) -> None:
    with pytest.raises(dualwrite.ConfigurationError):
        ExactlyOnceConsumer("sqlite://", {"bootstrap.servers": "127.0.0.1:1"},
                            **kw)  # type: ignore[arg-type]


@pytest.mark.unit
@pytest.mark.parametrize(("consumer_config", "session_ms", "heartbeat_ms"), [
    (None, 10_000, 2_000),  # not librdkafka's 45 s: a dead worker's partitions move in 10 s
    ({"session.timeout.ms": 6000}, 6000, 2000),
    ({"session.timeout.ms": "4500"}, "4500", 1500),
    ({"session.timeout.ms": 30_000, "heartbeat.interval.ms": 5000}, 30_000, 5000),
])
def test_session_timeout_defaults_to_10_s_unless_set(
        consumer_config: dict[str, object] | None, session_ms: object,
        heartbeat_ms: int) -> None:
    consumer = ExactlyOnceConsumer("sqlite://", {"bootstrap.servers": "127.0.0.1:1"},
                                   group_id="g", topics=["a"],
                                   consumer_config=consumer_config)
    config = consumer._consumer_config
    assert (config["session.timeout.ms"], config["heartbeat.interval.ms"]) == \
        (session_ms, heartbeat_ms)
    assert dualwrite.PhaseHooks is dualwrite.writer.PhaseHooks  # exported for hooks=
