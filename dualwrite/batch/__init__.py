"""The batch role: one decision for many participants (the exactly-once sinks).

``BatchCoordinator`` decides and completes a batch (``CoordinatorHooks``: its fault-injection
seam); ``DecisionLog`` keeps its decisions; the rows go to the target either through
``StagingTable`` or, write-once, in the tasks' prepared database transactions
(``PreparedTransactions``); ``naming`` names the participants' transactional ids.
"""

from dualwrite.batch.coordinator import (
    BatchCoordinator,
    BatchTimings,
    CoordinatorHooks,
    SinkRecovery,
)
from dualwrite.batch.decision_log import DecisionLog, Participant, SinkRecord, StagingTable
from dualwrite.batch.prepared_writes import PreparedDatabaseTxn, PreparedTransactions

__all__ = [
    "BatchCoordinator",
    "BatchTimings",
    "CoordinatorHooks",
    "DecisionLog",
    "Participant",
    "PreparedDatabaseTxn",
    "PreparedTransactions",
    "SinkRecord",
    "SinkRecovery",
    "StagingTable",
]
