"""dualwrite: atomic writes to a SQL database and Apache Kafka (KIP-939 on today's brokers).

The public surface is re-exported here; modules not listed in ``__all__`` are internal.
"""

from dualwrite.completion import Completion
from dualwrite.control_plane import (
    ControlPlane,
    ProbeResult,
    TopicPartition,
    TransactionDescription,
    TxnState,
)
from dualwrite.database import check_schema, create_engine, upgrade_database
from dualwrite.errors import (
    BrokerUnreachableError,
    DatabaseUnreachableError,
    DualWriteError,
    FatalError,
    HeuristicAbortError,
    HeuristicCommitError,
    HeuristicOutcomeError,
    InvalidPreparedStateError,
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
from dualwrite.prepared_state import PreparedTxnState
from dualwrite.producer import TwoPhaseProducer
from dualwrite.recipe import DualWriter, DualWriteTransaction
from dualwrite.recovery import Outcome, RecoveryReport, StatusReport, recover, status
from dualwrite.state_store import StateRow, StateStore

__version__ = "0.1.0"

__all__ = [
    "BrokerUnreachableError",
    "Completion",
    "ControlPlane",
    "DatabaseUnreachableError",
    "DualWriteError",
    "DualWriteTransaction",
    "DualWriter",
    "FatalError",
    "HeuristicAbortError",
    "HeuristicCommitError",
    "HeuristicOutcomeError",
    "InvalidPreparedStateError",
    "KafkaProtocolError",
    "LockTimeoutError",
    "MigrationRequiredError",
    "Outcome",
    "OutcomeUnknownError",
    "OutcomeUnreadableError",
    "PreparedTxnState",
    "ProbeResult",
    "ProducerFencedError",
    "RecoverableError",
    "RecoveryReport",
    "RetriableError",
    "StateRow",
    "StateStore",
    "StatusReport",
    "TopicPartition",
    "TransactionConflictError",
    "TransactionDescription",
    "TransactionStateError",
    "TwoPhaseProducer",
    "TxnState",
    "__version__",
    "check_schema",
    "create_engine",
    "recover",
    "status",
    "upgrade_database",
]
