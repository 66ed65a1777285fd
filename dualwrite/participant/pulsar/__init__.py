"""Pulsar as a two-phase-commit participant through its own transactions (issue 33).

:class:`PulsarTxnClient` opens a transaction, registers partitions, sends in it and ends it by
:class:`TxnId` from any process; it speaks Pulsar's binary protocol itself (``_wire``), since no
Python client of Pulsar has transactions. :class:`PulsarParticipant` prepares a transaction with an
anchor message and commits or aborts it by its :class:`PulsarPreparedTxn` state, telling a finished
transaction's outcome from the anchor partition (:func:`txn_outcome`).
Needs the ``pulsar`` extra (``protobuf``).
"""

from dualwrite.participant.pulsar._wire import MessageId, TxnId
from dualwrite.participant.pulsar.client import PulsarTxnClient, full_topic_name
from dualwrite.participant.pulsar.errors import (
    InvalidTxnStatusError,
    PulsarAuthError,
    PulsarConnectionError,
    PulsarError,
    PulsarFatalError,
    PulsarHeuristicAbortError,
    PulsarHeuristicCommitError,
    PulsarOutcomeUnknownError,
    PulsarOutcomeUnreadableError,
    PulsarProducerFencedError,
    PulsarProtocolError,
    PulsarRetriableError,
    PulsarTimeoutError,
    PulsarTopicError,
    PulsarTxnStillOpenError,
    PulsarUnsupportedError,
    TransactionNotFoundError,
)
from dualwrite.participant.pulsar.participant import (
    PulsarParticipant,
    PulsarPreparedTxn,
    PulsarTxnOutcome,
    txn_outcome,
)
from dualwrite.participant.pulsar.reader import (
    AnchorSubscription,
    PartitionReader,
    ReceivedEntry,
    ReceivedMessage,
)

__all__ = [
    "AnchorSubscription",
    "InvalidTxnStatusError",
    "MessageId",
    "PartitionReader",
    "PulsarAuthError",
    "PulsarConnectionError",
    "PulsarError",
    "PulsarFatalError",
    "PulsarHeuristicAbortError",
    "PulsarHeuristicCommitError",
    "PulsarOutcomeUnknownError",
    "PulsarOutcomeUnreadableError",
    "PulsarParticipant",
    "PulsarPreparedTxn",
    "PulsarProducerFencedError",
    "PulsarProtocolError",
    "PulsarRetriableError",
    "PulsarTimeoutError",
    "PulsarTopicError",
    "PulsarTxnClient",
    "PulsarTxnOutcome",
    "PulsarTxnStillOpenError",
    "PulsarUnsupportedError",
    "ReceivedEntry",
    "ReceivedMessage",
    "TransactionNotFoundError",
    "TxnId",
    "full_topic_name",
    "txn_outcome",
]
