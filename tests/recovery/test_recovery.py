"""dualwrite.recover and dualwrite.status against a real broker and real databases.

Each scenario is built the way a crash leaves it: a TwoPhaseProducer prepares and is closed (its
transaction stays Ongoing at the coordinator), and the state table holds what the database decided.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite import Outcome, PreparedTxnState
from dualwrite.participant import ControlPlane, TxnState
from dualwrite.writer import StateStore
from tests.support.kafka import prepare_open, read_committed, unique, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store(engine: sa.Engine) -> StateStore:
    return StateStore(engine)


def decide(store: StateStore, tid: str, state: PreparedTxnState | str) -> None:
    """What the database committed for ``tid``."""
    assert store.compare_and_set(tid, "", str(state))


def outcomes(report: dualwrite.RecoveryReport) -> dict[str, Outcome]:
    return {r.transactional_id: r.outcome for r in report.results}


def wait_broker_aborted(bootstrap: str, tid: str) -> None:
    with ControlPlane({"bootstrap.servers": bootstrap}, timeout_s=10) as cp:
        wait_for(lambda: (d := cp.describe_transaction(tid)) is not None
                 and d.state is TxnState.COMPLETE_ABORT, 20, interval_s=0.25,
                 what=f"the broker to abort {tid} after its timeout")


def build_scenario(store: StateStore, bootstrap: str, topic_for: Any, prefix: str
                   ) -> tuple[dict[str, str], list[bytes]]:
    """Six ids, as a crash leaves them; returns the ids and the records that must end up
    visible. ``topic_for(key)`` is the topic each id writes to."""
    ids = {k: f"{prefix}-{k}" for k in ("commit1", "commit2", "abort1", "abort2", "done",
                                        "empty")}

    def prep(key: str, values: list[str], commit: bool = False) -> PreparedTxnState:
        return prepare_open(bootstrap, topic_for(key), ids[key], values, commit=commit)

    decide(store, ids["commit1"], prep("commit1", ["c1a", "c1b"]))
    decide(store, ids["commit2"], prep("commit2", ["c2a"]))
    # Open but not decided: the database never committed their state.
    prep("abort1", ["x1a", "x1b"])
    decide(store, ids["abort1"], "")
    # Not decided either; the database still holds an earlier, committed transaction's state.
    earlier = prep("abort2", ["e2"], commit=True)
    prep("abort2", ["x2"])
    decide(store, ids["abort2"], earlier)
    decide(store, ids["done"], prep("done", ["d1"], commit=True))
    decide(store, ids["empty"], "")
    return ids, sorted(v.encode() for v in ("c1a", "c1b", "c2a", "e2", "d1"))


def test_recover_resolves_many_ids_and_is_idempotent(engine: sa.Engine, store: StateStore,
                                                      kconf: dict[str, Any], bootstrap: str,
                                                      kafka: Any, new_topic: Any) -> None:
    topics = {k: new_topic(kafka, partitions=2) for k in ("commit1", "commit2", "abort1",
                                                         "abort2", "done")}
    ids, expected = build_scenario(store, bootstrap, topics.__getitem__, unique("rec"))

    def visible() -> list[bytes]:
        return sorted(v for t in topics.values() for v in read_committed(bootstrap, t))

    report = dualwrite.recover(engine, kconf, parallelism=4, timeout_s=20)
    assert report.ok, report.as_dict()
    assert outcomes(report) == {
        ids["commit1"]: Outcome.COMMITTED,
        ids["commit2"]: Outcome.COMMITTED,
        ids["abort1"]: Outcome.ABORTED,
        ids["abort2"]: Outcome.ABORTED,
        ids["done"]: Outcome.ALREADY_COMMITTED,
        ids["empty"]: Outcome.NOTHING,
    }
    assert report.count(Outcome.COMMITTED) == 2
    json.dumps(report.as_dict())
    assert visible() == expected
    assert all(r.prepared_txn_state == "" for r in store.read_all())  # resolved states cleared

    again = dualwrite.recover(engine, kconf, timeout_s=20)
    assert again.ok
    assert set(outcomes(again)) == set(ids.values())
    assert set(outcomes(again).values()) <= {Outcome.NOTHING, Outcome.ALREADY_COMMITTED}
    assert visible() == expected

    # Only the given ids, listed twice: each is handled once.
    only = dualwrite.recover(engine, kconf, [ids["commit1"], ids["commit1"]], timeout_s=20)
    assert [r.transactional_id for r in only.results] == [ids["commit1"]]


def test_recover_ids_sharing_one_partition(engine: sa.Engine, store: StateStore,
                                           kconf: dict[str, Any], bootstrap: str,
                                           kafka: Any, new_topic: Any) -> None:
    """The usual deployment: many transactional ids writing the same topic partition."""
    shared = new_topic(kafka, partitions=1)
    _ids, expected = build_scenario(store, bootstrap, lambda _k: shared, unique("rec-shared"))
    report = dualwrite.recover(engine, kconf, parallelism=1, timeout_s=5)
    assert report.ok, report.as_dict()
    assert read_committed(bootstrap, shared) == expected


def test_recover_heuristic_reported_until_acknowledged(engine: sa.Engine, store: StateStore,
                                                       kconf: dict[str, Any], bootstrap: str,
                                                       topic: str) -> None:
    tid = unique("rec-heur")
    ok_tid = unique("rec-fine")
    state = prepare_open(bootstrap, topic, tid, ["lost"], timeout_ms=2000)
    decide(store, tid, state)
    decide(store, ok_tid, prepare_open(bootstrap, topic, ok_tid, ["fine"]))
    wait_broker_aborted(bootstrap, tid)

    for _ in range(2):  # reported every time, state kept for the operator
        report = dualwrite.recover(engine, kconf, [tid, ok_tid], timeout_s=20)
        assert not report.ok
        assert [r.transactional_id for r in report.heuristic] == [tid]
        assert report.heuristic[0].state == str(state)
        assert report.heuristic[0].detail
        row = store.read(tid)
        assert row is not None and row.prepared_txn_state == str(state)
    assert read_committed(bootstrap, topic) == [b"fine"]

    acked = dualwrite.recover(engine, kconf, [tid], acknowledge_heuristic=True, timeout_s=20)
    assert acked.ok
    assert outcomes(acked) == {tid: Outcome.ACKNOWLEDGED}
    assert not acked.heuristic
    row = store.read(tid)
    assert row is not None and row.prepared_txn_state == ""
    after = dualwrite.recover(engine, kconf, timeout_s=20)
    assert after.ok and not after.heuristic
    assert outcomes(after)[tid] is Outcome.NOTHING


def test_status_in_doubt_and_hanging(engine: sa.Engine, store: StateStore, kconf: dict[str, Any],
                                     bootstrap: str, topic: str) -> None:
    prefix = unique("stat")
    doubt, quiet, hanging = f"{prefix}-doubt", f"{prefix}-quiet", f"{prefix}-hanging"
    state = prepare_open(bootstrap, topic, doubt, ["s1"])
    decide(store, doubt, state)
    decide(store, quiet, "")
    prepare_open(bootstrap, topic, hanging, ["h1"])  # open at the broker, no state row at all

    report = dualwrite.status(engine, kconf, prefix=prefix, timeout_s=20)
    by_id = {r.transactional_id: r for r in report.rows}
    assert set(by_id) == {doubt, quiet}
    d = by_id[doubt]
    assert d.in_doubt and d.state == str(state)
    assert d.broker is not None and d.broker.state is TxnState.ONGOING
    assert d.broker.producer_id == state.producer_id
    assert d.open_for_ms is not None and 0 <= d.open_for_ms < 120_000
    assert d.updated_at is not None and d.updated_at.tzinfo is not None
    q = by_id[quiet]
    assert not q.in_doubt and q.open_for_ms is None
    assert [h.transactional_id for h in report.hanging] == [hanging]
    assert report.hanging[0].state is TxnState.ONGOING
    assert report.active_transaction_open_time_max_ms >= d.open_for_ms
    as_dict = json.loads(json.dumps(report.as_dict()))
    assert as_dict["hanging"][0]["transactional_id"] == hanging
    assert {r["transactional_id"]: r["in_doubt"] for r in as_dict["transactional_ids"]} == {
        doubt: True, quiet: False}

    # After recovery nothing named in the table is in doubt; the hanging one is still reported.
    assert dualwrite.recover(engine, kconf, timeout_s=20).ok
    later = dualwrite.status(engine, kconf, prefix=prefix, timeout_s=20)
    assert not any(r.in_doubt for r in later.rows)
    assert [h.transactional_id for h in later.hanging] == [hanging]
    with ControlPlane(kconf, timeout_s=10) as cp:
        cp.fence(hanging)  # clean up: abort it
    final = dualwrite.status(engine, kconf, prefix=prefix, timeout_s=20)
    assert final.hanging == ()


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_anchor_deleted_by_retention_is_reported_not_guessed(store: StateStore, engine: sa.Engine,
                                                             kconf: dict[str, Any],
                                                             bootstrap: str, topic: str) -> None:
    """The named transaction ended and its anchor record is gone (retention, DeleteRecords):
    Kafka can no longer say whether it committed, so recovery must neither commit, abort nor
    call it a heuristic abort; it reports the outcome as unreadable (resolved only by an
    operator's acknowledgement, see test_anchor_checks) and keeps the state."""
    from confluent_kafka import TopicPartition as CKTopicPartition
    from confluent_kafka.admin import AdminClient

    tid = unique("retention")
    state = prepare_open(bootstrap, topic, tid, ["gone"], commit=True)
    decide(store, tid, state)
    anchor = state.anchor
    assert anchor is not None
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.delete_records(
        [CKTopicPartition(anchor.topic, anchor.partition, anchor.offset + 2)])
    for future in futures.values():
        future.result(30)
    report = dualwrite.recover(engine, kconf, [tid], timeout_s=10)
    (result,) = report.results
    assert result.outcome is Outcome.OUTCOME_UNREADABLE
    assert "retention" in result.detail
    assert not report.ok
    row = store.read(tid)
    assert row is not None and row.prepared_txn_state == str(state)  # kept for a human
