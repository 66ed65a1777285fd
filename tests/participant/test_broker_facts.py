"""Pin, on real brokers, the Kafka and librdkafka behaviour dualwrite's design relies on.

Each test names the claim of /work/shared/FACTS.md (or of the issue) it checks; docs/broker-facts.md
records what was measured, with versions and error codes. Tests run on Kafka 4.3.1 (``kafka``); the
compatibility tier (tests/participant/test_compat.py) runs most of them on 3.9.x, 4.0, 4.1, 4.2
and 4.4 too. The KIP-939 checks use ``kafka_2pc``; the 3.9-only checks ``kafka39``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from kafka.errors import KafkaConnectionError

from dualwrite.participant.control_plane import ControlPlane, TransactionDescription, TxnState
from dualwrite.participant.identifiers import TopicPartition
from dualwrite.participant.kafka_errors import FatalKafkaError, FencedKafkaError
from tests.support.kafka import (
    ProducerProcess,
    TxnProducer,
    create_topic,
    first_offsets,
    raw_init_producer_id_v6,
    read_committed,
    unique,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)

INVALID_TXN_STATE = 48
INVALID_PRODUCER_ID_MAPPING = 49
PRODUCER_FENCED = 90
UNSUPPORTED_VERSION = 35
INT32_MAX = 2**31 - 1


@pytest.fixture
def bootstrap(kafka: Any) -> str:
    """Kafka 4.3.1; tests/participant/test_compat.py runs these tests on 3.9.x and the other
    versions."""
    servers: str = kafka.bootstrap_servers
    return servers


@pytest.fixture
def topic(bootstrap: str) -> str:
    return create_topic(bootstrap, unique("facts"), partitions=3)


VALUES = [b"r0", b"r1", b"r2", b"r3", b"r4", b"r5"]


def settled(cp: ControlPlane, tid: str, timeout_s: float = 10) -> TransactionDescription:
    """The description once the coordinator finished writing markers (no Prepare* state)."""
    desc: TransactionDescription = wait_for(
        lambda: (d := cp.describe_transaction(tid)) and not d.state.in_flight and d,
        timeout_s,
        what=f"{tid} to leave its in-flight state",
    )
    return desc


def ongoing_then_destroyed(
    bootstrap: str, topic: str, tid: str, timeout_ms: int = 60_000
) -> tuple[TxnProducer, tuple[int, int]]:
    """Begin, produce, flush, then drop the producer without commit, abort or close()."""
    producer = TxnProducer(bootstrap, tid, transaction_timeout_ms=timeout_ms).start()
    assert producer.producer is not None
    producer.producer.begin_transaction()
    producer.send(topic, VALUES)
    identity = producer.identity()
    producer.destroy()
    return producer, identity


# -- Fact 1: a producer that goes away mid-transaction leaves it Ongoing ----------------------


def test_destroyed_producer_leaves_transaction_ongoing(
    cp: ControlPlane, bootstrap: str, topic: str
) -> None:
    tid = unique("facts-destroy")
    producer, (pid, epoch) = ongoing_then_destroyed(bootstrap, topic, tid)
    time.sleep(1.0)  # anything librdkafka sent on destroy would have arrived by now
    desc = cp.describe_transaction(tid)
    assert desc is not None
    assert desc.state is TxnState.ONGOING
    assert (desc.producer_id, desc.epoch) == (pid, epoch)
    assert desc.partitions == {TopicPartition(topic, p) for p in first_offsets(producer.deliveries)}
    assert read_committed(bootstrap, topic) == []
    cp.end_transaction(tid, pid, epoch, commit=False)  # leave no open transaction behind


def test_producer_close_aborts_the_transaction(
    cp: ControlPlane, bootstrap: str, topic: str
) -> None:
    """confluent-kafka's Producer.close() is not a plain destroy: it aborts (unlike FACTS.md's
    "destroying / closing ... sends no EndTxn"). dualwrite must never close() a producer whose
    transaction it wants to keep."""
    tid = unique("facts-close")
    producer = TxnProducer(bootstrap, tid).start()
    assert producer.producer is not None
    producer.producer.begin_transaction()
    producer.send(topic, VALUES)
    pid, epoch = producer.identity()
    assert producer.producer.close() is True
    desc = settled(cp, tid)
    assert desc.state is TxnState.COMPLETE_ABORT
    assert (desc.producer_id, desc.epoch) == (pid, epoch)  # an ordinary TV1 abort: no bump
    assert read_committed(bootstrap, topic) == []


def test_sigkilled_producer_leaves_transaction_ongoing(
    cp: ControlPlane, bootstrap: str, topic: str
) -> None:
    tid = unique("facts-kill9")
    child = ProducerProcess(bootstrap, tid, topic, [v.decode() for v in VALUES], mode="hang")
    deliveries = child.wait_flushed()
    assert child.kill() == -9
    desc = cp.describe_transaction(tid)
    assert desc is not None
    assert desc.state is TxnState.ONGOING
    assert desc.partitions == {TopicPartition(topic, d.partition) for d in deliveries}
    assert read_committed(bootstrap, topic) == []
    cp.end_transaction(tid, desc.producer_id, desc.epoch, commit=False)


# -- Fact 2: another process finishes it with EndTxn(pid, epoch) --------------------------------


def test_another_process_commits_a_killed_producers_transaction(
    cp: ControlPlane, bootstrap: str, topic: str
) -> None:
    tid = unique("facts-resume")
    child = ProducerProcess(bootstrap, tid, topic, [v.decode() for v in VALUES], mode="hang")
    child.wait_flushed()
    child.kill()
    desc = cp.describe_transaction(tid)
    assert desc is not None and desc.state is TxnState.ONGOING

    cp.end_transaction(tid, desc.producer_id, desc.epoch, commit=True)
    final = settled(cp, tid)
    assert final.state is TxnState.COMPLETE_COMMIT
    assert (final.producer_id, final.epoch) == (desc.producer_id, desc.epoch)
    assert read_committed(bootstrap, topic) == sorted(VALUES)

    # Committing again is harmless (TV1: COMPLETE_COMMIT + COMMIT -> NONE) ...
    cp.end_transaction(tid, desc.producer_id, desc.epoch, commit=True)
    assert settled(cp, tid).state is TxnState.COMPLETE_COMMIT
    # ... aborting after the commit is refused.
    with pytest.raises(FatalKafkaError) as raised:
        cp.end_transaction(tid, desc.producer_id, desc.epoch, commit=False)
    assert (raised.value.info.code, raised.value.info.name) == (48, "INVALID_TXN_STATE")
    assert "INVALID_TXN_STATE (error code 48)" in str(raised.value)
    assert read_committed(bootstrap, topic) == sorted(VALUES)


def test_end_transaction_after_an_abort(cp: ControlPlane, bootstrap: str, topic: str) -> None:
    tid = unique("facts-after-abort")
    _, (pid, epoch) = ongoing_then_destroyed(bootstrap, topic, tid)
    cp.end_transaction(tid, pid, epoch, commit=False)
    assert settled(cp, tid).state is TxnState.COMPLETE_ABORT

    with pytest.raises(FatalKafkaError) as raised:
        cp.end_transaction(tid, pid, epoch, commit=True)
    assert (raised.value.info.code, raised.value.info.name) == (48, "INVALID_TXN_STATE")
    assert "INVALID_TXN_STATE (error code 48)" in str(raised.value)
    # Aborting twice is as harmless as committing twice.
    cp.end_transaction(tid, pid, epoch, commit=False)
    final = settled(cp, tid)
    assert final.state is TxnState.COMPLETE_ABORT
    assert final.epoch == epoch
    assert read_committed(bootstrap, topic) == []


def test_end_transaction_with_wrong_identity(cp: ControlPlane, bootstrap: str, topic: str) -> None:
    tid = unique("facts-wrong-id")
    _, (pid, epoch) = ongoing_then_destroyed(bootstrap, topic, tid)

    with pytest.raises(FatalKafkaError) as wrong_pid:
        cp.end_transaction(tid, pid + 1000, epoch, commit=True)
    assert wrong_pid.value.info.code == INVALID_PRODUCER_ID_MAPPING
    assert wrong_pid.value.info.name == "INVALID_PRODUCER_ID_MAPPING"

    with pytest.raises(FencedKafkaError) as wrong_epoch:
        cp.end_transaction(tid, pid, epoch + 1, commit=True)
    assert (wrong_epoch.value.info.code, wrong_epoch.value.info.name) == (90, "PRODUCER_FENCED")

    # Neither touched the transaction.
    desc = cp.describe_transaction(tid)
    assert desc is not None and desc.state is TxnState.ONGOING
    cp.end_transaction(tid, pid, epoch, commit=False)


def test_end_transaction_on_an_empty_transactional_id(cp: ControlPlane, bootstrap: str) -> None:
    tid = unique("facts-empty")
    producer = TxnProducer(bootstrap, tid).start()
    pid, epoch = producer.identity()
    desc = cp.describe_transaction(tid)
    assert desc is not None and desc.state is TxnState.EMPTY
    with pytest.raises(FatalKafkaError) as raised:
        cp.end_transaction(tid, pid, epoch, commit=True)
    assert raised.value.info.code == INVALID_TXN_STATE
    producer.destroy()


# -- Fact 3: librdkafka keeps (pid, epoch); the partition offset identifies the transaction --------


def test_pid_epoch_repeat_across_transactions_offsets_do_not(
    cp: ControlPlane, bootstrap: str, topic: str
) -> None:
    tid = unique("facts-anchor")
    producer = TxnProducer(bootstrap, tid).start()
    assert producer.producer is not None
    seen: list[tuple[tuple[int, int], tuple[int, int], dict[int, int]]] = []
    for round_ in range(3):
        producer.deliveries.clear()
        producer.producer.begin_transaction()
        producer.send(topic, [b"a%d" % round_, b"b%d" % round_, b"c%d" % round_, b"d%d" % round_])
        stats = producer.identity()
        desc = cp.describe_transaction(tid)
        assert desc is not None and desc.state is TxnState.ONGOING
        first = first_offsets(producer.deliveries)
        tps = [TopicPartition(topic, p) for p in sorted(first)]
        active = cp.describe_producers(tps)
        for tp in tps:
            mine = [p for p in active[tp] if p.producer_id == desc.producer_id]
            assert len(mine) == 1, active[tp]
            assert mine[0].epoch == desc.epoch
            assert mine[0].current_txn_start_offset == first[tp.partition]
        seen.append((stats, (desc.producer_id, desc.epoch), first))
        producer.producer.commit_transaction(30)

    identities = {s[0] for s in seen} | {s[1] for s in seen}
    assert len(identities) == 1, seen  # same (pid, epoch) in stats and coordinator, every time
    # ... while the first offsets move on: they tell the transactions apart.
    anchors = [tuple(sorted(s[2].items())) for s in seen]
    assert len(set(anchors)) == len(anchors)
    producer.destroy()


# -- Fact 4: InitProducerId v6 (KIP-939) --------------------------------------------------------


def test_v6_not_advertised_by_default_on_4x(kafka: Any) -> None:
    with ControlPlane({"bootstrap.servers": kafka.bootstrap_servers}, timeout_s=15) as cp:
        result = cp.probe(probe_transactional_id=unique("facts-probe"))
    assert result.init_producer_id_max_version == 5
    assert result.two_phase_commit_enabled is False
    assert "unsupported" in result.enable_2pc
    assert "unsupported" in result.keep_prepared_txn


@pytest.mark.kafka39
def test_v6_does_not_exist_on_39(kafka39: Any) -> None:
    with ControlPlane({"bootstrap.servers": kafka39.bootstrap_servers}, timeout_s=15) as cp:
        result = cp.probe(check_2pc=False)
    assert result.init_producer_id_max_version is not None
    assert result.init_producer_id_max_version < 6
    assert result.transaction_version == 0


@pytest.mark.parametrize("fixture", ["kafka", pytest.param("kafka39", marks=pytest.mark.kafka39)])
def test_v6_without_unstable_versions_closes_the_connection(
    request: pytest.FixtureRequest, fixture: str
) -> None:
    servers = request.getfixturevalue(fixture).bootstrap_servers
    with pytest.raises(KafkaConnectionError):
        raw_init_producer_id_v6(
            servers, unique("facts-v6-closed"), enable_2pc=True, keep_prepared_txn=False
        )


def test_v6_on_2pc_broker_enable_accepted_keep_rejected(kafka_2pc: Any) -> None:
    servers = kafka_2pc.bootstrap_servers
    tid = unique("facts-v6")
    accepted = raw_init_producer_id_v6(servers, tid, enable_2pc=True, keep_prepared_txn=False)
    assert accepted.error_code == 0
    assert accepted.producer_id >= 0 and accepted.producer_epoch >= 0
    assert (accepted.ongoing_txn_producer_id, accepted.ongoing_txn_producer_epoch) == (-1, -1)
    with ControlPlane({"bootstrap.servers": servers}, timeout_s=15) as cp:
        desc = cp.describe_transaction(tid)
    assert desc is not None
    assert desc.timeout_ms == INT32_MAX  # a 2PC transaction never times out

    for enable in (True, False):
        rejected = raw_init_producer_id_v6(servers, tid, enable_2pc=enable, keep_prepared_txn=True)
        assert rejected.error_code == UNSUPPORTED_VERSION
        assert (rejected.producer_id, rejected.producer_epoch) == (-1, -1)
        assert (rejected.ongoing_txn_producer_id, rejected.ongoing_txn_producer_epoch) == (-1, -1)


# -- Facts 5 and 6: the broker's transaction timeout -----------------------------------------------


def test_timed_out_transaction_is_aborted_and_fenced(
    cp: ControlPlane, bootstrap: str, topic: str
) -> None:
    tid = unique("facts-timeout")
    _, (pid, epoch) = ongoing_then_destroyed(bootstrap, topic, tid, timeout_ms=2000)
    started = time.monotonic()
    aborted = wait_for(
        lambda: (d := cp.describe_transaction(tid)) and d.state is TxnState.COMPLETE_ABORT and d,
        15,
        interval_s=0.2,
        what="the coordinator to abort the timed-out transaction",
    )
    elapsed = time.monotonic() - started
    assert elapsed < 10, f"aborted only after {elapsed:.1f} s"
    assert aborted.producer_id == pid
    assert aborted.epoch == epoch + 1  # the coordinator fenced the producer while aborting

    # Fact 6: none of its records is visible.
    assert read_committed(bootstrap, topic) == []

    # The late commit with the stored epoch is fenced (TV1) ...
    with pytest.raises(FencedKafkaError) as fenced:
        cp.end_transaction(tid, pid, epoch, commit=True)
    assert (fenced.value.info.code, fenced.value.info.name) == (90, "PRODUCER_FENCED")
    # ... and with the coordinator's new epoch it is a commit after an abort.
    with pytest.raises(FatalKafkaError) as invalid:
        cp.end_transaction(tid, pid, aborted.epoch, commit=True)
    assert invalid.value.info.code == INVALID_TXN_STATE
    final = cp.describe_transaction(tid)
    assert final is not None
    assert (final.state, final.epoch) == (TxnState.COMPLETE_ABORT, epoch + 1)
    assert read_committed(bootstrap, topic) == []


# -- Fact 7: init_transactions() on the same id aborts the open transaction ------------------------


def test_init_transactions_aborts_the_ongoing_transaction(
    cp: ControlPlane, bootstrap: str, topic: str
) -> None:
    tid = unique("facts-reinit")
    _, (pid, epoch) = ongoing_then_destroyed(bootstrap, topic, tid)
    assert cp.describe_transaction(tid).state is TxnState.ONGOING  # type: ignore[union-attr]

    successor = TxnProducer(bootstrap, tid).start()  # init_transactions()
    new_pid, new_epoch = successor.identity()
    assert new_pid == pid
    assert new_epoch == epoch + 2  # fence + abort, then the retried InitProducerId bumps again
    desc = cp.describe_transaction(tid)
    assert desc is not None
    assert (desc.state, desc.epoch) == (TxnState.EMPTY, new_epoch)
    assert read_committed(bootstrap, topic) == []

    # The old transaction cannot be committed any more.
    with pytest.raises(FencedKafkaError) as fenced:
        cp.end_transaction(tid, pid, epoch, commit=True)
    assert fenced.value.info.code == PRODUCER_FENCED

    # The successor works normally; only its records become visible.
    assert successor.producer is not None
    successor.producer.begin_transaction()
    successor.send(topic, [b"after"])
    successor.producer.commit_transaction(30)
    assert read_committed(bootstrap, topic) == [b"after"]
    successor.destroy()
