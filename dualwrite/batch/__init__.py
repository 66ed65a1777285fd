"""The batch role: one decision for many participants (the exactly-once sinks).

``BatchCoordinator`` decides and completes a batch; ``DecisionLog`` and ``StagingTable`` keep
its database side.
"""

from dualwrite.batch.coordinator import BatchCoordinator, BatchTimings, SinkRecovery
from dualwrite.batch.decision_log import DecisionLog, Participant, SinkRecord, StagingTable

__all__ = [
    "BatchCoordinator",
    "BatchTimings",
    "DecisionLog",
    "Participant",
    "SinkRecord",
    "SinkRecovery",
    "StagingTable",
]
