"""What a Kafka cluster offers dualwrite: the requests it needs, the brokers' versions and
features, KIP-939 support (``dualwrite probe``), and whether the bootstrap host names resolve.

The requests are :class:`~dualwrite.participant.control_plane.ControlPlane`'s; this module asks
them (:meth:`ProbeResult.gather`) and says what the answers mean.
"""

from __future__ import annotations

import enum
import logging
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from dualwrite.errors import BrokerUnreachableError
from dualwrite.participant.identifiers import ProducerIdentity

__all__ = [
    "RESOLVE_BOUND_S",
    "ApiKey",
    "ApiRange",
    "BrokerProbe",
    "ProbeRequests",
    "ProbeResult",
    "check_resolvable",
]

log = logging.getLogger(__name__)


class ApiKey(enum.IntEnum):
    """The requests recovery and status send besides what librdkafka's transactions need:
    every broker must offer them all."""

    FIND_COORDINATOR = 10
    INIT_PRODUCER_ID = 22
    END_TXN = 26
    DESCRIBE_PRODUCERS = 61
    DESCRIBE_TRANSACTIONS = 65
    LIST_TRANSACTIONS = 66

    @property
    def request_name(self) -> str:
        """The request's name in the Kafka protocol (``FindCoordinator``)."""
        return "".join(word.capitalize() for word in self.name.split("_"))


@dataclass(frozen=True)
class ApiRange:
    min_version: int
    max_version: int


@dataclass(frozen=True)
class BrokerProbe:
    node_id: int
    host: str
    port: int
    software: str
    api_versions: Mapping[int, ApiRange]
    finalized_features: Mapping[str, int]


class ProbeRequests(Protocol):
    """The requests a probe sends (:class:`~dualwrite.participant.control_plane.ControlPlane`
    answers them)."""

    def broker_versions(self) -> list[BrokerProbe]: ...

    def broker_configs(self, node_id: int) -> dict[str, str]: ...

    def init_producer_id_v6(self, transactional_id: str, *, enable_2pc: bool,
                            keep_prepared_txn: bool, transaction_timeout_ms: int = 60_000
                            ) -> ProducerIdentity: ...


@dataclass(frozen=True)
class ProbeResult:
    """What a cluster can do for two-phase commit; see ``dualwrite probe``."""

    brokers: tuple[BrokerProbe, ...]
    transaction_version: int | None
    max_transaction_timeout_ms: int | None
    two_phase_commit_enabled: bool | None
    init_producer_id_max_version: int | None
    enable_2pc: str
    keep_prepared_txn: str

    @classmethod
    def gather(cls, requests: ProbeRequests, *, probe_transactional_id: str = "dualwrite-probe",
               check_2pc: bool = True) -> ProbeResult:
        """What the cluster supports: versions, transaction.version, and KIP-939 (2PC) support.

        With ``check_2pc`` it sends InitProducerId v6 on ``probe_transactional_id`` (an id no
        application uses: it is fenced in the process) to learn whether Enable2Pc and
        KeepPreparedTxn are accepted.
        """
        brokers = requests.broker_versions()
        ipid = min((b.api_versions[ApiKey.INIT_PRODUCER_ID].max_version for b in brokers
                    if ApiKey.INIT_PRODUCER_ID in b.api_versions), default=None)
        tv = min((b.finalized_features.get("transaction.version", 0) for b in brokers),
                 default=None)
        configs = requests.broker_configs(brokers[0].node_id) if brokers else {}
        max_timeout = configs.get("transaction.max.timeout.ms")
        # Absent before Kafka 4.1 (KIP-939): reported as None ("not known"), not False.
        two_pc_cfg = configs.get("transaction.two.phase.commit.enable")
        enable_2pc = keep = "not tried"
        if check_2pc:
            if ipid is None or ipid < 6:
                enable_2pc = keep = (f"unsupported: brokers offer InitProducerId up to v{ipid} "
                                     "(v6 needs unstable.api.versions.enable=true)")
            else:
                enable_2pc = _try_init_v6(requests, probe_transactional_id, keep=False)
                keep = _try_init_v6(requests, probe_transactional_id, keep=True)
        return cls(
            brokers=tuple(brokers),
            transaction_version=tv,
            max_transaction_timeout_ms=int(max_timeout) if max_timeout else None,
            two_phase_commit_enabled=(two_pc_cfg.lower() == "true") if two_pc_cfg else None,
            init_producer_id_max_version=ipid,
            enable_2pc=enable_2pc,
            keep_prepared_txn=keep,
        )

    @property
    def missing(self) -> list[str]:
        """The requests dualwrite needs that some broker does not offer, with those brokers."""
        out = []
        for key in ApiKey:
            lacking = [b.node_id for b in self.brokers if key not in b.api_versions]
            if lacking:
                out.append(f"{key.request_name} (API key {int(key)}; "
                           f"broker{'s' if len(lacking) > 1 else ''} "
                           f"{', '.join(map(str, lacking))})")
        return out

    @property
    def supported(self) -> bool:
        return bool(self.brokers) and not self.missing

    @property
    def verdict(self) -> str:
        """One line: whether dualwrite works on this cluster, in which mode, or what is missing.

        dualwrite runs in epoch-resume mode on every released broker: librdkafka's TV1 session
        plus EndTxn by (producer id, epoch) and the anchor checks (docs/design.md). KIP-939's
        KeepPreparedTxn is reported, not needed: no released broker accepts it
        (docs/broker-facts.md).
        """
        if not self.brokers:
            return "dualwrite: not supported — no broker answered"
        if self.missing:
            return ("dualwrite: not supported — the brokers lack " + "; ".join(self.missing)
                    + " (Kafka 3.0 or newer has them all)")
        native = (" (KIP-939 KeepPreparedTxn accepted, not used yet)"
                  if self.keep_prepared_txn.startswith("accepted") else "")
        return (f"dualwrite: supported — epoch-resume mode (transaction.version="
                f"{self.transaction_version}){native}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "supported": self.supported,
            "missing": self.missing,
            "verdict": self.verdict,
            "brokers": [
                {
                    "node_id": b.node_id,
                    "address": f"{b.host}:{b.port}",
                    "software": b.software,
                    "finalized_features": dict(b.finalized_features),
                    "api_versions": {
                        str(k): [v.min_version, v.max_version]
                        for k, v in sorted(b.api_versions.items())
                    },
                }
                for b in self.brokers
            ],
            "transaction_version": self.transaction_version,
            "max_transaction_timeout_ms": self.max_transaction_timeout_ms,
            "transaction_two_phase_commit_enable": self.two_phase_commit_enabled,
            "init_producer_id_max_version": self.init_producer_id_max_version,
            "enable_2pc": self.enable_2pc,
            "keep_prepared_txn": self.keep_prepared_txn,
        }


def _try_init_v6(requests: ProbeRequests, tid: str, *, keep: bool) -> str:
    """Whether InitProducerId v6 with Enable2Pc (and ``keep``: KeepPreparedTxn) is accepted."""
    try:
        ident = requests.init_producer_id_v6(tid, enable_2pc=True, keep_prepared_txn=keep)
    except Exception as exc:
        info = getattr(exc, "info", None)
        return f"rejected: {info.name if info else exc}"
    return f"accepted (producer_id={ident.producer_id}, epoch={ident.epoch})"


#: The longest the look-up of the bootstrap host names may take before connecting is tried
#: anyway (a resolver that hangs is then kafka-python's to wait for, within the timeout).
RESOLVE_BOUND_S = 5.0


def _split_server(entry: str) -> tuple[str, int]:
    """``host:port`` (also ``[v6]:port``, ``PROTOCOL://host:port``, a bare host) as its parts."""
    entry = entry.strip().rsplit("://", 1)[-1]
    host, sep, port = entry.rpartition(":")
    if not sep or "]" in port or (host.count(":") and not host.startswith("[")):
        host, port = entry, "9092"  # a bare host name, or a bare IPv6 address
    try:
        number = int(port)
    except ValueError:
        number = 9092
    return host.strip("[]"), number


def check_resolvable(servers: Sequence[str], bound_s: float = RESOLVE_BOUND_S) -> None:
    """Look the bootstrap host names up (``socket.getaddrinfo``), all at once and for at most
    ``bound_s``: raise :class:`BrokerUnreachableError` ("cannot resolve host ...") at once when
    none resolves, rather than let the client retry a name that does not exist until its
    timeout; log the ones that fail when others resolve. A look-up still running after
    ``bound_s`` is not counted as failed."""
    results: dict[str, str | None] = {}

    def look_up(host: str, port: int) -> None:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            results[host] = None
        except (OSError, UnicodeError) as exc:  # socket.gaierror; a label too long (IDNA)
            results[host] = str(exc) or type(exc).__name__

    hosts = dict(_split_server(s) for s in servers if s.strip())
    threads = [threading.Thread(target=look_up, args=(h, p), daemon=True,
                                name="dualwrite-resolve") for h, p in hosts.items()]
    until = time.monotonic() + bound_s
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, until - time.monotonic()))
    failed = {h: why for h, why in dict(results).items() if why is not None}
    if not failed:
        return
    names = ", ".join(repr(h) for h in failed)
    reason = next(iter(failed.values()))
    if len(failed) == len(hosts):
        raise BrokerUnreachableError(
            f"cannot resolve host {names} ({reason}): check the host names in "
            f"bootstrap.servers ({','.join(servers)}) and the DNS")
    log.warning("cannot resolve Kafka bootstrap host %s (%s); trying the others", names, reason)
