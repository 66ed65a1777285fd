"""The Spark sink, end to end: local Spark, real Kafka, real PostgreSQL and SQLite.

Every test runs the query of tests/support/workers/spark_worker.py as a process, kills it with
SIGKILL where the test says (the whole process group: the Python driver and its JVM), restarts it,
and then checks the invariant: the records a read_committed consumer sees are exactly the rows of
the target table, each source event exactly once, nothing of the sink left open at the coordinator,
staging empty, and the last batch completed in the decision log.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dualwrite
from dualwrite.batch.decision_log import DecisionLog
from tests.support.db import pg_ctl, private_postgres
from tests.support.fixtures.spark import new_pipeline
from tests.support.spark import (
    FILES,
    Pipeline,
    StandaloneSpark,
    batches,
)

pytest.importorskip("pyspark", reason="the Spark sink needs dualwrite[spark]")

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]


# -- the happy path and replays --------------------------------------------------------------


@pytest.mark.parametrize("backend, sql_mode", [
    ("sqlite", "auto"), ("mariadb", "auto"),
    ("postgresql", "staging"),  # write-once is PostgreSQL's default: every other test runs it
], indirect=["backend"])
def test_every_batch_is_written_once_to_kafka_and_sql(pipeline: Pipeline, sql_mode: str) -> None:
    pipeline.sql_mode = sql_mode
    result = pipeline.run()
    assert batches(result.stdout, "committed") == list(range(FILES))
    pipeline.assert_exactly_once()


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_kafka_only_mode(pipeline: Pipeline) -> None:
    pipeline.kafka_only = True
    pipeline.run()
    pipeline.assert_exactly_once()


# -- the driver killed at each step of a batch -----------------------------------------------


@pytest.mark.parametrize("backend, point", [
    *(("postgresql", point) for point in ("prepared", "decided", "committed-one")),
    pytest.param("postgresql", "completed", marks=pytest.mark.spark_full),
    # The decided batch's staged rows applied once on MariaDB too.
    pytest.param("mariadb", "decided", marks=pytest.mark.mariadb_full),
], indirect=["backend"])
def test_driver_killed_then_restarted(pipeline: Pipeline, point: str) -> None:
    """SIGKILL after the tasks prepared, after the decision, between two participant commits,
    after everything (before Spark recorded the batch); restart with 3 partitions instead of 4.

    From "decided" on, Spark replays batch 2 after the restart: the replay must be skipped.
    """
    out = pipeline.run_until_killed(point, 2)
    assert batches(out, "committed") == [0, 1]
    if point != "prepared":
        # The decision is in the database: the restart must finish batch 2, not redo it.
        engine = dualwrite.create_engine(pipeline.db_url)
        record = DecisionLog(engine).read(pipeline.sink_id)
        engine.dispose()
        assert record is not None and record.last_batch_id == 2
        assert record.completed is (point == "completed")
    pipeline.partitions = 3
    result = pipeline.run()
    if point == "prepared":
        # Undecided: the restart aborts the prepared participants and writes batch 2 again.
        assert re.search(r"RECOVERY .*completed_batch=None.*aborted=\('", result.stdout)
        assert 2 in batches(result.stdout, "committed")
    else:
        # Spark replays batch 2 (its commit log never got it); the sink must not write it twice.
        assert ("completed_batch=2" in result.stdout) is (point != "completed")
        assert batches(result.stdout, "skipped") == [2]
    pipeline.assert_exactly_once()


def test_database_restarted_while_a_decided_batch_is_prepared(
        kafka: Any, new_topic: Any, tmp_path: Path) -> None:
    """Write-once: the driver SIGKILLed after deciding batch 2, then PostgreSQL crashes and
    restarts (``pg_ctl stop -m immediate``, then start) before the query does. The batch's prepared
    transactions survive the crash; the restart commits them and skips Spark's replay."""
    # synchronous_commit on: the decision must not be lost with the crash (with it off, the
    # batch would come back undecided, its prepared transactions rolled back and rewritten).
    with private_postgres(synchronous_commit="on") as pg:
        pipeline = new_pipeline(kafka, new_topic, pg.url, tmp_path)
        pipeline.run_until_killed("decided", 2)
        assert len(pipeline.prepared_transactions()) == pipeline.partitions
        assert pg.data_dir is not None
        pg_ctl(pg, "stop", "-m", "immediate", "-w")
        pg_ctl(pg, "start", "-w", "-l", str(pg.data_dir / "postgres.log"))
        assert len(pipeline.prepared_transactions()) == pipeline.partitions
        result = pipeline.run()
        assert "completed_batch=2" in result.stdout and batches(result.stdout, "skipped") == [2]
        pipeline.assert_exactly_once()


@pytest.mark.spark_full
@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize("point", ["committed-one"])
def test_driver_killed_on_sqlite(pipeline: Pipeline, point: str) -> None:
    pipeline.run_until_killed(point, 1)
    pipeline.run()
    pipeline.assert_exactly_once()


# -- task retries, speculation, timeouts -----------------------------------------------------


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_tasks_failing_or_killed_after_prepare_are_retried_and_their_transactions_ended(
        pipeline: Pipeline) -> None:
    """Attempt 0 of partition 1 prepares its transactions (Kafka, and the database's in
    write-once mode) and its Python worker is SIGKILLed; attempt 0 of partition 2 prepares and
    raises. The retries win; what the dead attempts prepared is rolled back and aborted."""
    result = pipeline.run(faults="kill:1:0:1;fail:2:0:3")
    assert "injected failure" in result.stderr
    assert re.search(r"sink=\S+ aborted lingering transactional_id=\S+-p1-a0", result.stderr)
    # Write-once: attempt 0's prepared rows hold the retry's COPY on the primary key until the
    # retry rolls them back (else it fails at its lock timeout, four times, and the query too);
    # the driver's sweep finds nothing of them left.
    assert "rolled back lingering prepared database transaction" not in result.stderr
    pipeline.assert_exactly_once()


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_heuristic_abort_after_broker_timeout_names_the_batch(pipeline: Pipeline,
                                                              tmp_path: Path) -> None:
    """A decided batch whose participants outlive transaction.timeout.ms: not silent."""
    pipeline.run_until_killed("decided", 1, "--txn-timeout-ms", "3000")
    time.sleep(6)  # the coordinator aborts the participants (cleanup interval 1 s)
    result = pipeline.run("--txn-timeout-ms", "3000", expect_ok=False)
    assert result.returncode != 0
    assert "BatchHeuristicAbortError" in result.stderr
    assert f"sink {pipeline.sink_id!r} batch 1" in result.stderr
    cli = subprocess.run([sys.executable, "-m", "dualwrite.cli", "recover", "--db",
                          pipeline.db_url, "-b", pipeline.bootstrap],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 3, cli.stdout + cli.stderr
    assert "batch 1" in cli.stdout + cli.stderr


@pytest.fixture(scope="module")
def standalone_spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneSpark]:
    cluster = StandaloneSpark(tmp_path_factory.mktemp("spark-standalone"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_speculative_copy_wins_and_the_straggler_is_aborted(
        pipeline: Pipeline, standalone_spark: StandaloneSpark) -> None:
    """Attempt 0 of partition 0 straggles in batch 2; the speculative attempt 1 (on the other
    worker) wins. The straggler's transaction must never commit."""
    conf = ["--conf", "spark.speculation=true", "--conf", "spark.speculation.multiplier=1.1",
            "--conf", "spark.speculation.quantile=0.1",
            "--conf", "spark.speculation.minTaskRuntime=500ms",
            "--conf", "spark.speculation.interval=100ms",
            "--conf", "spark.executor.memory=512m", "--conf", "spark.cores.max=2"]
    result = pipeline.run(*conf, "--master", standalone_spark.master_url,
                          faults="slow:0:0:2:15")
    assert batches(result.stdout, "committed") == list(range(FILES))
    decided = re.search(r"batch=2 decided participants=(\S+)", result.stderr)
    assert decided is not None
    assert f"{pipeline.sink_id}-b0-p0-a1" in decided.group(1).split(","), \
        "the speculative copy did not win"
    pipeline.assert_exactly_once()


def _executor_pids(cluster: StandaloneSpark) -> list[int]:
    """Executor JVMs of ``cluster`` (their working directory is under its work dir)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if b"CoarseGrainedExecutorBackend" in cmdline and cwd.startswith(str(cluster.work_dir)):
            pids.append(int(proc.name))
    return pids


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_lost_executors_mid_batch(pipeline: Pipeline, standalone_spark: StandaloneSpark) -> None:
    """SIGKILL every executor while batch 2's tasks run (partition 0 straggles); the cluster
    starts new executors and Spark reruns the lost tasks (and the lost shuffle output)."""
    extra = ["--master", standalone_spark.master_url, "--conf", "spark.executor.memory=512m",
             "--conf", "spark.cores.max=2"]
    marker = pipeline.checkpoint.parent / "straggler-running"
    proc = pipeline.start(f"slow:0:0:2:10:{marker}", extra)
    assert proc.stdout is not None
    stderr: list[str] = []
    drain = threading.Thread(target=lambda: stderr.extend(proc.stderr or ()), daemon=True)
    drain.start()
    killed: list[int] = []
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("BATCH 1 committed"):
                deadline = time.monotonic() + 120
                while not marker.exists() and time.monotonic() < deadline:
                    time.sleep(0.2)  # until batch 2's partition 0 runs (and sleeps 10 s)
                assert marker.exists(), "batch 2's straggler never started"
                time.sleep(1)  # the other tasks of batch 2 are under way too
                killed = _executor_pids(standalone_spark)
                for pid in killed:
                    os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    drain.join(10)
    assert killed, "no executor was running"
    assert proc.returncode == 0, "".join(stderr)[-6000:]
    output = "".join(lines)
    assert batches(output, "committed") == list(range(FILES))
    assert "Lost executor" in "".join(stderr)
    # The rerun may be a new stage attempt whose task attempt numbers restart at 0: then it
    # reuses the dead attempt's transactional id, and its initialisation fences the dead one.
    pipeline.assert_exactly_once()


# -- a first mistake ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_missing_topic_fails_the_batch_typed_without_retries(pipeline: Pipeline) -> None:
    """The batch fails on the driver with UnknownTopicError before any task runs, and the query
    stops with it: no task attempts, no batch attempts again, nothing decided or left open."""
    missing = dataclasses.replace(pipeline, topic=f"no-such-topic-{uuid.uuid4().hex[:8]}")
    result = missing.run(expect_ok=False)
    assert result.returncode != 0
    assert f"dualwrite.errors.UnknownTopicError: topic {missing.topic!r} does not exist" \
        in result.stderr, result.stderr[-4000:]
    for retried in ("Job aborted", "failed 4 times", "writing it again", "PythonException"):
        assert retried not in result.stderr, result.stderr[-4000:]
    assert missing.table_ids() == []
    engine = dualwrite.create_engine(missing.db_url)
    try:
        log = DecisionLog(engine)
        assert not log.has_tables() or log.read_all([missing.sink_id]) == []
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_task_failing_every_attempt_fails_the_batch_typed(pipeline: Pipeline,
                                                            tmp_path: Path) -> None:
    """Spark reports a failed task as its own exception (PythonException); the application
    gets BatchTasksFailedError (retriable: nothing was decided) instead, and the next run
    writes the batch once."""
    stop = tmp_path / "stop"
    stop.touch()  # --follow: write what is there, then stop
    result = pipeline.run("--master", "local[2]", "--follow", str(stop), "--max-restarts", "1",
                          faults="fail:2:0:1", expect_ok=False)
    assert result.returncode != 0
    assert "injected failure of partition 2" in result.stderr
    # The task raised RuntimeError (the injected failure): named, not hidden.
    assert re.search(r"^RESTART dualwrite\.errors\.BatchTasksFailedError retriable "
                     r"t=\S+ task=RuntimeError$", result.stdout, re.M), \
        result.stdout + result.stderr[-4000:]
    assert "FOREIGN" not in result.stdout
    pipeline.run()
    pipeline.assert_exactly_once()
