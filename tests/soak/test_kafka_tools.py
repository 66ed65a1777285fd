"""The soak verifier's Kafka tools (tests/soak/kafka_tools.py) against a real broker: Kafka's
ConsoleConsumer sees exactly the committed records read_committed and the aborted and open ones
read_uncommitted; kafka-transactions lists an open transaction as Ongoing and finds none
hanging."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from dualwrite.dev import KafkaTarget
from tests.soak.kafka_tools import (
    ConsoleRecord,
    _end_offsets,
    _missed,
    console_consume,
    find_hanging,
    list_transactions,
    tools_classpath,
)
from tests.support.fixtures.kafka import NewTopic
from tests.support.kafka import unique
from tests.support.settings import KAFKA_VERSION

T = TypeVar("T")
Rec = tuple[int, str | None, str]


def _timed(label: str, call: Callable[[], T]) -> T:
    started = time.monotonic()
    result = call()
    print(f"{label}: {time.monotonic() - started:.2f} s")
    return result


def _producer(bootstrap: str, tid: str) -> Producer:
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": tid, "linger.ms": 0,
                  "transaction.timeout.ms": 60_000})
    p.init_transactions(30)
    return p


def _write(p: Producer, topic: str, records: list[Rec]) -> None:
    p.begin_transaction()
    for partition, key, value in records:
        p.produce(topic, value.encode(), key=None if key is None else key.encode(),
                  partition=partition)
    p.flush(30)


@pytest.fixture
def open_producer(bootstrap: str) -> Iterator[tuple[str, Producer]]:
    """A transactional producer whose transaction a test may leave open: aborted at the end."""
    tid = unique("kafka-tools-open")
    p = _producer(bootstrap, tid)
    yield tid, p
    with contextlib.suppress(Exception):  # no transaction open
        p.abort_transaction(30)


def _by_partition(records: list[Rec]) -> dict[int, list[tuple[str | None, str]]]:
    """(key, value) per partition, in the order given."""
    out: dict[int, list[tuple[str | None, str]]] = {}
    for partition, key, value in records:
        out.setdefault(partition, []).append((key, value))
    return out


def _seen(records: list[ConsoleRecord]) -> dict[int, list[tuple[str | None, str]]]:
    """What ConsoleConsumer printed, per partition in offset order."""
    ordered = sorted(records, key=lambda r: (r.partition, r.offset))
    return _by_partition([(r.partition, r.key, r.value) for r in ordered])


def test_console_consumer_and_transactions_command(
        kafka: KafkaTarget, new_topic: NewTopic, bootstrap: str,
        open_producer: tuple[str, Producer]) -> None:
    _timed("tools_classpath", lambda: tools_classpath(KAFKA_VERSION))
    topic = new_topic(kafka, partitions=3)
    committed: list[Rec] = [(0, "k0", "v0"), (1, "k1", "v1"), (2, "k2", "v2"), (0, "k3", "v3"),
                            (1, None, "no-key")]
    aborted: list[Rec] = [(0, "a0", "x0"), (2, "a1", "x1")]
    still_open: list[Rec] = [(2, "o0", "y0")]

    p = _producer(bootstrap, unique("kafka-tools"))
    _write(p, topic, committed[:3])
    p.commit_transaction(30)
    _write(p, topic, aborted)
    p.abort_transaction(30)
    _write(p, topic, committed[3:])
    p.commit_transaction(30)
    open_tid, op = open_producer
    _write(op, topic, still_open)

    read = _timed("console_consume read_committed", lambda: console_consume(
        bootstrap, topic, kafka_version=KAFKA_VERSION, idle_timeout_s=3))
    assert _seen(read) == _by_partition(committed)
    # The stopped-short check: it finds what a read stopping early leaves, and nothing after a
    # whole read.
    ends = _end_offsets(bootstrap, topic, "read_committed", 10)
    assert _missed(bootstrap, topic, "read_committed", ends, {}, 10) == {0: 0, 1: 0, 2: 0}
    last = {r.partition: r.offset for r in sorted(read, key=lambda r: r.offset)}
    assert _missed(bootstrap, topic, "read_committed", ends, {**last, 0: 0}, 10) == {
        0: last[0]}
    assert _missed(bootstrap, topic, "read_committed", ends, last, 10) == {}
    raw = _timed("console_consume read_uncommitted", lambda: console_consume(
        bootstrap, topic, kafka_version=KAFKA_VERSION, isolation="read_uncommitted",
        idle_timeout_s=3))
    assert _seen(raw) == _by_partition(committed[:3] + aborted + committed[3:] + still_open)

    listed = _timed("list_transactions", lambda: list_transactions(
        bootstrap, kafka_version=KAFKA_VERSION))
    mine = [t for t in listed if t.transactional_id == open_tid]
    assert len(mine) == 1 and mine[0].state == "Ongoing", listed
    assert mine[0].producer_id >= 0 and mine[0].coordinator_id >= 0

    brokers = sorted(AdminClient({"bootstrap.servers": bootstrap}).list_topics(
        timeout=10).brokers)
    assert _timed("find_hanging", lambda: find_hanging(
        bootstrap, brokers, kafka_version=KAFKA_VERSION)) == []
    # Even past a zero timeout the open transaction is not hanging: its coordinator tracks it.
    assert _timed("find_hanging --max-transaction-timeout 0", lambda: find_hanging(
        bootstrap, brokers, kafka_version=KAFKA_VERSION, max_transaction_timeout_min=0)) == []
