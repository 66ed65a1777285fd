"""dualwrite: atomic writes to a SQL database and Apache Kafka (KIP-939 on today's brokers).

What an application and an operator use is re-exported here. The roles of the two-phase commit
live in subpackages with their own ``__all__`` (see docs/architecture.md): ``participant``
(the Kafka side), ``writer``, ``batch``, ``recovery``, ``database``, ``spark`` and ``dev``.
"""

from dualwrite.database import check_schema, create_engine, upgrade_database
from dualwrite.errors import (
    BatchHeuristicAbortError,
    BatchInDoubtError,
    BrokerUnreachableError,
    DatabaseUnreachableError,
    DualWriteError,
    FatalError,
    HeuristicAbortError,
    HeuristicCommitError,
    HeuristicOutcomeError,
    InvalidPreparedStateError,
    KafkaErrorInfo,
    KafkaProtocolError,
    LockTimeoutError,
    MigrationRequiredError,
    OutcomeUnknownError,
    OutcomeUnreadableError,
    ProducerFencedError,
    RecoverableError,
    RetriableError,
    TransactionConflictError,
    TransactionStateError,
)
from dualwrite.participant import PreparedTxnState, TwoPhaseProducer
from dualwrite.recovery import (
    Outcome,
    RecoveryReport,
    RecoveryResult,
    SinkRecoveryResult,
    SinkStatus,
    StatusReport,
    recover,
    status,
)
from dualwrite.writer import DualWriter, DualWriteTransaction

__version__ = "0.1.0"

__all__ = [
    "BatchHeuristicAbortError",
    "BatchInDoubtError",
    "BrokerUnreachableError",
    "DatabaseUnreachableError",
    "DualWriteError",
    "DualWriteTransaction",
    "DualWriter",
    "FatalError",
    "HeuristicAbortError",
    "HeuristicCommitError",
    "HeuristicOutcomeError",
    "InvalidPreparedStateError",
    "KafkaErrorInfo",
    "KafkaProtocolError",
    "LockTimeoutError",
    "MigrationRequiredError",
    "Outcome",
    "OutcomeUnknownError",
    "OutcomeUnreadableError",
    "PreparedTxnState",
    "ProducerFencedError",
    "RecoverableError",
    "RecoveryReport",
    "RecoveryResult",
    "RetriableError",
    "SinkRecoveryResult",
    "SinkStatus",
    "StatusReport",
    "TransactionConflictError",
    "TransactionStateError",
    "TwoPhaseProducer",
    "__version__",
    "check_schema",
    "create_engine",
    "recover",
    "status",
    "upgrade_database",
]
