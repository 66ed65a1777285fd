"""What the tests of the Pulsar participant check: the invariant (rows == messages read,
each once, nothing open at the coordinator) and the reads and CLI runs behind it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa

from dualwrite import create_engine
from dualwrite.participant.pulsar import MessageId, PulsarTimeoutError
from dualwrite.pulsar import PulsarTxnClient, partition_for_key
from dualwrite.writer import StateStore
from tests.support.cli import dw
from tests.support.workers.pulsar_worker import ORDERS

if TYPE_CHECKING:
    from dualwrite.dev.pulsar_cluster import LocalPulsar

ROOT = Path(__file__).resolve().parents[3]

ALL_DATABASES = pytest.mark.parametrize("db", ["postgresql", "mariadb", "sqlite"],
                                        indirect=True)


def read_topic(url: str, topic: str, wait_s: float = 1.5,
               token: str | None = None) -> list[tuple[int, str, str | None]]:
    """(partition, value, key) of every message dispatched to a read-committed reader."""
    out = []
    with PulsarTxnClient(url, timeout_s=20, token=token) as client:
        for index, partition in enumerate(client.partitions(topic)):
            deadline = time.monotonic() + wait_s
            with client.reader(partition, MessageId(0, 0)) as reader:
                try:
                    while True:
                        for m in reader.receive(deadline).messages():
                            out.append((index, m.payload.decode(), m.key))
                except PulsarTimeoutError:
                    pass
    return out


def stored_state(db: str, writer_id: str) -> str:
    row = StateStore(create_engine(db)).read(writer_id)
    assert row is not None
    return row.prepared_txn_state


def rows(db: str) -> list[int]:
    engine = create_engine(db)
    try:
        with engine.connect() as conn:
            return sorted(r[0] for r in conn.execute(sa.select(ORDERS.c.id)))
    finally:
        engine.dispose()


def open_transactions(broker: LocalPulsar) -> int:
    status, stats = broker.admin_request("GET", "/admin/v3/transactions/coordinatorStats")
    assert status == 200, stats
    return sum(int(tc["ongoingTxnSize"]) for tc in stats.values())


# Broker log lines that tell why a transaction stays counted (docs/broker-facts.md): the
# coordinator gave up ending it, or a finished one stayed in its map after a failed delete.
_WHY_STILL_OPEN = ("End transaction fail", "Failed to delete", "non-faulty bookies",
                   "Transaction Buffer")


def still_open(broker: LocalPulsar) -> str:
    """What the coordinator counts as ongoing, with each transaction's status, and the broker
    log's lines that explain a stuck one: for an assertion's message."""
    try:
        status, slow = broker.admin_request(
            "GET", "/admin/v3/transactions/slowTransactions/0?coordinatorId=0", timeout=10)
    except OSError as exc:
        status, slow = 0, f"{type(exc).__name__}: {exc}"
    lines = [line.strip()[:300] for line in
             broker.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
             if any(w in line for w in _WHY_STILL_OPEN)]
    found = ({txn: (m.get("status"), m.get("openTimestamp"), m.get("timeoutAt"))
              for txn, m in slow.items()} if status == 200 and isinstance(slow, dict)
             else (status, slow))
    return f"still counted: {found}; broker log: {lines[-12:]}"


def wait_until_none_open(broker: LocalPulsar, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while open_transactions(broker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert open_transactions(broker) == 0, still_open(broker)


def assert_invariant(broker: LocalPulsar, db: str, topic: str,
                     expected: set[int] | None = None, token: str | None = None) -> list[int]:
    """Rows == messages read, each once, keyed like Pulsar's Java client routes them, and
    nothing open at the coordinator. Returns the ids."""
    wait_until_none_open(broker, within_s=30)
    messages = read_topic(broker.service_url, topic, token=token)
    ids = [int(v) for _, v, _ in messages]
    assert len(ids) == len(set(ids)), f"duplicated messages: {sorted(ids)}"
    assert sorted(ids) == rows(db)
    for partition, value, key in messages:
        assert key == value and partition == partition_for_key(value, 3)
    if expected is not None:
        assert set(ids) == expected
    return sorted(ids)


def worker(broker: LocalPulsar, db: str, topic: str, writer: str, first: int, count: int,
           *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.support.workers.pulsar_worker", "--db", db,
         "--pulsar", broker.service_url, "--writer", writer, "--topic", topic,
         "--first", str(first), "--count", str(count), *extra],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120, check=False)


def recover_cli(broker: LocalPulsar, db: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return dw("recover", "--db", db, "--pulsar-url", broker.service_url, *extra)
