"""dualwrite: atomic writes to a SQL database and Apache Kafka (KIP-939 on today's brokers).

What an application and an operator use is re-exported here. The roles of the two-phase commit
live in subpackages with their own ``__all__`` (see docs/architecture.md): ``participant``
(the Kafka side), ``writer``, ``consumer``, ``batch``, ``recovery``, ``database``, ``spark``
and ``dev``.
"""

from dualwrite import errors
from dualwrite.consumer import ConsumedMessage, ExactlyOnceConsumer
from dualwrite.database import check_schema, create_engine, upgrade_database
from dualwrite.errors import *  # noqa: F403 (every error is API: errors.__all__)
from dualwrite.participant import PreparedTxnState, TwoPhaseProducer
from dualwrite.participant.kafka_errors import AuthenticationError, AuthorizationError
from dualwrite.recovery import (
    OpenTransaction,
    Outcome,
    RecoveryReport,
    RecoveryResult,
    SinkRecoveryResult,
    SinkStatus,
    StatusReport,
    VerifyReport,
    open_transactions,
    recover,
    status,
    verify,
)
from dualwrite.writer import (
    AsyncDualWriterPool,
    AsyncTransaction,
    DualWriter,
    DualWriterPool,
    DualWriteTransaction,
    GroupedTransaction,
    PhaseHooks,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncDualWriterPool",
    "AsyncTransaction",
    "AuthenticationError",
    "AuthorizationError",
    "ConsumedMessage",
    "DualWriteTransaction",
    "DualWriter",
    "DualWriterPool",
    "ExactlyOnceConsumer",
    "GroupedTransaction",
    "OpenTransaction",
    "Outcome",
    "PhaseHooks",
    "PreparedTxnState",
    "RecoveryReport",
    "RecoveryResult",
    "SinkRecoveryResult",
    "SinkStatus",
    "StatusReport",
    "TwoPhaseProducer",
    "VerifyReport",
    "__version__",
    "check_schema",
    "create_engine",
    "open_transactions",
    "recover",
    "status",
    "upgrade_database",
    "verify",
]
__all__ += errors.__all__
