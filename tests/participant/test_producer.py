"""TwoPhaseProducer against a real Kafka 4.3.1 broker (``kafka`` fixture).

The KIP-939 verbs on librdkafka: prepare names the transaction (producer id, epoch, and an anchor
at the transaction's first offset), a prepared transaction survives close(), and a new producer
finishes it with ``init_transactions(keep_prepared_txn=True)`` + ``complete_transaction(state)``.
What a read_committed consumer sees is the only judge of "committed".
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dualwrite import (
    HeuristicAbortError,
    PreparedTxnState,
    ProducerFencedError,
    TransactionStateError,
    TwoPhaseProducer,
)
from dualwrite.participant import ControlPlane, Outcome, TopicPartition, TxnState
from tests.support.kafka import read_committed, unique, wait_for

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def tid() -> str:
    return unique("tpp")


@pytest.fixture
def config(bootstrap: str, tid: str) -> dict[str, Any]:
    return {"bootstrap.servers": bootstrap, "transactional.id": tid, "linger.ms": 0,
            "transaction.timeout.ms": 60_000}


@pytest.fixture
def producers(config: dict[str, Any]) -> Iterator[Any]:
    """``make(**overrides)``: a TwoPhaseProducer, closed at the end of the test."""
    made: list[TwoPhaseProducer] = []

    def make(**overrides: Any) -> TwoPhaseProducer:
        producer = TwoPhaseProducer({**config, **overrides}, timeout_s=20)
        made.append(producer)
        return producer

    yield make
    for producer in made:
        # close() of a fenced producer raises (see test_close_after_fence_does_not_raise).
        with contextlib.suppress(Exception):
            producer.close()


def produce_values(producer: TwoPhaseProducer, topic: str, values: list[str],
                   partition: int | None = None, *, expect_delivery: bool = True
                   ) -> list[tuple[int, int]]:
    """Produce ``values``; the returned list fills with (partition, offset) on delivery.

    With ``expect_delivery=False`` failed deliveries (e.g. purged after fencing) are ignored
    here; the producer itself reports them.
    """
    delivered: list[tuple[int, int]] = []

    def on_delivery(err: Any, msg: Any) -> None:
        if err is not None:
            assert not expect_delivery, err
            return
        delivered.append((msg.partition(), msg.offset()))

    for v in values:
        producer.produce(topic, v.encode(), key=v.encode(), partition=partition,
                         on_delivery=on_delivery)
    return delivered


def encoded(values: list[str]) -> list[bytes]:
    return sorted(v.encode() for v in values)


def prepared_elsewhere(producers: Any, topic: str, values: list[str], **overrides: Any
                       ) -> PreparedTxnState:
    """Prepare a transaction with ``values`` in one producer, then close it (it stays open)."""
    p = producers(**overrides)
    p.init_transactions()
    p.begin_transaction()
    produce_values(p, topic, values)
    state = p.prepare_transaction()
    assert not state.is_empty
    p.close()
    assert isinstance(state, PreparedTxnState)
    return state


# -- one process ---------------------------------------------------------------------------


def test_prepare_commit_visible_and_state_names_transaction(producers: Any, bootstrap: str,
                                                            topic: str, tid: str) -> None:
    p = producers()
    p.init_transactions()
    assert p.transactional_id == tid
    assert p.identity is not None
    p.begin_transaction()
    assert p.has_open_transaction
    delivered = produce_values(p, topic, ["b1", "b2"], partition=1)
    delivered += produce_values(p, topic, ["c1"], partition=2)
    state = p.prepare_transaction()
    assert read_committed(bootstrap, topic) == []  # prepared is not committed

    assert (state.producer_id, state.epoch) == (p.identity.producer_id, p.identity.epoch)
    assert state.anchor is not None
    # The anchor is the lowest partition written and the transaction's first offset there.
    first_on_1 = min(off for part, off in delivered if part == 1)
    assert (state.anchor.topic, state.anchor.partition, state.anchor.offset) == \
        (topic, 1, first_on_1)
    assert PreparedTxnState.parse(str(state)) == state

    p.commit_transaction()
    assert not p.has_open_transaction
    assert read_committed(bootstrap, topic) == encoded(["b1", "b2", "c1"])

    # The same session goes on: a second transaction gets an anchor past the first one.
    p.begin_transaction()
    delivered2 = produce_values(p, topic, ["b3"], partition=1)
    state2 = p.prepare_transaction()
    assert state2 != state
    assert state2.anchor is not None and state2.anchor.offset == delivered2[0][1]
    assert state2.anchor.offset > state.anchor.offset
    p.commit_transaction()
    assert read_committed(bootstrap, topic) == encoded(["b1", "b2", "b3", "c1"])
    # Completing with what this session committed is a no-op.
    assert p.complete_transaction(state2) is Outcome.ALREADY_COMMITTED


def test_produce_many_sends_every_record_and_anchors_the_transaction(
        producers: Any, bootstrap: str, topic: str, cp: ControlPlane, tid: str) -> None:
    p = producers()
    p.init_transactions()
    p.begin_transaction()
    produce_values(p, topic, ["first"], partition=0)  # offsets of an earlier record stay first
    records = [(f"k{i}".encode(), f"v{i}".encode()) for i in range(5000)]
    assert p.produce_many(topic, records) == 5000
    state = p.prepare_transaction()
    assert state.anchor is not None and state.anchor.partition == 0
    producers_on_0 = cp.describe_producers([TopicPartition(topic, 0)])[TopicPartition(topic, 0)]
    assert any(ap.producer_id == state.producer_id
               and ap.current_txn_start_offset == state.anchor.offset for ap in producers_on_0)
    p.commit_transaction()
    assert read_committed(bootstrap, topic) == sorted([b"first", *(v for _, v in records)])


def test_after_prepare_only_commit_or_abort(producers: Any, bootstrap: str, topic: str) -> None:
    p = producers()
    p.init_transactions()
    p.begin_transaction()
    produce_values(p, topic, ["x"])
    p.prepare_transaction()
    with pytest.raises(TransactionStateError, match="produce"):
        p.produce(topic, b"late")
    with pytest.raises(TransactionStateError, match="begin_transaction"):
        p.begin_transaction()
    with pytest.raises(TransactionStateError):
        p.prepare_transaction()
    p.abort_transaction()
    p.begin_transaction()
    produce_values(p, topic, ["y"])
    p.prepare_transaction()
    p.commit_transaction()
    assert read_committed(bootstrap, topic) == [b"y"]


def test_an_abort_just_after_a_commit_ends_its_transaction(producers: Any, bootstrap: str,
                                                           topic: str, cp: ControlPlane,
                                                           tid: str) -> None:
    """A transaction begun right after a commit, aborted a few ms after its first record: its
    AddPartitionsToTxn may meet CONCURRENT_TRANSACTIONS (the commit's markers) and be retried.
    Without waiting for the records before the abort (``_acknowledged_before_abort``), such
    an abort may raise FatalError (INVALID_TXN_STATE, fatal to the librdkafka handle) or the
    retried request may reopen the transaction after it (docs/design.md, "An abort while a
    partition is still being added"). Every abort must succeed, and nothing stays open."""
    p = producers()
    p.init_transactions()
    for i in range(40):
        p.begin_transaction()
        produce_values(p, topic, [f"c{i}"])
        p.prepare_transaction()
        p.commit_transaction()
        p.begin_transaction()
        produce_values(p, topic, [f"a{i}"], expect_delivery=False)
        time.sleep((i % 20) / 1000)
        p.abort_transaction()
    time.sleep(1.0)  # a late AddPartitionsToTxn would have landed by now
    desc = cp.describe_transaction(tid)
    assert desc is not None and not desc.state.in_flight, desc
    assert sorted(read_committed(bootstrap, topic)) == sorted(f"c{i}".encode() for i in range(40))


def test_empty_transaction_prepares_to_empty_state(producers: Any, bootstrap: str,
                                                   topic: str) -> None:
    p = producers()
    p.init_transactions()
    p.begin_transaction()
    state = p.prepare_transaction()
    assert state.is_empty
    assert str(state) == ""
    p.commit_transaction()
    # The session is usable afterwards.
    p.begin_transaction()
    produce_values(p, topic, ["after-empty"])
    assert not p.prepare_transaction().is_empty
    p.commit_transaction()
    assert read_committed(bootstrap, topic) == [b"after-empty"]


def test_keep_prepared_requires_complete_before_begin(producers: Any, bootstrap: str,
                                                      topic: str) -> None:
    p = producers()
    p.init_transactions(keep_prepared_txn=True)
    with pytest.raises(TransactionStateError, match="begin_transaction"):
        p.begin_transaction()
    with pytest.raises(TransactionStateError):
        p.produce(topic, b"nope")
    with pytest.raises(TransactionStateError, match="init_transactions"):
        p.init_transactions()
    assert p.complete_transaction("") is Outcome.NOTHING  # a fresh id: nothing in doubt
    p.begin_transaction()
    produce_values(p, topic, ["ok"])
    p.prepare_transaction()
    p.commit_transaction()
    assert read_committed(bootstrap, topic) == [b"ok"]


# -- across processes (close, then a new producer) ------------------------------------------


def test_prepared_survives_close_and_new_producer_commits_it(
        producers: Any, bootstrap: str, topic: str, cp: ControlPlane, tid: str) -> None:
    values = ["p1", "p2", "p3", "p4"]
    state = prepared_elsewhere(producers, topic, values)
    desc = cp.describe_transaction(tid)
    assert desc is not None and desc.state is TxnState.ONGOING  # close() sent no EndTxn
    assert read_committed(bootstrap, topic) == []

    q = producers()
    q.init_transactions(keep_prepared_txn=True)
    assert q.complete_transaction(state) is Outcome.COMMITTED
    assert read_committed(bootstrap, topic) == encoded(values)
    assert q.complete_transaction(state) is Outcome.ALREADY_COMMITTED
    assert q.complete_transaction(str(state)) is Outcome.ALREADY_COMMITTED
    # q is a working producer after completion.
    q.begin_transaction()
    produce_values(q, topic, ["q1"])
    q.prepare_transaction()
    q.commit_transaction()
    assert read_committed(bootstrap, topic) == encoded([*values, "q1"])

    # A third producer, later, finds the state already committed as well.
    r = producers()
    r.init_transactions(keep_prepared_txn=True)
    assert r.complete_transaction(state) is Outcome.ALREADY_COMMITTED
    assert read_committed(bootstrap, topic) == encoded([*values, "q1"])


@pytest.mark.parametrize("stored", ["empty", "previous"])
def test_complete_with_other_state_aborts(producers: Any, bootstrap: str, topic: str,
                                          cp: ControlPlane, tid: str, stored: str) -> None:
    """The database holds "" or the state of an earlier committed transaction (the decision for
    the prepared one never committed): the prepared transaction is aborted, never visible."""
    committed = ["old1", "old2"]
    previous = PreparedTxnState.empty()
    if stored == "previous":
        p0 = producers()
        p0.init_transactions()
        p0.begin_transaction()
        produce_values(p0, topic, committed)
        previous = p0.prepare_transaction()
        p0.commit_transaction()
        p0.close()
    else:
        committed = []
    prepared = prepared_elsewhere(producers, topic, ["lost1", "lost2", "lost3"])
    assert prepared != previous

    q = producers()
    q.init_transactions(keep_prepared_txn=True)
    assert q.complete_transaction(previous) is Outcome.ABORTED
    desc = cp.describe_transaction(tid)
    assert desc is not None and not desc.state.in_flight
    # Visible: what committed before and what q commits now, never the aborted records.
    q.begin_transaction()
    produce_values(q, topic, ["new"])
    q.prepare_transaction()
    q.commit_transaction()
    assert read_committed(bootstrap, topic) == encoded([*committed, "new"])
    # Completing the aborted state now is a heuristic outcome, not a silent commit.
    r = producers()
    r.init_transactions(keep_prepared_txn=True)
    with pytest.raises(HeuristicAbortError):
        r.complete_transaction(prepared)
    assert read_committed(bootstrap, topic) == encoded([*committed, "new"])


def test_broker_timeout_of_prepared_transaction_is_heuristic_abort(
        producers: Any, bootstrap: str, topic: str, cp: ControlPlane, tid: str) -> None:
    state = prepared_elsewhere(producers, topic, ["t1", "t2"], **{"transaction.timeout.ms": 2000})
    started = time.monotonic()

    def aborted_by_broker() -> bool:
        desc = cp.describe_transaction(tid)
        return desc is not None and desc.state is TxnState.COMPLETE_ABORT

    wait_for(aborted_by_broker, 20, interval_s=0.25, what="the broker to time the txn out")
    assert time.monotonic() - started >= 1.0  # not aborted right away

    q = producers()
    q.init_transactions(keep_prepared_txn=True)
    with pytest.raises(HeuristicAbortError) as info:
        q.complete_transaction(state)
    exc = info.value
    assert exc.transactional_id == tid
    assert exc.state == str(state)
    assert tid in str(exc) and str(state) in str(exc)
    assert read_committed(bootstrap, topic) == []


# -- fencing ---------------------------------------------------------------------------------


def test_fenced_while_prepared(producers: Any, bootstrap: str, topic: str, tid: str) -> None:
    """The second producer's init aborts the first one's prepared transaction and fences it."""
    p1 = producers()
    p1.init_transactions()
    p1.begin_transaction()
    produce_values(p1, topic, ["zombie"])
    p1.prepare_transaction()
    p2 = producers()
    p2.init_transactions()
    assert p2.identity is not None and p1.identity is not None
    assert p2.identity.epoch > p1.identity.epoch
    with pytest.raises(ProducerFencedError) as info:
        p1.abort_transaction()
    assert tid in str(info.value) or "fenced" in str(info.value)
    p2.begin_transaction()
    produce_values(p2, topic, ["winner"])
    p2.prepare_transaction()
    p2.commit_transaction()
    assert read_committed(bootstrap, topic) == [b"winner"]


def test_fenced_before_prepare_is_detected_at_prepare(producers: Any, bootstrap: str,
                                                      topic: str, cp: ControlPlane,
                                                      tid: str) -> None:
    p1 = producers()
    p1.init_transactions()
    p1.begin_transaction()
    produce_values(p1, topic, ["zombie"], partition=0, expect_delivery=False)
    # Let the record reach the broker (the partition joins the transaction) before the fence.
    wait_for(lambda: (d := cp.describe_transaction(tid)) is not None and d.partitions, 10,
             what="the partition to join the transaction")
    p2 = producers()
    p2.init_transactions()
    with pytest.raises(ProducerFencedError, match="fenced"):
        p1.prepare_transaction()
    with pytest.raises(TransactionStateError):
        p1.begin_transaction()
    p2.begin_transaction()
    produce_values(p2, topic, ["winner"])
    p2.prepare_transaction()
    p2.commit_transaction()
    assert read_committed(bootstrap, topic) == [b"winner"]


def test_fenced_while_idle_next_transaction_raises_fenced(producers: Any, bootstrap: str,
                                                          topic: str) -> None:
    p1 = producers()
    p1.init_transactions()
    p2 = producers()
    p2.init_transactions()  # fences p1, which has no open transaction
    with pytest.raises(ProducerFencedError):
        p1.begin_transaction()
        produce_values(p1, topic, ["zombie"], expect_delivery=False)
        p1.prepare_transaction()
        p1.commit_transaction()
    p2.begin_transaction()
    produce_values(p2, topic, ["winner"])
    p2.prepare_transaction()
    p2.commit_transaction()
    assert read_committed(bootstrap, topic) == [b"winner"]


def test_commit_after_being_fenced_reports_lost_records(producers: Any, bootstrap: str,
                                                        topic: str, tid: str) -> None:
    """Commit of a prepared transaction that a newer producer aborted: the caller decided commit
    and Kafka aborted, so the records are lost and the error must say so."""
    p1 = producers()
    p1.init_transactions()
    p1.begin_transaction()
    produce_values(p1, topic, ["zombie"])
    state = p1.prepare_transaction()
    p2 = producers()
    p2.init_transactions()
    with pytest.raises(HeuristicAbortError) as info:
        p1.commit_transaction()
    assert info.value.transactional_id == tid
    assert info.value.state == str(state)
    assert read_committed(bootstrap, topic) == []


def test_close_after_fence_does_not_raise(producers: Any, topic: str) -> None:
    p1 = producers()
    p1.init_transactions()
    p1.begin_transaction()
    produce_values(p1, topic, ["zombie"])
    p1.prepare_transaction()
    p2 = producers()
    p2.init_transactions()
    with pytest.raises(ProducerFencedError):
        p1.abort_transaction()
    p1.close()


class _RequestTimeouts:
    """A librdkafka ``logger`` that keeps the lines of requests it timed out itself."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        line = msg % args if args else msg
        if "REQTMOUT" in line or "timed out: disconnect" in line:
            self.lines.append(line)


def test_long_transaction_timeout_keeps_requests_from_timing_out_at_once(
        producers: Any, bootstrap: str, topic: str) -> None:
    """With ``transaction.timeout.ms`` left to the broker's maximum (an hour here, as on the
    dev cluster), librdkafka's derived ``socket.timeout.ms`` overflowed its request deadlines:
    once a second it failed whatever request was in flight (``REQTMOUT ... ProduceRequest in
    flight (after 9ms)``) and reconnected, a 0.5 s stall in a flush. The producer keeps the
    socket timeout at librdkafka's default instead. Back-to-back transactions over three
    partitions for 3 s: no request may time out."""
    timeouts = _RequestTimeouts()
    overrides: dict[str, Any] = {"logger": timeouts, "debug": "broker,protocol"}
    producer = producers(**overrides, **{"transaction.timeout.ms": 3_600_000})
    producer.init_transactions()
    ended = time.monotonic() + 3.0
    transactions = 0
    while time.monotonic() < ended:
        producer.begin_transaction()
        for partition in range(3):
            producer.produce(topic, b"v", partition=partition)
        producer.flush_and_state()
        producer.commit_transaction()
        transactions += 1
    assert transactions > 20
    assert timeouts.lines == [], timeouts.lines[:3]


@pytest.mark.unit
def test_a_socket_timeout_librdkafka_overflows_is_refused() -> None:
    """``socket.timeout.ms`` above 2,147,483 wraps librdkafka's request deadlines (every request
    would time out at once): refused before anything connects."""
    from dualwrite.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"socket\.timeout\.ms=3000000"):
        TwoPhaseProducer({"bootstrap.servers": "127.0.0.1:1", "transactional.id": "t",
                          "socket.timeout.ms": 3_000_000})


def test_ctrl_c_in_a_delivery_report_reaches_the_caller(producers: Any, bootstrap: str,
                                                        topic: str) -> None:
    """SIGINT while flush() serves a batch of delivery reports: the KeyboardInterrupt is raised
    out of prepare_transaction(), not lost in confluent-kafka (which then raised a bare
    SystemError, taken for a broken session and retried, so a service's Ctrl-C did nothing).
    The transaction aborts and the producer goes on."""
    p = producers()
    p.init_transactions()
    p.begin_transaction()
    interrupted: list[bool] = []

    def interrupt_once(err: Any, msg: Any) -> None:
        if not interrupted:
            interrupted.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # handled at the next report's first line

    for n in range(50):  # one batch on one partition: many reports in one serving
        p.produce(topic, b"v", key=str(n).encode(), partition=0, on_delivery=interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        p.prepare_transaction()
    assert interrupted
    p.abort_transaction()
    p.begin_transaction()
    produce_values(p, topic, ["after"])
    p.prepare_transaction()
    p.commit_transaction()
    assert read_committed(bootstrap, topic) == [b"after"]
