"""A Spark standalone cluster on loopback: one master, two workers on different addresses.

Speculative copies need a second host: Spark never launches a copy of a task on a host that
already runs an attempt of it, so ``local[*]`` and ``local-cluster`` (one address) never speculate.
The workers bind 127.0.0.2 and 127.0.0.3, which Linux routes to loopback.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pyspark


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
