"""The transaction control plane: the coordinator RPCs that librdkafka does not expose.

librdkafka (confluent-kafka) is dualwrite's data path. It cannot describe or list transactions,
describe producers, end a transaction by (producer id, epoch) from another process, or send
InitProducerId v6. This module does exactly those with kafka-python 3: its public admin API where
that gives what dualwrite needs, else its generated protocol classes sent through
:mod:`dualwrite.participant._kafka_python_seam`, the one module that depends on kafka-python's
networking layer. No wire format is written by hand here.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import kafka.errors as kafka_errors
from kafka.protocol.admin.transactions import DescribeProducersRequest, DescribeTransactionsRequest
from kafka.protocol.metadata import (
    ApiVersionsRequest,
    CoordinatorType,
    FindCoordinatorRequest,
    MetadataRequest,
)
from kafka.protocol.producer.transaction import WriteTxnMarkersRequest

from dualwrite.deadline import Deadline, bounded, wait_s
from dualwrite.errors import (
    BrokerUnreachableError,
    DualWriteError,
    FatalError,
    OutcomeUnknownError,
    RetriableError,
    UnknownTopicError,
    UnsupportedBrokerError,
)
from dualwrite.participant._kafka_python_seam import (
    KafkaLink,
    end_txn_request,
    init_producer_id_request,
)
from dualwrite.participant.broker_probe import (
    RESOLVE_BOUND_S,
    ApiKey,
    ApiRange,
    BrokerProbe,
    ProbeResult,
    check_resolvable,
)
from dualwrite.participant.client_config import (
    authentication_failure,
    check_timeout,
    kafka_python_config,
)
from dualwrite.participant.identifiers import ProducerIdentity, TopicPartition
from dualwrite.participant.kafka_errors import (
    RetriableKafkaError,
    raise_for_code,
    topic_write_denied,
)

__all__ = [
    "CONNECT_NOTICE_S",
    "ActiveProducer",
    "ControlPlane",
    "TransactionDescription",
    "TransactionListing",
    "TxnState",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

_UNKNOWN_TOPIC_OR_PARTITION = 3
_TRANSACTIONAL_ID_NOT_FOUND = 105
_NOT_COORDINATOR = 16
_COORDINATOR_NOT_AVAILABLE = 15

# EndTxn v5 is "transaction version 2" (KIP-890 part 2): the coordinator bumps the epoch on every
# commit and only recognises a retry at the previous epoch. librdkafka starts its transactions on
# the TV1 path (EndTxn <= v1, AddPartitionsToTxn v0), and the broker picks TV1 or TV2 by request
# version alone, so finishing a librdkafka transaction with v5 would fence librdkafka's own later
# EndTxn. v4 is the newest TV1 version.
_END_TXN_TV1_MAX_VERSION = 4
_MAX_IN_FLIGHT = 32
_END_TXN_WINDOW = 16
"""EndTxn requests :meth:`ControlPlane.end_transactions` keeps in flight per coordinator: well
below the connection's ``max_in_flight_requests_per_connection`` (``_MAX_IN_FLIGHT``), past which
kafka-python refuses a request (NodeNotReadyError, "paused") instead of queueing it, and the
retry after it would cost a backoff (docs/design.md, "Measurements behind the code")."""


class TxnState(enum.Enum):
    """Coordinator-side transaction states, as DescribeTransactions names them."""

    EMPTY = "Empty"
    ONGOING = "Ongoing"
    PREPARE_COMMIT = "PrepareCommit"
    PREPARE_ABORT = "PrepareAbort"
    COMPLETE_COMMIT = "CompleteCommit"
    COMPLETE_ABORT = "CompleteAbort"
    DEAD = "Dead"
    PREPARE_EPOCH_FENCE = "PrepareEpochFence"
    UNKNOWN = "Unknown"

    @classmethod
    def parse(cls, text: str) -> TxnState:
        try:
            return cls(text)
        except ValueError:
            return cls.UNKNOWN

    @property
    def in_flight(self) -> bool:
        """The coordinator is still working on this transaction (it pins the LSO)."""
        return self in (TxnState.ONGOING, TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT,
                        TxnState.PREPARE_EPOCH_FENCE)


@dataclass(frozen=True)
class TransactionDescription:
    """A transactional id as its coordinator sees it."""

    transactional_id: str
    state: TxnState
    producer_id: int
    epoch: int
    timeout_ms: int
    start_time_ms: int | None
    partitions: frozenset[TopicPartition]
    coordinator_id: int
    described_at_ms: int = 0
    """This machine's clock when the coordinator answered: every figure of one report is taken
    at one instant, so a maximum over a report agrees with its parts."""

    def open_for_ms(self, now_ms: int | None = None) -> int | None:
        """How long an in-flight transaction had been open when described (the KIP's
        open-time metric), or at ``now_ms``."""
        if not self.state.in_flight or self.start_time_ms is None:
            return None
        now = (now_ms if now_ms is not None else self.described_at_ms
               or int(time.time() * 1000))
        return max(0, now - self.start_time_ms)


@dataclass(frozen=True)
class TransactionListing:
    transactional_id: str
    producer_id: int
    state: TxnState
    broker_id: int


@dataclass(frozen=True)
class ActiveProducer:
    """One producer's state on one partition (DescribeProducers)."""

    producer_id: int
    epoch: int
    last_sequence: int
    last_timestamp_ms: int
    coordinator_epoch: int
    current_txn_start_offset: int | None


#: After this long connecting to Kafka, say so in one log line rather than wait in silence.
CONNECT_NOTICE_S = 2.0


class ControlPlane:
    """A typed client for the transaction RPCs; one instance per cluster, thread-safe.

    ``config`` is the application's confluent-kafka configuration; only its connection and security
    settings are used. Every call is bounded by ``timeout_s`` and retries only errors Kafka marks
    retriable.

    kafka-python's public admin API serves ListTransactions, DescribeConfigs and the brokers'
    versions; the rest is sent through
    :class:`dualwrite.participant._kafka_python_seam.KafkaLink` (see there for why it has no
    public equivalent). Requests run as coroutines on kafka-python's IO thread, so the caches
    below are only touched from that one thread.
    """

    def __init__(self, config: Mapping[str, Any], *, timeout_s: float = 30.0,
                 require_support: bool = True) -> None:
        """``require_support``: raise :class:`UnsupportedBrokerError` if the bootstrap broker
        lacks a request recovery needs (every start-up path; ``dualwrite probe`` reports
        instead)."""
        self._timeout_s = timeout_s = check_timeout(timeout_s)
        kp = kafka_python_config(config)
        kp.setdefault("client_id", "dualwrite-control-plane")
        kp["request_timeout_ms"] = int(timeout_s * 1000)
        # The bootstrap wait is the one a caller feels when no broker answers: kafka-python
        # blocks in the admin client's constructor for bootstrap_timeout_ms.
        waiting_s = wait_s(timeout_s)
        kp["bootstrap_timeout_ms"] = int(waiting_s * 1000)
        kp["reconnect_backoff_max_ms"] = 1000
        # Recovery's threads share a connection per broker: let their requests queue on the wire
        # rather than in the client (kafka-python's default allows 5 in flight).
        kp.setdefault("max_in_flight_requests_per_connection", _MAX_IN_FLIGHT)
        self._servers = ",".join(kp["bootstrap_servers"])
        check_resolvable(kp["bootstrap_servers"], min(RESOLVE_BOUND_S, waiting_s))
        started = time.monotonic()
        notice = threading.Timer(CONNECT_NOTICE_S, log.warning,
                                 ("connecting to Kafka at %s (waiting up to %.3g s)…",
                                  self._servers, waiting_s))
        notice.daemon = True
        notice.start()
        try:
            self._link = KafkaLink(**kp)
        except kafka_errors.KafkaError as exc:
            elapsed = time.monotonic() - started
            notice.cancel()
            # kafka-python retries a failed SASL handshake until the timeout: say it was that.
            failure = authentication_failure(config, min(5.0, timeout_s))
            if failure is not None:
                raise FatalError(failure) from None
            raise BrokerUnreachableError(
                f"no Kafka broker answered at {self._servers} in {elapsed:.1f} s (timeout "
                f"{waiting_s:.3g} s; kafka-python: {str(exc) or type(exc).__name__}); "
                "check bootstrap.servers and that the cluster is up (`dualwrite dev status`)"
            ) from None
        finally:
            notice.cancel()
        self._admin = self._link.admin
        if require_support:
            missing = self.missing_requests()
            if missing:
                self._link.close()
                raise UnsupportedBrokerError(self._servers, missing)
        # Transaction coordinator of each transactional id, dropped after NOT_COORDINATOR.
        self._coordinators: dict[str, int] = {}
        # Partition leaders for DescribeProducers, refreshed when a leader answers with an error.
        self._leaders: dict[TopicPartition, int] = {}

    def missing_requests(self) -> list[str]:
        """The requests dualwrite needs that the bootstrap broker does not offer, each with its
        API key. Costs nothing: the client learned the versions on connecting (ApiVersions);
        none are reported before it has."""
        if not self._link.api_versions_known():
            return []
        return [f"{key.request_name} (API key {int(key)})" for key in ApiKey
                if self._link.max_version(key) is None]

    def close(self) -> None:
        self._link.close()

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------------------

    def _run(self, coro: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run a coroutine on kafka-python's IO thread, translating its errors."""
        result: T = self._call(self._link.run, coro, *args)
        return result

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call a blocking kafka-python method, translating its errors into dualwrite's."""
        try:
            return fn(*args, **kwargs)
        except kafka_errors.KafkaError as exc:
            raise self._typed(exc) from exc

    def _typed(self, exc: kafka_errors.KafkaError) -> DualWriteError:
        """The dualwrite error for a kafka-python error (see :meth:`_call`)."""
        if isinstance(exc, (kafka_errors.KafkaConnectionError, kafka_errors.NodeNotReadyError,
                            kafka_errors.KafkaTimeoutError, kafka_errors.RequestTimedOutError)):
            return BrokerUnreachableError(
                f"Kafka at {self._servers} did not answer ({exc!r}); retry when it is back")
        code = getattr(exc, "errno", None)
        if isinstance(code, int) and code > 0:
            try:
                raise_for_code(code, str(exc))
            except DualWriteError as typed:
                return typed
        return RetriableError(f"Kafka request failed: {exc!r}")

    def _deadline(self) -> Deadline:
        """This call's deadline: the caller's (dualwrite.deadline), or ``timeout_s`` from now."""
        return bounded(self._timeout_s)

    async def _send(self, dl: Deadline, request: Any, node: int | None = None) -> Any:
        """Send a request, waiting for its answer no longer than ``dl`` allows."""
        return await self._link.send(request, node, int(dl.wait_s() * 1000))

    async def _coordinator(self, transactional_id: str, dl: Deadline) -> int:
        return (await self._find_coordinators([transactional_id], dl))[transactional_id]

    async def _find_coordinators(self, ids: list[str], dl: Deadline) -> dict[str, int]:
        """Transaction coordinators of ``ids``: cached, else one batched FindCoordinator."""
        out = {tid: self._coordinators[tid] for tid in ids if tid in self._coordinators}
        unknown = [tid for tid in ids if tid not in out]
        if not unknown:
            return out
        if (self._link.max_version(ApiKey.FIND_COORDINATOR) or 0) >= 4:  # KIP-699: Kafka 3.0+
            response = await self._send(dl, FindCoordinatorRequest(
                key_type=CoordinatorType.TRANSACTION.value, coordinator_keys=unknown,
                min_version=4))
            answers = [(c.key, c) for c in response.coordinators]
        else:
            answers = []
            for tid in unknown:
                answers.append((tid, await self._send(dl, FindCoordinatorRequest(
                    key=tid, key_type=CoordinatorType.TRANSACTION.value, max_version=3))))
        for tid, answer in answers:
            # Raises the answer's error (kafka-python's exception types; see _with_retries).
            node = self._link.add_coordinator(answer, CoordinatorType.TRANSACTION, tid)
            self._coordinators[tid] = out[tid] = node
        return out

    @staticmethod
    async def _join(sent: list[tuple[int, Awaitable[Any]]]) -> list[tuple[int, Any]]:
        """Await requests sent concurrently (see :meth:`KafkaLink.spawn`), each node's answer;
        every one is waited for before the first failure is raised, so none is left running."""
        answers: list[tuple[int, Any]] = []
        failure: BaseException | None = None
        for node, pending in sent:
            try:
                answers.append((node, await pending))
            except Exception as exc:  # re-raised below, after the others
                failure = failure or exc
        if failure is not None:
            raise failure
        return answers

    def _forget_coordinator(self, transactional_id: str) -> None:
        """Drop a cached coordinator after NOT_COORDINATOR so the retry looks it up again."""
        self._coordinators.pop(transactional_id, None)

    async def _with_retries(self, what: str, attempt: Callable[[], Awaitable[T]],
                            dl: Deadline) -> T:
        """Run ``attempt`` until it succeeds, raises a non-retriable error, or ``dl`` passes."""
        deadline = dl.at
        delay = 0.05
        while True:
            try:
                try:
                    return await attempt()
                except kafka_errors.KafkaError as raw:
                    # kafka-python raises FindCoordinator errors as its own exception types.
                    code = getattr(raw, "errno", None)
                    if getattr(raw, "retriable", False) and isinstance(code, int) and code > 0:
                        raise_for_code(code, f"{what}: {raw}")
                    raise
            except (RetriableKafkaError, kafka_errors.NodeNotReadyError,
                    kafka_errors.KafkaConnectionError) as exc:
                if time.monotonic() + delay > deadline:
                    error = (RetriableError if isinstance(exc, RetriableKafkaError)
                             else BrokerUnreachableError)
                    raise error(f"{what}: Kafka at {self._servers} still failing after "
                                f"{dl.budget_s:.3g} s: {exc}") from exc
                if not isinstance(exc, RetriableKafkaError):
                    # A broker went away: leaders and coordinators may have moved (a dead
                    # coordinator, still cached, would be asked until the deadline).
                    self._leaders.clear()
                    self._coordinators.clear()
                log.debug("%s: retrying after %s", what, exc)
                await self._link.sleep(delay)
                delay = min(delay * 2, 1.0)

    # -- DescribeTransactions ------------------------------------------------------------------

    def describe_transaction(self, transactional_id: str) -> TransactionDescription | None:
        """The coordinator's view of one transactional id; None if it does not know the id."""
        return self.describe_transactions([transactional_id]).get(transactional_id)

    def describe_transactions(
        self, transactional_ids: Iterable[str]
    ) -> dict[str, TransactionDescription]:
        """Describe many transactional ids, one request per coordinator; unknown ids are absent."""
        # Not KafkaAdminClient.describe_transactions: it fails the whole batch when one id is
        # unknown (here: absent) and never forgets a coordinator after NOT_COORDINATOR.
        ids = list(dict.fromkeys(transactional_ids))
        return self._run(self._describe_transactions, ids, self._deadline()) if ids else {}

    async def _describe_transactions(self, ids: list[str], dl: Deadline
                                     ) -> dict[str, TransactionDescription]:
        async def attempt() -> dict[str, TransactionDescription]:
            coordinators = await self._find_coordinators(ids, dl)
            by_node: dict[int, list[str]] = defaultdict(list)
            for tid, node in coordinators.items():
                by_node[node].append(tid)
            out: dict[str, TransactionDescription] = {}
            # One request per coordinator, all coordinators at once.
            sent = [(node, self._link.spawn(
                self._send, dl, DescribeTransactionsRequest(transactional_ids=tids), node))
                for node, tids in by_node.items()]
            answered = await self._join(sent)
            described_at_ms = int(time.time() * 1000)
            for node, response in answered:
                for txn in response.transaction_states:
                    if txn.error_code == _TRANSACTIONAL_ID_NOT_FOUND:
                        continue
                    if txn.error_code in (_NOT_COORDINATOR, _COORDINATOR_NOT_AVAILABLE):
                        self._forget_coordinator(txn.transactional_id)
                    raise_for_code(txn.error_code,
                                   f"DescribeTransactions({txn.transactional_id!r})")
                    out[txn.transactional_id] = TransactionDescription(
                        transactional_id=txn.transactional_id,
                        state=TxnState.parse(txn.transaction_state),
                        producer_id=txn.producer_id,
                        epoch=txn.producer_epoch,
                        timeout_ms=txn.transaction_timeout_ms,
                        start_time_ms=(txn.transaction_start_time_ms
                                       if txn.transaction_start_time_ms >= 0 else None),
                        partitions=frozenset(
                            TopicPartition(t.topic, p) for t in txn.topics for p in t.partitions),
                        coordinator_id=node,
                        described_at_ms=described_at_ms,
                    )
            return out

        return await self._with_retries("DescribeTransactions", attempt, dl)

    # -- ListTransactions ----------------------------------------------------------------------

    def list_transactions(
        self,
        *,
        states: Iterable[TxnState] = (),
        prefix: str | None = None,
        producer_ids: Iterable[int] = (),
    ) -> list[TransactionListing]:
        """Transactions known to any coordinator, across all brokers.

        ``prefix`` is sent as a regex pattern where the broker supports it (ListTransactions v2,
        Kafka 4.1+) and always applied client-side as well.
        """
        # Fresh broker list first: every broker holds a slice of __transaction_state.
        self._run(self._link.bootstrap, int(self._deadline().wait_s() * 1000))
        pattern = None
        # The pattern is ListTransactions v2 (KIP-1152, Kafka 4.1+); 3.9 and 4.0 offer v1, where
        # kafka-python refuses a pattern (UNSUPPORTED_VERSION): filter on the client alone.
        if prefix is not None and (self._link.max_version(ApiKey.LIST_TRANSACTIONS) or 0) >= 2:
            pattern = "^" + re.escape(prefix) + ".*"
        by_broker: dict[int, list[Any]] = self._call(
            self._admin.list_transactions, state_filters=[s.value for s in states],
            producer_id_filters=list(producer_ids), transactional_id_pattern=pattern)
        out: list[TransactionListing] = []
        for node, listings in by_broker.items():
            for txn in listings:
                if prefix is not None and not txn.transactional_id.startswith(prefix):
                    continue
                out.append(TransactionListing(txn.transactional_id, txn.producer_id,
                                              TxnState.parse(str(txn.state.value)), node))
        return out

    # -- ACLs ----------------------------------------------------------------------------------

    def missing_topic_acls(self, topics: Iterable[str],
                           operation: str = "WRITE") -> list[str]:
        """The ACLs this principal lacks to ``operation`` each topic, as ``"WRITE on Topic 't'"``
        (Metadata's topic authorized operations, KIP-430); empty when it has them all or the
        broker does not say. librdkafka purges a transaction's records when AddPartitionsToTxn
        fails with TOPIC_AUTHORIZATION_FAILED and reports only the purge: this names the cause.
        """
        return self._missing_topic_acls(self._describe_topics(topics), operation)

    def check_topics_writable(self, topics: Iterable[str]) -> None:
        """Raise :class:`UnknownTopicError` for a topic that does not exist and
        :class:`AuthorizationError` naming the ACL for one this principal may not write to (one
        Metadata request): what a batch checks before its tasks produce."""
        described = self._describe_topics(topics)
        for topic in described:
            if topic.get("error_code") == 3:  # UNKNOWN_TOPIC_OR_PARTITION
                raise UnknownTopicError(str(topic["name"]), "Metadata: UNKNOWN_TOPIC_OR_PARTITION")
        missing = self._missing_topic_acls(described, "WRITE")
        if missing:
            raise topic_write_denied(missing, "Metadata: topic authorized operations")

    def _describe_topics(self, topics: Iterable[str]) -> list[dict[str, Any]]:
        names = sorted(set(topics))
        return list(self._call(self._admin.describe_topics, names)) if names else []

    @staticmethod
    def _missing_topic_acls(described: list[dict[str, Any]], operation: str) -> list[str]:
        missing = []
        for topic in described:
            ops = topic.get("authorized_operations")
            denied = topic.get("error_code") == 29  # not even DESCRIBE
            if denied or (ops is not None and operation not in ops):
                missing.append(f"{operation} on Topic {topic['name']!r}")
        return missing

    # -- DescribeProducers ---------------------------------------------------------------------

    def describe_producers(
        self, partitions: Iterable[TopicPartition]
    ) -> dict[TopicPartition, list[ActiveProducer]]:
        """Active producers of each partition, asked of its leader."""
        # Not KafkaAdminClient.describe_producers: it asks for metadata on every call, where
        # recovery calls this per chunk and per id; leaders are cached here instead.
        parts = sorted(set(partitions))
        return self._run(self._describe_producers, parts, self._deadline()) if parts else {}

    async def _find_leaders(self, parts: list[TopicPartition], dl: Deadline) -> None:
        """Look up the leaders of ``parts`` (one Metadata request) into the leader cache."""
        topics = sorted({p.topic for p in parts})
        response = await self._send(dl, MetadataRequest(
            topics=[MetadataRequest.MetadataRequestTopic(name=t) for t in topics],
            allow_auto_topic_creation=False))
        wanted = set(parts)
        for topic in response.topics:
            for part in topic.partitions:
                tp = TopicPartition(topic.name, part.partition_index)
                if tp in wanted:
                    self._leaders[tp] = part.leader_id
                    wanted.discard(tp)
        if wanted:
            raise_for_code(_UNKNOWN_TOPIC_OR_PARTITION, "DescribeProducers: partitions not known: "
                           + ", ".join(str(p) for p in sorted(wanted)))

    async def _describe_producers(
        self, parts: list[TopicPartition], dl: Deadline
    ) -> dict[TopicPartition, list[ActiveProducer]]:
        async def attempt() -> dict[TopicPartition, list[ActiveProducer]]:
            unknown = [p for p in parts if p not in self._leaders]
            if unknown:
                await self._find_leaders(unknown, dl)
            leaders: dict[int, list[TopicPartition]] = defaultdict(list)
            for p in parts:
                leaders[self._leaders[p]].append(p)
            out: dict[TopicPartition, list[ActiveProducer]] = {}
            sent = []
            for leader, tps in leaders.items():
                by_topic: dict[str, list[int]] = defaultdict(list)
                for tp in tps:
                    by_topic[tp.topic].append(tp.partition)
                request = DescribeProducersRequest(topics=[
                    DescribeProducersRequest.TopicRequest(name=t, partition_indexes=ps)
                    for t, ps in by_topic.items()])
                sent.append((leader, self._link.spawn(self._send, dl, request, leader)))
            for _, response in await self._join(sent):  # every leader at once
                for topic in response.topics:
                    for part in topic.partitions:
                        tp_ = TopicPartition(topic.name, part.partition_index)
                        if part.error_code:
                            self._leaders.pop(tp_, None)  # leadership moved: look it up again
                        raise_for_code(part.error_code, f"DescribeProducers({tp_})")
                        out[tp_] = [
                            ActiveProducer(
                                producer_id=p.producer_id,
                                epoch=p.producer_epoch,
                                last_sequence=p.last_sequence,
                                last_timestamp_ms=p.last_timestamp,
                                coordinator_epoch=p.coordinator_epoch,
                                current_txn_start_offset=(p.current_txn_start_offset
                                                          if p.current_txn_start_offset >= 0
                                                          else None),
                            )
                            for p in part.active_producers
                        ]
            return out

        return await self._with_retries("DescribeProducers", attempt, dl)

    # -- WriteTxnMarkers -----------------------------------------------------------------------

    def write_txn_marker(self, tp: TopicPartition, producer_id: int, epoch: int,
                         coordinator_epoch: int, *, commit: bool) -> None:
        """Write the marker that ends (producer id, epoch)'s open transaction on ``tp`` alone,
        at its leader, as a coordinator would (the request behind KIP-664's abort tool).

        Only for a transaction whose coordinator has already decided and completed it but whose
        marker never reached ``tp`` (see :meth:`completion.Completion.commit_lost_marker`): the
        outcome written must be the coordinator's own. Needs CLUSTER_ACTION on the cluster.
        """
        verb = "commit" if commit else "abort"
        what = (f"WriteTxnMarkers({verb}) {tp} producer_id={producer_id} epoch={epoch} "
                f"coordinator_epoch={coordinator_epoch}")
        log.warning("%s", what)
        self._run(self._write_txn_marker, tp, producer_id, epoch, coordinator_epoch, commit,
                  what, self._deadline())

    async def _write_txn_marker(self, tp: TopicPartition, pid: int, epoch: int,
                                coordinator_epoch: int, commit: bool, what: str,
                                dl: Deadline) -> None:
        marker_type = WriteTxnMarkersRequest.WritableTxnMarker
        request = WriteTxnMarkersRequest(markers=[marker_type(
            producer_id=pid, producer_epoch=epoch, transaction_result=commit,
            topics=[marker_type.WritableTxnMarkerTopic(name=tp.topic,
                                                       partition_indexes=[tp.partition])],
            coordinator_epoch=coordinator_epoch)])

        async def attempt() -> None:
            if tp not in self._leaders:
                await self._find_leaders([tp], dl)
            response = await self._send(dl, request, self._leaders[tp])
            for result in response.markers:
                for topic in result.topics:
                    for part in topic.partitions:
                        if part.error_code:
                            self._leaders.pop(tp, None)  # leadership moved: look it up again
                        raise_for_code(part.error_code, what)

        await self._with_retries(what, attempt, dl)

    # -- EndTxn --------------------------------------------------------------------------------

    def end_transaction(self, transactional_id: str, producer_id: int, epoch: int,
                        commit: bool) -> None:
        """Commit or abort the transaction that (producer id, epoch) has open, from any process.

        This is how a restarted process resumes a prepared transaction on brokers without
        KIP-939 (Flink's KafkaSink recovers the same way). Returns when the coordinator accepted
        the decision. A repeated commit of a committed transaction succeeds; commit after abort
        or abort after commit raises (INVALID_TXN_STATE); a stale epoch raises a fenced error.
        If the request was sent and no answer came, raises :class:`OutcomeUnknownError` — ask
        :meth:`describe_transaction`, never assume.
        """
        verb = "commit" if commit else "abort"
        what = (f"EndTxn({verb}) transactional_id={transactional_id} producer_id={producer_id} "
                f"epoch={epoch}")
        log.info("%s", what)
        self._run(self._end_transaction, transactional_id, producer_id, epoch, commit, what,
                  self._deadline())

    def end_transactions(self, ends: Sequence[tuple[str, int, int]], commit: bool
                         ) -> list[DualWriteError | None]:
        """:meth:`end_transaction` for many (transactional id, producer id, epoch) at once.

        One FindCoordinator for the ids whose coordinator is not cached, then every EndTxn sent
        at once: pipelined on the one connection to each coordinator, all coordinators in
        parallel, so the time does not grow with the number of ids. Each id keeps
        :meth:`end_transaction`'s rules (retried only after an answer saying it was not acted
        on; a commit sent without an answer is :class:`OutcomeUnknownError`). Returns each id's
        typed error in the order of ``ends``, None where the coordinator accepted the decision.
        """
        if not ends:
            return []
        verb = "commit" if commit else "abort"
        log.info("EndTxn(%s) of %d transactional ids at once", verb, len(ends))
        return self._run(self._end_transactions, list(ends), commit, self._deadline())

    async def _end_transactions(self, ends: list[tuple[str, int, int]], commit: bool,
                                dl: Deadline) -> list[DualWriteError | None]:
        verb = "commit" if commit else "abort"
        try:
            await self._find_coordinators(list(dict.fromkeys(t for t, _, _ in ends)), dl)
        except (DualWriteError, kafka_errors.KafkaError) as exc:
            # Each id's own attempt below looks its coordinator up again, with its retries.
            log.debug("FindCoordinator for %d ids failed (%r); looking up one by one",
                      len(ends), exc)
        by_node: dict[int | None, deque[int]] = defaultdict(deque)
        for i, (tid, _, _) in enumerate(ends):
            by_node[self._coordinators.get(tid)].append(i)
        out: list[DualWriteError | None] = [None] * len(ends)

        async def lane(queue: deque[int]) -> None:
            while queue:
                i = queue.popleft()
                tid, pid, epoch = ends[i]
                what = f"EndTxn({verb}) transactional_id={tid} producer_id={pid} epoch={epoch}"
                log.info("%s", what)
                try:
                    await self._end_transaction(tid, pid, epoch, commit, what, dl)
                except DualWriteError as exc:
                    out[i] = exc
                except kafka_errors.KafkaError as exc:
                    out[i] = self._typed(exc)

        lanes = [self._link.spawn(lane, queue) for queue in by_node.values()
                 for _ in range(min(_END_TXN_WINDOW, len(queue)))]
        for pending in lanes:
            await pending
        return out

    async def _end_transaction(self, tid: str, pid: int, epoch: int, commit: bool,
                               what: str, dl: Deadline) -> None:
        async def attempt() -> None:
            node = await self._coordinator(tid, dl)
            request = end_txn_request(tid, pid, epoch, commit, _END_TXN_TV1_MAX_VERSION)
            try:
                response = await self._send(dl, request, node)
            except (kafka_errors.KafkaTimeoutError, kafka_errors.RequestTimedOutError,
                    kafka_errors.KafkaConnectionError) as exc:
                if commit:
                    raise OutcomeUnknownError(
                        f"{what}: sent, but no answer ({exc!r}); the outcome is unknown — "
                        "run `dualwrite recover`, which asks the coordinator") from exc
                raise
            if response.error_code in (_NOT_COORDINATOR, _COORDINATOR_NOT_AVAILABLE):
                self._forget_coordinator(tid)
            # CONCURRENT_TRANSACTIONS while the previous marker write completes: retriable.
            raise_for_code(response.error_code, what)

        await self._with_retries(what, attempt, dl)

    # -- InitProducerId ------------------------------------------------------------------------

    def fence(self, transactional_id: str, *, transaction_timeout_ms: int = 60_000
              ) -> ProducerIdentity:
        """Bump the epoch of ``transactional_id``, aborting its open transaction.

        This is the KIP's forceTerminateTransaction: InitProducerId without producer id/epoch.
        Any producer still using the old epoch is fenced.
        """
        log.warning("fencing transactional_id=%s (aborts its open transaction)", transactional_id)
        identity = self._run(self._init_producer_id, transactional_id, transaction_timeout_ms,
                             None, False, False, self._deadline())
        log.info("fenced transactional_id=%s producer_id=%d epoch=%d", transactional_id,
                 identity.producer_id, identity.epoch)
        return identity

    async def _init_producer_id(self, tid: str, timeout_ms: int, version: int | None,
                                enable_2pc: bool, keep_prepared: bool, dl: Deadline
                                ) -> ProducerIdentity:
        async def attempt() -> ProducerIdentity:
            node = await self._coordinator(tid, dl)
            request = init_producer_id_request(tid, timeout_ms, version, enable_2pc,
                                               keep_prepared)
            response = await self._send(dl, request, node)
            if response.error_code in (_NOT_COORDINATOR, _COORDINATOR_NOT_AVAILABLE):
                self._forget_coordinator(tid)
            raise_for_code(response.error_code, f"InitProducerId({tid!r})")
            return ProducerIdentity(response.producer_id, response.producer_epoch)

        return await self._with_retries(f"InitProducerId({tid!r})", attempt, dl)

    # -- what the brokers offer (see broker_probe) ----------------------------------------------

    def probe(self, *, probe_transactional_id: str = "dualwrite-probe",
              check_2pc: bool = True) -> ProbeResult:
        """What the cluster supports (:meth:`ProbeResult.gather` through this client)."""
        return ProbeResult.gather(self, probe_transactional_id=probe_transactional_id,
                                  check_2pc=check_2pc)

    def broker_versions(self) -> list[BrokerProbe]:
        """Each broker that answers ApiVersions: its address, software, API versions and
        finalized features."""
        brokers = self._run(self._probe_brokers, self._deadline())
        return [replace(b, software=self._broker_software(b.node_id)) for b in brokers]

    def init_producer_id_v6(self, transactional_id: str, *, enable_2pc: bool,
                            keep_prepared_txn: bool, transaction_timeout_ms: int = 60_000
                            ) -> ProducerIdentity:
        """Send InitProducerId v6 (KIP-939) as is; raises the broker's error if it refuses."""
        return self._run(self._init_producer_id, transactional_id, transaction_timeout_ms, 6,
                         enable_2pc, keep_prepared_txn, self._deadline())

    async def _probe_brokers(self, dl: Deadline) -> list[BrokerProbe]:
        """The brokers that answer ApiVersions; one that is down is left out (a cluster with a
        broker away still serves transactions), and None answering is BrokerUnreachableError."""
        await self._link.bootstrap(int(dl.wait_s() * 1000))
        out: list[BrokerProbe] = []
        unreachable: list[str] = []
        for node in self._link.broker_ids():
            try:
                response = await self._send(dl, ApiVersionsRequest(
                    client_software_name="dualwrite", client_software_version="0.1.0"), node)
            except (kafka_errors.KafkaConnectionError, kafka_errors.NodeNotReadyError,
                    kafka_errors.KafkaTimeoutError, kafka_errors.RequestTimedOutError) as exc:
                unreachable.append(f"broker {node}: {exc!r}")
                continue
            raise_for_code(response.error_code, f"ApiVersions on broker {node}")
            apis = {k.api_key: ApiRange(k.min_version, k.max_version) for k in response.api_keys}
            features = {f.name: f.max_version_level
                        for f in (getattr(response, "finalized_features", None) or [])}
            host, port = self._link.broker_address(node)
            out.append(BrokerProbe(node, host, port, "unknown", apis, features))
        if not out:
            raise BrokerUnreachableError(
                f"no broker answered ApiVersions ({'; '.join(unreachable)})")
        if unreachable:
            log.info("probe: left out brokers that did not answer (%s)", "; ".join(unreachable))
        return out

    def _broker_software(self, node_id: int) -> str:
        """The broker's version as its connection learned it (public admin API)."""
        try:
            bvd = self._admin.get_broker_version_data(node_id)
        except kafka_errors.KafkaError as exc:
            log.info("cannot read broker %s's version (%r)", node_id, exc)
            return "unknown"
        return f"Apache Kafka {bvd.broker_version_str}" if bvd else "unknown"

    def broker_configs(self, node_id: int) -> dict[str, str]:
        """The broker's configuration (DescribeConfigs); empty if it cannot be read."""
        from kafka.admin import ConfigResource, ConfigResourceType

        try:
            result = self._admin.describe_configs(
                [ConfigResource(ConfigResourceType.BROKER, str(node_id))], config_filter="all")
        except kafka_errors.KafkaError as exc:
            log.info("cannot read broker configs (%r); continuing without them", exc)
            return {}
        out: dict[str, str] = {}
        for by_name in (result or {}).values():
            for configs in by_name.values():
                for key, data in configs.items():
                    value = data.get("value") if isinstance(data, dict) else data
                    if value is not None:
                        out[key] = str(value)
        if not out:
            # kafka-python drops DescribeConfigs' per-resource error; with config_filter="all" an
            # empty answer means CLUSTER_AUTHORIZATION_FAILED.
            log.warning("cannot read the broker configuration (transaction.max.timeout.ms): "
                        "grant DESCRIBE_CONFIGS on Cluster 'kafka-cluster' to this principal, or "
                        "set transaction.timeout.ms yourself; continuing without it")
        return out
