"""franz-go's kfake, an independent implementation of the Kafka protocol, as a local broker.

dualwrite is checked against a second Kafka-compatible implementation besides Apache Kafka
(``dualwrite dev up --flavour kfake``, ``tests/participant/test_alt_broker.py``). kfake is a Go
library: the tiny program beside this module (``kfake/main.go``, pinned by its
``go.mod``/``go.sum``) is built once with ``go build`` (modules from the Go module proxy) and
cached under ``$DUALWRITE_HOME/bin``, keyed by the sources' hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import time
from importlib import resources
from pathlib import Path
from typing import Any

from dualwrite.dev._util import (
    DevClusterError,
    LocalServer,
    dualwrite_home,
    free_ports,
    parent_death_signal,
    pid_alive,
    port_open,
    read_state,
    tail,
    terminate_pid,
    write_state,
)

__all__ = ["KFAKE_MODULE", "LocalKfake", "kfake_binary"]

log = logging.getLogger(__name__)

KFAKE_MODULE = "github.com/twmb/franz-go/pkg/kfake"
_SOURCES = ("main.go", "go.mod", "go.sum")
_BUILD_TIMEOUT_S = 900.0
_MARKER = "dualwrite-kfake"
"""In the binary's file name: lets pid_alive tell our broker from a recycled pid."""


def _source_dir() -> Path:
    return Path(str(resources.files("dualwrite.dev") / "kfake"))


def kfake_version() -> str:
    """The kfake module version ``go.mod`` pins (a pseudo-version: kfake has no tags)."""
    for line in (_source_dir() / "go.mod").read_text().splitlines():
        parts = line.split()
        if KFAKE_MODULE in parts:
            return parts[parts.index(KFAKE_MODULE) + 1]
    raise DevClusterError(f"{_source_dir() / 'go.mod'} does not require {KFAKE_MODULE}")


def kfake_binary(*, refresh: bool = False) -> Path:
    """The built kfake broker program, building it with ``go build`` the first time."""
    src = _source_dir()
    digest = hashlib.sha256(b"".join((src / n).read_bytes() for n in _SOURCES)).hexdigest()[:12]
    binary = dualwrite_home() / "bin" / f"{_MARKER}-{digest}"
    if binary.is_file() and not refresh:
        return binary
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists()
                                else None)
    if go is None:
        raise DevClusterError("go not found on PATH: install Go 1.26+ to build the kfake broker")
    binary.parent.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")
    log.info("building kfake %s with go build (first time: about a minute)", kfake_version())
    started = time.monotonic()
    try:
        result = subprocess.run([go, "build", "-trimpath", "-o", str(tmp), "."], cwd=src,
                                capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S,
                                check=False)
    except subprocess.TimeoutExpired:
        raise DevClusterError(f"go build of kfake did not finish in {_BUILD_TIMEOUT_S:.0f} s; "
                              "check that the Go module proxy is reachable") from None
    if result.returncode != 0:
        raise DevClusterError("go build of the kfake broker failed:\n"
                              + "\n".join((result.stdout + result.stderr).splitlines()[-20:]))
    tmp.replace(binary)
    log.info("built kfake in %.1f s", time.monotonic() - started)
    return binary


class LocalKfake(LocalServer):
    """One kfake broker on 127.0.0.1 (node id 0), in memory unless ``data_dir`` is given.

    ``broker_config``: kfake's broker settings (``transaction.max.timeout.ms`` ...).
    ``as_version``: offer only the requests (and versions) of that Apache Kafka release, e.g.
    ``"2.8"`` (no DescribeTransactions or ListTransactions).
    ``detach``: the broker outlives this process (``dualwrite dev up``).
    """

    def __init__(self, *, port: int | None = None, data_dir: Path | None = None,
                 broker_config: dict[str, str] | None = None, as_version: str | None = None,
                 detach: bool = False, startup_timeout: float = 120.0) -> None:
        self.port = port
        self.data_dir = data_dir
        self.broker_config = dict(broker_config or {})
        self.as_version = as_version
        self.detach = detach
        self.startup_timeout = startup_timeout
        self.pid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None

    @property
    def bootstrap_servers(self) -> str:
        if self.port is None:
            raise DevClusterError("the kfake broker has not been started")
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = kfake_binary()
        if self.port is None:
            self.port = free_ports(1)[0]
        log_dir = self.data_dir or (dualwrite_home() / "dev")
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log = log_dir / f"kfake-{self.port}.log"
        cmd = [str(binary), "-port", str(self.port), "-log-level", "warn"]
        if self.data_dir is not None:
            cmd += ["-data-dir", str(self.data_dir / "data")]
        if self.as_version:
            cmd += ["-as-version", self.as_version]
        for key, value in sorted(self.broker_config.items()):
            cmd += ["-c", f"{key}={value}"]
        with open(self._log, "ab") as out:
            self._proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=self.detach,
                preexec_fn=None if self.detach else parent_death_signal())
        self.pid = self._proc.pid
        deadline = time.monotonic() + self.startup_timeout
        while not port_open(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise DevClusterError(f"the kfake broker did not start on port {self.port}:\n"
                                      + tail(self._log))
            time.sleep(0.05)
        log.info("kfake broker up at %s (pid %d)", self.bootstrap_servers, self.pid)

    def running(self) -> bool:
        return (self.pid is not None and pid_alive(self.pid, _MARKER)
                and self.port is not None and port_open(self.port))

    def kill(self) -> None:
        """SIGKILL the broker (its in-memory state is gone; a ``data_dir`` keeps the log)."""
        if self.pid is not None:
            terminate_pid(self.pid, 0.0, _MARKER)
        self._reap()

    def stop(self) -> None:
        if self.pid is not None:
            terminate_pid(self.pid, 10.0, _MARKER)
        self._reap()

    def _reap(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            self._proc = None
        self.pid = None

    def to_state(self) -> dict[str, Any]:
        return {"flavour": "kfake", "kfake_version": kfake_version(), "port": self.port,
                "pid": self.pid, "data_dir": str(self.data_dir) if self.data_dir else None,
                "bootstrap_servers": self.bootstrap_servers}

    def save_state(self, path: Path) -> None:
        write_state(path, self.to_state())

    @classmethod
    def from_state(cls, path: Path) -> LocalKfake:
        state = read_state(path)
        broker = cls(port=int(state["port"]),
                     data_dir=Path(state["data_dir"]) if state.get("data_dir") else None,
                     detach=True)
        broker.pid = state.get("pid")
        return broker
