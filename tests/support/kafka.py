"""Helpers for tests that talk to a real broker: topics, read_committed reads, producer processes.

Everything here uses confluent-kafka (the data path) or, for the few raw requests a test needs to
send as is, kafka-python's generated protocol classes. Only 127.0.0.1 is ever used.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from dualwrite import PreparedTxnState, TwoPhaseProducer
from dualwrite.dev import read_committed as dev_read_committed

__all__ = [
    "Delivery",
    "ProducerProcess",
    "TxnProducer",
    "create_topic",
    "first_offsets",
    "in_thread",
    "raw_init_producer_id_v6",
    "read_committed",
    "unique",
    "wait_for",
]


def closed_port() -> int:
    """A loopback port nothing listens on (for "broker unreachable" tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prepare_open(bootstrap: str, topic: str, tid: str, values: list[str], *,
                 commit: bool = False, timeout_ms: int = 60_000) -> PreparedTxnState:
    """Prepare a transaction holding ``values`` (commit it too if asked), then drop the producer
    as a crashed process would: an uncommitted transaction stays open at the coordinator."""
    p = TwoPhaseProducer({"bootstrap.servers": bootstrap, "transactional.id": tid,
                          "linger.ms": 0, "transaction.timeout.ms": timeout_ms}, timeout_s=20)
    try:
        p.init_transactions()
        p.begin_transaction()
        for v in values:
            p.produce(topic, v.encode(), key=v.encode())
        state = p.prepare_transaction()
        if commit:
            p.commit_transaction()
    finally:
        p.close()
    return state


def unique(prefix: str) -> str:
    """A name no other test (or earlier run against the same broker) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def in_thread(fn: Callable[..., Any], *args: Any
              ) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``fn(*args)`` in a started thread; the list collects what it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn(*args)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def wait_for(
    predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.1, what: str = "condition"
) -> Any:
    """Poll ``predicate`` until it returns something truthy; return that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout_s:g} s waiting for {what} (last value: {value!r})"
            )
        time.sleep(interval_s)


def create_topic(bootstrap: str, name: str, partitions: int = 3) -> str:
    """Create a topic (replication factor 1) and wait until its leaders are known."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(timeout=30)

    def ready() -> bool:
        md = admin.list_topics(name, timeout=5).topics.get(name)
        return bool(
            md
            and not md.error
            and len(md.partitions) == partitions
            and all(p.leader >= 0 for p in md.partitions.values())
        )

    wait_for(ready, 30, what=f"topic {name} to have leaders")
    return name


@dataclass(frozen=True, order=True)
class Delivery:
    partition: int
    offset: int
    key: bytes


def first_offsets(deliveries: Iterable[Delivery]) -> dict[int, int]:
    """The first offset written on each partition (the transaction's anchor per partition)."""
    out: dict[int, int] = {}
    for d in deliveries:
        out[d.partition] = min(d.offset, out.get(d.partition, d.offset))
    return out


def read_committed(bootstrap: str, topic: str, timeout_s: float = 15.0) -> list[bytes]:
    """Every record value a read_committed consumer can see now, sorted; fails if a partition
    cannot be read to its end (its last stable offset) within ``timeout_s``."""
    records, unfinished = dev_read_committed(bootstrap, topic, timeout_s=timeout_s)
    if unfinished:
        raise AssertionError(f"read_committed of {topic}: no end of partition for {unfinished} "
                             f"within {timeout_s:g} s")
    return sorted(value or b"" for _, value in records)


@dataclass
class TxnProducer:
    """An in-process confluent-kafka transactional producer that records delivery reports and
    the producer id / epoch from the statistics JSON (the only place librdkafka shows them)."""

    bootstrap: str
    transactional_id: str
    transaction_timeout_ms: int = 60_000
    deliveries: list[Delivery] = field(default_factory=list)
    stats_identity: tuple[int, int] | None = None
    producer: Producer | None = None

    def start(self) -> TxnProducer:
        self.producer = Producer(
            {
                "bootstrap.servers": self.bootstrap,
                "transactional.id": self.transactional_id,
                "transaction.timeout.ms": self.transaction_timeout_ms,
                "statistics.interval.ms": 100,
                "stats_cb": self._on_stats,
                "linger.ms": 0,
            }
        )
        self.producer.init_transactions(30)
        return self

    def _on_stats(self, text: str) -> None:
        eos = json.loads(text).get("eos") or {}
        if eos.get("producer_id", -1) >= 0:
            self.stats_identity = (eos["producer_id"], eos["producer_epoch"])

    def _on_delivery(self, err: Any, msg: Any) -> None:
        if err is not None:
            raise KafkaException(err)
        self.deliveries.append(Delivery(msg.partition(), msg.offset(), msg.key()))

    def send(self, topic: str, values: Iterable[bytes], partition: int | None = None) -> None:
        """Produce and flush; delivery reports land in ``deliveries``."""
        assert self.producer is not None
        for value in values:
            kwargs: dict[str, Any] = {
                "key": value,
                "value": value,
                "on_delivery": self._on_delivery,
            }
            if partition is not None:
                kwargs["partition"] = partition
            self.producer.produce(topic, **kwargs)
        remaining = self.producer.flush(30)
        assert remaining == 0, f"{remaining} records not delivered"

    def identity(self, timeout_s: float = 5.0) -> tuple[int, int]:
        """(producer id, epoch) from the latest statistics callback."""
        assert self.producer is not None
        self.stats_identity = None
        producer = self.producer

        def poll() -> tuple[int, int] | None:
            producer.poll(0.05)
            return self.stats_identity

        result: tuple[int, int] = wait_for(
            poll, timeout_s, interval_s=0.0, what="librdkafka statistics with eos.producer_id"
        )
        return result

    def destroy(self) -> None:
        """Drop the producer without close(): librdkafka destroys it and sends no EndTxn."""
        self.producer = None
        import gc

        gc.collect()


# A producer process: init, begin, produce, flush, print one JSON line, then act on ``mode``:
# "hang" sleeps (the test SIGKILLs it), "exit" leaves through os._exit without any cleanup.
_PRODUCER_SCRIPT = r"""
import json, os, sys, time
from confluent_kafka import Producer
args = json.loads(sys.argv[1])
deliveries = []
def on_delivery(err, msg):
    if err is not None:
        print(json.dumps({"error": str(err)}), flush=True)
        os._exit(3)
    deliveries.append([msg.partition(), msg.offset()])
p = Producer({"bootstrap.servers": args["bootstrap"], "transactional.id": args["tid"],
              "transaction.timeout.ms": args["timeout_ms"], "linger.ms": 0})
p.init_transactions(30)
p.begin_transaction()
for v in args["values"]:
    p.produce(args["topic"], key=v.encode(), value=v.encode(), on_delivery=on_delivery)
left = p.flush(30)
print(json.dumps({"flushed": left == 0, "deliveries": deliveries, "pid": os.getpid()}),
      flush=True)
if args["mode"] == "exit":
    os._exit(0)
time.sleep(600)
"""


class ProducerProcess:
    """A transactional producer in a child process, left mid-transaction after it flushed."""

    def __init__(
        self,
        bootstrap: str,
        transactional_id: str,
        topic: str,
        values: list[str],
        *,
        mode: str = "hang",
        transaction_timeout_ms: int = 60_000,
    ) -> None:
        args = {
            "bootstrap": bootstrap,
            "tid": transactional_id,
            "topic": topic,
            "values": values,
            "mode": mode,
            "timeout_ms": transaction_timeout_ms,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PRODUCER_SCRIPT, json.dumps(args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.report: dict[str, Any] = {}

    def wait_flushed(self, timeout_s: float = 30.0) -> list[Delivery]:
        """Block until the child printed that it flushed; return its delivery reports."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                line = self.proc.stdout.readline()
                if not line:
                    break
                self.report = json.loads(line)
                if "error" in self.report:
                    raise AssertionError(f"producer process failed: {self.report}")
                assert self.report["flushed"], self.report
                return [Delivery(p, o, b"") for p, o in self.report["deliveries"]]
        self.kill()
        stderr = self.proc.stderr.read() if self.proc.stderr else ""
        raise AssertionError(f"producer process did not report a flush: {stderr[-2000:]}")

    def kill(self) -> int:
        """SIGKILL the child (no chance to abort or close anything) and reap it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        return self.proc.wait(10)

    def wait_exit(self, timeout_s: float = 10.0) -> int:
        return self.proc.wait(timeout_s)


def raw_init_producer_id_v6(
    bootstrap: str,
    transactional_id: str,
    *,
    enable_2pc: bool,
    keep_prepared_txn: bool,
    timeout_s: float = 10.0,
) -> Any:
    """Send InitProducerId v6 exactly as given, bypassing dualwrite; return the raw response.

    Retries COORDINATOR_LOAD_IN_PROGRESS / NOT_COORDINATOR (a fresh broker loads its transaction
    log first). Connection errors propagate (a broker without unstable versions disconnects).
    """
    from kafka.errors import KafkaConnectionError, KafkaError
    from kafka.protocol.metadata import CoordinatorType, FindCoordinatorRequest

    from dualwrite.participant._kafka_python_seam import KafkaLink, init_producer_id_request

    link = KafkaLink(
        bootstrap_servers=bootstrap,
        request_timeout_ms=int(timeout_s * 1000),
        reconnect_backoff_max_ms=500,
    )
    try:

        async def send() -> Any:
            found = await link.send(FindCoordinatorRequest(
                key_type=CoordinatorType.TRANSACTION.value,
                coordinator_keys=[transactional_id], min_version=4))
            node = link.add_coordinator(
                found.coordinators[0], CoordinatorType.TRANSACTION, transactional_id)
            request = init_producer_id_request(
                transactional_id, 60_000, 6, enable_2pc, keep_prepared_txn)
            return await link.send(request, node)

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                response = link.run(send)
            except KafkaError as exc:
                # FindCoordinator on a fresh cluster: COORDINATOR_NOT_AVAILABLE while the
                # transaction log is created. A closed connection is not retriable here.
                if (
                    isinstance(exc, KafkaConnectionError)
                    or not exc.retriable
                    or time.monotonic() > deadline
                ):
                    raise
            else:
                if response.error_code not in (14, 15, 16) or time.monotonic() > deadline:
                    return response
            time.sleep(0.2)
    finally:
        link.close()
