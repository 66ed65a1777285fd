"""Recovery: resolve every in-doubt transaction the database names, and report what it did.

``recover`` and ``status`` live in ``resolver``; what they return in ``report``;
``open_transactions`` (a cluster's unfinished transactions) in ``transactions``; the outcomes
are the participant layer's ``Outcome`` (what ``complete`` returns), re-exported here;
``verify`` (a table's rows against its topic's records, after an incident) in ``verify``;
``recover --watch``'s loop in ``daemon`` (``RecoveryDaemon``).
"""

from dualwrite.participant.outcome import Outcome
from dualwrite.recovery import report
from dualwrite.recovery.report import *  # noqa: F403 (the report types: report.__all__)
from dualwrite.recovery.resolver import recover, status
from dualwrite.recovery.transactions import OpenTransaction, open_transactions
from dualwrite.recovery.verify import KeyOfRecord, VerifyReport, record_key, verify

__all__ = ["KeyOfRecord", "OpenTransaction", "Outcome", "VerifyReport", "open_transactions",
           "record_key", "recover", "status", "verify"]
__all__ += report.__all__
