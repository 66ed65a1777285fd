"""A small synchronous Pulsar client for transactions: open, add partitions, send, end by TxnID.

Built on :mod:`dualwrite.participant.pulsar._wire`. It finds each topic's and each transaction
coordinator's owner by LOOKUP (following redirects), keeps one connection per broker and one
producer per topic, and bounds every public call by ``timeout_s``. Ending a transaction needs
only its :class:`TxnId`: any process can commit or abort what another one opened.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

from dualwrite.participant.pulsar import pulsar_api_pb2 as pb
from dualwrite.participant.pulsar._wire import Connection, MessageId, TxnId
from dualwrite.participant.pulsar.errors import (
    PulsarConnectionError,
    PulsarFatalError,
    PulsarOutcomeUnknownError,
    PulsarRetriableError,
    PulsarUnsupportedError,
    TransactionNotFoundError,
    server_error,
)
from dualwrite.participant.pulsar.reader import AnchorSubscription, PartitionReader

__all__ = ["TC_ASSIGN_TOPIC", "PulsarTxnClient", "full_topic_name"]

log = logging.getLogger(__name__)

TC_ASSIGN_TOPIC = "persistent://pulsar/system/transaction_coordinator_assign"
_MAX_REDIRECTS = 20
_T = TypeVar("_T")


def full_topic_name(topic: str) -> str:
    """``persistent://tenant/namespace/topic`` for a short name, as Pulsar's ``TopicName``
    completes it (``t`` → ``public/default/t``); the coordinator matches partitions by it."""
    if "://" in topic:
        return topic
    parts = topic.split("/")
    if len(parts) == 1:
        return f"persistent://public/default/{topic}"
    if len(parts) == 3:
        return f"persistent://{topic}"
    raise PulsarFatalError(f"invalid topic name {topic!r}: use persistent://tenant/ns/topic")


@dataclass(frozen=True)
class _Target:
    """Where to connect: a broker, or the service URL's proxy forwarding to a broker."""

    host: str
    port: int
    proxy_to: str | None = None


@dataclass
class _Producer:
    conn: Connection
    producer_id: int
    name: str
    next_sequence_id: int = 0


def _parse_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme == "pulsar+ssl":
        raise PulsarFatalError("pulsar+ssl:// (TLS) is not supported yet; use pulsar://")
    if parts.scheme != "pulsar" or not parts.hostname:
        raise PulsarFatalError("the service URL must look like pulsar://host:port")
    try:
        port = parts.port or 6650
    except ValueError:
        raise PulsarFatalError("the service URL has an invalid port") from None
    return parts.hostname, port


class PulsarTxnClient:
    """Pulsar transactions over our own protocol client. Not thread-safe; one per thread.

    ``token``: a JWT for Pulsar's token authentication (sent to the broker only; never logged,
    never in an error). ``timeout_s`` bounds each public call, lookups and reconnects included.
    """

    def __init__(self, service_url: str, timeout_s: float = 30.0, *,
                 token: str | None = None) -> None:
        if timeout_s <= 0:
            raise PulsarFatalError("timeout_s must be positive")
        host, port = _parse_url(service_url)
        self._service = _Target(host, port)
        self.service_url = f"pulsar://{host}:{port}"
        self.timeout_s = timeout_s
        self._token = token
        self._conns: dict[_Target, Connection] = {}
        self._tc_conns: dict[int, Connection] = {}
        self._tc_count: int | None = None
        self._tc_next = itertools.count()
        self._producers: dict[str, _Producer] = {}
        self._producer_ids = itertools.count()

    def __repr__(self) -> str:
        return f"PulsarTxnClient({self.service_url!r}, timeout_s={self.timeout_s})"

    def __enter__(self) -> PulsarTxnClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the transaction API -------------------------------------------------------------

    def new_txn(self, timeout_ms: int) -> TxnId:
        """Open a transaction that the coordinator aborts ``timeout_ms`` after opening unless
        it is ended first."""
        if not 0 < timeout_ms < 2**63:
            raise PulsarFatalError(f"a transaction timeout of {timeout_ms} ms is out of range")
        deadline = self._deadline()
        tc_id = next(self._tc_next) % self._coordinators(deadline)
        conn = self._tc_connection(tc_id, deadline)
        rid = conn.next_request_id()
        cmd = self._tc_request(tc_id, conn, pb.BaseCommand(
            type=pb.BaseCommand.NEW_TXN, newTxn=pb.CommandNewTxn(
                request_id=rid, txn_ttl_seconds=timeout_ms, tc_id=tc_id)),
            rid, deadline, f"NEW_TXN on coordinator {tc_id}")
        r = cmd.newTxnResponse
        return TxnId(r.txnid_most_bits, r.txnid_least_bits)

    def add_partitions(self, txn: TxnId, topics: Iterable[str]) -> None:
        """Register topic partitions (full names of non-partitioned topics or of partitions)
        with the transaction; needed before the first send to each."""
        deadline = self._deadline()
        names = [full_topic_name(t) for t in topics]
        conn = self._tc_connection(self._tc_of(txn, deadline), deadline)
        rid = conn.next_request_id()
        self._tc_request(txn.most, conn, pb.BaseCommand(
            type=pb.BaseCommand.ADD_PARTITION_TO_TXN, addPartitionToTxn=pb.CommandAddPartitionToTxn(
                request_id=rid, txnid_most_bits=txn.most, txnid_least_bits=txn.least,
                partitions=names)), rid, deadline, f"ADD_PARTITION_TO_TXN {txn}")

    def send(self, topic: str, payloads: Sequence[bytes], txn: TxnId | None,
             keys: Sequence[str | None] | None = None) -> list[MessageId]:
        """Send ``payloads`` to ``topic`` (one message each, in order) in transaction ``txn``
        (``None``: outside any), with ``keys`` as their partition keys if given; returns their
        message ids once the broker stored them all."""
        deadline = self._deadline()
        name = full_topic_name(topic)
        producer = self._retrying(deadline, lambda: self._producer(name, deadline))
        first = producer.next_sequence_id
        producer.next_sequence_id += len(payloads)
        what = f"SEND to {name}" + (f" in {txn}" if txn else "")
        try:
            return producer.conn.send_messages(producer.producer_id, producer.name, first,
                                               payloads, txn, deadline, what, keys)
        except BaseException:
            self._producers.pop(name, None)
            raise

    def end_txn(self, txn: TxnId, commit: bool) -> None:
        """Commit or abort ``txn`` by its id. :class:`TransactionNotFoundError` when the
        coordinator does not know it (also when it already ended: not proof of an outcome);
        :class:`PulsarOutcomeUnknownError` when the request left but no answer came."""
        deadline = self._deadline()
        action = "COMMIT" if commit else "ABORT"
        what = f"END_TXN {action} {txn}"
        conn = self._tc_connection(self._tc_of(txn, deadline), deadline)
        rid = conn.next_request_id()
        try:
            self._tc_request(txn.most, conn, pb.BaseCommand(
                type=pb.BaseCommand.END_TXN, endTxn=pb.CommandEndTxn(
                    request_id=rid, txnid_most_bits=txn.most, txnid_least_bits=txn.least,
                    txn_action=pb.COMMIT if commit else pb.ABORT)), rid, deadline, what)
        except PulsarConnectionError as e:
            if e.sent:
                raise PulsarOutcomeUnknownError(
                    f"{what}: sent, but no answer came ({e}); the transaction may or may not "
                    "have ended") from None
            raise

    def reader(self, topic: str, start: MessageId) -> PartitionReader:
        """A non-durable reader of ``topic`` (a partition, or a non-partitioned topic) from
        ``start`` on (inclusive), on its own connection to the topic's owner; close it after."""
        deadline = self._deadline()
        name = full_topic_name(topic)

        def open_reader() -> PartitionReader:
            target = self._lookup(name, deadline)
            return PartitionReader.open(target.host, target.port, name, start, deadline,
                                        token=self._token, proxy_to_broker_url=target.proxy_to)

        return self._retrying(deadline, open_reader)

    def anchor_subscription(self, topic: str, subscription: str) -> AnchorSubscription:
        """A durable subscription keeping ``topic``'s anchors (:class:`AnchorSubscription`),
        on its own connection to the topic's owner; close it after."""
        deadline = self._deadline()
        name = full_topic_name(topic)

        def subscribe() -> AnchorSubscription:
            target = self._lookup(name, deadline)
            return AnchorSubscription.open(target.host, target.port, name, subscription,
                                           deadline, token=self._token,
                                           proxy_to_broker_url=target.proxy_to)

        return self._retrying(deadline, subscribe)

    def partitions(self, topic: str) -> list[str]:
        """The partition names of ``topic`` (itself when it is not partitioned)."""
        deadline = self._deadline()
        name = full_topic_name(topic)
        count = self._retrying(deadline, lambda: self._partition_count(name, deadline))
        return [name] if count == 0 else [f"{name}-partition-{i}" for i in range(count)]

    def close(self) -> None:
        """Close every connection (the broker drops their producers)."""
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self._tc_conns.clear()
        self._producers.clear()

    # -- plumbing ------------------------------------------------------------------------

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _retrying(self, deadline: float, step: Callable[[], _T]) -> _T:
        """Run a setup step (lookup, connect, producer), retrying retriable failures with a
        short backoff until ``deadline``; nothing of a transaction is sent by such a step."""
        delay = 0.05
        while True:
            try:
                return step()
            except (PulsarRetriableError, PulsarConnectionError) as e:
                if time.monotonic() + delay >= deadline:
                    raise
                log.debug("retrying after %s", e)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _connection(self, target: _Target, deadline: float) -> Connection:
        conn = self._conns.get(target)
        if conn is not None and conn.poll():
            return conn
        conn = Connection.open(target.host, target.port, deadline, token=self._token,
                               proxy_to_broker_url=target.proxy_to)
        self._conns[target] = conn
        return conn

    def _lookup(self, topic: str, deadline: float) -> _Target:
        """The broker owning ``topic``, following redirects (authoritative as told)."""
        conn = self._connection(self._service, deadline)
        authoritative = False
        for _ in range(_MAX_REDIRECTS):
            rid = conn.next_request_id()
            cmd = conn.request(pb.BaseCommand(
                type=pb.BaseCommand.LOOKUP, lookupTopic=pb.CommandLookupTopic(
                    topic=topic, request_id=rid, authoritative=authoritative)),
                rid, deadline, f"LOOKUP {topic}")
            r = cmd.lookupTopicResponse
            if r.response == pb.CommandLookupTopicResponse.Failed:
                raise server_error(r.error, r.message, f"LOOKUP {topic}")
            target = _Target(*_parse_url(r.brokerServiceUrl))
            if r.proxy_through_service_url and target != self._service:
                # Connect to the service URL (a proxy) and ask it to forward to the owner.
                target = _Target(self._service.host, self._service.port, r.brokerServiceUrl)
            if r.response == pb.CommandLookupTopicResponse.Connect:
                return target
            log.debug("LOOKUP %s redirected to %s", topic, r.brokerServiceUrl)
            authoritative = r.authoritative
            conn = self._connection(target, deadline)
        raise PulsarRetriableError(f"LOOKUP {topic}: more than {_MAX_REDIRECTS} redirects")

    def _partition_count(self, topic: str, deadline: float) -> int:
        conn = self._connection(self._service, deadline)
        rid = conn.next_request_id()
        cmd = conn.request(pb.BaseCommand(
            type=pb.BaseCommand.PARTITIONED_METADATA, partitionMetadata=(
                pb.CommandPartitionedTopicMetadata(topic=topic, request_id=rid))),
            rid, deadline, f"PARTITIONED_METADATA {topic}")
        r = cmd.partitionMetadataResponse
        if r.response == pb.CommandPartitionedTopicMetadataResponse.Failed:
            raise server_error(r.error, r.message, f"PARTITIONED_METADATA {topic}")
        return r.partitions

    def _coordinators(self, deadline: float) -> int:
        if self._tc_count is None:
            count = self._retrying(deadline, lambda: self._partition_count(TC_ASSIGN_TOPIC,
                                                                           deadline))
            if count <= 0:
                raise PulsarUnsupportedError(
                    f"the broker at {self.service_url} has no transaction coordinator "
                    "(set transactionCoordinatorEnabled=true and initialise its metadata)")
            self._tc_count = count
        return self._tc_count

    def _tc_of(self, txn: TxnId, deadline: float) -> int:
        if txn.most >= self._coordinators(deadline):
            raise TransactionNotFoundError(
                f"transaction {txn}: there is no transaction coordinator {txn.most} "
                f"(the cluster has {self._tc_count})")
        return txn.most

    def _tc_connection(self, tc_id: int, deadline: float) -> Connection:
        conn = self._tc_conns.get(tc_id)
        if conn is not None and conn.poll():
            return conn
        self._tc_conns.pop(tc_id, None)

        def connect() -> Connection:
            target = self._lookup(f"{TC_ASSIGN_TOPIC}-partition-{tc_id}", deadline)
            c = self._connection(target, deadline)
            if tc_id not in c.tc_connected:
                rid = c.next_request_id()
                c.request(pb.BaseCommand(
                    type=pb.BaseCommand.TC_CLIENT_CONNECT_REQUEST,
                    tcClientConnectRequest=pb.CommandTcClientConnectRequest(
                        request_id=rid, tc_id=tc_id)), rid, deadline,
                    f"TC_CLIENT_CONNECT to coordinator {tc_id}")
                c.tc_connected.add(tc_id)
            return c

        conn = self._retrying(deadline, connect)
        self._tc_conns[tc_id] = conn
        return conn

    def _tc_request(self, tc_id: int, conn: Connection, command: pb.BaseCommand,
                    request_id: int, deadline: float, what: str) -> pb.BaseCommand:
        try:
            return conn.request(command, request_id, deadline, what)
        except (PulsarRetriableError, PulsarConnectionError):
            # The coordinator may have moved: look it up again next time.
            self._tc_conns.pop(tc_id, None)
            conn.tc_connected.discard(tc_id)
            raise

    def _producer(self, topic: str, deadline: float) -> _Producer:
        producer = self._producers.get(topic)
        if (producer is not None and producer.conn.poll()
                and producer.producer_id not in producer.conn.closed_producers):
            return producer
        self._producers.pop(topic, None)
        conn = self._connection(self._lookup(topic, deadline), deadline)
        producer_id = next(self._producer_ids)
        rid = conn.next_request_id()
        cmd = conn.request(pb.BaseCommand(
            type=pb.BaseCommand.PRODUCER, producer=pb.CommandProducer(
                topic=topic, producer_id=producer_id, request_id=rid, txn_enabled=True)),
            rid, deadline, f"PRODUCER on {topic}")
        while not cmd.producer_success.producer_ready:  # queued behind an exclusive producer
            cmd = conn.await_answer(rid, deadline, f"PRODUCER on {topic}")
        producer = _Producer(conn, producer_id, cmd.producer_success.producer_name)
        self._producers[topic] = producer
        return producer

