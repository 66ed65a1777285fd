"""Security for the local Kafka cluster: a run's own CA, SCRAM users, ACLs, client properties.

``LocalKafkaCluster(security="sasl")`` uses this module. The cluster gets a SASL_PLAINTEXT and a
SASL_SSL listener (SCRAM-SHA-512, TLS with a CA made for the run by ``keytool``), the KRaft
``StandardAuthorizer``, and an internal PLAINTEXT listener for inter-broker traffic and the dev
tooling whose principal (``User:ANONYMOUS``) is a super user, as is the controller listener's.
Every address is on 127.0.0.1. Passwords are random per run, written only to files readable
by their owner, and never logged or put in ``repr``/JSON.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dualwrite.dev._util import DevClusterError

__all__ = [
    "ADMIN_USER",
    "APP_USER",
    "GROUP_PREFIX",
    "MECHANISM",
    "Acl",
    "ClusterSecurity",
    "ScramUser",
    "TlsMaterial",
    "application_acls",
    "create_acls",
    "delete_acls",
    "make_tls_material",
    "upsert_scram_users",
    "write_properties_file",
]

log = logging.getLogger(__name__)

MECHANISM = "SCRAM-SHA-512"
ADMIN_USER = "admin"
APP_USER = "dualwrite-app"
GROUP_PREFIX = "dualwrite-verify-"
"""Consumer group ids that ``anchor_reader.AnchorReader`` uses (``dualwrite-verify-<hex>``)."""

ListenerProtocol = Literal["SASL_SSL", "SASL_PLAINTEXT"]


@dataclass(frozen=True)
class ScramUser:
    """A SCRAM user; the password is left out of ``repr``."""

    name: str
    password: str = field(repr=False)

    @property
    def principal(self) -> str:
        return f"User:{self.name}"

    @classmethod
    def generate(cls, name: str) -> ScramUser:
        """A user with a fresh random password."""
        return cls(name, secrets.token_urlsafe(24))


@dataclass(frozen=True)
class TlsMaterial:
    """The run's CA (PEM, for clients) and the brokers' PKCS12 keystore."""

    ca_pem: Path
    keystore: Path
    keystore_password: str = field(repr=False)


@dataclass(frozen=True)
class Acl:
    """One ALLOW ACL: ``operation`` on ``resource_type`` ``name`` (``pattern`` LITERAL/PREFIXED)."""

    principal: str
    operation: str  # READ, WRITE, DESCRIBE, DESCRIBE_CONFIGS, IDEMPOTENT_WRITE, ...
    resource_type: str  # TOPIC, GROUP, TRANSACTIONAL_ID, CLUSTER
    name: str
    pattern: str = "LITERAL"  # LITERAL or PREFIXED

    def __str__(self) -> str:
        kind = "prefix " if self.pattern == "PREFIXED" else ""
        return f"{self.operation} on {self.resource_type} {kind}{self.name!r} for {self.principal}"


def application_acls(
    principal: str,
    *,
    topics: Iterable[str] = (),
    topic_prefix: str | None = None,
    transactional_id_prefix: str = "",
    describe_configs: bool = True,
) -> list[Acl]:
    """The minimal ACLs of a dualwrite application (see docs/operating.md, "Secured clusters").

    Topics by name and/or by prefix: WRITE (produce) and READ (read_committed anchor checks,
    DescribeProducers); transactional ids by prefix: WRITE (implies DESCRIBE); consumer groups
    ``dualwrite-verify-`` by prefix: DESCRIBE (FindCoordinator of the anchor check); the
    cluster: DESCRIBE_CONFIGS (to read ``transaction.max.timeout.ms``; not needed when
    ``transaction.timeout.ms`` is set). An empty prefix means every name (``*``).
    """
    acls: list[Acl] = []

    def resource(kind: str, prefix: str) -> tuple[str, str]:
        return (kind, "*") if prefix == "" else (kind, prefix)

    topic_resources = [("TOPIC", t, "LITERAL") for t in topics]
    if topic_prefix is not None:
        kind, name = resource("TOPIC", topic_prefix)
        topic_resources.append((kind, name, "LITERAL" if name == "*" else "PREFIXED"))
    for kind, name, pattern in topic_resources:
        acls += [Acl(principal, op, kind, name, pattern) for op in ("WRITE", "READ")]
    _, tid = resource("TRANSACTIONAL_ID", transactional_id_prefix)
    acls.append(Acl(principal, "WRITE", "TRANSACTIONAL_ID", tid,
                    "LITERAL" if tid == "*" else "PREFIXED"))
    acls.append(Acl(principal, "DESCRIBE", "GROUP", GROUP_PREFIX, "PREFIXED"))
    if describe_configs:
        acls.append(Acl(principal, "DESCRIBE_CONFIGS", "CLUSTER", "kafka-cluster"))
    return acls


# confluent_kafka.admin re-exports its ACL and SCRAM classes as its public names, without an
# __all__ that tells mypy so: hence the ignores on these imports.


def _binding(acl: Acl) -> Any:
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    return AclBinding(
        # librdkafka calls Kafka's CLUSTER resource type (code 4) BROKER.
        ResourceType.BROKER if acl.resource_type == "CLUSTER" else ResourceType[acl.resource_type],
        acl.name, ResourcePatternType[acl.pattern],
        acl.principal, "*", AclOperation[acl.operation], AclPermissionType.ALLOW,
    )  # fmt: skip


def _admin(bootstrap_servers: str) -> Any:
    from confluent_kafka.admin import AdminClient

    conf: dict[str, Any] = {"bootstrap.servers": bootstrap_servers,
                            "logger": logging.getLogger("dualwrite.librdkafka.dev")}
    return AdminClient(conf)


def create_acls(admin_bootstrap: str, acls: Iterable[Acl], timeout: float = 30.0) -> None:
    """Create ALLOW ACLs as a super user (via the cluster's internal listener).

    Returns once the broker's authorizer lists them (DescribeAcls), so they are in force.
    """
    _change_acls(admin_bootstrap, acls, timeout, create=True)


def delete_acls(admin_bootstrap: str, acls: Iterable[Acl], timeout: float = 30.0) -> None:
    """Delete exactly these ACLs; returns once the authorizer no longer lists them."""
    _change_acls(admin_bootstrap, acls, timeout, create=False)


def _change_acls(admin_bootstrap: str, acls: Iterable[Acl], timeout: float, *,
                 create: bool) -> None:
    bindings = [_binding(a) for a in acls]
    if not bindings:
        return
    admin = _admin(admin_bootstrap)  # keep the handle alive until the futures resolve
    if create:
        futures = admin.create_acls(bindings, request_timeout=timeout)
    else:
        futures = admin.delete_acls([_as_filter(b) for b in bindings], request_timeout=timeout)
    verb = "create" if create else "delete"
    for binding, future in futures.items():
        try:
            future.result(timeout)
        except Exception as exc:
            raise DevClusterError(f"cannot {verb} ACL {binding}: {exc}") from exc
    deadline = time.monotonic() + timeout
    for binding in bindings:
        query = _as_filter(binding)
        while bool(admin.describe_acls(query, request_timeout=timeout).result(timeout)) != create:
            if time.monotonic() > deadline:
                raise DevClusterError(f"ACL {binding} not {'in' if create else 'out of'} "
                                      f"force after {timeout:.0f} s")
            time.sleep(0.1)


def _as_filter(binding: Any) -> Any:
    from confluent_kafka.admin import AclBindingFilter  # type: ignore[attr-defined]

    return AclBindingFilter(binding.restype, binding.name, binding.resource_pattern_type,
                            binding.principal, binding.host, binding.operation,
                            binding.permission_type)


def upsert_scram_users(admin_bootstrap: str, users: Iterable[ScramUser],
                       timeout: float = 30.0) -> None:
    """Create (or reset the password of) SCRAM-SHA-512 users (AlterUserScramCredentials)."""
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        ScramCredentialInfo,
        ScramMechanism,
        UserScramCredentialUpsertion,
    )

    alterations = [
        UserScramCredentialUpsertion(
            u.name, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192),
            u.password.encode(), secrets.token_bytes(16))
        for u in users
    ]
    admin = _admin(admin_bootstrap)
    futures = admin.alter_user_scram_credentials(alterations, request_timeout=timeout)
    for name, future in futures.items():
        try:
            future.result(timeout)
        except Exception as exc:
            raise DevClusterError(f"cannot create SCRAM user {name!r}: {exc}") from exc


def _keytool() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "keytool").is_file():
        return str(Path(java_home) / "bin" / "keytool")
    tool = shutil.which("keytool")
    if tool is None:
        raise DevClusterError("keytool not found: install a JDK 17 (it ships with the JRE too)")
    return tool


def make_tls_material(directory: Path) -> TlsMaterial:
    """A CA made for this run and a broker key pair it signed (SAN 127.0.0.1 and localhost)."""
    directory.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(18)
    keytool = _keytool()
    ca_store, ks = directory / "ca.p12", directory / "broker.p12"
    csr, crt, ca_pem = directory / "broker.csr", directory / "broker.crt", directory / "ca.pem"
    common = ["-storetype", "PKCS12", "-storepass:env", "DW_STOREPASS"]
    env = {**os.environ, "DW_STOREPASS": password}

    def run(*args: str) -> None:
        cmd = [keytool, *args]
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120,
                                check=False)
        if result.returncode != 0:
            raise DevClusterError(
                f"keytool {args[0]} failed: {result.stdout.strip()} {result.stderr.strip()}")

    run("-genkeypair", "-alias", "ca", "-keyalg", "EC", "-groupname", "secp256r1",
        "-dname", "CN=dualwrite dev CA", "-validity", "30", "-ext", "bc:c",
        "-keystore", str(ca_store), *common)
    run("-exportcert", "-rfc", "-alias", "ca", "-keystore", str(ca_store), "-file", str(ca_pem),
        *common)
    run("-genkeypair", "-alias", "broker", "-keyalg", "EC", "-groupname", "secp256r1",
        "-dname", "CN=localhost", "-validity", "30", "-keystore", str(ks), *common)
    run("-certreq", "-alias", "broker", "-keystore", str(ks), "-file", str(csr), *common)
    run("-gencert", "-alias", "ca", "-keystore", str(ca_store), "-infile", str(csr),
        "-outfile", str(crt), "-rfc", "-validity", "30",
        "-ext", "SAN=ip:127.0.0.1,dns:localhost", "-ext", "EKU=serverAuth", *common)
    run("-importcert", "-noprompt", "-alias", "ca", "-keystore", str(ks), "-file", str(ca_pem),
        *common)
    run("-importcert", "-alias", "broker", "-keystore", str(ks), "-file", str(crt), *common)
    for path in (ca_store, ks):
        path.chmod(0o600)
    ca_store.unlink()  # nothing else is ever signed: the CA key need not outlive the run
    csr.unlink()
    return TlsMaterial(ca_pem=ca_pem, keystore=ks, keystore_password=password)


def client_settings(bootstrap_servers: str, protocol: ListenerProtocol, user: ScramUser,
                    ca_pem: Path | None) -> dict[str, str]:
    """A librdkafka (confluent-kafka) configuration for ``user`` on one of the SASL listeners."""
    conf = {
        "bootstrap.servers": bootstrap_servers,
        "security.protocol": protocol,
        "sasl.mechanism": MECHANISM,
        "sasl.username": user.name,
        "sasl.password": user.password,
    }
    if protocol == "SASL_SSL":
        if ca_pem is None:
            raise DevClusterError("SASL_SSL needs the run's CA")
        conf["ssl.ca.location"] = str(ca_pem)
    return conf


def write_properties_file(path: Path, settings: Mapping[str, str], comment: str) -> Path:
    """Write a ``--kafka-properties`` file readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(f"# {comment}\n")
        for key, value in settings.items():
            f.write(f"{key}={value}\n")
    return path


@dataclass
class ClusterSecurity:
    """What a secured local cluster hands out: users, CA, properties files (no secrets shown)."""

    directory: Path
    admin: ScramUser
    app: ScramUser
    tls: TlsMaterial | None = None
    app_acls: list[Acl] = field(default_factory=list)

    @classmethod
    def create(cls, directory: Path) -> ClusterSecurity:
        """Fresh users (random passwords) and TLS material under ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        return cls(directory, ScramUser.generate(ADMIN_USER), ScramUser.generate(APP_USER),
                   make_tls_material(directory))

    def broker_settings(self) -> dict[str, str]:
        """Listener-independent broker settings (authorizer, SASL, TLS keystore)."""
        assert self.tls is not None
        jaas = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        return {
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:ANONYMOUS;{self.admin.principal}",
            "allow.everyone.if.no.acl.found": "false",
            "sasl.enabled.mechanisms": MECHANISM,
            "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config": jaas,
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": jaas,
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(self.tls.keystore),
            "ssl.keystore.password": self.tls.keystore_password,
            "ssl.key.password": self.tls.keystore_password,
            "ssl.client.auth": "none",
        }
