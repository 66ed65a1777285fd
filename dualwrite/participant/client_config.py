"""Translate a confluent-kafka (librdkafka) configuration into kafka-python keyword arguments."""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Mapping
from typing import Any

from dualwrite.errors import ConfigurationError, FatalError

__all__ = [
    "LIBRDKAFKA_LOGGER",
    "Secret",
    "authentication_failure",
    "bootstrap_servers",
    "check_kafka_config",
    "check_timeout",
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


# host, host:port, [ipv6]:port, each optionally behind a listener name (PLAINTEXT://host:port).
_SERVER = re.compile(r"(?:[A-Za-z][A-Za-z0-9_+.-]*://)?"
                     r"(\[[0-9A-Fa-f:.]+\]|[\w-]{1,63}(?:\.[\w-]{1,63})*\.?)"
                     r"(?::(\d{1,5}))?", re.ASCII)


def bootstrap_servers(value: object) -> list[str]:
    """The ``host:port`` entries of a ``bootstrap.servers`` value (a comma-separated str, or a
    list of str); :class:`ConfigurationError` naming the bad entry if one is malformed."""
    if isinstance(value, str):
        entries = [s.strip() for s in value.split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        entries = [s.strip() for s in value]
    else:
        raise ConfigurationError(f"bootstrap.servers must be a str like 'host:9092,host2:9092', "
                                 f"not {type(value).__name__}")
    entries = [s for s in entries if s]
    if not entries:
        raise ConfigurationError("bootstrap.servers is empty: give the brokers as "
                                 "'host:port[,host:port…]' (e.g. --bootstrap-servers "
                                 "127.0.0.1:9092)")
    for entry in entries:
        found = _SERVER.fullmatch(entry)
        port = found.group(2) if found is not None else None
        if found is None or len(found.group(1)) > 253 or (port and not 0 < int(port) < 65536):
            raise ConfigurationError(f"bootstrap.servers entry {entry!r} is not host:port "
                                     "(a port from 1 to 65535; IPv6 as [addr]:port)")
    return entries


def check_kafka_config(config: object) -> dict[str, Any]:
    """A copy of a confluent-kafka configuration after the checks that need no broker: a
    mapping of str keys with a well-formed ``bootstrap.servers``. librdkafka checks the values
    of its own settings when the producer starts."""
    if not isinstance(config, Mapping):
        raise ConfigurationError(f"the Kafka configuration must be a dict of librdkafka "
                                 f"settings, not {type(config).__name__}")
    bad = [k for k in config if not isinstance(k, str)]
    if bad:
        raise ConfigurationError(f"Kafka setting names must be str, not {bad[0]!r}")
    for key in config:
        if "_" in key and key not in _PYTHON_CLIENT_KEYS:
            dotted = _KAFKA_PYTHON_NAMES.get(key, key.replace("_", "."))
            raise ConfigurationError(
                f"unknown key {key!r} in the Kafka configuration (did you mean {dotted!r}?): "
                "it takes confluent-kafka's (librdkafka's) setting names, written with dots")
    if "bootstrap.servers" not in config:
        raise ConfigurationError("the Kafka configuration has no 'bootstrap.servers'")
    bootstrap_servers(config["bootstrap.servers"])
    return dict(config)


#: confluent-kafka's own settings, the only ones written with underscores (librdkafka's have
#: dots); another name with an underscore is most likely kafka-python's (``bootstrap_servers``).
_PYTHON_CLIENT_KEYS = frozenset({"error_cb", "throttle_cb", "stats_cb", "oauth_cb", "on_delivery",
                                 "on_commit", "log_cb", "log_level"})
#: kafka-python's names of the settings whose librdkafka name is not just the dotted one.
_KAFKA_PYTHON_NAMES = {v: k for k, v in _DIRECT.items()}


def check_timeout(value: object, name: str = "timeout_s") -> float:
    """``value`` as a positive, finite number of seconds, or :class:`ConfigurationError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{name} must be a number of seconds, not "
                                 f"{type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigurationError(f"{name} must be a positive number of seconds, not {value!r}")
    return float(value)


def kafka_python_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Map the connection and security part of a confluent-kafka config to kafka-python."""
    check_kafka_config(config)
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
            raise ConfigurationError(
                f"the Kafka setting {key!r} is not supported by dualwrite's control plane; "
                "use SASL PLAIN/SCRAM with username and password, or SSL with PEM files"
            )
        elif not key.startswith(_DATA_PATH_ONLY):
            log.debug("control plane ignores Kafka setting %s", key)
    out["bootstrap_servers"] = bootstrap_servers(out["bootstrap_servers"])
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
