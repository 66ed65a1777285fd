"""A throwaway Apache Pulsar standalone broker on loopback, run from Maven jars (no Docker).

``PulsarStandaloneStarter`` runs broker, an in-process BookKeeper and a RocksDB metadata store in
one JVM. The transaction coordinator is enabled; standalone then creates ``pulsar/system`` and the
one-partition ``transaction_coordinator_assign`` topic itself, and :meth:`LocalPulsar.start`
waits until that topic exists.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from dualwrite.dev._util import (
    DevClusterError,
    LocalServer,
    find_java,
    free_ports,
    parent_death_signal,
    pid_alive,
    port_open,
    read_state,
    tail,
    terminate_pid,
    write_state,
)
from dualwrite.dev.maven import resolve_classpath

__all__ = [
    "DEFAULT_PULSAR_VERSION",
    "LocalPulsar",
    "PulsarNotReadyError",
    "PulsarStartError",
    "pulsar_classpath",
]

log = logging.getLogger(__name__)

DEFAULT_PULSAR_VERSION = "4.0.8"
"""4.0.8: its transaction buffer no longer breaks a partition when two transactions send to
it first at once (apache/pulsar#24945; 4.0.7 does, docs/broker-facts.md). Central lacks two of
its jars, taken from 4.0.7 (pulsar-runtime.pom.xml)."""
POM_RESOURCE = "pulsar-runtime.pom.xml"
_MAIN_CLASS = "org.apache.pulsar.PulsarStandaloneStarter"
_STOP_TIMEOUT_S = 30.0
_TC_ASSIGN = "pulsar/system/transaction_coordinator_assign"

_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c{1})%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
"""


class PulsarStartError(DevClusterError):
    """The Pulsar standalone JVM could not be launched or exited during start-up."""


class PulsarNotReadyError(DevClusterError):
    """The broker runs but did not become ready (cluster, namespaces, coordinator topic) in time."""


def pulsar_classpath(version: str = DEFAULT_PULSAR_VERSION, *, refresh: bool = False) -> list[Path]:
    """The jars of Pulsar ``version``'s broker (and Java client), downloading them if needed.

    Resolved like the Kafka jars (``dualwrite.dev.maven``): Maven's local repository holds the
    jars, ``$DUALWRITE_HOME/classpath`` the resolved classpath.
    """
    return resolve_classpath(
        "Pulsar", version, POM_RESOURCE,
        {"pulsar.version": version, "pulsar.component": "broker"},
        coordinates=f"org.apache.pulsar:pulsar-broker:{version} (Central serves only some "
                    "4.0.x completely; 4.0.7 and 4.0.8 resolve)", refresh=refresh)


class LocalPulsar(LocalServer):
    """Start and stop a Pulsar standalone broker with transactions enabled, on free loopback ports.

    Use as a context manager, or call :meth:`start` and :meth:`stop`. Data and ``broker.log``
    live in ``data_dir`` (a new temporary folder, removed on stop, unless one is given; a given
    folder's broker data is wiped on start). ``detach=True`` (``dualwrite dev up``): the broker
    outlives this process; :meth:`save_state` and :meth:`from_state` let another process stop it.
    """

    def __init__(
        self,
        version: str = DEFAULT_PULSAR_VERSION,
        data_dir: Path | None = None,
        extra_config: Mapping[str, str] | None = None,
        *,
        heap: str = "512m",
        startup_timeout: float = 120.0,
        detach: bool = False,
        admin_token: str | None = None,
    ) -> None:
        self.version = version
        self.admin_token = admin_token
        """A JWT sent as ``Authorization: Bearer`` by :meth:`admin_request` (auth-on brokers)."""
        self.extra_config = dict(extra_config or {})
        self.heap = heap
        self.startup_timeout = startup_timeout
        self.detach = detach
        self._given_data_dir = data_dir
        self.data_dir: Path | None = data_dir
        self.broker_port = 0
        self.web_port = 0
        self.bookie_port = 0
        self.pid: int | None = None
        self.classpath: list[Path] = []
        self.startup_seconds: float | None = None
        """Seconds from launching the JVM to ready (not counting jar resolution)."""
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        url = self.service_url if self.broker_port else None
        return f"LocalPulsar(version={self.version!r}, service_url={url!r})"

    @property
    def service_url(self) -> str:
        """``pulsar://127.0.0.1:port`` (binary protocol)."""
        return f"pulsar://127.0.0.1:{self.broker_port}"

    @property
    def web_url(self) -> str:
        """``http://127.0.0.1:port`` (admin REST API)."""
        return f"http://127.0.0.1:{self.web_port}"

    @property
    def log_path(self) -> Path:
        if self.data_dir is None:
            raise DevClusterError("the broker is not started: call start() first")
        return self.data_dir / "broker.log"

    def broker_config(self) -> dict[str, str]:
        """The ``standalone.conf`` settings: loopback only, one bookie, transactions on."""
        settings = {
            "clusterName": "standalone",
            "bindAddress": "127.0.0.1",
            "advertisedAddress": "127.0.0.1",
            "brokerServicePort": str(self.broker_port),
            "webServicePort": str(self.web_port),
            "managedLedgerDefaultEnsembleSize": "1",
            "managedLedgerDefaultWriteQuorum": "1",
            "managedLedgerDefaultAckQuorum": "1",
            "managedLedgerCacheSizeMB": "64",
            "functionsWorkerEnabled": "false",
            "transactionCoordinatorEnabled": "true",
            "systemTopicEnabled": "true",
            "topicLevelPoliciesEnabled": "true",
            "allowAutoTopicCreation": "true",
            "allowAutoTopicCreationType": "non-partitioned",
            "brokerDeleteInactiveTopicsEnabled": "false",
        }
        settings.update(self.extra_config)
        return settings

    def start(self) -> None:
        """Resolve the jars, launch the JVM and wait until the broker is ready."""
        self.classpath = pulsar_classpath(self.version)
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="dualwrite-pulsar-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.broker_port, self.web_port, self.bookie_port = free_ports(3)
        shutil.rmtree(self.data_dir / "data", ignore_errors=True)
        self._launch()

    def crash(self) -> None:
        """SIGKILL the broker, keeping its data and ports for :meth:`restart` (fault tests)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        self.pid = None

    def restart(self) -> None:
        """Launch the broker again on the same data and ports (after :meth:`crash`): the
        transaction coordinator recovers its transactions from its log."""
        if self.data_dir is None or not self.broker_port:
            raise DevClusterError("the broker was never started: call start() first")
        self._launch()
        self._wait_writable(time.monotonic() + self.startup_timeout)

    def _wait_writable(self, deadline: float) -> None:
        """Wait until the broker can create a topic, i.e. its bookie takes writes again: after
        a SIGKILL the admin API answers seconds before the in-process bookie has registered
        (ledger creation fails with "Not enough non-faulty bookies" meanwhile)."""
        probe = f"/admin/v2/persistent/public/default/dualwrite-ready-{uuid.uuid4().hex[:8]}"
        while True:
            try:
                status, body = self.admin_request("PUT", probe, timeout=5.0)
            except OSError as exc:
                status, body = 0, str(exc)
            if status in (200, 204, 409):
                return
            if time.monotonic() > deadline:
                raise PulsarNotReadyError(
                    f"Pulsar restarted but cannot create a topic within "
                    f"{self.startup_timeout:.0f} s (HTTP {status}: {str(body)[:200]})"
                    f"\n{tail(self.log_path, 30)}")
            time.sleep(0.5)

    def _launch(self) -> None:
        assert self.data_dir is not None
        java = find_java("Pulsar 4.0 brokers")
        conf = self.data_dir / "standalone.conf"
        conf.write_text("".join(f"{k}={v}\n" for k, v in self.broker_config().items()),
                        encoding="utf-8")
        log4j = self.data_dir / "log4j2.properties"
        log4j.write_text(_LOG4J2, encoding="utf-8")
        data = self.data_dir / "data"
        cmd = [
            java, "-Xms128m", f"-Xmx{self.heap}", "-XX:MaxDirectMemorySize=512m",
            "-XX:+UseG1GC", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={log4j}", "-cp", os.pathsep.join(map(str, self.classpath)),
            _MAIN_CLASS, "-c", str(conf), "-nfw", "-nss", "-a", "127.0.0.1",
            "--metadata-dir", str(data / "metadata"), "--bookkeeper-dir", str(data / "bookkeeper"),
            "--bookkeeper-port", str(self.bookie_port),
        ]  # fmt: skip
        out: IO[bytes] = self.log_path.open("ab")
        started = time.monotonic()
        try:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                cwd=self.data_dir, start_new_session=True,
                preexec_fn=None if self.detach else parent_death_signal(),
            )
        except OSError as e:
            raise PulsarStartError(f"could not launch {java}: {e}") from None
        finally:
            out.close()
        self.pid = self._proc.pid
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        log.info("Pulsar %s ready on %s in %.1f s", self.version, self.service_url,
                 self.startup_seconds)

    def admin_get(self, path: str, timeout: float = 10.0) -> tuple[int, Any]:
        """GET ``path`` of the admin REST API: (HTTP status, decoded JSON or text)."""
        return self.admin_request("GET", path, timeout=timeout)

    def admin_request(self, method: str, path: str, body: Any = None,
                      timeout: float = 10.0) -> tuple[int, Any]:
        """Call the admin REST API with a JSON ``body``: (HTTP status, decoded JSON or text)."""
        headers = {"Accept": "application/json", "Content-Type": "application/json"}
        if self.admin_token:
            headers["Authorization"] = f"Bearer {self.admin_token}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.web_url + path, data=data, headers=headers,
                                     method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, body = int(resp.status), resp.read().decode()
        except urllib.error.HTTPError as e:
            status, body = e.code, e.read().decode()
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body

    def _ready(self) -> bool:
        try:
            status, clusters = self.admin_get("/admin/v2/clusters", timeout=2.0)
            if status != 200 or "standalone" not in clusters:
                return False
            status, ns = self.admin_get("/admin/v2/namespaces/public", timeout=2.0)
            if status != 200 or "public/default" not in ns:
                return False
            status, meta = self.admin_get(f"/admin/v2/persistent/{_TC_ASSIGN}/partitions", 2.0)
            return status == 200 and int(meta.get("partitions", 0)) >= 1
        except (OSError, ValueError, AttributeError):
            return False

    def _wait_ready(self, started: float) -> None:
        while not self._ready():
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise PulsarStartError(
                    f"Pulsar standalone exited with code {self._proc.returncode} during start-up"
                    f"\n{tail(self.log_path, 30)}")
            if time.monotonic() - started > self.startup_timeout:
                raise PulsarNotReadyError(
                    f"Pulsar standalone not ready within {self.startup_timeout:.0f} s (cluster, "
                    f"public/default, {_TC_ASSIGN})\n{tail(self.log_path, 30)}")
            time.sleep(0.25)

    def rss_bytes(self) -> int:
        """The broker JVM's resident set size now (Linux ``/proc``)."""
        if self.pid is None:
            raise DevClusterError("the broker is not started")
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise DevClusterError(f"no VmRSS for pid {self.pid}")

    def running(self) -> bool:
        """Whether the broker process lives and its binary-protocol port accepts connections."""
        return (self.pid is not None and pid_alive(self.pid, _MAIN_CLASS)
                and port_open(self.broker_port))

    def stop(self) -> None:
        """SIGTERM the broker (SIGKILL after 30 s) and remove a temporary data folder."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("Pulsar ignored SIGTERM for %.0f s; killing it", _STOP_TIMEOUT_S)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        elif proc is None and self.pid is not None:
            terminate_pid(self.pid, _STOP_TIMEOUT_S, must_contain=_MAIN_CLASS)
        self.pid = None
        if self._given_data_dir is None and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    def to_state(self) -> dict[str, Any]:
        """What another process needs to find and stop this broker."""
        return {"flavour": "pulsar", "pulsar_version": self.version, "pid": self.pid,
                "broker_port": self.broker_port, "web_port": self.web_port,
                "bookie_port": self.bookie_port, "service_url": self.service_url,
                "web_url": self.web_url, "data_dir": str(self.data_dir) if self.data_dir else None}

    def save_state(self, path: Path) -> None:
        write_state(path, self.to_state())

    @classmethod
    def from_state(cls, path: Path) -> LocalPulsar:
        """The broker a ``detach=True`` start recorded with :meth:`save_state`."""
        state = read_state(path)
        broker = cls(str(state["pulsar_version"]),
                     data_dir=Path(state["data_dir"]) if state.get("data_dir") else None,
                     detach=True)
        broker.pid = state.get("pid")
        broker.broker_port = int(state["broker_port"])
        broker.web_port = int(state["web_port"])
        broker.bookie_port = int(state["bookie_port"])
        return broker
