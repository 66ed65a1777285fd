"""The anchor check (``AnchorReader.committed``) on a real broker: compacted and trimmed logs,
hashed topic names, and genuine aborts.

"Committed" needs the record at the anchor offset visible to read_committed; "aborted" needs
positive evidence (the record is in the log and read_committed skips it). A record that is gone
(compacted away, below the log start) is :class:`OutcomeUnreadableError`, never a heuristic abort.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka import TopicPartition as CKTopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

import dualwrite
from dualwrite import DualWriter, PreparedTxnState
from dualwrite.errors import HeuristicAbortError, HeuristicOutcomeError, OutcomeUnreadableError
from dualwrite.participant import ControlPlane, TopicPartition, TxnState
from dualwrite.participant.anchor_reader import AnchorReader
from dualwrite.participant.completion import Outcome, complete
from dualwrite.participant.prepared_state import Anchor, topic_digest
from dualwrite.writer import StateStore
from tests.support.kafka import prepare_open, unique, wait_for

pytestmark = pytest.mark.timeout(120)


def _anchor_tp(state: PreparedTxnState) -> TopicPartition:
    assert state.anchor is not None
    return TopicPartition(state.anchor.topic, state.anchor.partition)


def _first_uncommitted_offset(bootstrap: str, tp: TopicPartition, offset: int) -> int | None:
    """The first offset >= ``offset`` a read_uncommitted consumer returns (None: none)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": unique("anchor-probe"),
                  "isolation.level": "read_uncommitted", "enable.partition.eof": True,
                  "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    try:
        c.assign([CKTopicPartition(tp.topic, tp.partition, offset)])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            msg = c.poll(0.2)
            if msg is None:
                continue
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    return None
                continue
            found = msg.offset()
            assert found is not None
            return int(found)
        return None
    finally:
        c.close()


def _stored(store: StateStore, tid: str) -> str:
    row = store.read(tid)
    assert row is not None
    return row.prepared_txn_state


def _all_offsets(bootstrap: str, tp: TopicPartition) -> list[tuple[int, bytes]]:
    """(offset, key) of every record read_uncommitted returns from offset 0."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": unique("anchor-probe"),
                  "isolation.level": "read_uncommitted", "enable.partition.eof": True,
                  "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    out: list[tuple[int, bytes]] = []
    try:
        c.assign([CKTopicPartition(tp.topic, tp.partition, 0)])
        while True:
            msg = c.poll(2)
            if msg is None or msg.error() is not None:
                return out
            offset, key = msg.offset(), msg.key()
            assert offset is not None and key is not None
            out.append((offset, key))
    finally:
        c.close()


def _wait_broker_aborted(bootstrap: str, tid: str) -> None:
    with ControlPlane({"bootstrap.servers": bootstrap}, timeout_s=10) as cp:
        wait_for(lambda: (d := cp.describe_transaction(tid)) is not None
                 and d.state is TxnState.COMPLETE_ABORT, 20, interval_s=0.25,
                 what=f"the broker to abort {tid} after its timeout")


@pytest.fixture
def fast_cleaner(bootstrap: str) -> Iterator[None]:
    """Lower every broker's dynamic ``log.cleaner.backoff.ms`` (default 15 s) for one test."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    brokers = sorted(admin.list_topics(timeout=10).brokers)

    def alter(op: AlterConfigOpType, value: str | None) -> None:
        res = [ConfigResource(ResourceType.BROKER, str(b), incremental_configs=[
            ConfigEntry("log.cleaner.backoff.ms", value, incremental_operation=op)])
            for b in brokers]
        for f in admin.incremental_alter_configs(res).values():
            f.result(timeout=30)

    alter(AlterConfigOpType.SET, "200")
    try:
        yield
    finally:
        alter(AlterConfigOpType.DELETE, None)


def test_compacted_anchor_of_committed_transaction_is_not_a_heuristic_abort(
        kafka: Any, new_topic: Any, bootstrap: str, kconf: dict[str, Any],
        fast_cleaner: None) -> None:
    topic = new_topic(kafka, partitions=1, config={
        "cleanup.policy": "compact", "segment.ms": "100", "min.cleanable.dirty.ratio": "0.01",
        "delete.retention.ms": "100", "min.compaction.lag.ms": "0"})
    tid = unique("anchor-compact")
    state = prepare_open(bootstrap, topic, tid, ["k"], commit=True)
    tp = _anchor_tp(state)
    assert state.anchor is not None
    anchor = state.anchor.offset
    # Supersede the anchor's key, then keep appending so that segments roll and get cleaned.
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})

    def compacted() -> bool:
        p.produce(topic, b"newer", key=b"k")
        p.produce(topic, b"filler", key=unique("f").encode())
        p.flush(10)
        return _first_uncommitted_offset(bootstrap, tp, anchor) != anchor

    wait_for(compacted, 50, interval_s=0.3, what="the log cleaner to remove the anchor record")
    left = _all_offsets(bootstrap, tp)
    assert anchor not in [o for o, _ in left] and b"k" in [k for _, k in left]

    with ControlPlane(kconf, timeout_s=20) as cp, pytest.raises(HeuristicOutcomeError) as err:
        complete(cp, kconf, tid, state, timeout_s=20)
    assert not isinstance(err.value, HeuristicAbortError)  # no re-publish hook may run
    assert isinstance(err.value, OutcomeUnreadableError)
    assert (err.value.transactional_id, err.value.state) == (tid, str(state))
    with pytest.raises(OutcomeUnreadableError) as info:
        AnchorReader(kconf).committed(tp, anchor, 20, transactional_id=tid, state=str(state))
    assert "log cleaner" in info.value.detail


def test_anchor_below_log_start_is_unreadable_not_unknown(
        topic: str, bootstrap: str, kconf: dict[str, Any]) -> None:
    tid = unique("anchor-trim")
    state = prepare_open(bootstrap, topic, tid, ["a", "b", "c"], commit=True)
    tp = _anchor_tp(state)
    assert state.anchor is not None
    admin = AdminClient({"bootstrap.servers": bootstrap})
    cut = CKTopicPartition(tp.topic, tp.partition, state.anchor.offset + 1)
    for f in admin.delete_records([cut]).values():
        assert f.result(timeout=30).low_watermark >= state.anchor.offset + 1
    with ControlPlane(kconf, timeout_s=20) as cp, pytest.raises(OutcomeUnreadableError) as err:
        complete(cp, kconf, tid, state, timeout_s=20)
    assert "log start" in err.value.detail
    assert err.value.state == str(state)


def test_aborted_transaction_still_reads_as_aborted(topic: str, bootstrap: str,
                                                    kconf: dict[str, Any]) -> None:
    tid = unique("anchor-abort")
    state = prepare_open(bootstrap, topic, tid, ["lost"], timeout_ms=2000)
    _wait_broker_aborted(bootstrap, tid)
    assert state.anchor is not None
    assert AnchorReader(kconf).committed(_anchor_tp(state), state.anchor.offset, 20) is False
    with ControlPlane(kconf, timeout_s=20) as cp, pytest.raises(HeuristicAbortError):
        complete(cp, kconf, tid, state, timeout_s=20)


def test_committed_transaction_reads_as_committed(topic: str, bootstrap: str,
                                                  kconf: dict[str, Any]) -> None:
    tid = unique("anchor-commit")
    state = prepare_open(bootstrap, topic, tid, ["kept"], commit=True)
    with ControlPlane(kconf, timeout_s=20) as cp:
        assert complete(cp, kconf, tid, state, timeout_s=20) is Outcome.ALREADY_COMMITTED


@pytest.mark.parametrize("length", [240, 249])
def test_hashed_topic_name_resolves_after_the_transaction_ended(
        kafka: Any, bootstrap: str, kconf: dict[str, Any], length: int) -> None:
    """A topic name too long for the state is stored as its digest; once the transaction ended
    the coordinator lists no partitions, so the check finds the topic among the cluster's."""
    topic = kafka.create_topic(unique("h" * (length - 11)), 1)
    assert len(topic) == length

    def hashed(state: PreparedTxnState) -> PreparedTxnState:
        # 240 characters fit beside a small producer id and offset; a larger one would not.
        assert state.anchor is not None
        anchor = Anchor(topic_digest(topic), state.anchor.partition, state.anchor.offset)
        return PreparedTxnState(state.producer_id, state.epoch, anchor)

    tid = unique("anchor-hashed")
    state = hashed(prepare_open(bootstrap, topic, tid, ["v"], commit=True))
    assert PreparedTxnState.parse(str(state)) == state
    with ControlPlane(kconf, timeout_s=20) as cp:
        desc = cp.describe_transaction(tid)
        assert desc is not None and not desc.partitions  # nothing left to resolve it from
        assert complete(cp, kconf, tid, state, timeout_s=20) is Outcome.ALREADY_COMMITTED

    aborted_tid = unique("anchor-hashed-abort")
    aborted = hashed(prepare_open(bootstrap, topic, aborted_tid, ["w"], timeout_ms=2000))
    _wait_broker_aborted(bootstrap, aborted_tid)
    with ControlPlane(kconf, timeout_s=20) as cp, pytest.raises(HeuristicAbortError):
        complete(cp, kconf, aborted_tid, aborted, timeout_s=20)


def test_hashed_topic_that_no_longer_exists_is_unreadable(bootstrap: str,
                                                          kconf: dict[str, Any]) -> None:
    tid = unique("anchor-gone")
    state = PreparedTxnState(7, 0, Anchor(topic_digest(unique("never-created")), 0, 0))
    with ControlPlane(kconf, timeout_s=20) as cp, pytest.raises(OutcomeUnreadableError) as err:
        complete(cp, kconf, tid, state, timeout_s=20)
    assert "digest" in err.value.detail


def test_anchor_on_a_topic_that_no_longer_exists_is_unreadable(bootstrap: str,
                                                               kconf: dict[str, Any]) -> None:
    missing = unique("never-created")
    state = PreparedTxnState(7, 0, Anchor(missing, 0, 0))
    with ControlPlane(kconf, timeout_s=20) as cp, pytest.raises(OutcomeUnreadableError) as err:
        complete(cp, kconf, unique("anchor-missing"), state, timeout_s=20)
    assert "no longer exists" in err.value.detail
    admin = AdminClient({"bootstrap.servers": bootstrap})
    assert missing not in admin.list_topics(timeout=10).topics  # the check created nothing


def _trimmed_decided_state(store: StateStore, bootstrap: str, topic: str, tid: str
                           ) -> PreparedTxnState:
    """A committed transaction the database decided, whose anchor DeleteRecords removed."""
    state = prepare_open(bootstrap, topic, tid, ["x", "y"], commit=True)
    assert state.anchor is not None and store.compare_and_set(tid, "", str(state))
    admin = AdminClient({"bootstrap.servers": bootstrap})
    cut = CKTopicPartition(state.anchor.topic, state.anchor.partition, state.anchor.offset + 1)
    for f in admin.delete_records([cut]).values():
        f.result(timeout=30)
    return state


def test_writer_stops_on_an_unreadable_outcome_without_calling_the_hook(
        engine: sa.Engine, bootstrap: str, topic: str) -> None:
    store = StateStore(engine)
    tid = unique("anchor-writer")
    _trimmed_decided_state(store, bootstrap, topic, tid)
    calls: list[Any] = []
    writer = DualWriter(engine, {"bootstrap.servers": bootstrap}, transactional_id=tid,
                        timeout_s=20, on_heuristic_abort=lambda exc, conn: calls.append(exc))
    try:
        with pytest.raises(OutcomeUnreadableError), writer.transaction() as tx:
            tx.produce(topic, b"next")
    finally:
        with contextlib.suppress(Exception):
            writer.close()
    assert calls == []  # it may have committed: re-publishing could duplicate it


def test_recover_reports_unreadable_until_acknowledged_then_the_writer_starts(
        engine: sa.Engine, bootstrap: str, topic: str) -> None:
    store = StateStore(engine)
    kconf = {"bootstrap.servers": bootstrap}
    tid = unique("anchor-ack")
    state = _trimmed_decided_state(store, bootstrap, topic, tid)
    for _ in range(2):  # reported every time, the state kept for the operator
        report = dualwrite.recover(engine, kconf, [tid], timeout_s=20)
        assert not report.ok
        assert [(r.transactional_id, r.outcome.value) for r in report.results] == [
            (tid, "outcome-unreadable")]
        assert report.heuristic and "log start" in report.results[0].detail
        assert _stored(store, tid) == str(state)
    done = dualwrite.recover(engine, kconf, [tid], timeout_s=20, acknowledge_heuristic=True)
    assert done.ok and done.results[0].outcome is dualwrite.Outcome.ACKNOWLEDGED
    assert _stored(store, tid) == ""
    with DualWriter(engine, kconf, transactional_id=tid, timeout_s=20) as writer, \
            writer.transaction() as tx:
        tx.produce(topic, b"after-ack")
