"""Recovery: resolve every in-doubt transaction the database names, and report what it did.
"""

from dualwrite.recovery.resolver import (
    Outcome,
    RecoveryReport,
    RecoveryResult,
    SinkRecoveryResult,
    SinkStatus,
    StatusReport,
    recover,
    status,
)

__all__ = [
    "Outcome",
    "RecoveryReport",
    "RecoveryResult",
    "SinkRecoveryResult",
    "SinkStatus",
    "StatusReport",
    "recover",
    "status",
]
