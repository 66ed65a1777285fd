"""Pulsar as a two-phase-commit participant through its own transactions (issue 33).

:class:`PulsarTxnClient` opens a transaction, registers partitions, sends in it and ends it by
:class:`TxnId` from any process; it speaks Pulsar's binary protocol itself (``_wire``), since no
Python client of Pulsar has transactions. Needs the ``pulsar`` extra (``protobuf``).
"""

from dualwrite.participant.pulsar._wire import MessageId, TxnId
from dualwrite.participant.pulsar.client import PulsarTxnClient, full_topic_name
from dualwrite.participant.pulsar.errors import (
    PulsarAuthError,
    PulsarConnectionError,
    PulsarError,
    PulsarFatalError,
    PulsarOutcomeUnknownError,
    PulsarProducerFencedError,
    PulsarProtocolError,
    PulsarRetriableError,
    PulsarTimeoutError,
    PulsarTopicError,
    PulsarUnsupportedError,
    TransactionNotFoundError,
)

__all__ = [
    "MessageId",
    "PulsarAuthError",
    "PulsarConnectionError",
    "PulsarError",
    "PulsarFatalError",
    "PulsarOutcomeUnknownError",
    "PulsarProducerFencedError",
    "PulsarProtocolError",
    "PulsarRetriableError",
    "PulsarTimeoutError",
    "PulsarTopicError",
    "PulsarTxnClient",
    "PulsarUnsupportedError",
    "TransactionNotFoundError",
    "TxnId",
    "full_topic_name",
]
