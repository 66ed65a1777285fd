"""The crash matrix's harness: ``CrashLoop`` drives one transactional id through rounds of
a worker SIGKILLed at a crash point, ``dualwrite recover`` and the invariant check.

Used by tests/faults/test_crash_matrix.py (which documents the method), the PgBouncer tier, the
alternative broker's and the compatibility tier's crash rounds.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue
from typing import IO, Any

import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError
from confluent_kafka import TopicPartition as CKTopicPartition

from dualwrite import create_engine
from dualwrite.participant import ControlPlane, TxnState
from tests.support.workers import CRASH_WORKER, worker_env
from tests.support.workers.crash_worker import row_ids

ROWS = 3
# One prefix per pytest session, so hanging transactions of earlier runs on a reused broker
# do not fail this one (and ours are all found).
TID_PREFIX = f"crash-{uuid.uuid4().hex[:8]}-"

# What `dualwrite recover` must report for the killed transactional id, per crash point.
# Recover did not visit the id: never expected, the writer registers it before any transaction.
NOT_LISTED = "(not listed)"
EXPECTED_OUTCOMES = {
    # librdkafka's begin is local: Kafka has nothing open.
    "after-begin": {"already-committed", "nothing-to-do"},
    # A record is in the log, the state-row lock was never taken.
    "before-lock": {"aborted"},
    "mid-produce": {"aborted"},
    "after-flush": {"aborted"},
    "after-prepare": {"aborted"},
    "after-state-row": {"aborted"},
    "after-db-commit": {"committed"},
    "during-kafka-commit": {"committed", "already-committed"},
    "after-kafka-commit": {"already-committed"},
}
# Whether the killed transaction's rows and records must exist in the end.
DB_COMMITTED = {"after-db-commit", "during-kafka-commit", "after-kafka-commit"}


def _pump(stream: IO[str], queue: Queue[str]) -> None:
    """Copy ``stream``'s lines into ``queue``, then an empty string at its end."""
    for line in stream:
        queue.put(line)
    queue.put("")


@dataclass
class CrashLoop:
    """One transactional id, topic and database, driven through crash rounds."""

    db_url: str
    bootstrap: str
    topic: str
    workdir: Path
    tid: str = field(default_factory=lambda: f"{TID_PREFIX}{uuid.uuid4().hex[:10]}")
    next_txn: int = 1
    history: list[str] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    recover_program: str = "from dualwrite.cli import main; main()"
    expect_present: set[int] = field(default_factory=set)
    expect_absent: set[int] = field(default_factory=set)

    # -- processes -----------------------------------------------------------------------------

    def run_worker(self, count: int, crash_point: str | None = None,
                   timeout_s: float = 90.0) -> None:
        """Run ``count`` transactions; with ``crash_point`` SIGKILL the worker in the last one."""
        started = time.monotonic()
        first = self.next_txn
        self.next_txn += count
        stderr_path = self.workdir / f"worker-{first}.err"
        cmd = [sys.executable, str(CRASH_WORKER), "--db", self.db_url,
               "--bootstrap", self.bootstrap, "--topic", self.topic, "--tid", self.tid,
               "--first-txn", str(first), "--count", str(count), "--rows", str(ROWS)]
        if crash_point:
            cmd += ["--crash-point", crash_point]
        with open(stderr_path, "w") as stderr:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                    env=worker_env())
        assert proc.stdout is not None
        # A thread reads the lines: select() on a buffered pipe misses lines already buffered.
        queue: Queue[str] = Queue()
        reader = threading.Thread(target=_pump, args=(proc.stdout, queue), daemon=True)
        reader.start()
        lines: list[str] = []
        deadline = time.monotonic() + timeout_s
        killed = False
        try:
            while time.monotonic() < deadline:
                try:
                    line = queue.get(timeout=0.5)
                except Empty:
                    continue
                if not line:
                    break  # end of output: the worker exited
                lines.append(line.strip())
                if line.startswith("AT "):
                    if crash_point == "during-kafka-commit":
                        # Spread the kill over the commit's round trips, not only its start.
                        time.sleep(random.choice((0, 0, 0.003, 0.006, 0.01, 0.02)))
                    os.kill(proc.pid, signal.SIGKILL)
                    killed = True
                    assert line.split()[1] == crash_point, lines
                    break
        finally:
            if proc.poll() is None and not killed:
                os.kill(proc.pid, signal.SIGKILL)
            code = proc.wait(30)
            reader.join(10)
            proc.stdout.close()
        what = f"worker txns {first}..{first + count - 1} crash={crash_point}"
        self.history.append(f"{what}: {lines} ({time.monotonic() - started:.1f} s)")
        detail = f"{what}: stdout={lines} exit={code}\n{stderr_path.read_text()[-3000:]}"
        if crash_point:
            assert killed, f"the worker never reached {crash_point}: {detail}"
            assert code == -signal.SIGKILL, detail
            last = first + count - 1
            (self.expect_present if crash_point in DB_COMMITTED else self.expect_absent).add(last)
            self.expect_present.update(range(first, last))
        else:
            assert code == 0, f"the worker failed: {detail}"
            self.expect_present.update(range(first, first + count))

    def recover(self) -> dict[str, Any]:
        """``dualwrite recover --json`` as a subprocess; asserts exit 0 and returns the report."""
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-c", self.recover_program, "recover", "--db", self.db_url,
             "-b", self.bootstrap, "--json"],
            capture_output=True, text=True, timeout=120, env=worker_env())
        self.history.append(f"recover exit={proc.returncode} ({time.monotonic() - started:.1f} s)"
                            f": {' '.join(proc.stdout.split())}")
        assert proc.returncode == 0, (f"recover exited {proc.returncode}\nstdout: {proc.stdout}\n"
                                      f"stderr: {proc.stderr[-3000:]}\n{self.describe()}")
        report: dict[str, Any] = json.loads(proc.stdout)
        assert report["ok"], report
        return report

    def crash_round(self, point: str, k: int) -> None:
        """Commit ``k - 1`` transactions, die in the k-th at ``point``, recover and check it."""
        self.run_worker(k, point)
        report = self.recover()
        outcomes = [r["outcome"] for r in report["results"] if r["transactional_id"] == self.tid]
        assert len(outcomes) <= 1, report
        outcome = outcomes[0] if outcomes else NOT_LISTED
        self.outcomes[f"{point}: {outcome}"] += 1
        assert outcome in EXPECTED_OUTCOMES[point], (
            f"after a kill at {point} recover reported {outcome!r}, expected one of "
            f"{sorted(EXPECTED_OUTCOMES[point])}\n{self.describe()}")

    def describe(self) -> str:
        recent = "\n  ".join(self.history[-12:])
        return f"transactional id {self.tid}, topic {self.topic}, last steps:\n  {recent}"

    # -- the invariant -------------------------------------------------------------------------

    def check_invariant(self) -> None:
        """Kafka (read_committed, read to the end) holds exactly the DB's ids, once each."""
        assert_nothing_open(self.bootstrap, self.tid)
        kafka_keys = read_committed_keys(self.bootstrap, self.topic)
        db_rows = read_events(self.db_url)
        counts = Counter(kafka_keys)
        duplicated = sorted(k for k, n in counts.items() if n > 1)
        missing = sorted(set(db_rows) - set(counts))
        extra = sorted(set(counts) - set(db_rows))
        wrong_txn = sorted(
            txn for txn in set(db_rows.values())
            if {i for i, t in db_rows.items() if t == txn} != set(row_ids(txn, ROWS)))
        lost = sorted(t for t in self.expect_present if row_ids(t, ROWS)[0] not in db_rows)
        resurrected = sorted(t for t in self.expect_absent if row_ids(t, ROWS)[0] in db_rows)
        problems = {
            "in the DB but not visible in Kafka": missing,
            "visible in Kafka but not in the DB": extra,
            "duplicated in Kafka": duplicated,
            "transactions with partial rows": wrong_txn,
            "committed transactions missing from the DB": lost,
            "killed-before-commit transactions present in the DB": resurrected,
        }
        problems = {k: v for k, v in problems.items() if v}
        assert not problems, (
            f"INVARIANT BROKEN ({len(db_rows)} DB rows, {len(kafka_keys)} Kafka records): "
            f"{json.dumps(problems, indent=1)}\n{self.describe()}")


def assert_nothing_open(bootstrap: str, tid: str) -> None:
    """Neither ``tid`` nor any other id of this session has an in-flight transaction."""
    with ControlPlane({"bootstrap.servers": bootstrap}, timeout_s=15) as cp:
        desc = cp.describe_transaction(tid)
        assert desc is not None, f"the coordinator does not know {tid}"
        assert not desc.state.in_flight, f"{tid} is left {desc.state.value}: {desc}"
        open_states = [TxnState.ONGOING, TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT]
        listed = cp.list_transactions(states=open_states, prefix=TID_PREFIX)
        assert not listed, f"transactions left open: {listed}"


def read_committed_keys(bootstrap: str, topic: str, timeout_s: float = 30.0) -> list[str]:
    """Every key a read_committed consumer sees, reading each partition up to its high watermark.

    Waits until the last stable offset equals the high watermark (no open transaction pins a
    partition; markers are written asynchronously after a commit), then reads until the position
    of every partition has reached it.
    """
    base = {"bootstrap.servers": bootstrap, "group.id": f"crash-check-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False, "enable.partition.eof": True,
            "auto.offset.reset": "earliest"}
    uncommitted = Consumer({**base, "isolation.level": "read_uncommitted"})
    consumer = Consumer({**base, "isolation.level": "read_committed"})
    try:
        parts = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        deadline = time.monotonic() + timeout_s
        while True:
            high = {p: uncommitted.get_watermark_offsets(CKTopicPartition(topic, p),
                                                         timeout=10)[1] for p in parts}
            stable = {p: consumer.get_watermark_offsets(CKTopicPartition(topic, p),
                                                        timeout=10)[1] for p in parts}
            if stable == high:
                break
            assert time.monotonic() < deadline, (
                f"last stable offsets {stable} stay below the high watermarks {high}: "
                "a transaction is left open")
            time.sleep(0.2)
        consumer.assign([CKTopicPartition(topic, p, 0) for p in parts])
        keys: list[str] = []
        pending = {p for p in parts if high[p] > 0}
        while pending:
            assert time.monotonic() < deadline, (
                f"read_committed of {topic} did not reach the high watermarks {high}: "
                f"partitions {sorted(pending)} stopped short")
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None:
                keys.append((msg.key() or b"").decode())
            elif msg is not None:
                error = msg.error()
                if error is not None and error.code() != KafkaError._PARTITION_EOF:
                    raise AssertionError(f"reading {topic}: {error}")
            positions = consumer.position([CKTopicPartition(topic, p) for p in sorted(pending)])
            pending -= {tp.partition for tp in positions if tp.offset >= high[tp.partition]}
        return keys
    finally:
        consumer.close()
        uncommitted.close()


def read_events(db_url: str) -> dict[str, int]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return {r.id: r.txn for r in conn.execute(sa.text("SELECT id, txn FROM events"))}
    finally:
        engine.dispose()
