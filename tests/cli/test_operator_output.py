"""Honest operator output (issue 23 §5, issue 17 §1): what `dualwrite status` calls in doubt and
its exit code, `dualwrite.open_transactions`, probe's verdict, force-terminate of an unknown id,
librdkafka's lines through `logging`, and no warning on a fresh broker's first transactions.

Writers run as subprocesses (tests/support/workers/status_worker.py) so that they stop the way an
application does: without ``close()``, or SIGKILLed between the database COMMIT and the Kafka
commit.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import dualwrite
from dualwrite.dev import LocalKafkaCluster
from dualwrite.participant import ControlPlane
from dualwrite.participant.coordinator_link import CoordinatorLinkWatch
from tests.support import REPO_ROOT
from tests.support.cli import dw
from tests.support.kafka import create_topic, prepare_open, unique
from tests.support.workers import STATUS_WORKER, worker_env

pytestmark = pytest.mark.timeout(180)

def _worker(db: str, bootstrap: str, topic: str, tid: str, mode: str) -> int:
    done = subprocess.run([sys.executable, str(STATUS_WORKER), db, bootstrap, topic, tid, mode],
                          capture_output=True, text=True, timeout=90, env=worker_env(),
                          check=False)
    assert "DONE" in done.stdout, (done.stdout, done.stderr)
    return done.returncode


@pytest.fixture
def db(sqlite_url: str) -> str:
    dualwrite.upgrade_database(sqlite_url)
    return sqlite_url


@pytest.fixture
def topic(kafka: Any, new_topic: Any) -> str:
    name: str = new_topic(kafka, partitions=2)
    return name


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["transactional_id"]: r for r in report["transactional_ids"]}


def test_status_after_restart_without_close_is_not_in_doubt(db: str, bootstrap: str,
                                                             topic: str) -> None:
    """Writers that stopped without close(): their state rows name committed transactions.
    ``committed`` ends in CompleteCommit (same producer id and epoch); ``aborted-last`` ends
    in CompleteAbort (its last block raised), so its stored state is confirmed at its anchor."""
    committed, aborted_last = unique("st-unclosed"), unique("st-abortlast")
    _worker(db, bootstrap, topic, committed, "unclosed")
    _worker(db, bootstrap, topic, aborted_last, "abort-last")
    result = dw("status", "--db", db, "-b", bootstrap, "--prefix", "st-", "--json")
    assert result.returncode == 0, (result.stdout, result.stderr)
    report = json.loads(result.stdout)
    rows = _rows(report)
    for tid in (committed, aborted_last):
        assert rows[tid]["state"], "the writer left its state row (no close())"
        assert rows[tid]["in_doubt"] is False, rows[tid]
        assert rows[tid]["condition"] == "completed", rows[tid]
    assert rows[committed]["broker"]["state"] == "CompleteCommit"
    assert rows[aborted_last]["broker"]["state"] == "CompleteAbort"
    assert report["ok"] is True and report["in_doubt"] == 0
    text = dw("status", "--db", db, "-b", bootstrap, "--prefix", "st-")
    assert text.returncode == 0, text.stderr
    assert "in doubt: 0 (completed=2)" in text.stdout
    assert "stopped without close()" in text.stdout


def test_status_in_doubt_after_kill_between_database_and_kafka_commit(
        db: str, bootstrap: str, topic: str) -> None:
    tid = unique("st-killed")
    assert _worker(db, bootstrap, topic, tid, "kill-after-db-commit") == -9
    result = dw("status", "--db", db, "-b", bootstrap, "--prefix", "st-", "--json")
    assert result.returncode == 5, (result.stdout, result.stderr)
    report = json.loads(result.stdout)
    row = _rows(report)[tid]
    assert row["condition"] == "in-doubt" and row["in_doubt"] is True
    assert row["broker"]["state"] == "Ongoing"
    assert "commit is pending" in row["detail"]
    assert report["ok"] is False and report["in_doubt"] == 1
    text = dw("status", "--db", db, "-b", bootstrap, "--prefix", "st-")
    assert text.returncode == 5
    assert "in doubt: 1" in text.stdout and tid in text.stdout
    # The Python API says the same.
    status = dualwrite.status(db, {"bootstrap.servers": bootstrap}, prefix="st-")
    assert [r.transactional_id for r in status.in_doubt] == [tid] and not status.ok
    recovered = dw("recover", "--db", db, "-b", bootstrap, "-t", tid)
    assert recovered.returncode == 0 and "committed" in recovered.stdout, recovered.stdout
    after = dw("status", "--db", db, "-b", bootstrap, "--prefix", "st-", "--json")
    assert after.returncode == 0, after.stdout
    assert _rows(json.loads(after.stdout))[tid]["condition"] == "clear"


def test_status_left_to_live_writer(db: str, bootstrap: str, topic: str) -> None:
    """A writer that is still running holds its lease: not in doubt, whatever its row says."""
    tid = unique("st-live")
    writer = dualwrite.DualWriter(db, {"bootstrap.servers": bootstrap}, transactional_id=tid)
    try:
        with writer.transaction() as tx:
            tx.produce(topic, b"live")
        result = dw("status", "--db", db, "-b", bootstrap, "--prefix", "st-", "--json")
        assert result.returncode == 0, (result.stdout, result.stderr)
        assert _rows(json.loads(result.stdout))[tid]["condition"] == "left-to-live-writer"
    finally:
        writer.close()


def test_open_transactions_lists_a_topics_open_transactions(bootstrap: str, kafka: Any,
                                                            new_topic: Any) -> None:
    topic, other = new_topic(kafka, partitions=2), new_topic(kafka, partitions=1)
    prefix = unique("ot")
    tid, elsewhere = f"{prefix}-a", f"{prefix}-b"
    prepare_open(bootstrap, topic, tid, ["x", "y"])
    prepare_open(bootstrap, other, elsewhere, ["z"])
    config = {"bootstrap.servers": bootstrap}
    try:
        found = dualwrite.open_transactions(config, [topic])
        [txn] = [t for t in found if t.transactional_id.startswith(prefix)]
        assert txn.transactional_id == tid and txn.state == "Ongoing"
        assert txn.partitions and {t for t, _ in txn.partitions} == {topic}
        assert txn.producer_id >= 0 and txn.epoch >= 0
        assert txn.open_for_ms is not None and txn.open_for_ms >= 0 and txn.timeout_ms > 0
        by_prefix = dualwrite.open_transactions(config, transactional_id_prefix=prefix)
        assert [t.transactional_id for t in by_prefix] == [tid, elsewhere]
        with pytest.raises(AttributeError):
            txn.state = "x"  # type: ignore[misc]  # frozen
    finally:
        with ControlPlane(config, timeout_s=10) as cp:
            cp.fence(tid)
            cp.fence(elsewhere)
    assert dualwrite.open_transactions(config, transactional_id_prefix=prefix) == []


def test_probe_ends_with_a_verdict(bootstrap: str) -> None:
    text = dw("probe", "-b", bootstrap, "--no-2pc-check")
    assert text.returncode == 0, text.stderr
    last = text.stdout.strip().splitlines()[-1]
    assert last.startswith("dualwrite: supported — epoch-resume mode (transaction.version="), last
    as_json = json.loads(dw("probe", "-b", bootstrap, "--no-2pc-check", "--json").stdout)
    assert as_json["verdict"] == last and as_json["supported"] is True
    assert as_json["missing"] == []


def test_force_terminate_refuses_an_id_the_coordinator_does_not_know(bootstrap: str) -> None:
    tid = unique("ft-typo")
    refused = dw("force-terminate", "-b", bootstrap, "-t", tid, "--yes")
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert "does not know transactional id" in refused.stderr and "--force" in refused.stderr
    with ControlPlane({"bootstrap.servers": bootstrap}, timeout_s=10) as cp:
        assert cp.describe_transaction(tid) is None  # nothing was created
        forced = dw("force-terminate", "-b", bootstrap, "-t", tid, "--yes", "--force")
        assert forced.returncode == 0, forced.stderr
        assert "unknown to the coordinator" in forced.stdout
        assert cp.describe_transaction(tid) is not None


def test_librdkafka_lines_go_through_logging(db: str, bootstrap: str, topic: str,
                                             tmp_path: Path) -> None:
    """A producer-only setting in the properties file makes the anchor check's consumers log
    CONFWARN: through ``logging`` at -v, nowhere by default (it was raw stderr before)."""
    quiet_id, loud_id = unique("st-quiet"), unique("st-loud")
    for tid in (quiet_id, loud_id):  # recover checks their stored state at its anchor
        _worker(db, bootstrap, topic, tid, "abort-last")
    props = tmp_path / "kafka.properties"
    props.write_text(f"bootstrap.servers={bootstrap}\nbatch.size=16384\n")
    quiet = dw("recover", "--db", db, "--kafka-properties", str(props), "-t", quiet_id)
    assert quiet.returncode == 0, (quiet.stdout, quiet.stderr)
    assert "already-committed" in quiet.stdout
    assert "CONFWARN" not in quiet.stderr and "batch.size" not in quiet.stderr, quiet.stderr
    loud = dw("-v", "recover", "--db", db, "--kafka-properties", str(props), "-t", loud_id)
    assert loud.returncode == 0, loud.stderr
    lines = [line for line in loud.stderr.splitlines() if "CONFWARN" in line]
    assert lines and all(" dualwrite.librdkafka: " in line for line in lines), loud.stderr


def test_a_library_user_sees_no_librdkafka_line_by_default(bootstrap: str, topic: str,
                                                           tmp_path: Path) -> None:
    """An application without logging configuration: nothing of librdkafka on stderr."""
    script = tmp_path / "app.py"
    script.write_text(
        "import dualwrite as dw\n"
        f"w = dw.DualWriter('sqlite:///{tmp_path}/app.db', {{'bootstrap.servers': "
        f"'{bootstrap}', 'session.timeout.ms': 10000}}, transactional_id='{unique('lib')}')\n"
        f"dw.upgrade_database('sqlite:///{tmp_path}/app.db')\n"
        "with w.transaction() as tx:\n"
        f"    tx.produce('{topic}', b'v')\n"
        "w.close()\nprint('DONE')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, env=worker_env(), check=False)
    assert "DONE" in done.stdout, done.stderr
    assert "CONFWARN" not in done.stderr and "session.timeout.ms" not in done.stderr, done.stderr


def test_a_timeout_of_a_request_never_sent_is_no_coordinator_trouble() -> None:
    """librdkafka's lines when an EndTxn timed out in the out-queue (never sent, retried): no
    copy can arrive late, so no new session (it warned of KAFKA-17754 before)."""
    forwarded: list[str] = []

    class Sink:
        def log(self, level: int, msg: str, *args: Any) -> None:
            forwarded.append(msg % args)

    config: dict[str, Any] = {"logger": Sink()}
    watch = CoordinatorLinkWatch(config)
    name = "rdkafka#producer-9"

    def line(facility: str, text: str) -> None:
        config["logger"].log(logging.WARNING, "%s [%s] %s", facility, name, text)

    line("REQTMOUT", "[thrd:TxnCoordinator]: TxnCoordinator/1: Timed out 0 in-flight, "
         "0 retry-queued, 1 out-queue, 0 partially-sent requests")
    line("FAIL", "[thrd:TxnCoordinator]: TxnCoordinator/1: 127.0.0.1:35785: 1 request(s) timed "
         "out: disconnect (average rtt 4.050ms) (after 999ms in state UP)")
    assert watch.troubles == 0
    assert len(forwarded) == 2  # still passed on
    line("REQTMOUT", "[thrd:TxnCoordinator]: TxnCoordinator/1: Timed out 1 in-flight, "
         "0 retry-queued, 0 out-queue, 0 partially-sent requests")
    line("FAIL", "[thrd:TxnCoordinator]: TxnCoordinator/1: 127.0.0.1:35785: 1 request(s) timed "
         "out: disconnect (average rtt 4.050ms) (after 999ms in state UP)")
    assert watch.troubles == 2  # a sent EndTxn timed out: a copy may arrive late
    line("FAIL", "[thrd:TxnCoordinator]: TxnCoordinator/1: 127.0.0.1:35785: Disconnected "
         "(after 5000ms in state UP)")
    assert watch.troubles == 3


def test_first_transactions_on_a_fresh_broker_log_no_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A fresh cluster: the first InitProducerId meets COORDINATOR_LOAD_IN_PROGRESS (librdkafka
    retries: GETPID), first EndTxns may wait behind the coordinator connection. None of it is
    the application's business: no WARNING from dualwrite's loggers."""
    caplog.set_level(logging.INFO)
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    dualwrite.upgrade_database(url)
    with LocalKafkaCluster(brokers=1) as cluster:
        topic = create_topic(cluster.bootstrap_servers, "fresh", 3)
        config = {"bootstrap.servers": cluster.bootstrap_servers}
        errors: list[BaseException] = []

        def write(n: int) -> None:
            try:
                with dualwrite.DualWriter(url, config, transactional_id=f"fresh-{n}") as w:
                    for i in range(3):
                        with w.transaction() as tx:
                            tx.produce(topic, f"{n}-{i}".encode())
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        # dualwrite's loggers (librdkafka's lines included); kafka-python's own selector may
        # warn of a slow task on a loaded machine, which is not this test's subject.
        warnings = [f"{r.name}: {r.getMessage()}" for r in caplog.records
                    if r.levelno >= logging.WARNING and r.name.startswith("dualwrite")]
        assert warnings == []
        assert sum("committed transactional_id=fresh-" in r.getMessage()
                   for r in caplog.records) == 12


def test_sqlite_lock_files_are_ignored_by_git(tmp_path: Path) -> None:
    """The lease and decision-lock files dualwrite creates beside an SQLite database file."""
    from dualwrite.batch.decision_log import DecisionLog
    from dualwrite.writer.lease import Leases

    repo = REPO_ROOT
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    db = tmp_path / "app.db"
    engine = dualwrite.create_engine(f"sqlite:///{db}")
    dualwrite.upgrade_database(engine)
    try:
        with DecisionLog(engine).locked("sink-a"):  # the batch sinks' decision lock
            pass
        with engine.connect() as conn:
            lease = Leases(engine).try_acquire(conn, "writer-a")
            assert lease is not None
            lease.release()
    finally:
        engine.dispose()
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.lock"))
    assert len(made) == 2, made
    for rel in made:  # the same names inside the repository must be ignored
        ignored = subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", str(rel)],
                                 check=False)
        assert ignored.returncode == 0, f"{rel} is not ignored by .gitignore"
