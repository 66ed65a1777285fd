"""Translate a confluent-kafka (librdkafka) configuration into kafka-python keyword arguments."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from dualwrite.errors import FatalError

__all__ = ["kafka_python_config", "load_properties", "redacted"]

log = logging.getLogger(__name__)

_DIRECT = {
    "bootstrap.servers": "bootstrap_servers",
    "client.id": "client_id",
    "sasl.username": "sasl_plain_username",
    "sasl.password": "sasl_plain_password",
    "ssl.ca.location": "ssl_cafile",
    "ssl.certificate.location": "ssl_certfile",
    "ssl.key.location": "ssl_keyfile",
    "ssl.key.password": "ssl_password",
    "ssl.crl.location": "ssl_crlfile",
}

# Settings of the data path that the control plane has no use for.
_DATA_PATH_ONLY = (
    "transactional.id",
    "transaction.timeout.ms",
    "enable.idempotence",
    "acks",
    "linger.ms",
    "batch.",
    "compression.",
    "message.",
    "queue.",
    "retries",
    "retry.",
    "delivery.",
    "statistics.",
    "socket.",
    "group.",
    "isolation.level",
    "auto.",
    "enable.",
    "fetch.",
    "session.",
    "max.",
    "request.",
    "debug",
    "log_level",
    "error_cb",
    "stats_cb",
    "logger",
    "on_delivery",
)

_SECRET_WORDS = ("password", "secret", "token", "jaas")


def redacted(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` safe to log or print: secrets replaced by ``***``."""
    return {
        k: ("***" if any(w in k.lower() for w in _SECRET_WORDS) else v) for k, v in config.items()
    }


def kafka_python_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Map the connection and security part of a confluent-kafka config to kafka-python."""
    if "bootstrap.servers" not in config:
        raise FatalError("the Kafka configuration has no 'bootstrap.servers'")
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key in _DIRECT:
            out[_DIRECT[key]] = value
        elif key == "security.protocol":
            out["security_protocol"] = str(value).upper()
        elif key in ("sasl.mechanism", "sasl.mechanisms"):
            out["sasl_mechanism"] = str(value).upper()
        elif key == "ssl.endpoint.identification.algorithm":
            out["ssl_check_hostname"] = str(value).lower() == "https"
        elif key.startswith(("sasl.", "ssl.")):
            raise FatalError(
                f"the Kafka setting {key!r} is not supported by dualwrite's control plane; "
                "use SASL PLAIN/SCRAM with username and password, or SSL with PEM files"
            )
        elif not key.startswith(_DATA_PATH_ONLY):
            log.debug("control plane ignores Kafka setting %s", key)
    servers = out["bootstrap_servers"]
    if isinstance(servers, str):
        out["bootstrap_servers"] = [s.strip() for s in servers.split(",") if s.strip()]
    return out


def load_properties(path: str) -> dict[str, str]:
    """Read a Java-style ``key=value`` properties file (as used by Kafka's own tools)."""
    props: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for raw in f:
                line = raw.strip()
                if not line or line.startswith(("#", "!")):
                    continue
                sep = min((i for i in (line.find("="), line.find(":")) if i >= 0), default=-1)
                if sep < 0:
                    raise FatalError(f"{path}: line {line!r} is not key=value")
                props[line[:sep].strip()] = line[sep + 1 :].strip()
    except OSError as exc:
        raise FatalError(f"cannot read Kafka properties file {path}: {exc}") from exc
    return props
