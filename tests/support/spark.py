"""Helpers of the Spark sink tests: the worker's pipeline, and a standalone Spark cluster.

:class:`Pipeline` runs the query of ``tests/support/workers/spark_worker.py`` as a process (the
tests kill it) and checks the sink's invariant afterwards. :class:`StandaloneSpark` starts one
master and two workers on different loopback addresses: speculative copies need a second host (Spark
never launches a copy of a task on a host that already runs an attempt of it, so ``local[*]`` and
``local-cluster``, one address, never speculate). The workers bind 127.0.0.2 and 127.0.0.3, which
Linux routes to loopback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pyspark
import sqlalchemy as sa

import dualwrite
from dualwrite.batch.decision_log import DecisionLog
from dualwrite.batch.prepared_writes import PreparedTransactions, gid_prefix
from dualwrite.participant.control_plane import ControlPlane, TxnState
from tests.support.kafka import read_committed
from tests.support.workers import SPARK_WORKER, worker_env

FILES = 5
EVENTS_PER_FILE = 120
OPEN = [TxnState.ONGOING, TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT]


def write_source_file(source: Path, index: int, events: int, *, mtime: float | None = None
                      ) -> Path:
    """Source file ``index``: events ``index * events`` up to the next file's first, one JSON
    object a line. Written beside ``source`` and renamed in, so Spark never lists it half done."""
    first = index * events
    lines = [json.dumps({"event_id": i, "payload": f"event {i} " + "x" * 40})
             for i in range(first, first + events)]
    name = f"events-{index:03d}.json"
    staged = source.parent / f".{source.name}-{name}"
    staged.write_text("\n".join(lines) + "\n")
    if mtime is not None:
        os.utime(staged, (mtime, mtime))
    return staged.replace(source / name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StandaloneSpark:
    def __init__(self, work_dir: Path, workers: int = 2) -> None:
        self.work_dir = work_dir
        self.workers = workers
        self.port = _free_port()
        self.master_url = f"spark://127.0.0.1:{self.port}"
        self._procs: list[subprocess.Popen[bytes]] = []

    def _spawn(self, *args: str) -> None:
        home = Path(pyspark.__file__).parent
        env = {**os.environ, "SPARK_HOME": str(home), "SPARK_LOG_DIR": str(self.work_dir),
               "SPARK_NO_DAEMONIZE": "1"}
        log = open(self.work_dir / f"{len(self._procs)}.log", "wb")  # noqa: SIM115
        self._procs.append(subprocess.Popen([str(home / "bin" / "spark-class"), *args],
                                            env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True))

    def start(self, timeout_s: float = 90.0) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._spawn("org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port",
                    str(self.port), "--webui-port", str(_free_port()))
        for i in range(self.workers):
            self._spawn("org.apache.spark.deploy.worker.Worker", "-h", f"127.0.0.{2 + i}",
                        "-c", "1", "-m", "1g", "--webui-port", str(_free_port()),
                        "--work-dir", str(self.work_dir / f"worker-{i}"), self.master_url)
        deadline = time.monotonic() + timeout_s
        master_log = self.work_dir / "0.log"
        while time.monotonic() < deadline:
            text = master_log.read_text(errors="replace") if master_log.exists() else ""
            if text.count("Registering worker") >= self.workers:
                return
            if any(p.poll() is not None for p in self._procs):
                break
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the standalone Spark cluster did not start; see {self.work_dir}")

    def stop(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._procs.clear()


def batches(output: str, status: str) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(rf"^BATCH (\d+) {status}", output, re.M)]


@dataclass
class Pipeline:
    """One sink's world: its source files, topic, database, checkpoint; runs the worker."""

    bootstrap: str
    db_url: str
    topic: str
    sink_id: str
    source: Path
    checkpoint: Path
    kafka_only: bool = False
    sql_mode: str = "auto"
    partitions: int = 4
    files: int = FILES
    events_per_file: int = EVENTS_PER_FILE
    outputs: list[str] = field(default_factory=list)

    @property
    def expected_mode(self) -> str | None:
        """The SQL mode the sink must choose: write-once on the test PostgreSQL (it allows
        prepared transactions), staging elsewhere, or as forced."""
        if self.kafka_only:
            return None
        if self.sql_mode != "auto":
            return self.sql_mode
        return "write-once" if self.db_url.startswith("postgresql") else "staging"

    @property
    def expected(self) -> list[int]:
        return list(range(self.files * self.events_per_file))

    def command(self, extra: list[str]) -> list[str]:
        cmd = [sys.executable, str(SPARK_WORKER), "--bootstrap", self.bootstrap,
               "--db", self.db_url, "--topic", self.topic, "--sink-id", self.sink_id,
               "--source", str(self.source), "--checkpoint", str(self.checkpoint),
               "--partitions", str(self.partitions)]
        if self.kafka_only:
            cmd.append("--kafka-only")
        else:
            cmd += ["--sql-mode", self.sql_mode]
        return cmd + extra

    def start(self, faults: str, extra: list[str]) -> subprocess.Popen[str]:
        env = {**worker_env(), "DUALWRITE_SPARK_FAULTS": faults}
        return subprocess.Popen(self.command(extra), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True, cwd=self.checkpoint.parent)

    def run(self, *extra: str, faults: str = "", expect_ok: bool = True,
            timeout_s: float = 240.0) -> subprocess.CompletedProcess[str]:
        proc = self.start(faults, list(extra))
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"worker timed out; stderr tail:\n{err[-4000:]}") from None
        self.outputs.append(out)
        if expect_ok:
            assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{err[-6000:]}"
            assert "DONE" in out
            assert f"MODE {self.expected_mode}" in out
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def run_until_killed(self, point: str, batch_id: int, *extra: str,
                         more_faults: str = "") -> str:
        """Run until the driver pauses at ``point`` of ``batch_id``, then SIGKILL its group."""
        faults = ";".join(f for f in (f"pause:{point}:{batch_id}", more_faults) if f)
        proc = self.start(faults, list(extra))
        stderr: list[str] = []
        drain = threading.Thread(target=lambda: stderr.extend(proc.stderr or ()), daemon=True)
        drain.start()
        lines: list[str] = []
        assert proc.stdout is not None
        deadline = time.monotonic() + 240
        try:
            for line in proc.stdout:
                lines.append(line)
                if line.startswith(f"DUALWRITE-PAUSED {point} {batch_id}"):
                    break
                if time.monotonic() > deadline:
                    raise AssertionError("the worker never reached the pause point")
            else:
                proc.wait()
                drain.join(5)
                raise AssertionError(f"worker exited ({proc.returncode}) before pausing at "
                                     f"{point} {batch_id}:\n{''.join(stderr)[-6000:]}")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.outputs.append("".join(lines))
        return "".join(lines)

    # -- the invariant -------------------------------------------------------------------------

    def kafka_ids(self) -> list[int]:
        return [json.loads(v)["event_id"] for v in read_committed(self.bootstrap, self.topic, 30)]

    def table_ids(self) -> list[int]:
        engine = dualwrite.create_engine(self.db_url)
        try:
            with engine.connect() as conn:
                return [r[0] for r in conn.execute(sa.text("SELECT event_id FROM events"))]
        finally:
            engine.dispose()

    def staged_rows(self) -> int:
        engine = dualwrite.create_engine(self.db_url)
        try:
            with engine.connect() as conn:
                if not sa.inspect(conn).has_table("events_dw_staging"):
                    return 0  # write-once mode stages nothing
                return int(conn.execute(sa.text(
                    "SELECT count(*) FROM events_dw_staging WHERE dw_sink_id = :s"),
                    {"s": self.sink_id}).scalar_one())
        finally:
            engine.dispose()

    def prepared_transactions(self) -> list[str]:
        """The sink's prepared database transactions left (write-once mode)."""
        engine = dualwrite.create_engine(self.db_url)
        try:
            return [t.gid for t in
                    PreparedTransactions(engine).list(gid_prefix(self.sink_id))]
        finally:
            engine.dispose()

    def open_transactions(self) -> list[str]:
        pattern = re.compile(re.escape(self.sink_id) + r"-b[01]-p\d+-a\d+")
        with ControlPlane({"bootstrap.servers": self.bootstrap}) as cp:
            listed = cp.list_transactions(states=OPEN, prefix=self.sink_id)
        return [t.transactional_id for t in listed if pattern.fullmatch(t.transactional_id)]

    def assert_exactly_once(self) -> None:
        kafka = self.kafka_ids()
        duplicates = {i: n for i, n in Counter(kafka).items() if n > 1}
        assert not duplicates, f"duplicated in Kafka: {dict(list(duplicates.items())[:10])}"
        lost = sorted(set(self.expected) - set(kafka))
        assert not lost, f"{len(lost)} events missing from Kafka, e.g. {lost[:10]}"
        assert sorted(kafka) == self.expected
        if not self.kafka_only:
            rows = self.table_ids()
            assert sorted(rows) == sorted(kafka), "read_committed records != target rows"
            assert self.staged_rows() == 0
        assert self.open_transactions() == []
        assert self.prepared_transactions() == []
        engine = dualwrite.create_engine(self.db_url)
        try:
            record = DecisionLog(engine).read(self.sink_id)
        finally:
            engine.dispose()
        assert record is not None and record.completed, record
