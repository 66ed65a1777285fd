"""Issue 10, the Spark side of the fault suite: the sink's streaming query under broker faults.

A cluster of three broker+controller nodes of this module's own (topic RF 3, min ISR 2; transaction
log RF 3, min ISR 2) and a private PostgreSQL server.
``tests/support/workers/spark_worker.py --follow`` runs the query (``local[2,4]``,
:class:`~dualwrite.spark.ExactlyOnceSink` to Kafka and a table) while the test feeds its source
directory one file (one micro-batch) at a time, and
:class:`tests.support.fault_runner.FaultRunner` injects, at random moments from a seed: SIGKILL of
the transaction coordinator of a participant's transactional id and of a partition leader (each
started again), a SIGSTOP/SIGCONT pause of a broker longer than the clients' request timeout, a
clean rolling restart of the three brokers, and an immediate restart of PostgreSQL (the decision
log). Batches are in every phase when a fault lands:
tasks producing and preparing, the driver verifying, deciding, committing. Besides, the driver
raises a typed error once (``DUALWRITE_SPARK_FAULTS``: after a batch's tasks prepared).

A query that fails with a dualwrite error is started again by the worker (same sink, same
checkpoint), as an application would; any other exception reaching the driver fails the test.
After the run: ``dualwrite.recover``, then the invariant (read_committed event ids == every event
fed, no duplicate, == the target table's rows, staging empty, nothing of the sink's id pool open,
the last batch completed). The metrics are printed; ``DUALWRITE_FAULT_SEED`` replays a schedule.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import dualwrite
from dualwrite.batch.naming import transactional_id
from dualwrite.dev import LocalKafkaCluster, LocalPostgres
from tests.support.db import pg_ctl
from tests.support.fault_runner import FaultRunner, heal_brokers
from tests.support.settings import KAFKA_VERSION
from tests.support.spark import Pipeline, write_source_file

pytest.importorskip("pyspark", reason="the Spark sink needs dualwrite[spark]")

pytestmark = [pytest.mark.spark]

SCHEDULE = ("coordinator-kill", "leader-kill", "broker-pause", "rolling-restart",
            "database-restart")
PARTITIONS = 4
EVENTS_PER_FILE = 50
BACKLOG = 2
"""Files fed ahead of the query: it never idles, and little is left to write after the faults."""
REQUEST_TIMEOUT_MS = 5000
ALLOWED_FAMILIES = {"retriable", "recoverable"}
"""What a restart may follow: "write it again" and "decided; the next start completes it"."""
STARTUP: dict[str, float] = {}
"""Seconds the module's servers took to start."""
RIDDEN = {"tasks failed (Spark ran them again)": r"ERROR Executor: Exception in task",
          "batch attempts not decided (the sink wrote the batch again)": r"attempt \d+ not decided",
          "commits of a decided batch retried": r"decided; completing it failed"}
"""What the query rode through without failing, counted in the worker's log."""


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[LocalKafkaCluster, LocalPostgres]]:
    """Three Kafka nodes and a PostgreSQL server of this module's own, started side by side:
    its faults must not disturb the shared servers."""
    began = time.monotonic()
    pg = LocalPostgres(backend="binaries", settings={"synchronous_commit": "on"})
    starter = ThreadPoolExecutor(1)
    pg_started = starter.submit(pg.start)
    starter.shutdown(wait=False)
    try:
        with LocalKafkaCluster(brokers=3, kafka_version=KAFKA_VERSION, backend="jars",
                               heap="512m", startup_timeout=300) as cluster:
            pg_started.result()
            STARTUP["kafka and postgres"] = time.monotonic() - began
            yield cluster, pg
            for node in cluster.nodes:  # its data is thrown away: no controlled shutdown
                cluster.kill_broker(node.index)
    finally:
        with contextlib.suppress(Exception):
            pg_started.result()
        with contextlib.suppress(Exception):  # the server pg_ctl started again, if it runs
            pg_ctl(pg, "stop", "-m", "fast", "-w")
        pg.stop()


@dataclass
class Query:
    """The worker process: its output lines (with arrival times) drained by threads."""

    proc: subprocess.Popen[str]
    log: Path
    lines: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.lock:
                self.lines.append((time.time(), line.rstrip("\n")))

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        with self.log.open("w", encoding="utf-8") as out:
            for line in self.proc.stderr:
                out.write(line)
                out.flush()

    def matching(self, pattern: str) -> list[tuple[float, re.Match[str]]]:
        with self.lock:
            lines = list(self.lines)
        return [(t, m) for t, line in lines if (m := re.match(pattern, line))]

    def batches_done(self) -> int:
        """Batches committed or skipped as replays (each one consumed a source file)."""
        return len({m.group(1) for _, m in self.matching(r"BATCH (\d+) (committed|skipped)")})

    def sink_started(self) -> bool:
        """Whether the query called the sink (which logs its start to stderr)."""
        return self.log.exists() and " starting on " in self.log.read_text(errors="replace")

    def committed_after(self, since: float) -> bool:
        return any(t > since for t, _ in self.matching(r"BATCH \d+ committed"))

    def stderr_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")[-chars:]


class Feeder(threading.Thread):
    """Writes the next source file whenever fewer than ``BACKLOG`` wait for the query."""

    def __init__(self, source: Path, query: Query) -> None:
        super().__init__(daemon=True)
        self.source = source
        self.query = query
        self.files = 0
        self.stopping = threading.Event()

    def feed(self) -> None:
        write_source_file(self.source, self.files, EVENTS_PER_FILE)
        self.files += 1

    def run(self) -> None:
        while not self.stopping.wait(0.2):
            if self.files - self.query.batches_done() < BACKLOG:
                self.feed()

    def stop(self) -> int:
        self.stopping.set()
        if self.is_alive():
            self.join(10)
        return self.files


def _seed() -> int:
    return int(os.environ.get("DUALWRITE_FAULT_SEED") or random.randrange(1 << 30))


def _wait(condition: Callable[[], bool], timeout: float, what: str, query: Query) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if query.proc.poll() is not None:
            raise AssertionError(f"the worker exited ({query.proc.returncode}) while waiting "
                                 f"for {what}:\n{query.stderr_tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f} s:\n{query.stderr_tail()}")
        time.sleep(0.2)


@pytest.mark.faults_full
@pytest.mark.timeout(420)
def test_spark_sink_under_broker_faults(
        servers: tuple[LocalKafkaCluster, LocalPostgres], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    cluster, pg = servers
    began = time.time()
    seed = _seed()
    rng = random.Random(seed)
    schedule = list(SCHEDULE)
    rng.shuffle(schedule)
    # Besides the broker faults, the driver fails once with a typed error after the tasks of
    # this batch prepared: the worker's restart of the query (and the sink's recovery) run.
    failing_batch = rng.randint(1, 3)
    with capsys.disabled():
        print(f"\nspark fault suite seed {seed}: {schedule}, driver error at batch "
              f"{failing_batch}")

    run = f"spark-{uuid.uuid4().hex[:8]}"
    topic = cluster.create_topic(f"{run}-topic", partitions=PARTITIONS)
    engine = dualwrite.create_engine(pg.url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE events (event_id BIGINT PRIMARY KEY, payload TEXT)")
    engine.dispose()
    source = tmp_path / "source"
    source.mkdir()
    pipeline = Pipeline(cluster.bootstrap_servers, pg.url, topic, f"sink-{run}", source,
                        tmp_path / "checkpoint", partitions=PARTITIONS,
                        events_per_file=EVENTS_PER_FILE)
    stop_file = tmp_path / "stop"
    timeout = f"{REQUEST_TIMEOUT_MS}"
    # socket.timeout.ms is librdkafka's client-side request timeout: a pause outlasts it.
    proc = pipeline.start(f"down:prepared:{failing_batch}", ["--follow", str(stop_file),
                               "--kafka-config", f"request.timeout.ms={timeout}",
                               "--kafka-config", f"socket.timeout.ms={timeout}"])
    query = Query(proc, tmp_path / "worker.log")
    feeder = Feeder(source, query)
    # The participants' ids: a coordinator-kill aims at the coordinator of one of them.
    tids = [transactional_id(pipeline.sink_id, b, p, 0) for b in (0, 1)
            for p in range(PARTITIONS)]
    runner = FaultRunner(cluster, pg, topic, tids, tmp_path, seed=seed,
                         request_timeout_ms=REQUEST_TIMEOUT_MS)
    files = 0
    try:
        feeder.feed()
        feeder.start()
        # Faults begin once the query runs: the first batch is under way.
        _wait(query.sink_started, 180, "start of the sink", query)
        faults_began = time.time()
        runner.run(schedule, gap=(0.5, 3.0))
        _wait(lambda: query.committed_after(runner.faults[-1].ended), 90,
              "batch committed after the last fault", query)
        files = feeder.stop()
        stop_file.touch()
        proc.wait(timeout=150)
    finally:
        files = feeder.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        heal_brokers(cluster)  # whole again, for what follows
    ran = time.time() - faults_began

    report = dualwrite.recover(pg.url, {"bootstrap.servers": cluster.bootstrap_servers},
                               sink_ids=[pipeline.sink_id], timeout_s=60)
    restarts = query.matching(r"RESTART (\S+) (\S+)")
    injected = query.matching(r"DUALWRITE-DOWN prepared (\d+)")
    metrics = _metrics(runner, query, files, restarts, len(injected), ran, time.time() - began)
    with capsys.disabled():
        print(metrics)
    foreign = query.matching(r"(FOREIGN|GAVE-UP) .*")
    assert not foreign, f"{foreign[0][1].group(0)}:\n{query.stderr_tail()}"
    assert proc.returncode == 0 and query.matching("DONE"), \
        f"worker failed ({proc.returncode}):\n{query.stderr_tail()}"
    families = Counter(m.group(2) for _, m in restarts)
    assert set(families) <= ALLOWED_FAMILIES, f"restarts after {families}"
    assert [m.group(1) for _, m in injected] == [str(failing_batch)]
    assert len(restarts) >= 1, "the query was not restarted after the injected error"
    assert report.ok, report
    pipeline.files = files
    pipeline.assert_exactly_once()


def _metrics(runner: FaultRunner, query: Query, files: int,
             restarts: list[tuple[float, re.Match[str]]], driver_errors: int, ran: float,
             total: float) -> str:
    committed = query.matching(r"BATCH (\d+) committed")
    skipped = query.matching(r"BATCH (\d+) skipped")
    log = query.log.read_text(encoding="utf-8", errors="replace")
    lines = [f"spark fault suite: {total:.0f} s in the test (servers started in "
             + ", ".join(f"{k} {v:.0f} s" for k, v in STARTUP.items())
             + f"), {ran:.0f} s from the first fault to the query's end; "
             f"{len(runner.faults)} faults, {files} files fed, {len(committed)} batches "
             f"committed, {len(skipped)} replays skipped, {len(restarts)} query restarts",
             "  ridden through: " + ", ".join(
                 f"{what} {len(re.findall(pattern, log))}" for what, pattern in RIDDEN.items()),
             "  faults injected: " + ", ".join(
                 f"{k} {v}" for k, v in sorted(Counter(f.kind for f in runner.faults).items()))
             + f", driver error (BrokerUnreachableError at 'prepared') {driver_errors}",
             "  query restarts after: " + (", ".join(
                 f"{k} {v}" for k, v in sorted(Counter(
                     f"{m.group(1).rsplit('.', 1)[-1]} ({m.group(2)})"
                     for _, m in restarts).items())) or "none")]
    for f in runner.faults:
        during = sum(1 for t, _ in committed if f.started <= t <= f.ended)
        hit = next((m.group(1) for t, m in committed if t >= f.started), "none")
        back = max(f.returns, default=f.ended)
        after = [t for t, _ in committed if t >= back]
        first = f"{after[0] - back:.1f} s" if after else "never"
        lines.append(f"    {f.started - runner.started:6.1f} s {f.kind} ({f.target}): "
                     f"{f.ended - f.started:.1f} s, hit batch {hit}, {during} batches "
                     f"committed during it, first commit {first} after the last return")
    return "\n".join(lines)
