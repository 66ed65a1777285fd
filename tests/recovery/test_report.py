"""StatusReport's figures taken at one instant.

Pure logic, no broker: a transaction's open time is measured at the moment its coordinator
answered, so the report's maximum (the KIP's ActiveTransactionOpenTimeMaxMs) agrees with every
row's own figure however long after the report is read (CI once saw 623 < 624 when each figure
read the clock on its own).
"""

from __future__ import annotations

import time

import pytest

from dualwrite.participant.control_plane import TransactionDescription, TxnState
from dualwrite.participant.identifiers import TopicPartition
from dualwrite.recovery.report import Condition, InDoubt, StatusReport

pytestmark = pytest.mark.unit


def _described(tid: str, state: TxnState, started_ms: int, at_ms: int) -> TransactionDescription:
    return TransactionDescription(
        transactional_id=tid, state=state, producer_id=7, epoch=0, timeout_ms=60_000,
        start_time_ms=started_ms, partitions=frozenset({TopicPartition("t", 0)}),
        coordinator_id=1, described_at_ms=at_ms)


def test_open_time_is_taken_when_described() -> None:
    d = _described("a", TxnState.ONGOING, started_ms=1_000, at_ms=1_624)
    assert d.open_for_ms() == 624
    time.sleep(0.01)
    assert d.open_for_ms() == 624
    assert d.open_for_ms(now_ms=2_000) == 1_000
    assert _described("b", TxnState.COMPLETE_COMMIT, 1_000, 1_624).open_for_ms() is None


def test_report_maximum_agrees_with_its_rows() -> None:
    now = int(time.time() * 1000)
    row = InDoubt("a", "", None, _described("a", TxnState.ONGOING, now - 623, now + 1),
                  Condition.IN_DOUBT)
    hanging = _described("h", TxnState.ONGOING, now - 100, now + 1)
    report = StatusReport((row,), (hanging,))
    time.sleep(0.01)
    assert row.open_for_ms == 624
    assert report.active_transaction_open_time_max_ms == 624
