"""Prepared states outside the wire protocol's ranges are rejected by the parser, so that one bad
state row is reported as failed instead of crashing a whole recovery run (OverflowError /
struct.error from the Kafka clients)."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite import InvalidPreparedStateError, Outcome, PreparedTxnState
from dualwrite.writer import StateStore
from tests.support.kafka import prepare_open, read_committed, unique

pytestmark = pytest.mark.timeout(120)

INT64 = 2**63 - 1
INT32 = 2**31 - 1


@pytest.mark.unit
@pytest.mark.parametrize("text", [
    f"dw1:{INT64 + 1}:0:t:0:0",
    f"{INT64 + 1}:0",
    f"dw1:1:0:t:{INT32 + 1}:0",
    f"dw1:1:0:t:0:{INT64 + 1}",
    "dw1:1:0:t:0:9999999999999999999",
    "dw1:1:32768:t:0:0",
])
def test_parser_rejects_values_outside_the_protocol_ranges(text: str) -> None:
    with pytest.raises(InvalidPreparedStateError):
        PreparedTxnState.parse(text)


@pytest.mark.unit
def test_parser_accepts_the_largest_values() -> None:
    text = f"dw1:{INT64}:32767:t:{INT32}:{INT64}"
    state = PreparedTxnState.parse(text)
    assert str(state) == text
    assert PreparedTxnState.parse(f"{INT64}:32767").producer_id == INT64


def test_recover_reports_an_out_of_range_state_and_resolves_the_others(
        engine: sa.Engine, bootstrap: str, topic: str) -> None:
    store = StateStore(engine)
    kconf: dict[str, Any] = {"bootstrap.servers": bootstrap}
    bad = {
        unique("bad-partition"): f"dw1:5:0:{topic}:{INT32 + 1}:0",
        unique("bad-offset"): f"dw1:5:0:{topic}:0:{INT64 + 1}",
        unique("bad-pid"): f"dw1:{INT64 + 1}:0:{topic}:0:0",
    }
    for tid, text in bad.items():
        assert store.compare_and_set(tid, "", text)
    commit_tid, done_tid = unique("good-commit"), unique("good-done")
    assert store.compare_and_set(commit_tid, "", str(prepare_open(bootstrap, topic, commit_tid,
                                                                  ["in-doubt"])))
    assert store.compare_and_set(done_tid, "", str(prepare_open(bootstrap, topic, done_tid,
                                                                ["done"], commit=True)))

    report = dualwrite.recover(engine, kconf, timeout_s=20)

    got = {r.transactional_id: r for r in report.results}
    assert got[commit_tid].outcome is Outcome.COMMITTED
    assert got[done_tid].outcome is Outcome.ALREADY_COMMITTED
    for tid, text in bad.items():
        assert got[tid].outcome is Outcome.FAILED, got[tid]
        assert got[tid].state == text
        assert "invalid prepared transaction state" in got[tid].detail
    assert read_committed(bootstrap, topic) == [b"done", b"in-doubt"]
    assert {r.transactional_id: r.prepared_txn_state for r in store.read_all()
            if r.transactional_id in bad} == bad  # left for the operator
