"""Recovery: resolve every in-doubt transaction the database names, and report what it did.

``recover`` and ``status`` live in ``resolver``; what they return in ``report``; the outcomes
are the participant layer's ``Outcome`` (what ``complete`` returns), re-exported here.
"""

from dualwrite.participant.outcome import Outcome
from dualwrite.recovery.report import (
    InDoubt,
    RecoveryReport,
    RecoveryResult,
    SinkParticipantStatus,
    SinkRecoveryResult,
    SinkStatus,
    StatusReport,
)
from dualwrite.recovery.resolver import recover, status

__all__ = [
    "InDoubt",
    "Outcome",
    "RecoveryReport",
    "RecoveryResult",
    "SinkParticipantStatus",
    "SinkRecoveryResult",
    "SinkStatus",
    "StatusReport",
    "recover",
    "status",
]
