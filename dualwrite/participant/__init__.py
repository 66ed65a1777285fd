"""The Kafka side: a Kafka transaction as a two-phase-commit participant.

``TwoPhaseProducer`` prepares and commits; ``PreparedTxnState`` names what it prepared;
``Completion`` (``complete`` for one id) finishes an in-doubt transaction from that name and
says what it did (``Outcome``); ``ControlPlane`` speaks the coordinator RPCs librdkafka does not
expose, ``ProbeResult`` says what a cluster offers (``broker_probe``); ``kafka_errors`` turns
Kafka error codes into dualwrite errors (the one translation layer for the Kafka side);
``read_committed`` reads a whole topic as a read_committed consumer sees it (``verify``).
"""

from dualwrite.participant.broker_probe import ProbeResult
from dualwrite.participant.completion import Completion, complete
from dualwrite.participant.control_plane import ControlPlane, TransactionDescription, TxnState
from dualwrite.participant.identifiers import ProducerIdentity, TopicPartition
from dualwrite.participant.outcome import Outcome
from dualwrite.participant.prepared_state import Anchor, PreparedTxnState
from dualwrite.participant.producer import TwoPhaseProducer
from dualwrite.participant.topic_reader import TopicRead, read_committed

__all__ = [
    "Anchor",
    "Completion",
    "ControlPlane",
    "Outcome",
    "PreparedTxnState",
    "ProbeResult",
    "ProducerIdentity",
    "TopicPartition",
    "TopicRead",
    "TransactionDescription",
    "TwoPhaseProducer",
    "TxnState",
    "complete",
    "read_committed",
]
