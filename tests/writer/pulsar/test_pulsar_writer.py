"""PulsarDualWriter against a real Pulsar 4.0.8 standalone and a real database.

Every check ends with the invariant: the rows in ``pulsar_orders`` are exactly the messages a
reader of the topic gets (Pulsar dispatches committed transactional messages only), each once,
and no transaction is left open at the coordinator (``coordinatorStats``). The crash tests
SIGKILL a worker process (tests/support/workers/pulsar_worker.py) at each phase of the
protocol, then run ``dualwrite recover --pulsar-url`` as an operator would.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa

from dualwrite import create_engine
from dualwrite.errors import ConfigurationError, TransactionStateError
from dualwrite.pulsar import (
    PulsarDualWriter,
    PulsarTransaction,
    partition_for_key,
    recover_pulsar,
)
from dualwrite.recovery import Outcome
from tests.support.cli import dw
from tests.support.pulsar.checks import (
    ALL_DATABASES,
    assert_invariant,
    read_topic,
    recover_cli,
    rows,
    stored_state,
    wait_until_none_open,
    worker,
)
from tests.support.pulsar.probe import TxnProbe
from tests.support.workers.pulsar_worker import ORDERS, PHASES

if TYPE_CHECKING:
    from dualwrite.dev.pulsar_cluster import LocalPulsar

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(300)


# -- the recipe ---------------------------------------------------------------------------------


@ALL_DATABASES
def test_rows_and_messages_commit_together(pulsar_broker: LocalPulsar, db: str,
                                           topic: str) -> None:
    with PulsarDualWriter(db, pulsar_broker.service_url, writer_id="w-recipe") as writer:
        for n in range(12):
            fails = n % 4 == 3
            with (pytest.raises(ValueError) if fails else contextlib.nullcontext(),
                  writer.transaction() as tx):
                tx.connection.execute(sa.insert(ORDERS).values(id=n, writer="w"))
                tx.send(topic, str(n), key=str(n))
                if fails:
                    raise ValueError("the block failed: both sides roll back")
        with writer.transaction() as tx:  # an empty block commits nothing, and fails nothing
            pass
    assert assert_invariant(pulsar_broker, db, topic) == [n for n in range(12) if n % 4 != 3]
    assert stored_state(db, "w-recipe") == ""  # cleared by close()


@ALL_DATABASES
def test_a_block_ending_the_transaction_is_refused_and_nothing_commits(
        pulsar_broker: LocalPulsar, db: str, topic: str) -> None:
    with PulsarDualWriter(db, pulsar_broker.service_url, writer_id="w-guard") as writer:
        with pytest.raises(TransactionStateError), writer.transaction() as tx:
            tx.connection.execute(sa.insert(ORDERS).values(id=1, writer="w"))
            tx.send(topic, "1", key="1")
            tx.connection.exec_driver_sql("/* hidden */ COMMIT")
        with writer.transaction() as tx:
            tx.connection.execute(sa.insert(ORDERS).values(id=2, writer="w"))
            tx.send(topic, "2", key="2")
    assert_invariant(pulsar_broker, db, topic, expected={2})


def test_the_docs_examples_run(pulsar_broker: LocalPulsar, db: str) -> None:
    """docs/pulsar.md's Python blocks (the writer's, then the pool's), as written, one after
    the other against this broker and database."""
    text = (ROOT / "docs" / "pulsar.md").read_text(encoding="utf-8")
    blocks = [part.split("```", 1)[0] for part in text.split("```python\n")[1:]]
    assert len(blocks) == 2
    status, body = pulsar_broker.admin_request(
        "PUT", "/admin/v2/persistent/public/default/orders/partitions", 3)
    assert status in (200, 204, 409), body
    for block in blocks:
        run = subprocess.run([sys.executable, "-c", block], cwd=ROOT, capture_output=True,
                             text=True, timeout=120, check=False,
                             env={**os.environ, "PYTHONPATH": str(ROOT),
                                  "DUALWRITE_DATABASE_URL": db,
                                  "DUALWRITE_PULSAR_URL": pulsar_broker.service_url})
        assert run.returncode == 0, run.stderr[-3000:]
    engine = create_engine(db)
    with engine.connect() as conn:
        assert conn.execute(sa.text(
            "SELECT order_id FROM pulsar_orders_example ORDER BY order_id")).all() \
            == [("o-1",), ("o-2",)]
    messages = read_topic(pulsar_broker.service_url, "persistent://public/default/orders")
    for order in ("o-1", "o-2"):
        assert (partition_for_key(order, 3), f'{{"order_id": "{order}"}}', order) in messages


# -- the crash matrix ---------------------------------------------------------------------------


@pytest.mark.parametrize("phase", PHASES)
def test_sigkill_at_each_phase_then_recover(pulsar_broker: LocalPulsar, db: str, topic: str,
                                            phase: str) -> None:
    """Killed at ``phase`` of its third transaction; ``dualwrite recover --pulsar-url`` finishes
    what the database decided, the coordinator's timeout aborts what it did not; a new worker
    of the same writer id goes on."""
    wid = f"w-kill-{phase}"
    decided = phase in ("database_committed", "committed")
    # An undecided transaction stays open (holding back dispatch) until its timeout: short
    # for those; a decided one must outlive the recovery below.
    timeout = "30" if decided else "4"
    run = worker(pulsar_broker, db, topic, wid, 0, 5, "--kill-at", "2", "--phase", phase,
                 "--txn-timeout", timeout)
    assert run.returncode == -9, run.stdout + run.stderr
    assert f"KILL {phase}" in run.stdout and "COMMITTED 1" in run.stdout
    # status, by the anchor: the decided, uncommitted one is in doubt; a committed one done.
    seen = dw("status", "--db", db, "--pulsar-url", pulsar_broker.service_url)
    pending = phase == "database_committed"
    assert seen.returncode == (5 if pending else 0), seen.stdout + seen.stderr
    assert re.search(rf"^{wid} +{'in-doubt' if pending else 'completed'} ", seen.stdout,
                     re.MULTILINE), seen.stdout
    result = recover_cli(pulsar_broker, db)
    assert result.returncode == 0, result.stdout + result.stderr
    outcome = {"database_committed": "committed", "committed": "already-committed"}.get(
        phase, "already-committed")  # else the row still names transaction 1, committed
    assert f"{wid}: {outcome}" in result.stdout, result.stdout
    ids = assert_invariant(pulsar_broker, db, topic, expected={0, 1, 2} if decided else {0, 1})
    if phase == "database_committed":  # once: Pulsar's own Java client reads the same
        java = TxnProbe(pulsar_broker.classpath, pulsar_broker.service_url).read(topic)
        assert sorted(int(v) for v in java[topic]) == ids
    # The writer id is usable again, by a new process.
    again = worker(pulsar_broker, db, topic, wid, 10, 2)
    assert again.returncode == 0, again.stdout + again.stderr
    assert_invariant(pulsar_broker, db, topic,
                     expected=({0, 1, 2} if decided else {0, 1}) | {10, 11})


@ALL_DATABASES
def test_the_next_transaction_of_the_writer_commits_what_the_database_decided(
        pulsar_broker: LocalPulsar, db: str, topic: str) -> None:
    run = worker(pulsar_broker, db, topic, "w-next", 0, 3, "--kill-at", "1", "--phase",
                 "database_committed")
    assert run.returncode == -9
    assert read_topic(pulsar_broker.service_url, topic, wait_s=0.5) == [
        (partition_for_key("0", 3), "0", "0")]  # 1 is open, held back
    again = worker(pulsar_broker, db, topic, "w-next", 5, 1)  # no recover: the writer does it
    assert again.returncode == 0, again.stdout + again.stderr
    assert_invariant(pulsar_broker, db, topic, expected={0, 1, 5})


def test_timeout_abort_of_a_decided_transaction_is_a_heuristic_abort(
        pulsar_broker: LocalPulsar, db: str, topic: str) -> None:
    """Pulsar's timeout aborts a transaction the database committed: never silent. Recovery
    exits 3; the writer refuses to go on; its hook re-publishes; acknowledging clears it."""
    run = worker(pulsar_broker, db, topic, "w-heur", 0, 3, "--kill-at", "1", "--phase",
                 "database_committed", "--txn-timeout", "2")
    assert run.returncode == -9
    state = stored_state(db, "w-heur")
    wait_until_none_open(pulsar_broker, within_s=30)  # the coordinator aborted it
    seen = dw("status", "--db", db, "--pulsar-url", pulsar_broker.service_url)
    assert seen.returncode == 3 and re.search(r"^w-heur +heuristic ", seen.stdout, re.MULTILINE), (
        seen.stdout + seen.stderr)
    result = recover_cli(pulsar_broker, db)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "w-heur: heuristic-abort" in result.stdout
    refused = worker(pulsar_broker, db, topic, "w-heur", 5, 1)
    assert refused.returncode == 3 and "ERROR PulsarHeuristicAbortError" in refused.stdout, (
        refused.stdout + refused.stderr)
    assert rows(db) == [0, 1]  # row 1 is committed, its message lost: what the error says
    hooked = worker(pulsar_broker, db, topic, "w-heur", 6, 1, "--acknowledge-hook")
    assert hooked.returncode == 0 and f"HOOK {state}" in hooked.stdout, hooked.stdout
    assert [int(v) for _, v, _ in read_topic(pulsar_broker.service_url, topic)] \
        and rows(db) == [0, 1, 6]
    result = recover_cli(pulsar_broker, db)
    assert result.returncode == 0, result.stdout  # the hook cleared it with transaction 6


def test_recover_acknowledges_a_heuristic_abort(pulsar_broker: LocalPulsar, db: str,
                                                topic: str) -> None:
    run = worker(pulsar_broker, db, topic, "w-ack", 0, 2, "--kill-at", "1", "--phase",
                 "database_committed", "--txn-timeout", "2")
    assert run.returncode == -9
    wait_until_none_open(pulsar_broker, within_s=30)
    engine = create_engine(db)
    report = recover_pulsar(engine, pulsar_broker.service_url, ["w-ack"],
                            acknowledge_heuristic=True)
    assert [r.outcome for r in report.results] == [Outcome.ACKNOWLEDGED]
    assert stored_state(db, "w-ack") == ""
    again = worker(pulsar_broker, db, topic, "w-ack", 5, 1)
    assert again.returncode == 0, again.stdout + again.stderr


def test_recover_beside_a_live_writer(pulsar_broker: LocalPulsar, db: str, topic: str) -> None:
    """Recovery passes while a writer runs: it commits only what the database decided, never
    ends the writer's open transaction, and the writer never fails for it."""
    live = subprocess.Popen(
        [sys.executable, "-m", "tests.support.workers.pulsar_worker", "--db", db,
         "--pulsar", pulsar_broker.service_url, "--writer", "w-live", "--topic", topic,
         "--first", "0", "--count", "150"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    outcomes: list[Outcome] = []
    stop = threading.Event()

    def passes() -> None:
        engine = create_engine(db)
        while not stop.is_set():
            report = recover_pulsar(engine, pulsar_broker.service_url, timeout_s=10)
            outcomes.extend(r.outcome for r in report.results)
            time.sleep(0.05)

    t = threading.Thread(target=passes)
    t.start()
    try:
        out, err = live.communicate(timeout=240)
    finally:
        stop.set()
        t.join()
    assert live.returncode == 0, out[-2000:] + err[-2000:]
    assert out.count("COMMITTED ") == 150
    assert outcomes and set(outcomes) <= {Outcome.COMMITTED, Outcome.ALREADY_COMMITTED,
                                          Outcome.NOTHING}, outcomes
    assert assert_invariant(pulsar_broker, db, topic) == list(range(150))
    print(f"recovery beside the writer: {len(outcomes)} ids handled: "
          f"{ {o.value: outcomes.count(o) for o in set(outcomes)} }")


def test_recover_without_a_pulsar_url_reports_pulsar_rows(pulsar_broker: LocalPulsar, db: str,
                                                          topic: str) -> None:
    """Not skipped silently: without --pulsar-url a Pulsar row is unresolved (exit 5)."""
    run = worker(pulsar_broker, db, topic, "w-nourl", 0, 2, "--kill-at", "1", "--phase",
                 "database_committed")
    assert run.returncode == -9
    result = dw("recover", "--db", db, "-b", "127.0.0.1:1", "-t", "w-nourl", timeout=120)
    assert result.returncode == 5, result.stdout + result.stderr
    assert "w-nourl: failed" in result.stdout and "--pulsar-url" in result.stdout
    assert recover_cli(pulsar_broker, db).returncode == 0
    assert_invariant(pulsar_broker, db, topic, expected={0, 1})


def test_broker_killed_and_restarted_under_load(pulsar_broker: LocalPulsar, db: str,
                                                topic: str) -> None:
    """SIGKILL the broker mid-run and start it again on the same data: the writer retries what
    was not decided and goes on; nothing committed is lost, nothing doubled, nothing left open
    (a transaction the kill left undecided is aborted by its timeout, counted from its open).
    Should one stay counted, the failure names each one's status and the broker's log lines
    that explain it (docs/broker-facts.md)."""
    live = subprocess.Popen(
        [sys.executable, "-m", "tests.support.workers.pulsar_worker", "--db", db,
         "--pulsar", pulsar_broker.service_url, "--writer", "w-restart", "--topic", topic,
         "--first", "0", "--count", "200", "--retry", "--txn-timeout", "20"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    seen_at: list[float] = []

    def read_lines() -> None:
        for line in live.stdout or ():
            lines.append(line)
            seen_at.append(time.monotonic())

    reading = threading.Thread(target=read_lines)
    reading.start()
    deadline = time.monotonic() + 120
    while sum(line.startswith("COMMITTED ") for line in lines) < 40:
        assert time.monotonic() < deadline and live.poll() is None, "".join(lines)[-3000:]
        time.sleep(0.1)
    pulsar_broker.crash()
    killed_at = time.monotonic()
    killed_after = sum(line.startswith("COMMITTED ") for line in lines)
    time.sleep(1.0)
    pulsar_broker.restart()
    restarted_at = time.monotonic()
    assert live.wait(timeout=240) == 0, "".join(lines)[-3000:]
    reading.join()
    committed = {int(line.split()[1]) for line in lines if line.startswith("COMMITTED ")}
    assert len(committed) > killed_after  # it went on after the restart
    # ... having waited through it: no transaction committed while the broker was down.
    assert not [t for t, line in zip(seen_at, lines, strict=True)
                if killed_at + 0.5 < t < restarted_at and line.startswith("COMMITTED ")]
    result = recover_cli(pulsar_broker, db)
    assert result.returncode == 0, result.stdout + result.stderr
    wait_until_none_open(pulsar_broker, within_s=60)
    ids = set(assert_invariant(pulsar_broker, db, topic))
    assert committed <= ids <= set(range(200))
    print(f"broker down {restarted_at - killed_at:.1f} s; committed {len(committed)}, "
          f"rows {len(ids)}, retried "
          f"{sum(line.startswith('RETRY ') for line in lines)}, unknown "
          f"{sum(line.startswith('UNKNOWN ') for line in lines)}")


@pytest.mark.unit
@pytest.mark.parametrize(("key", "java_hash"), [
    # (String.hashCode() & Integer.MAX_VALUE) as Java 17 printed it (the Java client's default
    # JavaStringHash), including a surrogate pair.
    ("0", 48), ("order-42", 1234255197), ("", 0), ("\u00e9", 233), ("\U0001F600", 1772899),
    ("customer-7781", 2103292520),
])
def test_partition_for_key_is_the_java_clients(key: str, java_hash: int) -> None:
    for partitions in (1, 3, 7, 16):
        assert partition_for_key(key, partitions) == java_hash % partitions


@pytest.mark.unit
def test_send_refuses_bad_input_and_sends_after_the_block() -> None:
    tx = PulsarTransaction(connection=None)  # type: ignore[arg-type]  # send() never uses it
    tx.send("orders", "a", key="k")
    tx.send("persistent://t/ns/orders", b"b", partition=2)
    assert [(m.topic, m.value, m.key, m.partition) for m in tx.messages] == [
        ("persistent://public/default/orders", b"a", "k", None),
        ("persistent://t/ns/orders", b"b", None, 2)]
    for bad in ({"value": 5}, {"value": b"x", "key": 7}, {"value": b"x", "partition": -1}):
        with pytest.raises(ConfigurationError):
            tx.send("orders", **bad)
    assert len(tx.messages) == 2  # nothing of a refused send was queued
    tx.end()
    with pytest.raises(TransactionStateError):
        tx.send("orders", b"late")
