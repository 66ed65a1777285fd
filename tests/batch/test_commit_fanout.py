"""The batch commit phase is flat in participants: every EndTxn at once, verification batched.

Real brokers and PostgreSQL. The shared broker shows per-id results (a fenced participant among
many gets its typed error, the others commit); a private 3-broker cluster behind Kafka-framing
proxies shows that participants of every coordinator are committed, that all their EndTxn
requests are sent before any answer comes back, and that verification asks each coordinator and
each partition leader once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import pytest
import sqlalchemy as sa

from dualwrite import TwoPhaseProducer
from dualwrite.batch.coordinator import BatchCoordinator, CoordinatorHooks
from dualwrite.batch.decision_log import DecisionLog, Participant
from dualwrite.batch.naming import transactional_id
from dualwrite.dev import LocalKafkaCluster
from dualwrite.errors import BatchHeuristicAbortError, ProducerFencedError
from dualwrite.participant import ControlPlane
from tests.support.kafka import read_committed, unique
from tests.support.settings import BACKEND, KAFKA_VERSION
from tests.support.tcp_proxy import TcpProxy, kafka_api

pytestmark = pytest.mark.timeout(240)
POSTGRESQL = pytest.mark.parametrize("backend", ["postgresql"], indirect=True)

FIND_COORDINATOR, END_TXN, DESCRIBE_PRODUCERS, DESCRIBE_TRANSACTIONS = 10, 26, 61, 65


class Hooks(CoordinatorHooks):
    def __init__(self, on: Any) -> None:
        self.on = on

    def at(self, point: str, batch_id: int) -> None:
        self.on(point, batch_id)


def prepare_many(bootstrap: str, cp: ControlPlane, sink: str, topic: str, batch: int,
                 n: int) -> list[Participant]:
    """``n`` task attempts, one per partition, prepared and left open for the driver."""

    def task(partition: int) -> Participant:
        tid = transactional_id(sink, batch, partition, 0)
        p = TwoPhaseProducer({"bootstrap.servers": bootstrap, "transactional.id": tid,
                              "linger.ms": 0, "transaction.timeout.ms": 600_000},
                             control_plane=cp, timeout_s=20)
        try:
            p.init_transactions()
            p.begin_transaction()
            p.produce(topic, f"p{partition}".encode(), partition=partition)
            state = p.prepare_transaction()
        finally:
            p.close()
        return Participant(partition, tid, state, 1)

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(task, range(n)))


def values(*partitions: int) -> list[bytes]:
    return sorted(f"p{p}".encode() for p in partitions)


def test_end_transactions_gives_each_id_its_own_typed_error(bootstrap: str, kafka: Any) -> None:
    topic = kafka.create_topic(unique("fanout"), 6, 1)
    with ControlPlane({"bootstrap.servers": bootstrap}, timeout_s=20) as cp:
        parts = prepare_many(bootstrap, cp, unique("sink"), topic, 0, 6)
        victim = parts[2]
        cp.fence(victim.transactional_id)  # a newer epoch: the prepared one is aborted
        results = cp.end_transactions(
            [(p.transactional_id, p.state.producer_id, p.state.epoch) for p in parts],
            commit=True)
    assert isinstance(results[2], ProducerFencedError), results
    assert [r for i, r in enumerate(results) if i != 2] == [None] * 5
    assert read_committed(bootstrap, topic) == values(0, 1, 3, 4, 5)


def test_more_ids_than_a_connection_takes_in_flight_are_sent_without_a_refusal(
        bootstrap: str, kafka: Any, caplog: pytest.LogCaptureFixture) -> None:
    n = 40  # past the control plane's 32 requests in flight per connection
    topic = kafka.create_topic(unique("fanout"), n, 1)
    with ControlPlane({"bootstrap.servers": bootstrap}, timeout_s=20) as cp:
        parts = prepare_many(bootstrap, cp, unique("sink"), topic, 0, n)
        with caplog.at_level(logging.DEBUG, logger="dualwrite.participant.control_plane"):
            results = cp.end_transactions(
                [(p.transactional_id, p.state.producer_id, p.state.epoch) for p in parts],
                commit=True)
    assert results == [None] * n
    # kafka-python refuses a request past the connection's limit ("Node paused"); the retry
    # after it costs a backoff and forgets every cached coordinator.
    assert not [r.getMessage() for r in caplog.records if "retrying after" in r.getMessage()]
    assert read_committed(bootstrap, topic) == values(*range(n))


@POSTGRESQL
def test_a_fenced_participant_among_many_is_reported_and_the_others_commit(
        engine: sa.Engine, bootstrap: str, kafka: Any) -> None:
    topic = kafka.create_topic(unique("fanout"), 12, 1)
    sink = unique("sink")
    kconf = {"bootstrap.servers": bootstrap}
    with ControlPlane(kconf, timeout_s=20) as cp:
        parts = prepare_many(bootstrap, cp, sink, topic, 1, 12)
        victim = parts[7]

        def fence_victim(point: str, _batch: int) -> None:
            if point == "decided":  # re-initialised after the decision (an operator, a zombie)
                cp.fence(victim.transactional_id)

        with BatchCoordinator(sink, engine, kconf, control_plane=cp, timeout_s=20,
                              hooks=Hooks(fence_victim)) as coord, \
                pytest.raises(BatchHeuristicAbortError) as info:
            coord.finish(1, parts)
    assert [c.transactional_id for c in info.value.causes] == [victim.transactional_id]
    assert read_committed(bootstrap, topic) == values(*(p for p in range(12) if p != 7))
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.in_doubt  # a heuristic outcome waits to be acknowledged


# -- a 3-broker cluster behind proxies ------------------------------------------------------------

@pytest.fixture(scope="module")
def proxied3() -> Iterator[tuple[LocalKafkaCluster, list[TcpProxy]]]:
    """Three brokers whose clients go through one Kafka-framing proxy each."""
    if BACKEND == "docker":
        pytest.skip("the proxied listener needs the jars backend")
    with ExitStack() as stack:
        cluster = stack.enter_context(LocalKafkaCluster(
            brokers=3, kafka_version=KAFKA_VERSION, backend="jars", proxied=True))
        proxies = [stack.enter_context(TcpProxy(target, port=port, kafka_framing=True))
                   for target, port in zip(cluster.external_ports, cluster.proxy_ports,
                                           strict=True)]
        yield cluster, proxies


@POSTGRESQL
def test_participants_of_every_coordinator_commit_at_once(
        engine: sa.Engine, proxied3: tuple[LocalKafkaCluster, list[TcpProxy]]) -> None:
    cluster, proxies = proxied3
    n = 24  # more than the coordinator's 16 threads: a thread per EndTxn would stop at 16
    bootstrap = cluster.external_bootstrap_servers
    kconf = {"bootstrap.servers": bootstrap}
    topic = cluster.create_topic(unique("fanout"), n, 1)
    sink = unique("sink")

    def total(api_key: int) -> int:
        return sum(p.requests(api_key) for p in proxies)

    with ControlPlane(kconf, timeout_s=30) as tasks_cp, \
            ControlPlane(kconf, timeout_s=30) as driver_cp:
        parts = prepare_many(bootstrap, tasks_cp, sink, topic, 0, n)
        coordinators = {d.coordinator_id for d in tasks_cp.describe_transactions(
            p.transactional_id for p in parts).values()}
        assert len(coordinators) >= 2, coordinators  # 24 ids over 50 txn-log partitions

        seen: dict[str, dict[int, int]] = {}
        apis = (FIND_COORDINATOR, DESCRIBE_TRANSACTIONS, DESCRIBE_PRODUCERS, END_TXN)
        sent_while_held: list[int] = []

        def release_when_all_sent(first: int) -> None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and total(END_TXN) < first + n - 1:
                time.sleep(0.05)
            time.sleep(0.2)  # nothing more may come while the answers are held
            sent_while_held.append(total(END_TXN) - first)
            for proxy in proxies:
                proxy.disarm()
                proxy.release()

        def at(point: str, _batch: int) -> None:
            seen[point] = {api: total(api) for api in apis}
            if point == "committed-one":
                # Each coordinator answers its next EndTxn, and nothing after, until released:
                # what reaches the proxies meanwhile was sent without waiting for an answer.
                for proxy in proxies:
                    proxy.hold_next_response(kafka_api(END_TXN))
                threading.Thread(target=release_when_all_sent, args=(seen[point][END_TXN],),
                                 daemon=True).start()

        before = {api: total(api) for api in apis}
        with BatchCoordinator(sink, engine, kconf, control_plane=driver_cp, timeout_s=30,
                              hooks=Hooks(at)) as coord:
            timings = coord.finish(0, parts)
    assert timings is not None
    assert sent_while_held == [n - 1]  # every remaining EndTxn, before any answer
    assert read_committed(bootstrap, topic) == values(*range(n))
    verified = seen["verified"]
    # Verification: one lookup for all ids, one DescribeTransactions per coordinator, one
    # DescribeProducers per anchor leader.
    assert verified[FIND_COORDINATOR] - before[FIND_COORDINATOR] == 1
    assert verified[DESCRIBE_TRANSACTIONS] - before[DESCRIBE_TRANSACTIONS] == len(coordinators)
    assert verified[DESCRIBE_PRODUCERS] - before[DESCRIBE_PRODUCERS] <= 3
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.completed
