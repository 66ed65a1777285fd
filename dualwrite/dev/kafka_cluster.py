"""A throwaway Apache Kafka cluster (KRaft) on loopback, for tests and local development.

Two backends: ``jars`` runs ``kafka.Kafka`` on the local JVM with jars resolved by Maven (no
Kafka download, no Docker); ``docker`` runs the official ``apache/kafka`` image. Every node is
broker and controller at once, with a static controller quorum, which keeps the cluster small
while still letting tests kill and restart a node.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Literal, Protocol

from dualwrite.dev._util import (
    DevClusterError,
    LocalServer,
    choose_backend,
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
from dualwrite.dev.maven import kafka_classpath, logging_flavour, major_version
from dualwrite.dev.security import (
    Acl,
    ClusterSecurity,
    ListenerProtocol,
    ScramUser,
    client_settings,
    create_acls,
    delete_acls,
    upsert_scram_users,
    write_properties_file,
)

__all__ = [
    "DEFAULT_KAFKA_VERSION",
    "Backend",
    "BrokerNode",
    "ExternalKafkaCluster",
    "KafkaTarget",
    "LocalKafkaCluster",
    "create_topic",
    "transactional_defaults",
]

log = logging.getLogger(__name__)

Backend = Literal["auto", "jars", "docker"]
Security = Literal["none", "sasl"]
DEFAULT_KAFKA_VERSION = "4.3.1"
DOCKER_IMAGE = "apache/kafka"
_MAIN_CLASS = "kafka.Kafka"
_STOP_TIMEOUT_S = 20.0
_DOCKER_LABEL = "dualwrite.dev=kafka"
_LIFECYCLE = re.compile(r"[Ff]enc|[Rr]egistration|BrokerLifecycleManager|Unable to register")
"""Broker log lines on a broker's registration and fencing (broker and controller side)."""


def transactional_defaults(brokers: int) -> dict[str, str]:
    """Broker settings chosen for transactional tests; see docs/dev-cluster.md for the reasons."""
    rf = min(brokers, 3)
    min_isr = max(1, min(rf - 1, 2))
    return {
        "offsets.topic.replication.factor": str(rf),
        "offsets.topic.num.partitions": "10",
        "transaction.state.log.replication.factor": str(rf),
        "transaction.state.log.min.isr": str(min_isr),
        "transaction.state.log.num.partitions": "10",
        "default.replication.factor": str(rf),
        "min.insync.replicas": str(min_isr),
        "transaction.max.timeout.ms": "3600000",
        "transaction.abort.timed.out.transaction.cleanup.interval.ms": "1000",
        "group.initial.rebalance.delay.ms": "0",
        "auto.create.topics.enable": "false",
        "num.partitions": "3",
    }


def _share_group_defaults(brokers: int, kafka_version: str) -> dict[str, str]:
    # Kafka 4.x creates __share_group_state with RF 3 on first use; give it the cluster's RF.
    if major_version(kafka_version) < 4:
        return {}
    rf = min(brokers, 3)
    return {
        "share.coordinator.state.topic.replication.factor": str(rf),
        "share.coordinator.state.topic.min.isr": str(max(1, min(rf - 1, 2))),
    }


def new_cluster_id() -> str:
    """A random KRaft cluster id: a UUID in URL-safe base64 without padding (22 characters)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):  # the storage tool would read it as an option
            return cid


@dataclass
class BrokerNode:
    """One broker+controller process (or container) of the cluster."""

    index: int
    node_id: int
    port: int
    controller_port: int
    directory: str = ""
    pid: int | None = None
    container: str | None = None
    sasl_port: int | None = None
    ssl_port: int | None = None
    external_port: int | None = None
    """``proxied=True``: the EXTERNAL listener's bound port."""
    proxy_port: int | None = None
    """``proxied=True``: the port EXTERNAL advertises, where a test's proxy listens."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
logger.state.name = state.change.logger
logger.state.level = WARN
logger.request.name = kafka.request.logger
logger.request.level = WARN
"""

_LOG4J1 = """\
log4j.rootLogger=INFO, out
log4j.appender.out=org.apache.log4j.ConsoleAppender
log4j.appender.out.layout=org.apache.log4j.PatternLayout
log4j.appender.out.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.state.change.logger=WARN
log4j.logger.kafka.request.logger=WARN
"""


def docker_env_name(prop: str) -> str:
    # The apache/kafka image maps KAFKA_A_B__C___D to a.b_c-d.
    return "KAFKA_" + prop.replace("_", "__").replace("-", "___").replace(".", "_").upper()


def _write_properties(path: Path, props: Mapping[str, str]) -> None:
    lines = [f"{k}={v}" for k, v in props.items()]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # may hold a keystore pass
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _run(cmd: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


class KafkaTarget(Protocol):
    """What tests need of a cluster, local or external: its address and topic creation."""

    @property
    def bootstrap_servers(self) -> str: ...

    def create_topic(
        self,
        name: str,
        partitions: int = 3,
        replication_factor: int | None = None,
        config: Mapping[str, str] | None = None,
        timeout: float = 30.0,
    ) -> str: ...


def create_topic(
    bootstrap_servers: str,
    name: str,
    partitions: int = 3,
    replication_factor: int = 1,
    config: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> str:
    """Create a topic and wait until every partition has a leader; returns ``name``."""
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    conf: dict[str, Any] = {"bootstrap.servers": bootstrap_servers,
                            "logger": logging.getLogger("dualwrite.librdkafka.dev")}
    admin = AdminClient(conf)
    futures = admin.create_topics(
        [NewTopic(name, partitions, replication_factor, config=dict(config or {}))],
        operation_timeout=timeout,
    )
    futures[name].result(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        md = admin.list_topics(name, timeout=5.0).topics.get(name)
        if (
            md is not None
            and md.error is None
            and len(md.partitions) == partitions
            and all(p.leader >= 0 for p in md.partitions.values())
        ):
            return name
        time.sleep(0.1)
    raise DevClusterError(f"topic {name!r} has no leader for every partition after {timeout} s")


class ExternalKafkaCluster:
    """A cluster someone else runs (e.g. ``DUALWRITE_TEST_BOOTSTRAP``): address and topics only."""

    def __init__(self, bootstrap_servers: str, kafka_version: str = "external") -> None:
        self.bootstrap_servers = bootstrap_servers
        self.kafka_version = kafka_version

    def __repr__(self) -> str:
        return f"ExternalKafkaCluster({self.bootstrap_servers!r})"

    @property
    def brokers(self) -> int:
        """How many brokers the cluster metadata lists now."""
        from confluent_kafka.admin import AdminClient

        conf: dict[str, Any] = {"bootstrap.servers": self.bootstrap_servers,
                                "logger": logging.getLogger("dualwrite.librdkafka.dev")}
        admin = AdminClient(conf)
        return len(admin.list_topics(timeout=10.0).brokers)

    def create_topic(self, name: str, partitions: int = 3, replication_factor: int | None = None,
                     config: Mapping[str, str] | None = None, timeout: float = 30.0) -> str:
        """Create a topic (RF: min(brokers now in the metadata, 3) by default); wait for leaders."""
        rf = replication_factor or min(self.brokers, 3)
        return create_topic(self.bootstrap_servers, name, partitions, rf, config, timeout)


class LocalKafkaCluster(LocalServer):
    """Start, stop, kill and restart a local KRaft Kafka cluster on free loopback ports.

    Use as a context manager, or call :meth:`start` and :meth:`stop`. With ``detach=True``
    (used by ``dualwrite dev up``) the brokers outlive this process; :meth:`save_state` and
    :meth:`from_state` let another process find and stop them.
    """

    def __init__(
        self,
        brokers: int = 1,
        kafka_version: str = DEFAULT_KAFKA_VERSION,
        data_dir: Path | None = None,
        extra_config: Mapping[str, str] | None = None,
        backend: Backend = "auto",
        *,
        detach: bool = False,
        heap: str = "512m",
        startup_timeout: float = 120.0,
        security: Security = "none",
        proxied: bool = False,
    ) -> None:
        if brokers < 1:
            raise ValueError("brokers must be at least 1")
        if backend not in ("auto", "jars", "docker"):
            raise ValueError(f"backend must be 'auto', 'jars' or 'docker', not {backend!r}")
        if security not in ("none", "sasl"):
            raise ValueError(f"security must be 'none' or 'sasl', not {security!r}")
        major_version(kafka_version)
        self.brokers = brokers
        self.kafka_version = kafka_version
        self.extra_config: dict[str, str] = dict(extra_config or {})
        self.requested_backend: Backend = backend
        self.backend: Literal["jars", "docker"] | None = None
        self.detach = detach
        self.heap = heap
        self.startup_timeout = startup_timeout
        self.cluster_id = new_cluster_id()
        self.nodes: list[BrokerNode] = []
        self.network: str | None = None
        self._given_data_dir = data_dir
        self.data_dir: Path | None = data_dir
        self._classpath: str | None = None
        self._java: str | None = None
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self.security: Security = security
        self.secrets: ClusterSecurity | None = None
        """Users, CA and properties files of a ``security="sasl"`` cluster (jar backend)."""
        self.restored_security: dict[str, Any] = {}
        """The security state (no passwords) read back by :meth:`from_state`."""
        self.proxied = proxied
        """An EXTERNAL listener per broker, advertised on another port than it binds (jars
        backend): clients reach the broker only through a proxy from ``proxy_ports`` to
        ``external_ports`` (fault tests cut or delay that path)."""

    def __repr__(self) -> str:
        return (
            f"LocalKafkaCluster(brokers={self.brokers}, kafka_version={self.kafka_version!r}, "
            f"backend={self.backend or self.requested_backend!r}, "
            f"bootstrap_servers={self.bootstrap_servers if self.nodes else None!r})"
        )

    # -- public API ---------------------------------------------------------------------------

    @property
    def bootstrap_servers(self) -> str:
        """``"127.0.0.1:port,..."`` of every broker."""
        if not self.nodes:
            raise DevClusterError("the cluster is not started: call start() first")
        return ",".join(n.address for n in self.nodes)

    @property
    def sasl_bootstrap_servers(self) -> str:
        """The SASL_PLAINTEXT (SCRAM-SHA-512) listeners of a ``security="sasl"`` cluster."""
        return self._listener_servers("sasl_port")

    @property
    def ssl_bootstrap_servers(self) -> str:
        """The SASL_SSL (SCRAM-SHA-512 over TLS) listeners of a ``security="sasl"`` cluster."""
        return self._listener_servers("ssl_port")

    @property
    def external_bootstrap_servers(self) -> str:
        """The EXTERNAL listeners as advertised (the proxies' ports) of a ``proxied`` cluster."""
        return self._listener_servers("proxy_port")

    @property
    def external_ports(self) -> list[int]:
        """Where each broker's EXTERNAL listener is bound (the proxies' targets)."""
        return [int(p) for p in self._listener_servers("external_port").replace(
            "127.0.0.1:", "").split(",")]

    @property
    def proxy_ports(self) -> list[int]:
        """The port each broker's EXTERNAL listener advertises (a proxy listens there)."""
        return [int(p) for p in self._listener_servers("proxy_port").replace(
            "127.0.0.1:", "").split(",")]

    def _listener_servers(self, attr: str) -> str:
        ports = [getattr(n, attr) for n in self.nodes]
        if not self.nodes or None in ports:
            raise DevClusterError("the cluster was not started with security='sasl'")
        return ",".join(f"127.0.0.1:{p}" for p in ports)

    def client_config(self, user: ScramUser | None = None,
                      protocol: ListenerProtocol = "SASL_SSL") -> dict[str, str]:
        """A librdkafka configuration for ``user`` (default: the application user)."""
        if user is None:
            user = self._require_secrets().app
        servers = (self.ssl_bootstrap_servers if protocol == "SASL_SSL"
                   else self.sasl_bootstrap_servers)
        return client_settings(servers, protocol, user, self.ca_file)

    @property
    def ca_file(self) -> Path | None:
        """The PEM file of the run's CA (``ssl.ca.location``) of a secured cluster."""
        if self.secrets is not None and self.secrets.tls is not None:
            return self.secrets.tls.ca_pem
        ca = self.restored_security.get("ca_file")
        return Path(ca) if ca else None

    def add_scram_user(self, name: str, password: str | None = None) -> ScramUser:
        """Create a SCRAM-SHA-512 user (random password by default); it has no ACLs yet."""
        user = ScramUser(name, password) if password else ScramUser.generate(name)
        upsert_scram_users(self.bootstrap_servers, [user])
        return user

    def create_acls(self, acls: list[Acl]) -> None:
        """Create ALLOW ACLs (as a super user, over the internal listener)."""
        create_acls(self.bootstrap_servers, acls)

    def delete_acls(self, acls: list[Acl]) -> None:
        """Delete exactly these ACLs."""
        delete_acls(self.bootstrap_servers, acls)

    def _require_secrets(self) -> ClusterSecurity:
        if self.secrets is None:
            raise DevClusterError(
                "no credentials: the cluster was not started by this process with "
                "security='sasl' (a detached cluster's credentials are in its properties files)")
        return self.secrets

    def broker_config(self, index: int) -> dict[str, str]:
        """The full ``server.properties`` of broker ``index`` (jar backend layout)."""
        node = self.nodes[index]
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes)
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node.node_id),
            "controller.quorum.voters": voters,
            "listeners": (
                f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}"
            ),
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{node.port}",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "log.dirs": str(Path(node.directory) / "data"),
        }
        if self.security == "sasl":
            sec = self._require_secrets()
            extra = {"SASL_PLAINTEXT": node.sasl_port, "SASL_SSL": node.ssl_port}
            listeners = [f"{name}://127.0.0.1:{port}" for name, port in extra.items()]
            props["listeners"] += "," + ",".join(listeners)
            props["advertised.listeners"] += "," + ",".join(listeners)
            props["listener.security.protocol.map"] += ",".join(
                ["", "SASL_PLAINTEXT:SASL_PLAINTEXT", "SASL_SSL:SASL_SSL"])
            props.update(sec.broker_settings())
        if node.external_port is not None:
            props["listeners"] += f",EXTERNAL://127.0.0.1:{node.external_port}"
            props["advertised.listeners"] += f",EXTERNAL://127.0.0.1:{node.proxy_port}"
            props["listener.security.protocol.map"] += ",EXTERNAL:PLAINTEXT"
        props.update(self._settings())
        return props

    def start(self) -> None:
        """Start every node and wait until all brokers serve metadata; raise with log tails."""
        if self.nodes:
            raise DevClusterError("the cluster is already started")
        self.backend = choose_backend(self.requested_backend, "jars",
                                      "use backend='jars' (needs Java 17 and Maven)")
        started = time.monotonic()
        try:
            if self.backend == "docker":
                self._start_docker()
            else:
                self._start_jars()
            self.wait_until_ready(self.startup_timeout)
            if self.security == "sasl":
                self._set_up_security()
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop()
            raise
        log.info(
            "Kafka %s (%d broker(s), %s backend) ready at %s in %.1f s",
            self.kafka_version, self.brokers, self.backend, self.bootstrap_servers,
            time.monotonic() - started,
        )  # fmt: skip

    def stop(self, keep_data: bool = False) -> None:
        """Shut every broker down (SIGTERM, then SIGKILL after a grace period), remove the data."""
        if self.backend == "docker":
            self._stop_docker()
        else:
            for node in self.nodes:
                if node.pid is not None and pid_alive(node.pid, _MAIN_CLASS):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(node.pid, 15)
            for node in self.nodes:
                self._wait_stopped(node, _STOP_TIMEOUT_S)
        self._procs.clear()
        if not keep_data:
            self._remove_data()
        self.nodes = []

    def kill_broker(self, index: int) -> None:
        """Kill broker ``index`` with SIGKILL (no controlled shutdown) and wait until it is gone."""
        node = self.nodes[index]
        if self.backend == "docker":
            self._docker("kill", self._container(node))
            return
        if node.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, 9)
        self._wait_stopped(node, 10.0)

    def stop_broker(self, index: int) -> None:
        """Shut broker ``index`` down cleanly (SIGTERM, controlled shutdown)."""
        node = self.nodes[index]
        if self.backend == "docker":
            self._docker("stop", "-t", str(int(_STOP_TIMEOUT_S)), self._container(node))
            return
        if node.pid is not None and pid_alive(node.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(node.pid, 15)
        self._wait_stopped(node, _STOP_TIMEOUT_S)

    def restart_broker(self, index: int, timeout: float | None = None) -> None:
        """Start broker ``index`` again (stopping it first if it runs) and wait until it rejoins."""
        if self.is_running(index):
            self.stop_broker(index)
        node = self.nodes[index]
        if self.backend == "docker":
            self._docker("start", self._container(node))
        else:
            self._launch(node)
        self.wait_until_ready(timeout or self.startup_timeout)

    def broker_pid(self, index: int) -> int | None:
        """The process id of broker ``index`` (jar backend; None for a container or no process)."""
        node = self.nodes[index]
        if self.backend == "docker" or node.pid is None or not pid_alive(node.pid, _MAIN_CLASS):
            return None
        return node.pid

    def pause_broker(self, index: int) -> None:
        """Freeze broker ``index`` (SIGSTOP, or ``docker pause``), as a long GC pause would."""
        node = self.nodes[index]
        if self.backend == "docker":
            self._docker("pause", self._container(node))
            return
        pid = self.broker_pid(index)
        if pid is None:
            raise DevClusterError(f"broker {node.node_id} is not running")
        os.kill(pid, signal.SIGSTOP)

    def resume_broker(self, index: int) -> None:
        """Let a paused broker ``index`` run again (SIGCONT, or ``docker unpause``)."""
        node = self.nodes[index]
        if self.backend == "docker":
            self._docker("unpause", self._container(node))
            return
        pid = self.broker_pid(index)
        if pid is not None:
            os.kill(pid, signal.SIGCONT)

    def is_running(self, index: int) -> bool:
        """Whether the process (or container) of broker ``index`` is alive."""
        node = self.nodes[index]
        if self.backend == "docker":
            result = _run(["docker", "inspect", "-f", "{{.State.Running}}", self._container(node)])
            return result.returncode == 0 and result.stdout.strip() == "true"
        return node.pid is not None and pid_alive(node.pid, _MAIN_CLASS)

    def broker_log(self, index: int) -> str:
        """Everything broker ``index`` has logged so far (across restarts)."""
        node = self.nodes[index]
        if self.backend == "docker":
            result = _run(["docker", "logs", self._container(node)])
            return result.stdout + result.stderr
        path = Path(node.directory) / "broker.log"
        return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""

    def wait_until_ready(self, timeout: float = 60.0) -> None:
        """Wait until every live broker is listed in the cluster metadata."""
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout
        expected = {n.node_id for n in self.nodes}
        admin: Any = None
        seen: set[int] = set()
        last = "no metadata request sent (a port is closed)"
        while True:
            self._check_alive()
            if admin is None and all(port_open(n.port) for n in self.nodes):
                conf: dict[str, Any] = {
                    "bootstrap.servers": self.bootstrap_servers,
                    "logger": logging.getLogger("dualwrite.librdkafka.dev"),
                }
                admin = AdminClient(conf)
            if admin is not None:
                try:
                    metadata = admin.list_topics(timeout=2.0)
                    seen = {int(b) for b in metadata.brokers}
                    if expected <= seen:
                        return
                    last = f"the last metadata answer listed brokers {sorted(seen)}"
                except Exception as e:  # KafkaException while brokers register
                    log.debug("metadata not ready yet: %s", e)
                    last = f"the last metadata request failed: {e}"
            if time.monotonic() > deadline:
                missing = sorted(expected - seen)
                raise DevClusterError(
                    f"Kafka {self.kafka_version} did not become ready within {timeout:.0f} s "
                    f"(brokers not in metadata: {missing}; {last}).\n"
                    f"{self._lifecycle_lines()}\n{self._log_tails()}"
                )
            time.sleep(0.2)

    def create_topic(self, name: str, partitions: int = 3, replication_factor: int | None = None,
                     config: Mapping[str, str] | None = None, timeout: float = 30.0) -> str:
        """Create a topic (RF: min(brokers of this cluster, 3) by default); wait for leaders."""
        rf = replication_factor or min(len(self.nodes), 3)
        return create_topic(self.bootstrap_servers, name, partitions, rf, config, timeout)

    # -- state for detached clusters --------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """A JSON-able description that :meth:`from_state` turns back into a cluster handle."""
        return {
            "backend": self.backend,
            "kafka_version": self.kafka_version,
            "brokers": self.brokers,
            "cluster_id": self.cluster_id,
            "bootstrap_servers": self.bootstrap_servers,
            "data_dir": str(self.data_dir) if self.data_dir else None,
            "owns_data_dir": self._given_data_dir is None,
            "network": self.network,
            "extra_config": self.extra_config,
            "nodes": [asdict(n) for n in self.nodes],
            "security": self.security_state(),
        }

    def security_state(self) -> dict[str, Any]:
        """Addresses, principal and file paths of a secured cluster, without any password."""
        if self.security != "sasl":
            return {}
        if self.restored_security:
            return dict(self.restored_security)
        sec = self._require_secrets()
        assert sec.tls is not None
        return {
            "mechanism": "SCRAM-SHA-512",
            "sasl_ssl_bootstrap_servers": self.ssl_bootstrap_servers,
            "sasl_plaintext_bootstrap_servers": self.sasl_bootstrap_servers,
            "internal_bootstrap_servers": self.bootstrap_servers,
            "app_principal": sec.app.principal,
            "client_properties": str(sec.directory / "client.properties"),
            "client_properties_sasl_plaintext": str(
                sec.directory / "client-sasl-plaintext.properties"),
            "admin_properties": str(sec.directory / "admin.properties"),
            "ca_file": str(sec.tls.ca_pem),
        }

    def save_state(self, path: Path) -> None:
        """Write :meth:`to_state` as JSON to ``path`` (atomically)."""
        write_state(path, self.to_state())

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | Path) -> LocalKafkaCluster:
        """A handle on a cluster another process started (see :meth:`save_state`)."""
        if isinstance(state, Path):
            state = read_state(state)
        data_dir = Path(state["data_dir"]) if state.get("data_dir") else None
        cluster = cls(
            brokers=int(state["brokers"]),
            kafka_version=str(state["kafka_version"]),
            data_dir=None if state.get("owns_data_dir", True) else data_dir,
            extra_config=state.get("extra_config") or {},
            backend=state["backend"],
            detach=True,
            security="sasl" if state.get("security") else "none",
        )
        cluster.restored_security = dict(state.get("security") or {})
        cluster.backend = state["backend"]
        cluster.data_dir = data_dir
        cluster.cluster_id = str(state["cluster_id"])
        cluster.network = state.get("network")
        cluster.nodes = [BrokerNode(**n) for n in state["nodes"]]
        return cluster

    # -- internals ---------------------------------------------------------------------------

    def _settings(self) -> dict[str, str]:
        settings = transactional_defaults(self.brokers)
        settings.update(_share_group_defaults(self.brokers, self.kafka_version))
        settings.update(self.extra_config)
        return settings

    def _check_alive(self) -> None:
        if self.backend == "docker":
            for node in self.nodes:
                if not self.is_running(node.index):
                    raise DevClusterError(
                        f"Kafka container {node.container} stopped during startup.\n"
                        f"{self._log_tails([node])}"
                    )
            return
        for node in self.nodes:
            proc = self._procs.get(node.index)
            if proc is not None and proc.poll() is not None:
                raise DevClusterError(
                    f"Kafka broker {node.node_id} exited with code {proc.returncode} during "
                    f"startup.{self._hint(node)}\n{self._log_tails([node])}"
                )

    def _hint(self, node: BrokerNode) -> str:
        text = tail(Path(node.directory) / "broker.log", 200)
        if "UnsupportedClassVersionError" in text:
            return " The JVM is too old: Kafka 4.x needs Java 17 or newer."
        if "Address already in use" in text:
            return " A port was taken between choosing it and binding it; start again."
        return ""

    def _lifecycle_lines(self, lines: int = 20) -> str:
        """The last registration, fencing and heartbeat lines of each broker's log: why a
        broker that runs is not in the metadata (the tail is often coordinator loading)."""
        parts = []
        for node in self.nodes:
            found = [line for line in self.broker_log(node.index).splitlines()
                     if line.startswith("[") and _LIFECYCLE.search(line)]  # not the config
            parts.append(f"--- broker {node.node_id}: registration and fencing ---\n"
                         + "\n".join(found[-lines:]))
        return "\n".join(parts)

    def _log_tails(self, nodes: list[BrokerNode] | None = None, lines: int = 30) -> str:
        parts = []
        for node in nodes if nodes is not None else self.nodes:
            if self.backend == "docker":
                text = "\n".join(self.broker_log(node.index).splitlines()[-lines:])
            else:
                text = tail(Path(node.directory) / "broker.log", lines)
            parts.append(f"--- last lines of broker {node.node_id} log ---\n{text}")
        return "\n".join(parts)

    def _allocate_nodes(self, directory: Path | None) -> None:
        per = 4 if self.security == "sasl" else 2
        ports = free_ports(per * self.brokers)
        self.nodes = [
            BrokerNode(
                index=i,
                node_id=i + 1,
                port=ports[per * i],
                controller_port=ports[per * i + 1],
                directory=str(directory / f"node-{i + 1}") if directory else "",
                sasl_port=ports[per * i + 2] if per == 4 else None,
                ssl_port=ports[per * i + 3] if per == 4 else None,
            )
            for i in range(self.brokers)
        ]
        if self.proxied:
            extra = free_ports(2 * self.brokers)
            for i, node in enumerate(self.nodes):
                node.external_port, node.proxy_port = extra[2 * i], extra[2 * i + 1]

    def _set_up_security(self) -> None:
        """Create the SCRAM users and write the client properties files (no ACLs yet)."""
        sec = self._require_secrets()
        upsert_scram_users(self.bootstrap_servers, [sec.admin, sec.app])
        note = "dualwrite dev cluster, principal {0}; --kafka-properties form (librdkafka names)"
        write_properties_file(sec.directory / "client.properties",
                              self.client_config(sec.app, "SASL_SSL"),
                              note.format(sec.app.principal))
        write_properties_file(sec.directory / "client-sasl-plaintext.properties",
                              self.client_config(sec.app, "SASL_PLAINTEXT"),
                              note.format(sec.app.principal))
        write_properties_file(sec.directory / "admin.properties",
                              self.client_config(sec.admin, "SASL_SSL"),
                              note.format(sec.admin.principal) + ", a super user")
        self.wait_for_authentication(self.client_config(sec.app, "SASL_SSL"))

    def wait_for_authentication(self, config: Mapping[str, str], timeout: float = 30.0) -> None:
        """Wait until SCRAM credentials just created authenticate on every broker."""
        from confluent_kafka.admin import AdminClient

        conf: dict[str, Any] = dict(config)
        conf["logger"] = logging.getLogger("dualwrite.librdkafka.dev")
        admin = AdminClient(conf)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if len(admin.list_topics(timeout=2.0).brokers) >= len(self.nodes):
                    return
            except Exception as e:  # authentication fails until the credential propagates
                log.debug("SCRAM credentials not usable yet: %s", type(e).__name__)
            if time.monotonic() > deadline:
                raise DevClusterError(
                    f"SCRAM credentials did not authenticate within {timeout:.0f} s")
            time.sleep(0.2)

    # jar backend

    def _start_jars(self) -> None:
        self._java = find_java("Kafka 4.x brokers")
        self._classpath = os.pathsep.join(str(j) for j in kafka_classpath(self.kafka_version))
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="dualwrite-kafka-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._allocate_nodes(self.data_dir)
        if self.security == "sasl":
            security_dir = self.data_dir / "security"
            if security_dir.exists():
                shutil.rmtree(security_dir)
            self.secrets = ClusterSecurity.create(security_dir)
        for node in self.nodes:
            node_dir = Path(node.directory)
            if node_dir.exists():
                shutil.rmtree(node_dir)
            node_dir.mkdir(parents=True)
            _write_properties(node_dir / "server.properties", self.broker_config(node.index))
            if logging_flavour(self.kafka_version) == "log4j2":
                (node_dir / "log4j2.properties").write_text(_LOG4J2, encoding="utf-8")
            else:
                (node_dir / "log4j.properties").write_text(_LOG4J1, encoding="utf-8")
        self._format_storage()
        for node in self.nodes:
            self._launch(node)

    def _jvm_args(self, node: BrokerNode, short_lived: bool = False) -> list[str]:
        assert self._java is not None and self._classpath is not None
        # C1-only JIT halves the start-up of the one-shot storage tool; brokers keep full JIT.
        jit = ["-XX:TieredStopAtLevel=1"] if short_lived else []
        node_dir = Path(node.directory)
        if logging_flavour(self.kafka_version) == "log4j2":
            log_opt = f"-Dlog4j2.configurationFile={node_dir / 'log4j2.properties'}"
        else:
            log_opt = f"-Dlog4j.configuration=file:{node_dir / 'log4j.properties'}"
        return [
            self._java, "-Xms128m", f"-Xmx{self.heap}", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
            "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true", log_opt,
            f"-Dkafka.logs.dir={node_dir / 'logs'}", *jit, "-cp", self._classpath,
        ]  # fmt: skip

    def _format_storage(self) -> None:
        procs = []
        for node in self.nodes:
            node_dir = Path(node.directory)
            cmd = [
                *self._jvm_args(node, short_lived=True), "kafka.tools.StorageTool", "format",
                "--cluster-id", self.cluster_id, "--config", str(node_dir / "server.properties"),
            ]  # fmt: skip
            out = (node_dir / "format.log").open("wb")
            procs.append((node, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT), out))
        failures = []
        for node, proc, out in procs:
            try:
                code = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = -9
            out.close()
            if code != 0:
                text = tail(Path(node.directory) / "format.log", 20)
                failures.append(f"node {node.node_id} (exit {code}):\n{text}")
        if failures:
            raise DevClusterError(
                "kafka.tools.StorageTool format failed for " + "\n".join(failures)
            )

    def _launch(self, node: BrokerNode) -> None:
        node_dir = Path(node.directory)
        cmd = [*self._ensure_jvm_args(node), _MAIN_CLASS, str(node_dir / "server.properties")]
        out: IO[bytes] = (node_dir / "broker.log").open("ab")
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=node_dir,
                start_new_session=True,
                preexec_fn=None if self.detach else parent_death_signal(),
            )
        finally:
            out.close()
        node.pid = proc.pid
        self._procs[node.index] = proc
        log.debug("started Kafka broker %d (pid %d) on %s", node.node_id, proc.pid, node.address)

    def _ensure_jvm_args(self, node: BrokerNode) -> list[str]:
        if self._java is None:
            self._java = find_java("Kafka 4.x brokers")
        if self._classpath is None:
            jars = kafka_classpath(self.kafka_version)
            self._classpath = os.pathsep.join(str(j) for j in jars)
        return self._jvm_args(node)

    def _wait_stopped(self, node: BrokerNode, timeout: float) -> None:
        proc = self._procs.get(node.index)
        if proc is not None:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning(
                    "broker %d ignored SIGTERM for %.0f s; killing it", node.node_id, timeout
                )
                proc.kill()
                proc.wait(timeout=10)
        elif node.pid is not None:
            terminate_pid(node.pid, timeout, must_contain=_MAIN_CLASS)

    def _remove_data(self) -> None:
        if self.backend == "docker" or self.data_dir is None:
            return
        if self._given_data_dir is None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        else:
            for node in self.nodes:
                if node.directory:
                    shutil.rmtree(node.directory, ignore_errors=True)
            shutil.rmtree(self.data_dir / "security", ignore_errors=True)
            with contextlib.suppress(OSError):
                self.data_dir.rmdir()  # only if now empty

    # docker backend

    def _container(self, node: BrokerNode) -> str:
        if node.container is None:
            raise DevClusterError(f"broker {node.node_id} has no container")
        return node.container

    def _docker(self, *args: str, timeout: float = 120.0) -> str:
        result = _run(["docker", *args], timeout=timeout)
        if result.returncode != 0:
            raise DevClusterError(f"`docker {' '.join(args[:2])}` failed: {result.stderr.strip()}")
        return result.stdout.strip()

    def _start_docker(self) -> None:
        if self.security != "none" or self.proxied:
            raise DevClusterError(
                "security='sasl' and proxied=True need the jars backend (Java 17 and Maven): "
                "the run's CA and keystore are files the brokers read from the local disk, and "
                "a proxied listener advertises a loopback port of this host")
        image = f"{DOCKER_IMAGE}:{self.kafka_version}"
        if _run(["docker", "image", "inspect", image]).returncode != 0:
            log.info("pulling %s", image)
            self._docker("pull", image, timeout=900.0)
        suffix = self.cluster_id[:8].lower().replace("_", "x").replace("-", "x")
        self.network = f"dualwrite-kafka-{suffix}"
        self._docker("network", "create", "--label", _DOCKER_LABEL, self.network)
        self._allocate_nodes(None)
        for node in self.nodes:
            node.container = f"dualwrite-kafka-{suffix}-{node.node_id}"
            node.controller_port = 9093
        voters = ",".join(f"{n.node_id}@{n.container}:9093" for n in self.nodes)
        for node in self.nodes:
            env = {
                "CLUSTER_ID": self.cluster_id,
                "KAFKA_HEAP_OPTS": f"-Xms128m -Xmx{self.heap}",
                "KAFKA_NODE_ID": str(node.node_id),
                "KAFKA_PROCESS_ROLES": "broker,controller",
                "KAFKA_CONTROLLER_QUORUM_VOTERS": voters,
                "KAFKA_LISTENERS": "INTERNAL://:19092,EXTERNAL://:9092,CONTROLLER://:9093",
                "KAFKA_ADVERTISED_LISTENERS": (
                    f"INTERNAL://{node.container}:19092,EXTERNAL://127.0.0.1:{node.port}"
                ),
                "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": (
                    "INTERNAL:PLAINTEXT,EXTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT"
                ),
                "KAFKA_INTER_BROKER_LISTENER_NAME": "INTERNAL",
                "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
                "KAFKA_LOG_DIRS": "/tmp/kraft-combined-logs",
            }
            env.update({docker_env_name(k): v for k, v in self._settings().items()})
            args = ["run", "-d", "--name", str(node.container), "--hostname", str(node.container)]
            args += ["--network", self.network, "--label", _DOCKER_LABEL]
            args += ["-p", f"127.0.0.1:{node.port}:9092"]
            for key, value in env.items():
                args += ["-e", f"{key}={value}"]
            self._docker(*args, image)

    def _stop_docker(self) -> None:
        containers = [n.container for n in self.nodes if n.container]
        if containers:
            # One call stops them in parallel, so no node waits for a quorum that is leaving.
            _run(["docker", "stop", "-t", str(int(_STOP_TIMEOUT_S)), *containers], timeout=120.0)
            _run(["docker", "rm", "-f", "-v", *containers])
        if self.network:
            _run(["docker", "network", "rm", self.network])
            self.network = None
