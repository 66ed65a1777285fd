"""Kafka error codes as data, and the dualwrite exception each one becomes.

The one translation layer of the Kafka side: broker error codes met by the control plane
(:func:`raise_for_code`) and librdkafka's errors met by the producer and the anchor reads
(:func:`librdkafka_error`).
"""

from __future__ import annotations

import re

import kafka.errors as kafka_errors
from confluent_kafka import KafkaError, KafkaException

from dualwrite.errors import (
    BrokerUnreachableError,
    DualWriteError,
    FatalError,
    InvalidRecordError,
    KafkaErrorInfo,
    KafkaProtocolError,
    ProducerFencedError,
    RecordTooLargeError,
    RecoverableError,
    RetriableError,
    UnknownTopicError,
)

__all__ = [
    "AuthenticationError",
    "AuthorizationError",
    "FatalKafkaError",
    "FencedKafkaError",
    "RetriableKafkaError",
    "error_info",
    "hides_its_cause",
    "librdkafka_error",
    "raise_for_code",
    "record_error",
    "required_acl",
    "topic_write_denied",
]

# What to do about the codes the transaction control plane meets. Everything else falls back to
# the generic advice below.
_ADVICE: dict[int, str] = {
    7: "The broker did not answer in time; retry.",
    14: "The transaction coordinator is loading its log; retry shortly.",
    15: "No transaction coordinator is available; check broker health and retry.",
    16: "The coordinator moved to another broker; look it up again and retry.",
    33: "The broker does not offer this SASL mechanism: check sasl.mechanism.",
    34: "The SASL exchange went wrong: check security.protocol and sasl.mechanism.",
    35: "The broker does not support this request version; run `dualwrite probe` to see what "
    "it supports.",
    47: "The producer epoch is stale: another producer with this transactional id took over.",
    48: "The transaction is not in a state that allows this (e.g. commit after abort, or no "
    "transaction in progress); inspect it with `dualwrite status`.",
    49: "The coordinator does not know this producer id for the transactional id (expired, or "
    "taken over); inspect it with `dualwrite status`.",
    51: "Another state change of this transaction is in progress; retry shortly.",
    58: "Authentication failed: check sasl.username and sasl.password (and sasl.mechanism).",
    90: "Another producer with this transactional id has a newer epoch; this one is fenced and "
    "must stop.",
    105: "The coordinator has no such transactional id (never used, or expired).",
}

_AUTHORIZATION_CODES = frozenset({29, 30, 31, 53})
_ACL_HELP = 'see docs/operating.md, "Secured clusters"'
_AUTHENTICATION_CODES = frozenset({33, 34, 58})

# The ACL each request needs, by (API, error code): what a missing-ACL error tells the operator
# to grant (see docs/operating.md, "Secured clusters"). WRITE, READ, DELETE and ALTER imply
# DESCRIBE.
_RESOURCE_TYPE = {29: "Topic", 30: "Group", 31: "Cluster", 53: "TransactionalId"}
_REQUIRED_OPERATION: dict[tuple[str, int], str] = {
    ("Produce", 29): "WRITE",
    ("AddPartitionsToTxn", 29): "WRITE",
    ("DescribeProducers", 29): "READ",
    ("Fetch", 29): "READ",
    ("ListOffsets", 29): "DESCRIBE",
    ("Metadata", 29): "DESCRIBE",
    ("OffsetFetch", 30): "READ",
    ("JoinGroup", 30): "READ",
    ("FindCoordinator", 30): "DESCRIBE",
    ("DescribeConfigs", 31): "DESCRIBE_CONFIGS",
    ("InitProducerId", 31): "IDEMPOTENT_WRITE",
    ("WriteTxnMarkers", 31): "CLUSTER_ACTION",
    ("DescribeTransactions", 53): "DESCRIBE",
    ("ListTransactions", 53): "DESCRIBE",
    ("FindCoordinator", 53): "WRITE",  # the transactional producer's WRITE implies DESCRIBE
    ("InitProducerId", 53): "WRITE",
    ("EndTxn", 53): "WRITE",
    ("AddPartitionsToTxn", 53): "WRITE",
    ("AddOffsetsToTxn", 53): "WRITE",
}
_DEFAULT_OPERATION = {29: "WRITE", 30: "READ", 31: "DESCRIBE", 53: "WRITE"}
_API_NAMES = frozenset(api for api, _ in _REQUIRED_OPERATION)
_RESOURCE_PATTERNS = {
    53: (r"transactional_id=([^\s,;)]+)", r"TRANSACTION/([^\s:,;]+)",
         r"\('([^']+)'\)", r"transactional id '([^']+)'"),
    29: (r"\(([^\s()]+)-\d+\)", r"[Tt]opic '([^']+)'", r"\(([^\s()',]+)\)"),
    30: (r"[Gg]roup '([^']+)'",),
}
_FENCED_CODES = frozenset({47, 90})


class RetriableKafkaError(KafkaProtocolError, RetriableError):
    """A broker error Kafka marks retriable."""


class FatalKafkaError(KafkaProtocolError, FatalError):
    """A broker error that retrying will not fix."""


class AuthorizationError(FatalKafkaError):
    """The principal lacks an ACL; the message names the permission to grant.

    ``acl`` is that permission, e.g. ``"READ on Topic 'orders'"``.
    """

    def __init__(self, info: KafkaErrorInfo, context: str, acl: str) -> None:
        super().__init__(info, context)
        self.acl = acl


class AuthenticationError(FatalKafkaError):
    """SASL authentication failed (wrong user name, password or mechanism)."""


class FencedKafkaError(KafkaProtocolError, ProducerFencedError):
    """The broker fenced this producer id / epoch."""


def error_info(code: int) -> KafkaErrorInfo:
    """Name, retriability and advice for a Kafka error code."""
    error_type = kafka_errors.for_code(code)
    name = getattr(error_type, "message", None) or error_type.__name__
    retriable = bool(getattr(error_type, "retriable", False))
    advice = _ADVICE.get(code, "Retry." if retriable else "See the broker log for details.")
    return KafkaErrorInfo(code=code, name=str(name), retriable=retriable, advice=advice)


def required_acl(code: int, context: str, resource: str | None = None) -> str:
    """The ACL whose absence makes a request fail with authorization error ``code``.

    The request is named by the first Kafka API name in ``context`` (e.g. ``"EndTxn(commit)
    transactional_id=x ..."``); the resource is ``resource`` or found in ``context``.
    """
    kind = _RESOURCE_TYPE.get(code, "resource")
    found_at = [(context.find(a), a) for a in _API_NAMES if a in context]
    api = min(found_at)[1] if found_at else ""  # the outermost request named first
    operation = _REQUIRED_OPERATION.get((api, code), _DEFAULT_OPERATION.get(code, "the needed"))
    if code == 31:
        return f"{operation} on Cluster 'kafka-cluster'"
    if resource is None:
        for pattern in _RESOURCE_PATTERNS.get(code, ()):
            found = re.search(pattern, context)
            if found:
                resource = found.group(1)
                break
    if resource and resource.startswith("prefix "):
        name = resource  # e.g. "prefix 'dualwrite-verify-'": a PREFIXED ACL
    else:
        name = repr(resource) if resource else "(named above)"
    acl = f"{operation} on {kind} {name}"
    if code == 53 and operation == "WRITE" and api == "InitProducerId":
        acl += " (and TWO_PHASE_COMMIT there for KIP-939 2PC, on brokers that enforce it)"
    return acl


def raise_for_code(code: int, context: str, *, resource: str | None = None) -> None:
    """Raise the dualwrite exception for a non-zero Kafka error code.

    Authorization errors become :class:`AuthorizationError` naming the missing ACL (``resource``
    names the topic, group or transactional id when ``context`` does not).
    """
    if code == 0:
        return
    info = error_info(code)
    if code in _FENCED_CODES:
        raise FencedKafkaError(info, context)
    if code in _AUTHORIZATION_CODES:
        acl = required_acl(code, context, resource)
        advice = f"Missing ACL: grant {acl} to this principal ({_ACL_HELP})."
        raise AuthorizationError(KafkaErrorInfo(info.code, info.name, False, advice), context,
                                 acl)
    if code in _AUTHENTICATION_CODES:
        raise AuthenticationError(info, context)
    if info.retriable:
        raise RetriableKafkaError(info, context)
    raise FatalKafkaError(info, context)


# librdkafka's errors (confluent_kafka.KafkaError) whose code decides the dualwrite class, with
# the advice added to the message. Broker codes keep their protocol numbers (47, 90, 29 …);
# librdkafka's own are negative (_FENCED).
_FENCED_ADVICE = "another producer with this transactional id took over — stop this one"
_LIBRDKAFKA_BY_CODE: dict[int, tuple[type[DualWriteError], str]] = {
    KafkaError._FENCED: (ProducerFencedError, _FENCED_ADVICE),
    KafkaError.PRODUCER_FENCED: (ProducerFencedError, _FENCED_ADVICE),
    KafkaError.INVALID_PRODUCER_EPOCH: (ProducerFencedError, _FENCED_ADVICE),
}
# Missing ACLs librdkafka reports (with the broker's codes): AuthorizationError naming the ACL.
_LIBRDKAFKA_AUTHORIZATION = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED,
                                       KafkaError.CLUSTER_AUTHORIZATION_FAILED,
                                       KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED})

# Errors of one record or its topic that sending again cannot fix, whether librdkafka raises
# them from produce() (its own checks) or reports them for a delivery (the broker's answer):
# the kind of error and what to do. Anything else about a record is retried or aborted as before.
_UNKNOWN_TOPIC, _TOO_LARGE, _INVALID = "unknown topic", "too large", "invalid"
_RECORD_CODES: dict[int, tuple[str, str]] = {
    KafkaError.UNKNOWN_TOPIC_OR_PART: (_UNKNOWN_TOPIC, ""),
    KafkaError._UNKNOWN_TOPIC: (_UNKNOWN_TOPIC, ""),
    KafkaError._UNKNOWN_PARTITION: (_INVALID, "the partition does not exist in the topic; "
                                    "leave partition unset or use an existing one"),
    KafkaError.TOPIC_EXCEPTION: (_INVALID, "the topic name is not valid"),
    KafkaError.MSG_SIZE_TOO_LARGE: (_TOO_LARGE, ""),
    KafkaError.RECORD_LIST_TOO_LARGE: (_TOO_LARGE, ""),
    KafkaError.INVALID_MSG_SIZE: (_INVALID, "the record's size is invalid"),
    KafkaError.INVALID_RECORD: (_INVALID, "the broker rejected the record (a compacted "
                                "topic needs a key; see the broker log)"),
    KafkaError.INVALID_TIMESTAMP: (_INVALID, "the record's timestamp is outside the topic's "
                                   "message.timestamp.*.max.ms bounds"),
}


def record_error(exc: BaseException, topic: str, context: str, *, size: int | None = None,
                 client_limit: int | None = None) -> DualWriteError | None:
    """The typed error for a record librdkafka refused (``local``) or a broker rejected, when
    sending it again cannot help; None for any other error.

    ``size`` is the record's key and value size; ``client_limit`` the producer's
    ``message.max.bytes`` when librdkafka itself refused it (before sending), None when the
    broker did. A topic authorization failure names the WRITE ACL on ``topic``.
    """
    err = _librdkafka_cause(exc)
    if err is None:
        return None
    code = err.code()
    if code == KafkaError.TOPIC_AUTHORIZATION_FAILED:
        return _authorization_error(err, context, topic)
    kind, advice = _RECORD_CODES.get(code, ("", ""))
    text = f"{context}: {err.name()} ({err.str()})"
    if kind == _UNKNOWN_TOPIC:
        return UnknownTopicError(topic, text)
    if kind == _INVALID:
        return InvalidRecordError(topic, f"{text}: {advice}; sending it again will fail again")
    if kind != _TOO_LARGE:
        return None
    sized = f"a record of {size} bytes" if size is not None else "a record"
    if client_limit is not None:
        limit = f"message.max.bytes={client_limit}"
        where = (f"the producer's {limit} (a client setting; the topic's max.message.bytes "
                 "must allow it too)")
    else:
        limit = "max.message.bytes"
        where = ("the topic's max.message.bytes (or the broker's message.max.bytes), which "
                 "the broker enforces")
    return RecordTooLargeError(
        topic, f"{context}: {sized} is larger than {where} ({err.name()}); make the record "
        "smaller or raise the limit — sending it again will fail again", size=size, limit=limit)


def topic_write_denied(missing: list[str], context: str) -> AuthorizationError:
    """The error for topics this principal may not write to (``missing``: their ACLs, as
    :meth:`ControlPlane.missing_topic_acls` names them)."""
    info = error_info(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    acls = ", ".join(missing)
    advice = f"Missing ACL: grant {acls} to this principal ({_ACL_HELP})."
    return AuthorizationError(KafkaErrorInfo(info.code, info.name, False, advice), context, acls)


def _authorization_error(err: KafkaError, context: str, resource: str | None) -> DualWriteError:
    info = error_info(err.code())
    acl = required_acl(err.code(), context, resource)
    advice = f"Missing ACL: grant {acl} to this principal ({_ACL_HELP})."
    return AuthorizationError(KafkaErrorInfo(info.code, info.name, False, advice),
                              f"{context}: {err.str()}", acl)


# Retriable errors that mean no broker answered in time.
_UNREACHABLE_CODES = frozenset({KafkaError._TIMED_OUT, KafkaError._TRANSPORT,
                                KafkaError._ALL_BROKERS_DOWN})


def _librdkafka_cause(exc: BaseException) -> KafkaError | None:
    """The librdkafka error ``exc`` carries: confluent-kafka raises a fatal error from inside a
    delivery callback as SystemError caused by the KafkaException."""
    while not isinstance(exc, KafkaException) and exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, KafkaException) and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return None


def hides_its_cause(exc: BaseException) -> bool:
    """Whether ``exc`` does not carry the librdkafka error that caused it: a bare SystemError
    (confluent-kafka leaving a callback), or ``_FATAL``, which librdkafka answers every call
    with once the client hit a fatal error. The error itself reaches the client's ``error_cb``.
    """
    if not isinstance(exc, KafkaException):
        return True
    err = exc.args[0]
    return isinstance(err, KafkaError) and err.code() == KafkaError._FATAL


def ends_only_the_session(exc: BaseException) -> bool:
    """Whether ``exc`` is a librdkafka-fatal error that is neither a fence nor a missing ACL
    (e.g. OUT_OF_ORDER_SEQUENCE_NUMBER after a request timed out): the session cannot go on,
    but a new session of the same transactional id can."""
    err = _librdkafka_cause(exc)
    return (err is not None and err.fatal() and err.code() not in _LIBRDKAFKA_BY_CODE
            and err.code() not in _LIBRDKAFKA_AUTHORIZATION)


def librdkafka_error(exc: BaseException, context: str, *,
                     otherwise: type[DualWriteError] = RecoverableError) -> DualWriteError:
    """The dualwrite exception for a confluent-kafka failure; ``context`` says what failed.

    The code decides where the table above lists it (a fence is always
    :class:`ProducerFencedError`); else librdkafka's flags: fatal is :class:`FatalError`,
    retriable :class:`RetriableError`. Anything else is ``otherwise``: :class:`RecoverableError`
    for the producer (its transaction must be aborted), :class:`RetriableError` for a read that
    decided nothing. A retriable one that no broker answered is
    :class:`BrokerUnreachableError`.
    """
    err = _librdkafka_cause(exc)
    if err is None:
        return otherwise(f"{context}: {exc!r}")
    text = f"{context}: {err.name()} ({err.str()})"
    if err.code() in _LIBRDKAFKA_AUTHORIZATION:
        return _authorization_error(err, context, None)
    by_code = _LIBRDKAFKA_BY_CODE.get(err.code())
    if by_code is not None:
        error_class, advice = by_code
        return error_class(f"{text}; {advice}")
    if err.fatal():
        return FatalError(text)
    retriable = err.retriable() or issubclass(otherwise, RetriableError)
    if retriable and err.code() in _UNREACHABLE_CODES:
        return BrokerUnreachableError(text)
    if err.retriable():
        return RetriableError(text)
    return otherwise(text)
