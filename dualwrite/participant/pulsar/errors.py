"""Pulsar's server error codes as data, and the dualwrite exception each one becomes.

The one translation layer of the Pulsar side: every ``ServerError`` a broker or transaction
coordinator answers (in ``ERROR``, ``SEND_ERROR`` or a ``*_RESPONSE``) goes through
:func:`server_error`. The classes say what the caller does next, like dualwrite.errors: retry,
run recovery, or stop.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualwrite.errors import (
    BrokerUnreachableError,
    DualWriteError,
    FatalError,
    HeuristicAbortError,
    HeuristicCommitError,
    OutcomeUnknownError,
    OutcomeUnreadableError,
    ProducerFencedError,
    RetriableError,
)

__all__ = [
    "InvalidTxnStatusError",
    "PulsarAuthError",
    "PulsarConnectionError",
    "PulsarError",
    "PulsarErrorInfo",
    "PulsarFatalError",
    "PulsarHeuristicAbortError",
    "PulsarHeuristicCommitError",
    "PulsarOutcomeUnknownError",
    "PulsarOutcomeUnreadableError",
    "PulsarProducerFencedError",
    "PulsarProtocolError",
    "PulsarRetriableError",
    "PulsarTimeoutError",
    "PulsarTopicError",
    "PulsarTxnStillOpenError",
    "PulsarUnsupportedError",
    "TransactionNotFoundError",
    "error_info",
    "server_error",
]


@dataclass(frozen=True)
class PulsarErrorInfo:
    """A Pulsar ``ServerError`` code as data: its name, the exception class, what to do."""

    code: int
    name: str
    kind: type[PulsarError]
    advice: str


class PulsarError(DualWriteError):
    """Base of the errors of the Pulsar participant. ``code`` and ``code_name`` name the server
    error when a broker answered one (``None`` for client-side failures)."""

    def __init__(self, message: str, info: PulsarErrorInfo | None = None) -> None:
        super().__init__(message)
        self.code: int | None = info.code if info else None
        self.code_name: str | None = info.name if info else None


class PulsarRetriableError(PulsarError, RetriableError):
    """Nothing was decided: the same call may be retried (after a fresh lookup)."""


class PulsarConnectionError(PulsarError, BrokerUnreachableError):
    """No broker answered, or the connection was lost; ``sent`` tells whether the request had
    been written before (then the broker may have acted on it)."""

    def __init__(self, message: str, *, sent: bool = False) -> None:
        super().__init__(message)
        self.sent = sent


class PulsarTimeoutError(PulsarConnectionError):
    """The call's ``timeout_s`` passed before the broker answered."""


class PulsarOutcomeUnknownError(PulsarError, OutcomeUnknownError):
    """``END_TXN`` was written but its answer never came: the transaction may be ended or not;
    recovery resolves it from its own evidence, never by asking again (see TransactionNotFound)."""


class PulsarFatalError(PulsarError, FatalError):
    """Retrying will not help: a configuration problem, a refused request, or a client bug."""


class PulsarAuthError(PulsarFatalError):
    """The broker refused the credentials, or the role may not do this."""


class PulsarTopicError(PulsarFatalError):
    """The topic does not exist, is terminated, or its name is invalid."""


class PulsarUnsupportedError(PulsarFatalError):
    """The broker lacks a feature dualwrite needs (transactions disabled, too old a protocol)."""


class PulsarProducerFencedError(PulsarError, ProducerFencedError):
    """Another producer took exclusive access to the topic."""


class PulsarProtocolError(PulsarFatalError):
    """The broker sent something this client cannot parse, or the reverse (a bug)."""


class InvalidTxnStatusError(PulsarRetriableError):
    """The transaction is already committing or aborting (another process's END_TXN, or its
    timeout): its outcome is read once that ends, not guessed from this answer."""


class TransactionNotFoundError(PulsarFatalError):
    """The coordinator does not know this TxnID: never issued, already committed, already
    aborted, timed out, or owned by another role. A finished transaction reads exactly like an
    unknown one, so this never proves an outcome: recovery needs its own evidence."""


class PulsarTxnStillOpenError(PulsarRetriableError):
    """The coordinator no longer answers for the transaction, but its anchor partition still
    holds dispatch at an open transaction (this one, ending, or an earlier one there): retry."""


class _PulsarVerdict(PulsarError):
    """A heuristic outcome of one Pulsar transaction: ``transactional_id`` is its TxnID,
    ``state`` its prepared state string, ``detail`` what showed it. Subclasses give the words."""

    _words = ""

    def __init__(self, txn: str, state: str, detail: str) -> None:
        # Not the cooperative chain: the heuristic classes' own __init__ words Kafka's case.
        DualWriteError.__init__(self, f"Pulsar transaction {txn}: " + self._words.format(
            state=state, detail=detail))
        self.code, self.code_name = None, None
        self.transactional_id = txn
        self.state = state
        self.detail = detail


class PulsarHeuristicAbortError(_PulsarVerdict, HeuristicAbortError):
    """Commit was decided, but Pulsar aborted the transaction (e.g. its timeout passed before
    the commit came): its messages are lost."""

    _words = ("commit was decided (prepared state {state!r}) but Pulsar aborted the "
              "transaction ({detail}); its messages are lost. Re-publish them from the database "
              "rows of that transaction.")


class PulsarHeuristicCommitError(_PulsarVerdict, HeuristicCommitError):
    """Abort was decided, but Pulsar had committed the transaction: its messages are visible
    without a decision covering them; compensate."""

    _words = ("abort was decided (prepared state {state!r}) but Pulsar committed the "
              "transaction ({detail}); its messages are visible. Compensate for them.")


class PulsarOutcomeUnreadableError(_PulsarVerdict, OutcomeUnreadableError):
    """Commit was decided, the coordinator no longer knows the transaction, and its anchor's
    ledger is no longer stored: whether it committed cannot be read. Nothing is re-published
    automatically; an operator checks the topic."""

    _words = ("whether it committed can no longer be read (prepared state {state!r}; "
              "{detail}). Check whether its messages reached the topic and re-publish only what "
              "is missing.")


_R, _F, _A, _T = PulsarRetriableError, PulsarFatalError, PulsarAuthError, PulsarTopicError
_RETRY = "Transient; retry (after a fresh lookup)."

_TABLE: dict[int, tuple[str, type[PulsarError], str]] = {
    0: ("UnknownError", _R, "The broker failed without a specific cause; retry."),
    1: ("MetadataError", _R, "The broker's metadata store failed; retry."),
    2: ("PersistenceError", _R, "The broker could not write to BookKeeper; retry."),
    3: ("AuthenticationError", _A, "Check the authentication token."),
    4: ("AuthorizationError", _A, "Grant the role the permission on the namespace or topic."),
    5: ("ConsumerBusy", _R, _RETRY),
    6: ("ServiceNotReady", _R, "The topic or coordinator is moving or loading; look it up "
        "again and retry."),
    7: ("ProducerBlockedQuotaExceededError", _R, "The topic's backlog quota is full; consume "
        "or raise the quota, then retry."),
    8: ("ProducerBlockedQuotaExceededException", _R, "The topic's backlog quota is full; "
        "consume or raise the quota, then retry."),
    9: ("ChecksumError", _F, "The broker found a bad CRC32C on a message (a client bug)."),
    10: ("UnsupportedVersionError", PulsarUnsupportedError, "The broker does not support this "
         "request; transactions need Pulsar 2.7+ with transactionCoordinatorEnabled=true."),
    11: ("TopicNotFound", _T, "Create the topic, or enable auto topic creation."),
    12: ("SubscriptionNotFound", _F, "The subscription does not exist."),
    13: ("ConsumerNotFound", _F, "The consumer does not exist."),
    14: ("TooManyRequests", _R, "The broker throttles this client; retry shortly."),
    15: ("TopicTerminatedError", _T, "The topic was terminated and takes no more messages."),
    16: ("ProducerBusy", _R, "A producer of this name is still connected; retry shortly."),
    17: ("InvalidTopicName", _T, "Fix the topic name (persistent://tenant/namespace/topic)."),
    18: ("IncompatibleSchema", _F, "The topic's schema does not accept bytes messages."),
    19: ("ConsumerAssignError", _F, "The dispatcher could not assign the consumer."),
    20: ("TransactionCoordinatorNotFound", _R, "The transaction coordinator is not loaded on "
         "this broker (moving, starting); look it up again and retry."),
    21: ("InvalidTxnStatus", InvalidTxnStatusError, "The transaction is committing or "
         "aborting (perhaps by its timeout); ask again shortly for a definitive answer."),
    22: ("NotAllowedError", _F, "The broker does not allow this (e.g. a send to a transaction "
         "that has already ended)."),
    23: ("TransactionConflict", _F, "Another transaction acknowledged the same message."),
    24: ("TransactionNotFound", TransactionNotFoundError, "The coordinator does not know this "
         "TxnID (never issued, already ended, timed out, or owned by another role); this does "
         "not tell the outcome."),
    25: ("ProducerFenced", PulsarProducerFencedError, "Another producer has exclusive access "
         "to the topic."),
}


def error_info(code: int) -> PulsarErrorInfo:
    """What a ``ServerError`` code means; an unknown code is treated like ``UnknownError``."""
    name, kind, advice = _TABLE.get(code, (f"ServerError{code}", _R, _TABLE[0][2]))
    return PulsarErrorInfo(code, name, kind, advice)


def server_error(code: int, message: str, context: str) -> PulsarError:
    """The exception for a broker's ``ServerError`` answer to ``context`` (e.g. ``END_TXN
    COMMIT (0,5)``). ``message`` is the broker's text, cut to a bounded length."""
    info = error_info(code)
    if code == 24 and _NOT_THE_OWNER in message:
        # With authorization on, the coordinator answers another role's END_TXN with
        # TransactionNotFound and this text (TransactionMetadataStoreService's owner check):
        # the transaction is there, this role may not end it; asking its anchor would only
        # wait for an outcome nobody is deciding.
        info = PulsarErrorInfo(code, info.name, PulsarAuthError,
                               "Use the role that opened the transaction (the writer's token) "
                               "or a super user's.")
    text = f"{context}: {info.name} (server error {code}): {message[:500]}. {info.advice}"
    return info.kind(text, info)


_NOT_THE_OWNER = "is neither the owner of the transaction"
