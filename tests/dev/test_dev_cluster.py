"""The local Kafka / PostgreSQL machinery works against real servers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

from dualwrite.dev import (
    DEFAULT_KAFKA_VERSION,
    DevClusterError,
    KafkaTarget,
    LocalKafkaCluster,
    LocalMariaDB,
    transactional_defaults,
)
from dualwrite.dev._util import dualwrite_home, pid_alive
from dualwrite.dev.kafka_cluster import docker_env_name

NewTopic = Callable[..., str]


def _txn_producer(bootstrap: str, **extra: Any) -> Producer:
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "transactional.id": f"test-{uuid.uuid4().hex[:10]}",
        "acks": "all",
        "enable.idempotence": True,
        "transaction.timeout.ms": 60_000,
        **extra,
    }
    producer = Producer(conf)
    producer.init_transactions(60)
    return producer


def _produce_txn(producer: Producer, topic: str, values: list[str], commit: bool) -> None:
    producer.begin_transaction()
    for i, value in enumerate(values):
        producer.produce(topic, value=value.encode(), partition=i % 3)
    producer.flush(60)
    if commit:
        producer.commit_transaction(60)
    else:
        producer.abort_transaction(60)


def _read_all(
    bootstrap: str, topic: str, isolation: str, expected: int, timeout: float = 30.0
) -> list[str]:
    """Everything in ``topic`` (3 partitions) as seen with ``isolation``; stops at ``expected``."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-{uuid.uuid4().hex[:8]}",
            "isolation.level": isolation,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in range(3)])
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and len(seen) < expected:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            value = msg.value()
            assert value is not None
            seen.append(value.decode())
        # a short extra wait so that records beyond ``expected`` would be noticed
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                seen.append((msg.value() or b"").decode())
    finally:
        consumer.close()
    return seen


def _committed_and_aborted(cluster: KafkaTarget, topic: str) -> None:
    producer = _txn_producer(cluster.bootstrap_servers)
    committed = [f"c{i}" for i in range(10)]
    aborted = [f"a{i}" for i in range(5)]
    _produce_txn(producer, topic, committed, commit=True)
    _produce_txn(producer, topic, aborted, commit=False)
    _produce_txn(producer, topic, ["c-last"], commit=True)
    producer.flush(10)

    visible = _read_all(cluster.bootstrap_servers, topic, "read_committed", 11)
    assert sorted(visible) == sorted([*committed, "c-last"])
    everything = _read_all(cluster.bootstrap_servers, topic, "read_uncommitted", 16)
    assert sorted(everything) == sorted([*committed, *aborted, "c-last"])


# -- pure functions ----------------------------------------------------------------------------


@pytest.mark.unit
def test_transactional_defaults_single_and_three_brokers() -> None:
    one = transactional_defaults(1)
    assert one["transaction.state.log.replication.factor"] == "1"
    assert one["transaction.state.log.min.isr"] == "1"
    assert one["offsets.topic.replication.factor"] == "1"
    assert one["min.insync.replicas"] == "1"
    three = transactional_defaults(3)
    assert three["transaction.state.log.replication.factor"] == "3"
    assert three["transaction.state.log.min.isr"] == "2"
    assert three["min.insync.replicas"] == "2"
    for cfg in (one, three):
        assert cfg["transaction.max.timeout.ms"] == "3600000"
        assert cfg["transaction.abort.timed.out.transaction.cleanup.interval.ms"] == "1000"
        assert cfg["auto.create.topics.enable"] == "false"


@pytest.mark.unit
def test_docker_env_names_follow_the_apache_image_rules() -> None:
    assert (
        docker_env_name("transaction.state.log.min.isr") == "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"
    )
    assert docker_env_name("a_b-c.d") == "KAFKA_A__B___C_D"


@pytest.mark.unit
def test_extra_config_overrides_defaults() -> None:
    cluster = LocalKafkaCluster(brokers=3, extra_config={"min.insync.replicas": "3", "x.y": "z"})
    cluster._allocate_nodes(Path("/nonexistent"))
    props = cluster.broker_config(1)
    assert props["min.insync.replicas"] == "3"
    assert props["x.y"] == "z"
    assert props["node.id"] == "2"
    assert props["process.roles"] == "broker,controller"
    voters = props["controller.quorum.voters"].split(",")
    assert [v.split("@")[0] for v in voters] == ["1", "2", "3"]
    assert all(v.split("@")[1].startswith("127.0.0.1:") for v in voters)


# -- real brokers ------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["kafka", pytest.param("kafka39", marks=pytest.mark.kafka39)])
def test_single_broker_transactions(
    fixture: str, request: pytest.FixtureRequest, new_topic: NewTopic
) -> None:
    cluster: KafkaTarget = request.getfixturevalue(fixture)
    if isinstance(cluster, LocalKafkaCluster):
        assert f"Kafka version: {cluster.kafka_version}" in cluster.broker_log(0)
    _committed_and_aborted(cluster, new_topic(cluster))


def test_kafka_2pc_broker_has_kip939_enabled(kafka_2pc: KafkaTarget, new_topic: NewTopic) -> None:
    admin = AdminClient({"bootstrap.servers": kafka_2pc.bootstrap_servers})
    broker_id = next(iter(admin.list_topics(timeout=10).brokers))
    resource = ConfigResource(ConfigResource.Type.BROKER, str(broker_id))
    configs = admin.describe_configs([resource])[resource].result(30)
    assert configs["transaction.two.phase.commit.enable"].value == "true"
    assert configs["unstable.api.versions.enable"].value == "true"
    # librdkafka's own (non-2PC) transactions keep working on such a broker
    _committed_and_aborted(kafka_2pc, new_topic(kafka_2pc))


def test_plain_broker_has_our_transaction_settings(kafka: KafkaTarget) -> None:
    if not isinstance(kafka, LocalKafkaCluster):
        pytest.skip("external cluster: settings are not ours")
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    resource = ConfigResource(ConfigResource.Type.BROKER, "1")
    configs = admin.describe_configs([resource])[resource].result(30)
    assert configs["transaction.max.timeout.ms"].value == "3600000"
    assert configs["auto.create.topics.enable"].value == "false"
    assert configs["transaction.two.phase.commit.enable"].value == "false"


def test_three_brokers_survive_a_kill_and_the_broker_rejoins(
    kafka3: LocalKafkaCluster, new_topic: NewTopic
) -> None:
    topic = new_topic(kafka3)
    producer = _txn_producer(kafka3.bootstrap_servers)
    # the first commit creates __transaction_state (RF 3), which needs all three brokers
    _produce_txn(producer, topic, ["before"], commit=True)

    admin = AdminClient({"bootstrap.servers": kafka3.bootstrap_servers})
    leader = admin.list_topics(topic, timeout=10).topics[topic].partitions[0].leader
    victim = next(n for n in kafka3.nodes if n.node_id == leader)
    kafka3.kill_broker(victim.index)
    assert not kafka3.is_running(victim.index)
    assert victim.pid is not None and not pid_alive(victim.pid)

    _produce_txn(producer, topic, [f"during-{i}" for i in range(6)], commit=True)
    seen = _read_all(kafka3.bootstrap_servers, topic, "read_committed", 7, timeout=60)
    assert sorted(seen) == sorted(["before", *[f"during-{i}" for i in range(6)]])

    kafka3.restart_broker(victim.index)
    assert kafka3.is_running(victim.index)
    deadline = time.monotonic() + 90
    while True:
        parts = admin.list_topics(topic, timeout=10).topics[topic].partitions.values()
        if all(len(p.isrs) == 3 for p in parts):
            break
        assert time.monotonic() < deadline, f"broker {leader} did not rejoin the ISR"
        time.sleep(0.5)
    assert "Kafka Server started" in kafka3.broker_log(victim.index).split("Kafka version")[-1]
    _produce_txn(producer, topic, ["after"], commit=True)
    producer.flush(10)


def test_startup_failure_reports_the_broker_log(tmp_path: Path) -> None:
    cluster = LocalKafkaCluster(
        kafka_version=DEFAULT_KAFKA_VERSION,
        data_dir=tmp_path / "bad",
        extra_config={"transaction.max.timeout.ms": "not-a-number"},
        backend="jars",
        startup_timeout=60,
    )
    with pytest.raises(DevClusterError) as err:
        cluster.start()
    assert "transaction.max.timeout.ms" in str(err.value)
    assert not cluster.nodes


def test_postgres_answers_select_1(postgres_url: str) -> None:
    engine = sa.create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("select 1")).scalar_one() == 1
            version = conn.execute(sa.text("show server_version_num")).scalar_one()
            assert int(version) >= 150000
    finally:
        engine.dispose()


def test_mariadb_restart_after_a_crash_keeps_committed_rows() -> None:
    """``crash()`` is a SIGKILL (what the soak's database-restart fault does), ``restart()``
    starts the server again on the same data and port: a committed row survives, a session
    of the old server is gone, and a new one works."""
    with LocalMariaDB() as server:
        engine = sa.create_engine(server.url, poolclass=sa.NullPool)
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql("CREATE TABLE t (id INT PRIMARY KEY) ENGINE=InnoDB")
                conn.exec_driver_sql("INSERT INTO t VALUES (1)")
            old = engine.connect()
            pid = server.pid
            server.restart()
            assert server.pid != pid and server.running()
            assert pid is not None and not pid_alive(pid, "mariadbd")
            with pytest.raises(sa.exc.OperationalError):
                old.exec_driver_sql("SELECT 1")
            old.invalidate()
            with engine.connect() as conn:
                assert conn.exec_driver_sql("SELECT id FROM t").scalars().all() == [1]
        finally:
            engine.dispose()


def test_sqlite_url_is_a_fresh_file(sqlite_url: str, tmp_path: Path) -> None:
    engine = sa.create_engine(sqlite_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("create table t (x int)"))
        assert (tmp_path / "dualwrite.db").exists()
    finally:
        engine.dispose()


def _dev(home: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DUALWRITE_HOME": str(home)}
    code = "from dualwrite.dev.cli import dev; dev()"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True, text=True, env=env, timeout=timeout, check=False,
    )  # fmt: skip


def test_dev_cli_up_status_down(tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = _dev(home, "up", "--backend", "jars", "--json")
    assert result.returncode == 0, result.stderr
    state = json.loads(result.stdout)
    pid = state["nodes"][0]["pid"]
    try:
        assert (home / "dev" / "cluster.json").exists()
        assert state["bootstrap_servers"].startswith("127.0.0.1:")
        # the broker outlived the `up` process and serves metadata
        admin = AdminClient({"bootstrap.servers": state["bootstrap_servers"]})
        assert len(admin.list_topics(timeout=20).brokers) == 1

        status = _dev(home, "status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert "1/1 broker(s) up" in status.stdout

        # The same cluster again: reused (a README's `eval "$(dev up ...)"` may run twice),
        # with the topics it asks for created; a different one is refused.
        again = _dev(home, "up", "--backend", "jars", "--topic", "made-on-reuse:2")
        assert again.returncode == 0, again.stderr
        assert "already running at" in again.stdout
        assert f"export DUALWRITE_BOOTSTRAP_SERVERS={state['bootstrap_servers']}" in again.stdout
        topics = admin.list_topics(timeout=20).topics
        assert len(topics["made-on-reuse"].partitions) == 2
        other = _dev(home, "up", "--backend", "jars", "--brokers", "3")
        assert other.returncode != 0
        assert "a different dev cluster is already running" in other.stderr
    finally:
        down = _dev(home, "down")
    assert down.returncode == 0, down.stderr
    assert not pid_alive(pid)
    assert not (home / "dev" / "cluster.json").exists()
    assert not Path(state["nodes"][0]["directory"]).exists()
    after = _dev(home, "status")
    assert after.returncode == 3


def test_dev_cli_pulsar_up_status_down(tmp_path: Path) -> None:
    """``dev up --flavour pulsar``: a detached standalone with transactions on, reused by a
    second ``up``, shown by ``status``, stopped by ``down``."""
    from dualwrite.dev.pulsar_cluster import pulsar_classpath
    from dualwrite.participant.pulsar import PulsarParticipant, PulsarTxnClient

    pulsar_classpath()  # resolved once into the default home, then copied: no Maven run here
    home = tmp_path / "home"
    shutil.copytree(dualwrite_home() / "classpath", home / "classpath")
    result = _dev(home, "up", "--flavour", "pulsar", "--topic", "dev-orders:2", "--json")
    assert result.returncode == 0, result.stderr
    state = json.loads(result.stdout)
    try:
        assert (home / "dev" / "pulsar.json").exists()
        assert state["service_url"].startswith("pulsar://127.0.0.1:")
        again = _dev(home, "up", "--flavour", "pulsar", "--topic", "dev-orders:2")
        assert again.returncode == 0, again.stderr
        assert f"export DUALWRITE_PULSAR_URL={state['service_url']}" in again.stdout
        status = _dev(home, "status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"at {state['service_url']} (pid {state['pid']}): up" in status.stdout
        # A transaction of the outlived broker, on a partition of the topic `up` made.
        with PulsarTxnClient(state["service_url"], timeout_s=60) as client:
            assert client.partitions("dev-orders")[-1].endswith("dev-orders-partition-1")
            participant = PulsarParticipant(client)
            participant.begin(60_000)
            prepared = participant.prepare(client.partitions("dev-orders")[0], b"anchor")
            participant.commit(prepared)
    finally:
        down = _dev(home, "down")
    assert down.returncode == 0, down.stderr
    assert "stopped the dev Pulsar broker" in down.stdout
    assert not pid_alive(state["pid"])
    assert not (home / "dev" / "pulsar.json").exists()
    assert _dev(home, "status").returncode == 3
