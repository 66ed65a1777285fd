"""`dualwrite verify` / `dualwrite.verify`: a table's rows against its topic's records, on the
real Kafka and PostgreSQL (and SQLite): lost, phantom and duplicate records, open transactions,
typed errors, the command's exit codes and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from confluent_kafka import Producer

import dualwrite
from dualwrite import BrokerUnreachableError, ConfigurationError, DatabaseUnreachableError
from dualwrite.cli import main
from tests.support.kafka import closed_port, unique

pytestmark = pytest.mark.timeout(60)

OK_LINE = "verified: lost=0 duplicates=0 open=0"


def make_table(url: str, keys: Iterable[str], name: str = "orders") -> None:
    engine = dualwrite.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {name} (order_id VARCHAR(40) PRIMARY KEY, "
                                 "region VARCHAR(10))"))
            for key in keys:
                conn.execute(sa.text(f"INSERT INTO {name} VALUES (:k, :r)"),
                             {"k": key, "r": "eu" if key.endswith("1") else "us"})
    finally:
        engine.dispose()


def txn_producer(bootstrap: str, **conf: Any) -> Producer:
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": unique("verify"),
                         **conf})
    producer.init_transactions(30)
    return producer


def publish(bootstrap: str, topic: str, keys: Iterable[str | None]) -> None:
    """One committed transaction with a record per key (value = the key, as JSON)."""
    producer = txn_producer(bootstrap)
    producer.begin_transaction()
    for key in keys:
        producer.produce(topic, key=key, value=json.dumps({"order_id": key}))
    producer.commit_transaction(30)


def check(url: str, bootstrap: str, topic: str, **kw: Any) -> dualwrite.VerifyReport:
    kw.setdefault("timeout_s", 10)
    return dualwrite.verify(url, {"bootstrap.servers": bootstrap}, table="orders",
                            key_column="order_id", topic=topic, **kw)


def test_a_table_and_its_topic_agree(empty_db_url: str, bootstrap: str, topic: str) -> None:
    keys = [f"o{n}" for n in range(20)]
    make_table(empty_db_url, keys)
    publish(bootstrap, topic, keys)
    report = check(empty_db_url, bootstrap, topic)
    assert report.ok and (report.rows, report.records) == (20, 20)
    assert report.summary == str(report) == OK_LINE
    assert report.as_dict()["ok"] is True


def test_lost_phantom_and_duplicate_records_are_named(empty_db_url: str, bootstrap: str,
                                                      topic: str) -> None:
    make_table(empty_db_url, ["o1", "o2", "o3", "o4"])
    publish(bootstrap, topic, ["o1", "o2", "o2", "o2", "o3", "o9"])
    report = check(empty_db_url, bootstrap, topic)
    assert not report.ok
    assert report.lost == ("o4",)
    assert report.phantoms == ("o9",)
    assert report.duplicates == (("o2", 3),) and report.duplicate_records == 2
    assert report.summary == "verified: lost=1 duplicates=2 open=0 phantoms=1"
    with pytest.raises(AttributeError):
        report.lost = ()  # type: ignore[misc]  # frozen


def test_where_filter_and_key_of_record(sqlite_url: str, bootstrap: str, topic: str) -> None:
    """Only the filtered rows are compared; a record's row key may come from its value, and a
    record key_of_record returns None for is skipped."""
    make_table(sqlite_url, ["o1", "o2", "o11"])  # o1, o11 in 'eu'
    publish(bootstrap, topic, ["o1", "o11", None])

    def from_value(key: bytes | None, value: bytes | None) -> str | None:
        return json.loads(value or b"{}")["order_id"] if key is not None else None

    report = check(sqlite_url, bootstrap, topic, where="region = 'eu'", key_of_record=from_value)
    assert report.ok and report.rows == 2 and report.skipped_records == 1
    assert check(sqlite_url, bootstrap, topic).lost == ("o2",)


def test_an_open_transaction_is_reported_within_the_timeout(sqlite_url: str, bootstrap: str,
                                                            topic: str) -> None:
    make_table(sqlite_url, ["o1", "o2"])
    publish(bootstrap, topic, ["o1"])
    producer = txn_producer(bootstrap, **{"transaction.timeout.ms": 20_000})
    producer.begin_transaction()
    producer.produce(topic, key="o2", value=b"{}", partition=1)
    producer.flush(10)
    committed = threading.Event()

    def commit() -> None:
        producer.commit_transaction(10)
        committed.set()

    committer = threading.Timer(1.0, commit)
    try:
        started = time.monotonic()
        report = check(sqlite_url, bootstrap, topic, timeout_s=2)
        assert time.monotonic() - started < 2 + 3
        assert report.open_partitions == (1,) and report.lost == ("o2",) and not report.ok
        assert report.summary == "verified: lost=1 duplicates=0 open=1"
        committer.start()  # committed while verify waits: its record is read, nothing lost
        report = check(sqlite_url, bootstrap, topic, timeout_s=15)
        assert report.ok, report.as_dict()
    finally:
        if committer.is_alive():
            committer.join()
        if not committed.is_set():
            producer.abort_transaction(10)


def test_missing_names_are_configuration_errors(sqlite_url: str, bootstrap: str,
                                                topic: str) -> None:
    make_table(sqlite_url, [])
    kafka = {"bootstrap.servers": bootstrap}
    cases = [({"table": "nope"}, "table 'nope' does not exist"),
             ({"key_column": "id"}, "has no column 'id'; its columns: order_id, region"),
             ({"topic": topic + "-nope"}, "does not exist in the Kafka cluster"),
             ({"where": "no_such_column = 1"}, "the filter")]
    for change, message in cases:
        kw: dict[str, Any] = {"table": "orders", "key_column": "order_id", "topic": topic,
                              **change}
        with pytest.raises(ConfigurationError, match=message):
            dualwrite.verify(sqlite_url, kafka, timeout_s=5, **kw)


def test_unreachable_sides_are_typed(sqlite_url: str, bootstrap: str, topic: str) -> None:
    make_table(sqlite_url, [])
    with pytest.raises(BrokerUnreachableError):
        dualwrite.verify(sqlite_url, {"bootstrap.servers": f"127.0.0.1:{closed_port()}"},
                         table="orders", key_column="order_id", topic=topic, timeout_s=1.5)
    with pytest.raises(DatabaseUnreachableError):
        dualwrite.verify(f"postgresql://nobody@127.0.0.1:{closed_port()}/x",
                         {"bootstrap.servers": bootstrap}, table="orders",
                         key_column="order_id", topic=topic, timeout_s=5)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed command, as an operator runs it."""
    script = Path(sys.executable).parent / "dualwrite"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "dualwrite.cli"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("DUALWRITE_DATABASE_URL", "DUALWRITE_BOOTSTRAP_SERVERS")}
    return subprocess.run([*command, "verify", *args], capture_output=True, text=True,
                          timeout=60, env=env, check=False)


def invoke(*args: str) -> Result:
    """The command in this process (a subprocess costs seconds of imports)."""
    return CliRunner().invoke(main, ["verify", *args], env={"DUALWRITE_DATABASE_URL": None,
                                                         "DUALWRITE_BOOTSTRAP_SERVERS": None})


def test_the_command_exit_codes_and_json(sqlite_url: str, bootstrap: str, topic: str) -> None:
    make_table(sqlite_url, ["o1", "o2"])
    publish(bootstrap, topic, ["o1", "o2"])
    common = ["--db", sqlite_url, "-b", bootstrap, "--table", "orders", "--key", "order_id",
              "--topic", topic, "--timeout", "10"]
    ok = cli(*common)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == OK_LINE

    publish(bootstrap, topic, ["o1", "o7", "o8"])
    found = invoke(*common, "--json", "--limit-report", "1")
    assert found.exit_code == 6, found.output
    doc = json.loads(found.stdout)
    assert doc["ok"] is False and doc["phantoms"] == ["o7"]  # the first of two
    assert doc["counts"]["phantoms"] == 2 and doc["duplicates"] == [{"key": "o1", "records": 2}]
    assert doc["summary"] == "verified: lost=0 duplicates=1 open=0 phantoms=2"

    text = invoke(*common, "--limit-report", "5")
    assert text.exit_code == 6 and "phantoms (record without row): 2: o7, o8" in text.stdout
    assert text.stdout.splitlines()[-1] == doc["summary"]

    missing = invoke(*[a if a != "orders" else "nope" for a in common])
    assert missing.exit_code == 2 and "table 'nope' does not exist" in missing.stderr
    down = invoke(*[a if a != bootstrap else f"127.0.0.1:{closed_port()}" for a in common[:-1]],
                  "1.5")
    assert down.exit_code == 4, down.output
