"""The first mistakes a user makes get a typed error that says what to do, fast, losing nothing.

Permanent Kafka errors (a topic that does not exist, a record too large for the client or the
broker, a record the broker rejects, a value that is not bytes) are non-retriable
:class:`~dualwrite.FatalError` subclasses that name the topic and the limit; the transaction is
rolled back on both sides, nothing is left open, and the writer goes on with the next one. Bad
input (a database URL that is not one, an empty or malformed bootstrap) is a
:class:`~dualwrite.ConfigurationError`, which is also a ``ValueError``; the CLI prints one line and
exits 2. The authorization cases run on the SASL cluster (tests/participant/test_security.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import dualwrite
from dualwrite import DualWriter
from dualwrite.cli import main as cli
from dualwrite.dev import KafkaTarget
from tests.support.kafka import read_committed

pytestmark = pytest.mark.timeout(120)

FAST_S = 5.0
E = TypeVar("E", bound=Exception)


@pytest.fixture
def writer(db_url: str, bootstrap: str) -> Iterator[DualWriter]:
    engine = dualwrite.create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE items (id TEXT PRIMARY KEY)"))
    w = DualWriter(engine, {"bootstrap.servers": bootstrap},
                   transactional_id=f"mistakes-{uuid.uuid4().hex[:10]}", timeout_s=15)
    try:
        yield w
    finally:
        w.close()
        engine.dispose()


def _rows(db_url: str) -> list[str]:
    engine = dualwrite.create_engine(db_url)
    try:
        with engine.connect() as conn:
            return sorted(r[0] for r in conn.execute(sa.text("SELECT id FROM items")))
    finally:
        engine.dispose()


def _write(writer: DualWriter, row: str, produce: Callable[[Any], object]) -> float:
    """One transaction: a row, then ``produce(tx)``; its wall time."""
    started = time.monotonic()
    with writer.transaction() as tx:
        tx.connection.execute(sa.text("INSERT INTO items VALUES (:id)"), {"id": row})
        produce(tx)
    return time.monotonic() - started


def _fails(writer: DualWriter, produce: Callable[[Any], object],
           error: type[E]) -> tuple[pytest.ExceptionInfo[E], float]:
    started = time.monotonic()
    with pytest.raises(error) as info:
        _write(writer, "lost", produce)
    return info, time.monotonic() - started


def _assert_settled(writer: DualWriter, db_url: str, bootstrap: str, good_topic: str,
                    rows: list[str]) -> None:
    """Rows == read_committed records, and nothing of the writer's id open or in doubt."""
    assert _rows(db_url) == rows
    assert sorted(read_committed(bootstrap, good_topic)) == [r.encode() for r in rows]
    tid = writer.transactional_id
    report = dualwrite.status(db_url, {"bootstrap.servers": bootstrap}, prefix=tid,
                              timeout_s=10)
    last = writer.producer.last_committed
    for row in report.rows:  # the state row names the last commit, or nothing
        assert row.state in ("", str(last)), row
        assert row.broker is None or not row.broker.state.in_flight, row
    assert [h for h in report.hanging if h.transactional_id == tid] == []


def _then_next_works(writer: DualWriter, db_url: str, bootstrap: str, topic: str) -> None:
    _write(writer, "next", lambda tx: tx.produce(topic, b"next"))
    _assert_settled(writer, db_url, bootstrap, topic, ["next"])


# -- permanent Kafka errors ---------------------------------------------------------------------


def test_missing_topic_is_typed_fast_and_leaves_nothing_open(
        writer: DualWriter, db_url: str, bootstrap: str, topic: str) -> None:
    """Today: DeliveryTimeoutError (retriable) after ~15-30 s and two new sessions."""
    missing = f"no-such-topic-{uuid.uuid4().hex[:8]}"
    # The writer's very first transaction: its session starts, then the topic is looked up.
    info, took = _fails(writer, lambda tx: tx.produce(missing, b"x"), dualwrite.UnknownTopicError)
    assert took < FAST_S, took
    assert not isinstance(info.value, dualwrite.RetriableError)
    assert isinstance(info.value, dualwrite.FatalError)
    assert info.value.topic == missing and repr(missing) in str(info.value)
    assert "does not exist" in str(info.value)
    _assert_settled(writer, db_url, bootstrap, topic, [])
    _then_next_works(writer, db_url, bootstrap, topic)
    # Again after the first one succeeded (its session warm): as fast, still typed.
    info, took = _fails(writer, lambda tx: (tx.produce(topic, b"kept?"),
                                            tx.produce(missing, b"x")),
                        dualwrite.UnknownTopicError)
    assert took < FAST_S, took
    assert _rows(db_url) == ["next"]
    assert sorted(read_committed(bootstrap, topic)) == [b"next"]  # 'kept?' never shows
    # Nothing of it is open: before the producer waited for 'kept?' ahead of the abort, its
    # AddPartitionsToTxn, retried, landed after the abort about 1 run in 10 under load (the
    # abort's EndTxn then answered INVALID_TXN_STATE, or was not sent) and left the transaction
    # Ongoing (test_producer::test_an_abort_just_after_a_commit_ends_its_transaction).
    _assert_settled(writer, db_url, bootstrap, topic, ["next"])
    _write(writer, "after", lambda tx: tx.produce(topic, b"after"))
    _assert_settled(writer, db_url, bootstrap, topic, ["after", "next"])


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_record_too_large_for_the_client(writer: DualWriter, db_url: str, bootstrap: str,
                                         topic: str) -> None:
    """librdkafka refuses it before sending (message.max.bytes). Today: RecoverableError."""
    big = b"x" * 2_000_000
    info, took = _fails(writer, lambda tx: tx.produce(topic, big), dualwrite.RecordTooLargeError)
    assert took < FAST_S, took
    err = info.value
    assert isinstance(err, dualwrite.FatalError) and isinstance(err, ValueError)
    assert err.topic == topic and err.size == len(big)
    assert err.limit == "message.max.bytes=1000000"
    assert repr(topic) in str(err) and "2000000 bytes" in str(err)
    _assert_settled(writer, db_url, bootstrap, topic, [])
    _then_next_works(writer, db_url, bootstrap, topic)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_record_too_large_for_the_broker(writer: DualWriter, db_url: str, bootstrap: str,
                                         topic: str,
                                         kafka: KafkaTarget, new_topic: Any) -> None:
    """The topic's max.message.bytes rejects it at the broker. Today: RetriableError after
    ~2 s (the writer sent it again in a new session), which an application retries forever."""
    small = new_topic(kafka, partitions=1, config={"max.message.bytes": "2000"})
    info, took = _fails(writer, lambda tx: (tx.produce(topic, b"kept?"),
                                            tx.produce(small, b"x" * 5000)),
                        dualwrite.RecordTooLargeError)
    assert took < FAST_S, took
    err = info.value
    assert not isinstance(err, dualwrite.RetriableError)
    assert err.topic == small and err.size == 5000 and err.limit == "max.message.bytes"
    assert f"delivery to {small}[0]" in str(err) and "max.message.bytes" in str(err)
    _assert_settled(writer, db_url, bootstrap, topic, [])
    assert read_committed(bootstrap, small) == []
    _then_next_works(writer, db_url, bootstrap, topic)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_record_the_broker_rejects(writer: DualWriter, db_url: str, bootstrap: str, topic: str,
                                   kafka: KafkaTarget, new_topic: Any) -> None:
    """A compacted topic takes no record without a key: INVALID_RECORD, not retried."""
    compacted = new_topic(kafka, partitions=1, config={"cleanup.policy": "compact"})
    info, took = _fails(writer, lambda tx: tx.produce(compacted, b"no key"),
                        dualwrite.InvalidRecordError)
    assert took < FAST_S, took
    assert not isinstance(info.value, dualwrite.RecordTooLargeError)
    assert "INVALID_RECORD" in str(info.value) and compacted in str(info.value)
    _assert_settled(writer, db_url, bootstrap, topic, [])
    _then_next_works(writer, db_url, bootstrap, topic)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("value", [{"order": 1}, 42, ["a"]], ids=["dict", "int", "list"])
def test_value_of_the_wrong_type(writer: DualWriter, db_url: str, bootstrap: str, topic: str,
                                 value: object) -> None:
    """Today: a raw TypeError from confluent-kafka."""
    info, _ = _fails(writer, lambda tx: tx.produce(topic, value), dualwrite.InvalidRecordError)
    assert isinstance(info.value, TypeError)  # `except TypeError` still catches it
    assert repr(topic) in str(info.value) and "json.dumps" in str(info.value)
    _assert_settled(writer, db_url, bootstrap, topic, [])
    _then_next_works(writer, db_url, bootstrap, topic)


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "says"), [
    ("shop.db", "sqlite:///shop.db"),
    ("mssql+pyodbc://app:Pw-5ecret@db/shop", "is not supported"),
    ("postgresql+psycopg2://app:Pw-5ecret@db/shop", "driver"),
    ("oracle+cx_oracle://app:Pw-5ecret@db/shop", "SQLite, PostgreSQL and MariaDB"),
])
def test_database_url_mistakes(url: str, says: str, bootstrap: str) -> None:
    """Today: ArgumentError, ModuleNotFoundError (MySQLdb, psycopg2)."""
    for attempt in (lambda: dualwrite.create_engine(url),
                    lambda: DualWriter(url, {"bootstrap.servers": bootstrap},
                                       transactional_id="x"),
                    lambda: dualwrite.upgrade_database(url)):
        with pytest.raises(dualwrite.ConfigurationError) as info:
            attempt()
        assert isinstance(info.value, ValueError)
        assert says in str(info.value)
        assert "Pw-5ecret" not in str(info.value)


@pytest.mark.unit
@pytest.mark.parametrize("servers", ["", " , ", "broker:port", "[::1", "host:99999", "a b:9092"])
def test_bootstrap_mistakes(servers: str, sqlite_url: str) -> None:
    """Today: IndexError / ValueError from kafka-python."""
    with pytest.raises(dualwrite.ConfigurationError, match=r"bootstrap\.servers"):
        DualWriter(sqlite_url, {"bootstrap.servers": servers}, transactional_id="x")
    with pytest.raises(dualwrite.ConfigurationError, match=r"bootstrap\.servers"):
        dualwrite.status(sqlite_url, {"bootstrap.servers": servers})


def test_kafka_setting_librdkafka_rejects(db_url: str, bootstrap: str) -> None:
    """Today: a raw KafkaException at the first transaction."""
    writer = DualWriter(db_url, {"bootstrap.servers": bootstrap, "acks": "sometimes"},
                        transactional_id=f"mistakes-{uuid.uuid4().hex[:10]}", timeout_s=10)
    try:
        with pytest.raises(dualwrite.ConfigurationError, match=r"acks"), \
                writer.transaction():
            pass
    finally:
        writer.close()


@pytest.mark.unit
@pytest.mark.parametrize(("args", "says"), [
    (["db", "upgrade", "--db", "shop.db"], "sqlite:///shop.db"),
    (["db", "upgrade", "--db", "mssql+pyodbc://app:Pw-5ecret@db/shop"], "is not supported"),
    (["status", "--db", "sqlite:///x.db", "-b", "broker:port"], "bootstrap.servers"),
    (["recover", "--db", "sqlite:///x.db", "-b", ","], "bootstrap.servers"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args: list[str], says: str) -> None:
    """Today `db upgrade --db shop.db` prints a 40-line traceback."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
    assert "Pw-5ecret" not in result.output


# -- issue 31 ------------------------------------------------------------------------------


@pytest.mark.unit
def test_kafka_python_style_key_is_named(sqlite_url: str) -> None:
    """``bootstrap_servers`` (kafka-python's spelling) is named as the unknown key, with the
    librdkafka name to use, not reported as a missing ``bootstrap.servers``."""
    dualwrite.upgrade_database(sqlite_url)
    with pytest.raises(dualwrite.ConfigurationError,
                       match=r"unknown key 'bootstrap_servers'.*did you mean "
                             r"'bootstrap.servers'\?"):
        DualWriter(sqlite_url, {"bootstrap_servers": "127.0.0.1:9092"},
                   transactional_id=f"fm-{uuid.uuid4().hex[:8]}")


def test_transaction_without_with_says_to_use_with(writer: DualWriter, topic: str) -> None:
    """``w.transaction().produce(...)`` (the ``with`` forgotten) is a typed error saying what
    to write, not an AttributeError about a _GeneratorContextManager; hasattr still works."""
    misused = writer.transaction()
    with pytest.raises(dualwrite.TransactionStateError,
                       match=r"with writer\.transaction\(\) as tx:"):
        misused.produce(topic, "v")  # type: ignore[attr-defined]
    assert not hasattr(misused, "connection")
    _write(writer, "after-misuse", lambda tx: tx.produce(topic, "v"))


@pytest.mark.unit
def test_pulsar_url_without_the_pulsar_extra_names_it(tmp_path: Any) -> None:
    """Recovery of Pulsar ids without protobuf installed: one line naming the extra, exit 2."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['google'] = None; "  # as if protobuf were not installed
            "from dualwrite.cli import main; main()")
    for command in ("recover", "status"):
        run = subprocess.run([sys.executable, "-c", code, command, "--db",
                              f"sqlite:///{tmp_path / 'x.db'}", "--pulsar-url",
                              "pulsar://127.0.0.1:1"], capture_output=True, text=True,
                             timeout=60, check=False)
        assert run.returncode == 2, run.stdout + run.stderr
        assert "pip install 'dualwrite[pulsar]'" in run.stderr
        assert "Traceback" not in run.stderr
