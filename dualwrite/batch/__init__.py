"""The batch role: one decision for many participants (the exactly-once sinks).

``BatchCoordinator`` decides and completes a batch (``CoordinatorHooks``: its fault-injection
seam); ``DecisionLog`` and ``StagingTable`` keep its database side; ``naming`` names the
participants' transactional ids.
"""

from dualwrite.batch.coordinator import (
    BatchCoordinator,
    BatchTimings,
    CoordinatorHooks,
    SinkRecovery,
)
from dualwrite.batch.decision_log import DecisionLog, Participant, SinkRecord, StagingTable

__all__ = [
    "BatchCoordinator",
    "BatchTimings",
    "CoordinatorHooks",
    "DecisionLog",
    "Participant",
    "SinkRecord",
    "SinkRecovery",
    "StagingTable",
]
