"""Secured clusters: SASL/SCRAM-SHA-512 over TLS and plaintext, ACLs, and secrets kept secret.

One broker started with ``security="sasl"`` (the ``kafka_secured`` fixture); every test makes its
own SCRAM user with a distinctive password and exactly the ACLs it needs
(``dualwrite.dev.security.application_acls``: the list README.md documents).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite import DualWriter, TwoPhaseProducer
from dualwrite.dev import LocalKafkaCluster
from dualwrite.dev.security import Acl, ScramUser, application_acls, write_properties_file
from dualwrite.errors import DualWriteError, FatalError
from dualwrite.participant import ControlPlane
from dualwrite.participant.client_config import Secret, kafka_python_config
from dualwrite.participant.identifiers import TopicPartition
from dualwrite.participant.kafka_errors import AuthorizationError, required_acl
from dualwrite.writer import StateStore
from tests.support import REPO_ROOT
from tests.support.kafka import read_committed, unique

pytestmark = pytest.mark.timeout(240)

SECRET_MARK = "Pw-dualwrite-5ecret"


def _password() -> str:
    return f"{SECRET_MARK}-{uuid.uuid4().hex[:8]}"


def _command() -> list[str]:
    script = Path(sys.executable).parent / "dualwrite"
    return [str(script)] if script.exists() else [sys.executable, "-m", "dualwrite.cli"]


def _dw(*args: str, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("DUALWRITE_") or k == "DUALWRITE_MAVEN_REPO_LOCAL"}
    return subprocess.run([*_command(), *args], capture_output=True, text=True,
                          timeout=timeout, env={**base, **(env or {})}, check=False)


@dataclasses.dataclass
class App:
    """An application principal: its user, ACLs, topic, id prefix and client configuration."""

    user: ScramUser
    acls: list[Acl]
    topic: str
    prefix: str
    config: dict[str, str]


def _app(cluster: LocalKafkaCluster, topic: str, *, protocol: str = "SASL_SSL",
         drop: str | None = None) -> App:
    """A fresh SCRAM user with the documented ACLs on ``topic`` (minus ``drop``, e.g.
    ``"READ TOPIC"``) and transactional ids ``<prefix>-*``."""
    prefix = unique("app")
    user = cluster.add_scram_user(prefix, _password())
    acls = application_acls(user.principal, topics=[topic],
                            transactional_id_prefix=f"{prefix}-")
    kept = [a for a in acls if f"{a.operation} {a.resource_type}" != drop]
    assert drop is None or len(kept) == len(acls) - 1, (drop, [str(a) for a in acls])
    cluster.create_acls(kept)
    config = cluster.client_config(user, protocol)  # type: ignore[arg-type]
    return App(user, kept, topic, prefix, config)


def _bump_epoch(config: dict[str, str], tid: str) -> None:
    """Initialise ``tid`` once more (a new epoch): the coordinator forgets the last transaction,
    so recovery must read its anchor record to learn whether it committed."""
    from confluent_kafka import Producer

    producer = Producer({**config, "transactional.id": tid})
    producer.init_transactions(15)
    producer.flush(5)


def _prepare(config: dict[str, str], tid: str, topic: str, value: bytes, *,
             commit: bool = False) -> str:
    """Prepare (and optionally commit) a transaction, then drop the producer like a crash."""
    p = TwoPhaseProducer({**config, "transactional.id": tid, "linger.ms": 0,
                          "transaction.timeout.ms": 120_000}, timeout_s=15)
    try:
        p.init_transactions()
        p.begin_transaction()
        p.produce(topic, value, key=value)
        state = p.prepare_transaction()
        if commit:
            p.commit_transaction()
    finally:
        p.close()
    return str(state)


@pytest.fixture
def debug_logs() -> Iterator[list[str]]:
    """Every log record of the test, formatted, at DEBUG (kafka-python's included)."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Collect(logging.DEBUG)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


@pytest.fixture
def secured_topic(kafka_secured: LocalKafkaCluster, new_topic: Any) -> str:
    name: str = new_topic(kafka_secured, partitions=2)
    return name


def _sqlite(tmp_path: Path) -> sa.Engine:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    dualwrite.upgrade_database(url)
    engine = dualwrite.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE items (id TEXT PRIMARY KEY)")
    return engine


# -- the application principal with exactly the documented ACLs -------------------------------


@pytest.mark.parametrize("protocol", ["SASL_SSL", "SASL_PLAINTEXT"])
def test_application_principal_writes_recovers_and_reports(
        kafka_secured: LocalKafkaCluster, secured_topic: str, tmp_path: Path, protocol: str,
        debug_logs: list[str], capfd: pytest.CaptureFixture[str]) -> None:
    app = _app(kafka_secured, secured_topic, protocol=protocol)
    engine = _sqlite(tmp_path)
    try:
        with ControlPlane(app.config, timeout_s=15) as cp:
            assert cp.probe(check_2pc=False).max_transaction_timeout_ms == 3_600_000

        writer = DualWriter(engine, app.config, transactional_id=f"{app.prefix}-w")
        try:
            with writer.transaction() as tx:
                tx.produce(app.topic, key="w", value=b"w")
                tx.connection.execute(sa.text("INSERT INTO items VALUES ('w')"))
        finally:
            writer.close()

        store = StateStore(engine)
        in_doubt = _prepare(app.config, f"{app.prefix}-r", app.topic, b"r")
        assert store.compare_and_set(f"{app.prefix}-r", "", in_doubt)
        done = _prepare(app.config, f"{app.prefix}-c", app.topic, b"c", commit=True)
        _bump_epoch(app.config, f"{app.prefix}-c")  # recovery reads the anchor record
        assert store.compare_and_set(f"{app.prefix}-c", "", done)
        _prepare(app.config, f"{app.prefix}-h", app.topic, b"h")  # hanging: no state row

        report = dualwrite.recover(engine, app.config, timeout_s=15)
        outcomes = {r.transactional_id: r.outcome.value for r in report.results}
        assert outcomes[f"{app.prefix}-r"] == "committed", report.as_dict()
        assert outcomes[f"{app.prefix}-c"] == "already-committed", report.as_dict()
        assert not report.failed

        status = dualwrite.status(engine, app.config, prefix=f"{app.prefix}-", timeout_s=15)
        assert [h.transactional_id for h in status.hanging] == [f"{app.prefix}-h"]
        assert {r.transactional_id for r in status.rows} >= {f"{app.prefix}-w", f"{app.prefix}-r"}
    finally:
        engine.dispose()
    assert read_committed(kafka_secured.bootstrap_servers, app.topic) == [b"c", b"r", b"w"]
    out, err = capfd.readouterr()
    text = "\n".join(debug_logs)
    assert "SaslAuthenticate" in text  # DEBUG really was on for kafka-python
    for where in (text, out, err):
        assert app.user.password not in where
        assert SECRET_MARK not in where


# -- one ACL missing ----------------------------------------------------------------------------


def _assert_nothing_written(cluster: LocalKafkaCluster, engine: sa.Engine, topic: str,
                            tid: str) -> None:
    """No row, no visible record, nothing of ``tid`` open (asked as the super user)."""
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM items")).scalar_one() == 0
    assert read_committed(cluster.bootstrap_servers, topic) == []
    report = dualwrite.status(engine, {"bootstrap.servers": cluster.bootstrap_servers},
                              prefix=tid, timeout_s=10)
    for row in report.rows:
        assert row.state == "" and (row.broker is None or not row.broker.state.in_flight), row
    assert [h.transactional_id for h in report.hanging] == []


def _write_item(writer: DualWriter, topic: str, item: str) -> None:
    with writer.transaction() as tx:
        tx.connection.execute(sa.text("INSERT INTO items VALUES (:id)"), {"id": item})
        tx.produce(topic, key=item, value=item.encode())


def test_missing_write_on_transactional_id_is_named(kafka_secured: LocalKafkaCluster,
                                                    secured_topic: str, tmp_path: Path) -> None:
    """A typed AuthorizationError naming the ACL within seconds, nothing written or open."""
    app = _app(kafka_secured, secured_topic, drop="WRITE TRANSACTIONAL_ID")
    engine = _sqlite(tmp_path)
    tid = f"{app.prefix}-w"
    started = time.monotonic()
    writer = DualWriter(engine, app.config, transactional_id=tid, timeout_s=10)
    try:
        with pytest.raises(dualwrite.AuthorizationError) as info:
            _write_item(writer, app.topic, "w")
        took = time.monotonic() - started
        _assert_nothing_written(kafka_secured, engine, app.topic, tid)
    finally:
        writer.close()
        engine.dispose()
    assert took < 5, took
    assert not isinstance(info.value, dualwrite.RetriableError)
    assert info.value.acl.startswith(f"WRITE on TransactionalId '{tid}'"), info.value.acl
    assert f"WRITE on TransactionalId '{tid}'" in str(info.value)
    assert SECRET_MARK not in str(info.value)


def test_missing_read_on_topic_is_named(kafka_secured: LocalKafkaCluster, secured_topic: str,
                                        tmp_path: Path) -> None:
    app = _app(kafka_secured, secured_topic, drop="READ TOPIC")
    with ControlPlane(app.config, timeout_s=10) as cp, \
            pytest.raises(AuthorizationError) as info:
        cp.describe_producers([TopicPartition(app.topic, 0)])
    assert info.value.acl == f"READ on Topic '{app.topic}'"
    assert f"Missing ACL: grant READ on Topic '{app.topic}'" in str(info.value)
    # Recovery (which asks DescribeProducers) reports the same ACL for the id.
    engine = _sqlite(tmp_path)
    try:
        state = _prepare(app.config, f"{app.prefix}-r", app.topic, b"r")
        assert StateStore(engine).compare_and_set(f"{app.prefix}-r", "", state)
        report = dualwrite.recover(engine, app.config, timeout_s=10)
    finally:
        engine.dispose()
    [result] = report.results
    assert result.outcome.value == "failed"
    assert f"READ on Topic '{app.topic}'" in result.detail


def test_missing_write_on_topic_fails_the_transaction(kafka_secured: LocalKafkaCluster,
                                                      secured_topic: str, tmp_path: Path) -> None:
    """WRITE on the topic is needed; the control plane can name it (librdkafka cannot)."""
    app = _app(kafka_secured, secured_topic, drop="WRITE TOPIC")
    engine = _sqlite(tmp_path)
    writer = DualWriter(engine, app.config, transactional_id=f"{app.prefix}-w", timeout_s=10)
    started = time.monotonic()
    try:
        with pytest.raises(DualWriteError), writer.transaction() as tx:
            tx.produce(app.topic, key="k", value=b"v")
    finally:
        writer.close()
        engine.dispose()
    assert time.monotonic() - started < 10
    assert read_committed(kafka_secured.bootstrap_servers, app.topic) == []
    with ControlPlane(app.config, timeout_s=10) as cp:
        assert cp.missing_topic_acls([app.topic]) == [f"WRITE on Topic '{app.topic}'"]
        assert cp.missing_topic_acls([app.topic], "READ") == []
    full = _app(kafka_secured, secured_topic)
    with ControlPlane(full.config, timeout_s=10) as cp:
        assert cp.missing_topic_acls([app.topic]) == []


def test_missing_write_on_topic_is_named(kafka_secured: LocalKafkaCluster, secured_topic: str,
                                         tmp_path: Path) -> None:
    """The topic is visible (READ) but not writable: AuthorizationError within seconds, nothing
    written or open; once the ACL is granted the same writer goes on."""
    app = _app(kafka_secured, secured_topic, drop="WRITE TOPIC")
    engine = _sqlite(tmp_path)
    tid = f"{app.prefix}-w"
    writer = DualWriter(engine, app.config, transactional_id=tid, timeout_s=10)
    try:
        started = time.monotonic()
        with pytest.raises(dualwrite.AuthorizationError) as info:
            _write_item(writer, app.topic, "w")
        took = time.monotonic() - started
        _assert_nothing_written(kafka_secured, engine, app.topic, tid)
        kafka_secured.create_acls([Acl(app.user.principal, "WRITE", "TOPIC", app.topic)])
        time.sleep(0.5)  # the ACL travels through the metadata log
        _write_item(writer, app.topic, "after-grant")
    finally:
        writer.close()
        engine.dispose()
    assert took < 5, took
    assert not isinstance(info.value, dualwrite.RetriableError)
    assert info.value.acl == f"WRITE on Topic '{app.topic}'"
    assert f"Missing ACL: grant WRITE on Topic '{app.topic}'" in str(info.value)
    assert read_committed(kafka_secured.bootstrap_servers, app.topic) == [b"after-grant"]


def test_topic_not_even_visible_is_named(kafka_secured: LocalKafkaCluster, secured_topic: str,
                                         new_topic: Any, tmp_path: Path) -> None:
    """A topic without any ACL for the principal (Metadata says TOPIC_AUTHORIZATION_FAILED):
    named at once, before anything is sent; the writer goes on with its own topic. The Spark
    sink's per-batch check (ControlPlane.check_topics_writable) names it the same way."""
    app = _app(kafka_secured, secured_topic)
    hidden = new_topic(kafka_secured, partitions=1)
    engine = _sqlite(tmp_path)
    tid = f"{app.prefix}-w"
    writer = DualWriter(engine, app.config, transactional_id=tid, timeout_s=10)
    try:
        started = time.monotonic()
        with pytest.raises(dualwrite.AuthorizationError) as info:
            _write_item(writer, hidden, "w")
        took = time.monotonic() - started
        _assert_nothing_written(kafka_secured, engine, hidden, tid)
        _write_item(writer, app.topic, "own-topic")
        with ControlPlane(app.config, timeout_s=10) as cp:
            with pytest.raises(dualwrite.AuthorizationError) as checked:
                cp.check_topics_writable([hidden])
            cp.check_topics_writable([app.topic])
    finally:
        writer.close()
        engine.dispose()
    assert took < 5, took
    assert info.value.acl == f"WRITE on Topic '{hidden}'"
    assert checked.value.acl == f"WRITE on Topic '{hidden}'"
    assert read_committed(kafka_secured.bootstrap_servers, app.topic) == [b"own-topic"]


_GROUP_ACL_TRIES = 16


def _anchor_check_without_group_acl(cluster: LocalKafkaCluster, topic: str,
                                    tmp_path: Path) -> str:
    """Recover a Kafka-committed transaction whose coordinator state is gone, as a principal
    without DESCRIBE on the ``dualwrite-verify-`` groups; the first failure's detail.

    librdkafka looks the verify consumer's group coordinator up in the background, so the
    GROUP_AUTHORIZATION_FAILED races with the fetch of the anchor record: try a few times.
    """
    app = _app(cluster, topic, drop="DESCRIBE GROUP")
    engine = _sqlite(tmp_path)
    try:
        for attempt in range(_GROUP_ACL_TRIES):
            tid = f"{app.prefix}-c{attempt}"
            state = _prepare(app.config, tid, app.topic, b"c", commit=True)
            _bump_epoch(app.config, tid)
            assert StateStore(engine).compare_and_set(tid, "", state)
            started = time.monotonic()
            report = dualwrite.recover(engine, app.config, [tid], timeout_s=10)
            assert time.monotonic() - started < 15
            [result] = report.results
            if result.outcome.value == "failed":
                return result.detail
            assert result.outcome.value == "already-committed", report.as_dict()
    finally:
        engine.dispose()
    raise AssertionError(f"the anchor check never met the missing group ACL in "
                         f"{_GROUP_ACL_TRIES} tries")


def test_missing_group_acl_fails_the_anchor_check_and_is_named(
        kafka_secured: LocalKafkaCluster, secured_topic: str, tmp_path: Path) -> None:
    """The group ACL is needed: without it recovery cannot confirm a Kafka-side commit, and the
    failure names the ACL to grant."""
    detail = _anchor_check_without_group_acl(kafka_secured, secured_topic, tmp_path)
    assert "GROUP_AUTHORIZATION_FAILED" in detail
    assert "DESCRIBE on Group prefix 'dualwrite-verify-'" in detail


def test_missing_describe_configs_is_warned_and_shortens_the_timeout(
        kafka_secured: LocalKafkaCluster, secured_topic: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """Without DESCRIBE_CONFIGS on the cluster the broker's transaction.max.timeout.ms cannot be
    read: a prepared transaction then gets librdkafka's 60 s default instead of the maximum
    (and is aborted by the broker if recovery takes longer), so the control plane warns."""
    app = _app(kafka_secured, secured_topic, drop="DESCRIBE_CONFIGS CLUSTER")
    with ControlPlane(app.config, timeout_s=10) as cp:
        with caplog.at_level(logging.WARNING, logger="dualwrite.participant.control_plane"):
            assert cp.probe(check_2pc=False).max_transaction_timeout_ms is None
        assert "grant DESCRIBE_CONFIGS on Cluster 'kafka-cluster'" in caplog.text
        p = TwoPhaseProducer({**app.config, "transactional.id": f"{app.prefix}-t"},
                             control_plane=cp, timeout_s=10)
        try:
            p.init_transactions()
            desc = cp.describe_transaction(f"{app.prefix}-t")
        finally:
            p.close()
    assert desc is not None and desc.timeout_ms == 60_000  # with the ACL: 3600000


# -- authentication -----------------------------------------------------------------------------


def test_marker_repair_without_cluster_action_is_named(kafka_secured: LocalKafkaCluster,
                                                       secured_topic: str) -> None:
    """Writing a lost commit marker (Completion.commit_lost_marker) needs CLUSTER_ACTION, which
    an application principal does not have: the broker refuses before looking at the partition,
    and the error names the ACL."""
    app = _app(kafka_secured, secured_topic)
    with ControlPlane(app.config, timeout_s=10) as cp, \
            pytest.raises(AuthorizationError) as refused:
        cp.write_txn_marker(TopicPartition(secured_topic, 0), 0, 0, 0, commit=True)
    assert refused.value.acl == "CLUSTER_ACTION on Cluster 'kafka-cluster'"


def test_wrong_password_is_a_clear_fatal_error_within_the_timeout(
        kafka_secured: LocalKafkaCluster, tmp_path: Path, debug_logs: list[str],
        capfd: pytest.CaptureFixture[str]) -> None:
    user = kafka_secured.add_scram_user(unique("wrongpw"), _password())
    wrong = ScramUser(user.name, _password())
    config = kafka_secured.client_config(wrong, "SASL_SSL")
    started = time.monotonic()
    with pytest.raises(FatalError) as info:
        ControlPlane(config, timeout_s=4)
    assert time.monotonic() - started < 4 + 6  # the timeout, then one diagnosing handshake
    message = str(info.value)
    assert "SASL authentication" in message and repr(user.name) in message
    assert "sasl.password" in message
    started = time.monotonic()
    with pytest.raises(FatalError):
        TwoPhaseProducer({**config, "transactional.id": "never"}, timeout_s=4)
    assert time.monotonic() - started < 4 + 6
    props = write_properties_file(tmp_path / "wrong.properties", config, "wrong password")
    result = _dw("-vv", "probe", "--kafka-properties", str(props), "--timeout", "4")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "SASL authentication" in result.stderr
    out, err = capfd.readouterr()
    for where in ("\n".join(debug_logs), message, out, err, result.stdout, result.stderr):
        assert wrong.password not in where and user.password not in where


# -- the command line, with secrets in the properties file and the database URL ---------------


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_cli_with_properties_file_shows_no_password(kafka_secured: LocalKafkaCluster,
                                                    secured_topic: str, empty_db_url: str,
                                                    tmp_path: Path) -> None:
    app = _app(kafka_secured, secured_topic)
    db_password = _password()
    db_url = sa.make_url(empty_db_url).set(password=db_password).render_as_string(
        hide_password=False)  # the test server trusts every local connection
    dualwrite.upgrade_database(db_url)
    engine = dualwrite.create_engine(db_url)
    try:
        state = _prepare(app.config, f"{app.prefix}-r", app.topic, b"r")
        assert StateStore(engine).compare_and_set(f"{app.prefix}-r", "", state)
    finally:
        engine.dispose()
    props = write_properties_file(tmp_path / "client.properties", app.config, "app")
    env = {"DUALWRITE_KAFKA_PROPERTIES": str(props)}
    runs = [
        _dw("-vv", "probe", "--no-2pc-check", "--json", env=env),
        _dw("-vv", "status", "--db", db_url, "--json", env=env),
        _dw("-vv", "recover", "--db", db_url, "--json", env=env),
        _dw("-vv", "status", "--db", db_url, "--kafka-properties", str(props)),
        _dw("-vv", "status", "--db", db_url.replace("127.0.0.1", "127.0.0.1:1"),
            "--timeout", "3", env=env),  # an error naming the database
    ]
    for result, code in zip(runs[:4], (0, 5, 0, 0), strict=True):  # 5: status, in doubt
        assert result.returncode == code, (result.args, result.stdout, result.stderr[-3000:])
    assert runs[3].stdout.count(f"{app.prefix}-r") == 1
    assert json.loads(runs[2].stdout)["counts"] == {"committed": 1}
    assert runs[4].returncode != 0
    assert "DEBUG" in runs[0].stderr  # -vv really logged at DEBUG
    for result in runs:
        for where in (result.stdout, result.stderr):
            assert app.user.password not in where and db_password not in where
            assert SECRET_MARK not in where


# -- dualwrite dev up --security sasl -----------------------------------------------------------


def test_dev_up_security_sasl(tmp_path: Path) -> None:
    env = {"DUALWRITE_HOME": str(tmp_path / "home")}
    up = _dw("dev", "up", "--security", "sasl", "--backend", "jars", "--acl-prefix", "shop.",
             env=env, timeout=240)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        props = Path(next(line.split(": ", 1)[1] for line in up.stdout.splitlines()
                          if "client properties for User:dualwrite-app" in line))
        assert stat.S_IMODE(props.stat().st_mode) == 0o600
        settings = dualwrite.participant.client_config.load_properties(str(props))
        assert settings["security.protocol"] == "SASL_SSL"
        assert settings["sasl.mechanism"] == "SCRAM-SHA-512"
        assert Path(settings["ssl.ca.location"]).read_text().startswith("-----BEGIN CERT")
        password = settings["sasl.password"]
        status = _dw("dev", "status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        state = json.loads(status.stdout)
        assert state["bootstrap_servers"] == settings["bootstrap.servers"]
        assert state["client_properties"] == str(props)
        text = _dw("dev", "status", env=env)
        state_file = Path(env["DUALWRITE_HOME"]) / "dev" / "cluster.json"
        for where in (up.stdout, up.stderr, status.stdout, text.stdout,
                      state_file.read_text()):
            assert password not in where
        # The printed file works as is, for the documented ACLs on the "shop." prefix.
        cluster = LocalKafkaCluster.from_state(state_file)
        cluster.create_topic("shop.orders", 2)
        db = f"sqlite:///{tmp_path / 'shop.db'}"
        dualwrite.upgrade_database(db)
        engine = dualwrite.create_engine(db)
        try:
            writer = DualWriter(engine, settings, transactional_id="shop.writer-1")
            try:
                with writer.transaction() as tx:
                    tx.produce("shop.orders", key="1", value=b"order-1")
            finally:
                writer.close()
        finally:
            engine.dispose()
        probe = _dw("probe", "--no-2pc-check", "--kafka-properties", str(props))
        assert probe.returncode == 0, probe.stderr
        assert read_committed(cluster.bootstrap_servers, "shop.orders") == [b"order-1"]
    finally:
        down = _dw("dev", "down", env=env)
    assert down.returncode == 0, down.stderr
    assert not (Path(env["DUALWRITE_HOME"]) / "dev" / "kafka" / "security").exists()


# -- the Spark sink -----------------------------------------------------------------------------

_SPARK_SCRIPT = textwrap.dedent('''
    import os, sys
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession
    from dualwrite.participant.client_config import load_properties
    from dualwrite.spark import ExactlyOnceSink
    props, db, topic, sink_id = sys.argv[1:5]
    spark = (SparkSession.builder.master("local[2]").appName(sink_id)
             .config("spark.ui.enabled", "false")
             .config("spark.pyspark.python", sys.executable)
             .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    sink = ExactlyOnceSink(sink_id=sink_id, kafka_config=load_properties(props), topic=topic,
                           database_url=db, key_column="key", value_column="value",
                           max_participants=2)
    for batch in (0, 1):
        rows = [(f"{batch}-{i}", f"v{batch}-{i}") for i in range(10)]
        sink(spark.createDataFrame(rows, "key STRING, value STRING").repartition(2), batch)
    sink.close()
    spark.stop()
    print("DONE", flush=True)
''')


@pytest.mark.spark
def test_spark_sink_as_application_principal(kafka_secured: LocalKafkaCluster,
                                             secured_topic: str, tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    sink_id = unique("sparksec")
    user = kafka_secured.add_scram_user(sink_id, _password())
    kafka_secured.create_acls(application_acls(
        user.principal, topics=[secured_topic], transactional_id_prefix=f"{sink_id}-"))
    props = write_properties_file(tmp_path / "client.properties",
                                  kafka_secured.client_config(user, "SASL_SSL"), "spark")
    db = f"sqlite:///{tmp_path / 'spark.db'}"
    script = tmp_path / "sink.py"
    script.write_text(_SPARK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, str(script), str(props), db, secured_topic,
                             sink_id], capture_output=True, text=True, timeout=300, env=env,
                            check=False)
    assert result.returncode == 0 and "DONE" in result.stdout, result.stderr[-5000:]
    values = read_committed(kafka_secured.bootstrap_servers, secured_topic)
    assert sorted(values) == sorted(f"v{b}-{i}".encode() for b in (0, 1) for i in range(10))
    assert user.password not in result.stdout + result.stderr


# -- units: the ACL names, the secret wrapper ---------------------------------------------------


@pytest.mark.unit
def test_required_acl_names_operation_and_resource() -> None:
    assert required_acl(29, "DescribeProducers(orders-3)") == "READ on Topic 'orders'"
    assert required_acl(53, "EndTxn(commit) transactional_id=o-1 producer_id=1 epoch=0") \
        == "WRITE on TransactionalId 'o-1'"
    assert required_acl(53, "DescribeTransactions('o-2')") == "DESCRIBE on TransactionalId 'o-2'"
    assert required_acl(31, "DescribeConfigs") == "DESCRIBE_CONFIGS on Cluster 'kafka-cluster'"
    assert required_acl(31, "WriteTxnMarkers(commit) orders-0 producer_id=1 epoch=0") \
        == "CLUSTER_ACTION on Cluster 'kafka-cluster'"
    assert required_acl(30, "FindCoordinator response error: Group authorization failed.",
                        "prefix 'dualwrite-verify-'") \
        == "DESCRIBE on Group prefix 'dualwrite-verify-'"
    assert required_acl(53, "InitProducerId('o-3')").startswith(
        "WRITE on TransactionalId 'o-3' (and TWO_PHASE_COMMIT")


@pytest.mark.unit
def test_passwords_are_hidden_from_repr_and_config_dumps() -> None:
    config = {"bootstrap.servers": "h:1", "security.protocol": "SASL_SSL",
              "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "u", "sasl.password": "pw-xyz"}
    kp = kafka_python_config(config)
    assert isinstance(kp["sasl_plain_password"], Secret)
    assert kp["sasl_plain_password"].encode() == b"pw-xyz"  # what the SASL exchange uses
    assert "pw-xyz" not in repr(kp) and "pw-xyz" not in f"{kp['sasl_plain_password']}"
    assert "pw-xyz" not in repr(ScramUser("u", "pw-xyz"))
    record = logging.LogRecord("kafka.protocol.parser", logging.DEBUG, "", 0,
                               "Sending SaslAuthenticateRequest(auth_bytes=%r)", (b"\0u\0pw-xyz",),
                               None)
    for f in logging.getLogger("kafka.protocol.parser").filters:
        assert not isinstance(f, logging.Filter) or f.filter(record)
    assert "pw-xyz" not in record.getMessage()


def test_dualwrite_errors_only(kafka_secured: LocalKafkaCluster, secured_topic: str) -> None:
    """Missing ACLs surface as dualwrite's typed errors, never kafka-python's or librdkafka's."""
    app = _app(kafka_secured, secured_topic, drop="WRITE TRANSACTIONAL_ID")
    with ControlPlane(app.config, timeout_s=10) as cp:
        for call in (lambda: cp.describe_transaction(f"{app.prefix}-x"),
                     lambda: cp.end_transaction(f"{app.prefix}-x", 1, 0, commit=False),
                     lambda: cp.fence(f"{app.prefix}-x")):
            with pytest.raises(DualWriteError) as info:
                call()
            assert isinstance(info.value, FatalError), repr(info.value)
            assert f"TransactionalId '{app.prefix}-x'" in str(info.value)
