"""Translate a confluent-kafka (librdkafka) configuration into kafka-python keyword arguments."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from typing import Any

from dualwrite.errors import FatalError

__all__ = [
    "LIBRDKAFKA_LOGGER",
    "Secret",
    "authentication_failure",
    "install_log_redaction",
    "kafka_python_config",
    "librdkafka_config",
    "load_properties",
    "redacted",
]

log = logging.getLogger(__name__)

LIBRDKAFKA_LOGGER = "dualwrite.librdkafka"
"""The logger of librdkafka's own log lines (``GETPID``, ``REQTMOUT``, ``FAIL`` ...) for every
confluent-kafka client dualwrite creates. librdkafka reports transient trouble it retries by
itself there; what dualwrite must act on reaches it as errors. So the logger is quiet by
default: its level is CRITICAL (librdkafka's fatal lines) unless the application sets one,
e.g. ``logging.getLogger("dualwrite.librdkafka").setLevel(logging.INFO)``; ``dualwrite -v``
does."""

_librdkafka_log = logging.getLogger(LIBRDKAFKA_LOGGER)
if _librdkafka_log.level == logging.NOTSET:
    _librdkafka_log.setLevel(logging.CRITICAL)


def librdkafka_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a confluent-kafka configuration whose log lines go through Python ``logging``
    (the application's ``logger`` if it set one, else :data:`LIBRDKAFKA_LOGGER`), never raw
    to stderr. confluent-kafka queues them and hands them over on ``poll``/``flush``."""
    out = dict(config)
    if out.get("logger") is None:
        out["logger"] = _librdkafka_log
    return out


class Secret(str):
    """A password that is itself (for the SASL exchange) but never shows in ``repr``/``str``.

    kafka-python logs its whole configuration at DEBUG; its values are printed with ``repr``.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "'***'"

    def __str__(self) -> str:
        return "***"

    def __format__(self, spec: str) -> str:
        return "***"


# kafka-python's DEBUG protocol log prints SaslAuthenticate requests, whose bytes carry the
# password in clear for SASL/PLAIN; its configuration dumps name the password too.
_SECRET_IN_LOG = re.compile(
    r"(auth_bytes=)(b'(?:[^'\\]|\\.)*'|b\"(?:[^\"\\]|\\.)*\")"
    r"|((?:sasl_plain_password|ssl_password|sasl\.password|ssl\.key\.password|password)"
    r"['\"]?\s*[:=]\s*)('[^']*'|\"[^\"]*\"|[^\s,}]+)"
)
_KAFKA_PYTHON_LOGGERS = ("kafka", "kafka.admin.client", "kafka.client_async", "kafka.net",
                         "kafka.net.connection", "kafka.net.manager", "kafka.protocol.parser",
                         "kafka.conn", "kafka.net.sasl", "kafka.net.sasl.plain",
                         "kafka.net.sasl.scram")


class _RedactSecrets(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a broken format string: leave it to logging's own error path
            return True
        masked = _SECRET_IN_LOG.sub(
            lambda m: (m.group(1) + "***") if m.group(1) else (m.group(3) + "***"), text)
        if masked != text:
            record.msg, record.args = masked, None
        return True


_REDACTION = _RedactSecrets()


def install_log_redaction() -> None:
    """Mask passwords in kafka-python's log records (idempotent; done on import)."""
    for name in _KAFKA_PYTHON_LOGGERS:
        logger = logging.getLogger(name)
        if _REDACTION not in logger.filters:
            logger.addFilter(_REDACTION)


install_log_redaction()

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
            secret = "password" in key and isinstance(value, str)
            out[_DIRECT[key]] = Secret(value) if secret else value
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


def authentication_failure(config: Mapping[str, Any], timeout_s: float) -> str | None:
    """Why a SASL client could not connect, when that is failed authentication; else None.

    kafka-python retries a failed SASL handshake until its bootstrap times out, so after a
    timeout the control plane asks librdkafka, which reports authentication failures as such.
    The text names the user and mechanism, never the password.
    """
    protocol = str(config.get("security.protocol", "")).upper()
    if not protocol.startswith("SASL"):
        return None
    from confluent_kafka import KafkaError
    from confluent_kafka.admin import AdminClient

    errors: list[KafkaError] = []
    conf: dict[str, Any] = {k: v for k, v in config.items()
                            if k == "bootstrap.servers" or k.startswith(("sasl.", "ssl.",
                                                                         "security."))}
    conf["error_cb"] = errors.append
    admin = AdminClient(librdkafka_config(conf))
    future = admin.describe_cluster(request_timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    failed: KafkaError | None = None
    while failed is None and not future.done() and time.monotonic() < deadline:
        admin.poll(0.1)  # serves error_cb
        failed = next((e for e in errors if e.code() == KafkaError._AUTHENTICATION), None)
    if failed is None:
        return None
    user = config.get("sasl.username", "")
    mechanism = config.get("sasl.mechanism", config.get("sasl.mechanisms", "GSSAPI"))
    return (f"SASL authentication of user {user!r} ({mechanism}) failed at "
            f"{config.get('bootstrap.servers')}: {failed.str()}. Check sasl.username and "
            "sasl.password (and sasl.mechanism)")


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
