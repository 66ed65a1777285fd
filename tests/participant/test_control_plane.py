"""dualwrite.participant.control_plane against real brokers: Apache Kafka 4.3.1 (``kafka``; the
compatibility tier, tests/participant/test_compat.py, runs most of these on 3.9.x, 4.0, 4.1, 4.2
and 4.4), plus the KIP-939 requests on a 4.3.1 broker with 2PC enabled (``kafka_2pc``).

Transactions are opened with confluent-kafka (librdkafka, the data path) and then inspected or
finished through the control plane, as dualwrite's recovery does.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

from dualwrite.errors import BrokerUnreachableError
from dualwrite.participant.control_plane import ControlPlane, TxnState
from dualwrite.participant.identifiers import TopicPartition
from dualwrite.participant.kafka_errors import FatalKafkaError, FencedKafkaError
from tests.support.kafka import (
    TxnProducer,
    create_topic,
    first_offsets,
    read_committed,
    unique,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)

INT32_MAX = 2**31 - 1


@pytest.fixture
def cluster(kafka: Any) -> Any:
    """Kafka 4.3.1; tests/participant/test_compat.py runs these tests on 3.9.x and the other
    versions."""
    return kafka


@pytest.fixture
def bootstrap(cluster: Any) -> str:
    servers: str = cluster.bootstrap_servers
    return servers


@pytest.fixture
def is_kafka4() -> bool:
    """True here (4.3.1); tests/participant/test_compat.py answers per version."""
    return True


@pytest.fixture
def has_2pc_config(is_kafka4: bool) -> bool:
    """Whether the broker knows ``transaction.two.phase.commit.enable`` (KIP-939, Kafka 4.1+)."""
    return is_kafka4


@pytest.fixture
def topic(bootstrap: str) -> str:
    return create_topic(bootstrap, unique("cp"), partitions=3)


def open_transaction(
    bootstrap: str,
    topic: str,
    tid: str,
    values: list[bytes],
    *,
    partition: int | None = None,
    timeout_ms: int = 60_000,
) -> TxnProducer:
    """A librdkafka producer with an open (Ongoing) transaction holding ``values``."""
    producer = TxnProducer(bootstrap, tid, transaction_timeout_ms=timeout_ms).start()
    assert producer.producer is not None
    producer.producer.begin_transaction()
    producer.send(topic, values, partition=partition)
    return producer


def test_describe_unknown_id_is_none(cp: ControlPlane) -> None:
    assert cp.describe_transaction(unique("never-used")) is None
    assert cp.describe_transactions([unique("a"), unique("b")]) == {}


def test_describe_ongoing_transaction(cp: ControlPlane, bootstrap: str, topic: str) -> None:
    tid = unique("cp-describe")
    before_ms = int(time.time() * 1000)
    producer = open_transaction(
        bootstrap, topic, tid, [b"a", b"b", b"c", b"d", b"e", b"f"], timeout_ms=45_000
    )
    after_ms = int(time.time() * 1000)
    pid, epoch = producer.identity()

    desc = cp.describe_transaction(tid)
    assert desc is not None
    assert desc.transactional_id == tid
    assert desc.state is TxnState.ONGOING
    assert desc.state.in_flight
    assert (desc.producer_id, desc.epoch) == (pid, epoch)
    assert desc.timeout_ms == 45_000
    assert desc.partitions == {
        TopicPartition(topic, p) for p in {d.partition for d in producer.deliveries}
    }
    assert desc.start_time_ms is not None
    assert before_ms - 1000 <= desc.start_time_ms <= after_ms + 1000
    open_for = desc.open_for_ms()
    assert open_for is not None and 0 <= open_for < 60_000

    # describe_transactions: many ids at once, unknown ones left out.
    many = cp.describe_transactions([tid, unique("unknown")])
    assert list(many) == [tid]

    assert producer.producer is not None
    producer.producer.commit_transaction(30)
    # EndTxn returns once PrepareCommit is logged; the markers are written after that.
    done = wait_for(
        lambda: (d := cp.describe_transaction(tid)) and not d.state.in_flight and d,
        10,
        what="the commit to complete",
    )
    assert done.state is TxnState.COMPLETE_COMMIT
    assert not done.state.in_flight
    assert done.open_for_ms() is None


def test_list_transactions_prefix_and_state(cp: ControlPlane, bootstrap: str, topic: str) -> None:
    prefix = unique("cp-list") + "-"
    ongoing_tid, committed_tid = prefix + "ongoing", prefix + "committed"
    other_tid = unique("cp-other")

    committed = open_transaction(bootstrap, topic, committed_tid, [b"c"])
    assert committed.producer is not None
    committed.producer.commit_transaction(30)
    ongoing = open_transaction(bootstrap, topic, ongoing_tid, [b"o"])
    other = open_transaction(bootstrap, topic, other_tid, [b"x"])
    ongoing_pid, _ = ongoing.identity()

    listed = cp.list_transactions(prefix=prefix)
    by_id = {t.transactional_id: t for t in listed}
    assert len(listed) == len(by_id) == 2, listed  # each id once, though every broker is asked
    assert set(by_id) == {ongoing_tid, committed_tid}
    assert by_id[ongoing_tid].state is TxnState.ONGOING
    assert by_id[ongoing_tid].producer_id == ongoing_pid
    assert by_id[committed_tid].state is TxnState.COMPLETE_COMMIT
    coordinator = cp.describe_transaction(ongoing_tid)
    assert coordinator is not None
    assert by_id[ongoing_tid].broker_id == coordinator.coordinator_id

    only_ongoing = cp.list_transactions(prefix=prefix, states=[TxnState.ONGOING])
    assert [t.transactional_id for t in only_ongoing] == [ongoing_tid]

    by_pid = cp.list_transactions(producer_ids=[ongoing_pid])
    assert [t.transactional_id for t in by_pid] == [ongoing_tid]

    # Without a prefix the other open transaction is listed as well.
    everything = {t.transactional_id for t in cp.list_transactions(states=[TxnState.ONGOING])}
    assert {ongoing_tid, other_tid} <= everything
    assert committed_tid not in everything

    for p in (ongoing, other):
        assert p.producer is not None
        p.producer.abort_transaction(30)


def test_describe_producers(cp: ControlPlane, bootstrap: str, topic: str) -> None:
    tid = unique("cp-producers")
    # Something before the transaction so that its first offset is not 0.
    warmup = open_transaction(bootstrap, topic, unique("cp-warmup"), [b"w1", b"w2"], partition=0)
    assert warmup.producer is not None
    warmup.producer.commit_transaction(30)

    producer = open_transaction(bootstrap, topic, tid, [b"p1", b"p2", b"p3"], partition=0)
    pid, epoch = producer.identity()
    first = first_offsets(producer.deliveries)
    assert list(first) == [0] and first[0] > 0

    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    result = cp.describe_producers([tp0, tp1])
    assert set(result) == {tp0, tp1}
    mine = [p for p in result[tp0] if p.producer_id == pid]
    assert len(mine) == 1
    active = mine[0]
    assert active.epoch == epoch
    assert active.current_txn_start_offset == first[0]
    assert active.last_sequence == 2  # three records, sequence numbers 0..2
    assert active.last_timestamp_ms > 0
    assert not [p for p in result[tp1] if p.producer_id == pid]

    assert producer.producer is not None
    producer.producer.commit_transaction(30)

    def closed() -> bool:
        after = {p.producer_id: p for p in cp.describe_producers([tp0])[tp0]}
        return after[pid].current_txn_start_offset is None

    wait_for(closed, 10, what="the commit marker to clear CurrentTxnStartOffset")


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "abort"])
def test_end_transaction(cp: ControlPlane, bootstrap: str, topic: str, commit: bool) -> None:
    tid = unique("cp-end")
    values = [b"e1", b"e2", b"e3", b"e4"]
    producer = open_transaction(bootstrap, topic, tid, values)
    desc = cp.describe_transaction(tid)
    assert desc is not None and desc.state is TxnState.ONGOING
    producer.destroy()  # the process that opened it is gone; another one finishes it

    cp.end_transaction(tid, desc.producer_id, desc.epoch, commit=commit)

    final = wait_for(
        lambda: (d := cp.describe_transaction(tid)) and not d.state.in_flight and d,
        10,
        what="the transaction to complete",
    )
    assert final.state is (TxnState.COMPLETE_COMMIT if commit else TxnState.COMPLETE_ABORT)
    assert (final.producer_id, final.epoch) == (desc.producer_id, desc.epoch)  # TV1: no bump
    assert read_committed(bootstrap, topic) == (sorted(values) if commit else [])


def test_fence(cp: ControlPlane, bootstrap: str, topic: str) -> None:
    tid = unique("cp-fence")
    producer = open_transaction(bootstrap, topic, tid, [b"f1", b"f2"])
    desc = cp.describe_transaction(tid)
    assert desc is not None and desc.state is TxnState.ONGOING

    identity = cp.fence(tid)
    assert identity.producer_id == desc.producer_id
    # Two bumps: the coordinator fences (epoch + 1) and aborts, answering CONCURRENT_TRANSACTIONS;
    # the retried InitProducerId then bumps once more.
    assert identity.epoch == desc.epoch + 2

    # fence() returns after the abort completed: the id is Empty at the new epoch.
    after = cp.describe_transaction(tid)
    assert after is not None
    assert after.state is TxnState.EMPTY
    assert (after.producer_id, after.epoch) == (identity.producer_id, identity.epoch)
    assert read_committed(bootstrap, topic) == []

    # The old epoch is fenced for everybody, including the control plane.
    with pytest.raises(FencedKafkaError) as raised:
        cp.end_transaction(tid, desc.producer_id, desc.epoch, commit=True)
    assert raised.value.info.code in (47, 90)
    producer.destroy()


def _broker_config(bootstrap: str, name: str) -> str:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    node = min(b.id for b in admin.list_topics(timeout=10).brokers.values())
    resource = ConfigResource(ConfigResource.Type.BROKER, str(node))
    configs = admin.describe_configs([resource])[resource].result(timeout=10)
    value: str = configs[name].value
    return value


def test_probe(cp: ControlPlane, bootstrap: str, is_kafka4: bool, has_2pc_config: bool) -> None:
    result = cp.probe(probe_transactional_id=unique("cp-probe"))
    assert len(result.brokers) >= 1
    assert all(b.api_versions for b in result.brokers)
    # Kafka 4.x finalizes transaction.version 2 on a fresh cluster; 3.9 has no such feature.
    assert result.transaction_version == (2 if is_kafka4 else 0)
    # v6 (KIP-939) is unstable in 4.x and absent in 3.9: neither advertises it by default.
    assert result.init_producer_id_max_version == 5
    assert result.max_transaction_timeout_ms == int(
        _broker_config(bootstrap, "transaction.max.timeout.ms")
    )
    # Kafka 4.0 and 3.9 have no such config (KIP-939 arrived in 4.1): the probe says None.
    assert result.two_phase_commit_enabled is (False if has_2pc_config else None)
    assert result.enable_2pc.startswith("unsupported")
    assert result.keep_prepared_txn.startswith("unsupported")
    as_dict = result.as_dict()
    assert as_dict["init_producer_id_max_version"] == 5
    assert str(22) in as_dict["brokers"][0]["api_versions"]


def test_probe_on_2pc_broker(kafka_2pc: Any) -> None:
    with ControlPlane({"bootstrap.servers": kafka_2pc.bootstrap_servers}, timeout_s=15) as cp:
        result = cp.probe(probe_transactional_id=unique("cp-probe-2pc"))
    assert result.init_producer_id_max_version == 6
    assert result.two_phase_commit_enabled is True
    assert result.enable_2pc.startswith("accepted"), result.enable_2pc
    assert "UNSUPPORTED_VERSION" in result.keep_prepared_txn, result.keep_prepared_txn


def test_init_producer_id_v6_on_2pc_broker(kafka_2pc: Any) -> None:
    tid = unique("cp-v6")
    with ControlPlane({"bootstrap.servers": kafka_2pc.bootstrap_servers}, timeout_s=15) as cp:
        identity = cp.init_producer_id_v6(tid, enable_2pc=True, keep_prepared_txn=False)
        assert identity.producer_id >= 0 and identity.epoch >= 0
        desc = cp.describe_transaction(tid)
        assert desc is not None
        assert (desc.producer_id, desc.epoch) == (identity.producer_id, identity.epoch)
        # With Enable2Pc the coordinator never times the transaction out.
        assert desc.timeout_ms == INT32_MAX

        with pytest.raises(FatalKafkaError) as raised:
            cp.init_producer_id_v6(tid, enable_2pc=True, keep_prepared_txn=True)
        assert raised.value.info.code == 35
        assert "UNSUPPORTED_VERSION" in str(raised.value)


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_unreachable_bootstrap_raises_within_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(BrokerUnreachableError) as raised:
        ControlPlane({"bootstrap.servers": f"127.0.0.1:{_closed_port()}"}, timeout_s=2)
    elapsed = time.monotonic() - started
    assert elapsed < 2 + 3, f"took {elapsed:.1f} s"
    assert "127.0.0.1" in str(raised.value)
