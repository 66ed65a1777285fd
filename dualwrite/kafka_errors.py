"""Kafka protocol error codes as data, and the dualwrite exception each one becomes."""

from __future__ import annotations

import kafka.errors as kafka_errors

from dualwrite.errors import (
    FatalError,
    KafkaErrorInfo,
    KafkaProtocolError,
    ProducerFencedError,
    RetriableError,
)

__all__ = [
    "AuthorizationError",
    "FatalKafkaError",
    "FencedKafkaError",
    "RetriableKafkaError",
    "error_info",
    "raise_for_code",
]

# What to do about the codes the transaction control plane meets. Everything else falls back to
# the generic advice below.
_ADVICE: dict[int, str] = {
    7: "The broker did not answer in time; retry.",
    14: "The transaction coordinator is loading its log; retry shortly.",
    15: "No transaction coordinator is available; check broker health and retry.",
    16: "The coordinator moved to another broker; look it up again and retry.",
    29: "Grant WRITE on the topic to this principal.",
    31: "Grant the needed cluster permission (IDEMPOTENT_WRITE or ALTER) to this principal.",
    35: "The broker does not support this request version; run `dualwrite probe` to see what "
    "it supports.",
    47: "The producer epoch is stale: another producer with this transactional id took over.",
    48: "The transaction is not in a state that allows this (e.g. commit after abort, or no "
    "transaction in progress); inspect it with `dualwrite status`.",
    49: "The coordinator does not know this producer id for the transactional id (expired, or "
    "taken over); inspect it with `dualwrite status`.",
    51: "Another state change of this transaction is in progress; retry shortly.",
    53: "Grant WRITE (and TWO_PHASE_COMMIT for 2PC) on the transactional id to this principal.",
    90: "Another producer with this transactional id has a newer epoch; this one is fenced and "
    "must stop.",
    105: "The coordinator has no such transactional id (never used, or expired).",
}

_AUTHORIZATION_CODES = frozenset({29, 30, 31, 53})
_FENCED_CODES = frozenset({47, 90})


class RetriableKafkaError(KafkaProtocolError, RetriableError):
    """A broker error Kafka marks retriable."""


class FatalKafkaError(KafkaProtocolError, FatalError):
    """A broker error that retrying will not fix."""


class AuthorizationError(FatalKafkaError):
    """The principal lacks an ACL; the message names the permission to grant."""


class FencedKafkaError(KafkaProtocolError, ProducerFencedError):
    """The broker fenced this producer id / epoch."""


def error_info(code: int) -> KafkaErrorInfo:
    """Name, retriability and advice for a Kafka error code."""
    error_type = kafka_errors.for_code(code)
    name = getattr(error_type, "message", None) or error_type.__name__
    retriable = bool(getattr(error_type, "retriable", False))
    advice = _ADVICE.get(code, "Retry." if retriable else "See the broker log for details.")
    return KafkaErrorInfo(code=code, name=str(name), retriable=retriable, advice=advice)


def raise_for_code(code: int, context: str) -> None:
    """Raise the dualwrite exception for a non-zero Kafka error code."""
    if code == 0:
        return
    info = error_info(code)
    if code in _FENCED_CODES:
        raise FencedKafkaError(info, context)
    if code in _AUTHORIZATION_CODES:
        raise AuthorizationError(info, context)
    if info.retriable:
        raise RetriableKafkaError(info, context)
    raise FatalKafkaError(info, context)
