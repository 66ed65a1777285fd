"""TwoPhaseProducer: a confluent-kafka transactional producer with KIP-939's verbs.

librdkafka stays the data path. What it cannot do — keep a prepared transaction across a restart,
name one transaction, finish a transaction by (producer id, epoch) — is done beside it through the
control plane (see ``completion`` and ``control_plane``).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from dualwrite.deadline import bounded
from dualwrite.deadline import wait_s as within
from dualwrite.errors import (
    ConfigurationError,
    DeliveryTimeoutError,
    DualWriteError,
    FatalError,
    HeuristicAbortError,
    InvalidRecordError,
    OutcomeUnknownError,
    OutcomeUnreadableError,
    ProducerFencedError,
    RecordTooLargeError,
    RecoverableError,
    RetriableError,
    TransactionStateError,
)
from dualwrite.participant.client_config import (
    check_kafka_config,
    check_timeout,
    librdkafka_config,
)
from dualwrite.participant.completion import Completion, OwnerAlive
from dualwrite.participant.control_plane import ControlPlane, TxnState
from dualwrite.participant.coordinator_link import CoordinatorLinkWatch
from dualwrite.participant.identifiers import ProducerIdentity, TopicPartition
from dualwrite.participant.interrupts import interrupts_kept
from dualwrite.participant.kafka_errors import (
    ends_only_the_session,
    hides_its_cause,
    librdkafka_error,
    record_error,
    topic_write_denied,
)
from dualwrite.participant.outcome import Outcome
from dualwrite.participant.prepared_state import PreparedTxnState

__all__ = ["TwoPhaseProducer"]

log = logging.getLogger(__name__)

Headers = Mapping[str, bytes | str] | Sequence[tuple[str, bytes | str]]


class _Phase(enum.Enum):
    NEW = "new"
    AWAITING_COMPLETION = "awaiting complete_transaction"
    READY = "ready"
    IN_TRANSACTION = "in transaction"
    PREPARED = "prepared"
    FAILED = "failed"
    CLOSED = "closed"


class TwoPhaseProducer:
    """A transactional producer that can prepare, and finish a prepared transaction later.

    ``config`` is a confluent-kafka producer configuration with ``transactional.id``. If
    ``transaction.timeout.ms`` is not set it defaults to the broker's
    ``transaction.max.timeout.ms``: a prepared transaction must outlive the time it takes to
    restart and recover, or the broker aborts it (then :class:`HeuristicAbortError` says so).
    """

    def __init__(self, config: Mapping[str, Any], *, control_plane: ControlPlane | None = None,
                 timeout_s: float = 30.0) -> None:
        config = check_kafka_config(config)
        _check_socket_timeout(config)
        tid = config.get("transactional.id")
        if not tid or not isinstance(tid, str):
            raise ConfigurationError("TwoPhaseProducer needs 'transactional.id' (a non-empty str) "
                                     "in its configuration")
        self._tid = tid
        self._timeout_s = timeout_s = check_timeout(timeout_s)
        """Each wait's own bound; a caller's :func:`~dualwrite.deadline.deadline_scope` can
        only shorten it (its waits then share one deadline)."""
        self._servers = str(config.get("bootstrap.servers", "?"))
        self._owns_cp = control_plane is None
        self._cp = control_plane or ControlPlane(config, timeout_s=timeout_s)
        self._config = librdkafka_config(config)
        self._completion = Completion(self._cp, self._config, timeout_s=timeout_s)
        if "transaction.timeout.ms" not in self._config:
            probe = self._cp.probe(check_2pc=False)
            if probe.max_transaction_timeout_ms:
                self._config["transaction.timeout.ms"] = probe.max_transaction_timeout_ms
        _bound_socket_timeout(self._config, timeout_s)
        self._config.setdefault("error_cb", self._on_error)
        self._link = CoordinatorLinkWatch(self._config)
        self._fatal: KafkaError | None = None
        self._producer: Producer | None = None
        self._phase = _Phase.NEW
        self._identity: ProducerIdentity | None = None
        self._first_offsets: dict[TopicPartition, int] = {}
        self._first_raw: dict[tuple[Any, Any], Any] = {}
        self._delivery_errors: list[tuple[str, int, KafkaError, int]] = []
        """(topic, partition, error, key and value bytes) of each failed delivery."""
        self._known_topics: set[str] = set()
        """Topics whose metadata this producer has seen: checked once, on first use."""
        self._unconfirmed = False
        """The flush of the open transaction failed or timed out: some records may be in the
        log unacknowledged, so it is aborted by a new session (see _abort_by_new_session)."""
        self._failed_topics: set[str] = set()
        self._delivered = self._record_delivery  # one bound method, not one per record
        self._produced = 0
        self._begun_at = 0.0
        self._prepared: PreparedTxnState | None = None
        self.last_committed: PreparedTxnState | None = None
        """The state of the last transaction this producer committed (in this process)."""

    # -- properties ----------------------------------------------------------------------------

    @property
    def transactional_id(self) -> str:
        return self._tid

    @property
    def identity(self) -> ProducerIdentity | None:
        """Producer id and epoch of the current librdkafka session, once initialised."""
        return self._identity

    @property
    def control_plane(self) -> ControlPlane:
        return self._cp

    @property
    def transaction_timeout_ms(self) -> int | None:
        value = self._config.get("transaction.timeout.ms")
        return int(value) if value is not None else None

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self._fatal = err
            log.error("fatal producer error for %s: %s", self._ids(), err)

    def _fail(self, exc: BaseException, what: str) -> DualWriteError:
        """Mark the transaction failed and return the exception to raise."""
        self._phase = _Phase.FAILED
        unexplained = False
        if hides_its_cause(exc):
            if self._fatal is None and self._producer is not None:
                # librdkafka hit a fatal error (e.g. fenced) before the error callback was
                # served: serve it now.
                with contextlib.suppress(KafkaException, SystemError):
                    self._producer.poll(0)
            if self._fatal is not None:
                exc = KafkaException(self._fatal)
            elif self.fenced_at_coordinator():
                return ProducerFencedError(f"{what}: {self._ids()} was fenced by a newer "
                                           "producer of the same transactional id")
            else:  # a bare SystemError out of flush, with no fatal error behind it: not a fence
                unexplained = True
        if unexplained or ends_only_the_session(exc):
            # Before the decision (produce, flush): nothing was decided, and the abort starts a
            # new session, whose InitProducerId aborts this transaction and bumps the epoch.
            self._unconfirmed = True
            return RetriableError(f"{librdkafka_error(exc, what)}; this session cannot go on: "
                                  f"abort_transaction() starts a new one; retry ({self._ids()})")
        return librdkafka_error(exc, what)

    def fenced_at_coordinator(self) -> bool:
        """Whether the coordinator now has another producer id or epoch for this id (a newer
        producer fenced this one); False when that cannot be told."""
        ident = self._identity
        if ident is None:
            return False
        try:
            desc = self._cp.describe_transaction(self._tid)
        except DualWriteError:
            return False
        return desc is not None and (desc.producer_id, desc.epoch) != (ident.producer_id,
                                                                       ident.epoch)

    @property
    def open_for_s(self) -> float:
        """Seconds since :meth:`begin_transaction` (an upper bound of the coordinator's age)."""
        return time.monotonic() - self._begun_at if self.has_open_transaction else 0.0

    @property
    def ready(self) -> bool:
        """A session is running and no transaction is open: :meth:`begin_transaction` may run."""
        return self._phase is _Phase.READY

    @property
    def has_open_transaction(self) -> bool:
        """A transaction was begun and is neither committed nor aborted yet."""
        return self._phase in (_Phase.IN_TRANSACTION, _Phase.PREPARED, _Phase.FAILED)

    def _ids(self) -> str:
        ident = self._identity
        pid, epoch = (ident.producer_id, ident.epoch) if ident else (-1, -1)
        return f"transactional_id={self._tid} producer_id={pid} epoch={epoch}"

    def _require(self, *phases: _Phase, verb: str) -> None:
        if self._phase not in phases:
            allowed = " or ".join(p.value for p in phases)
            raise TransactionStateError(
                f"{verb}() is not allowed while the producer is {self._phase.value} "
                f"(allowed when {allowed}); {self._tid}")

    # -- init / complete -----------------------------------------------------------------------

    def init_transactions(self, keep_prepared_txn: bool = False) -> None:
        """Start the producer session.

        With ``keep_prepared_txn=True`` the in-doubt transaction of this transactional id is left
        alone: call :meth:`complete_transaction` with the state stored in your database next,
        which commits or aborts it and only then initialises librdkafka (whose own
        initialisation would abort it blindly).
        """
        self._require(_Phase.NEW, verb="init_transactions")
        if keep_prepared_txn:
            self._phase = _Phase.AWAITING_COMPLETION
            log.info("init keep_prepared_txn transactional_id=%s: awaiting complete_transaction",
                     self._tid)
            return
        self._start_librdkafka()

    def _start_librdkafka(self) -> None:
        producer: Producer | None
        try:
            producer = Producer(self._config)
        except (KafkaException, TypeError, ValueError) as exc:
            cause = exc.args[0].str() if isinstance(exc, KafkaException) else str(exc)
            raise ConfigurationError(f"the Kafka configuration of {self._tid!r} is not valid: "
                                     f"{cause}") from None
        assert producer is not None
        wait = within(self._timeout_s)
        try:
            producer.init_transactions(wait)
        except KafkaException as exc:
            error = librdkafka_error(
                exc, f"init_transactions (InitProducerId) transactional_id={self._tid} with Kafka "
                f"at {self._servers} (waited {wait:.3g} s)")
            # Destroy the handle now: kept alive by this frame (the traceback holds it), it
            # would go on sending InitProducerId in the background once the broker is back.
            producer = None
            raise error from exc
        self._producer = producer
        desc = self._cp.describe_transaction(self._tid)
        if desc is None:
            raise FatalError(f"the coordinator does not know {self._tid!r} right after "
                             "init_transactions; is another cluster configured?")
        self._identity = ProducerIdentity(desc.producer_id, desc.epoch)
        self._phase = _Phase.READY
        log.info("initialised %s", self._ids())

    def complete_transaction(self, state: PreparedTxnState | str, *,
                             owner_alive: OwnerAlive | None = None) -> Outcome:
        """Commit the in-doubt transaction if ``state`` names it, otherwise abort it.

        ``state`` is what the database holds (the decision). If the named transaction already
        committed this is a no-op; if Kafka aborted it, :class:`HeuristicAbortError` is raised.
        ``owner_alive``: True while the producer that prepared it may still be running (then it
        is left to commit its own transaction; see
        :meth:`dualwrite.participant.completion.Completion.complete`).
        """
        if isinstance(state, str):
            state = PreparedTxnState.parse(state)
        if self._phase is _Phase.READY and self.last_committed == state:
            return Outcome.ALREADY_COMMITTED  # this session committed it itself
        self._require(_Phase.AWAITING_COMPLETION, _Phase.READY, _Phase.PREPARED,
                      verb="complete_transaction")
        if self._phase is _Phase.PREPARED:
            # Same process: we know our own prepared transaction.
            if state == self._prepared:
                self.commit_transaction()
                return Outcome.COMMITTED
            self.abort_transaction()
            return Outcome.ABORTED
        try:
            outcome = self._completion.complete(self._tid, state, owner_alive=owner_alive)
        except (HeuristicAbortError, OutcomeUnreadableError):
            # Nothing is open any more: the session can start, the caller decides what to do.
            if self._phase is _Phase.AWAITING_COMPLETION:
                self._start_librdkafka()
            raise
        log.info("completed transactional_id=%s state=%r outcome=%s", self._tid, str(state),
                 outcome.value)
        if self._phase is _Phase.AWAITING_COMPLETION:
            self._start_librdkafka()
        return outcome

    # -- the transaction -----------------------------------------------------------------------

    def begin_transaction(self) -> None:
        self._require(_Phase.READY, verb="begin_transaction")
        assert self._producer is not None
        try:
            self._producer.begin_transaction()
        except KafkaException as exc:
            raise librdkafka_error(exc, "begin_transaction") from exc
        self._first_offsets = {}
        self._first_raw = {}
        self._delivery_errors = []
        self._failed_topics = set()
        self._produced = 0
        self._unconfirmed = False
        self._prepared = None
        self._begun_at = time.monotonic()
        self._phase = _Phase.IN_TRANSACTION
        log.debug("begin %s", self._ids())

    def produce(self, topic: str, value: bytes | str | None = None, key: bytes | str | None = None,
                *, partition: int | None = None, headers: Headers | None = None,
                timestamp: int = 0,
                on_delivery: Callable[[KafkaError | None, Message], None] | None = None) -> None:
        """Send one record in the current transaction (asynchronously, like confluent-kafka)."""
        if self._phase is not _Phase.IN_TRANSACTION:
            self._require(_Phase.IN_TRANSACTION, verb="produce")
        producer = self._producer
        assert producer is not None
        try:
            if topic not in self._known_topics:
                self._check_topic(topic)
            if partition is None and headers is None and not timestamp and on_delivery is None:
                # Once per record: the common case goes straight to librdkafka.
                try:
                    producer.produce(topic, value, key, on_delivery=self._delivered)
                except BufferError:
                    self._produce_when_room(topic, value, key, {})
            else:
                extra: dict[str, Any] = {}
                if partition is not None:
                    extra["partition"] = partition
                if headers is not None:
                    extra["headers"] = headers
                if timestamp:
                    extra["timestamp"] = timestamp
                if on_delivery is not None:
                    user_callback = on_delivery

                    def delivered(err: KafkaError | None, msg: Message) -> None:
                        self._record_delivery(err, msg)
                        user_callback(err, msg)

                    extra["on_delivery"] = delivered
                self._produce_when_room(topic, value, key, extra)
            self._produced += 1
            if not self._produced & 255:
                with interrupts_kept():
                    producer.poll(0)  # serve delivery reports now and then, not per record
        except (KafkaException, SystemError, TypeError, ValueError) as exc:
            raise self._refused(exc, topic, value, key) from exc

    def check_record(self, topic: str, value: object = None, key: object = None, *,
                     partition: object = None) -> None:
        """Raise what :meth:`produce` would for a record librdkafka refuses by itself (its topic,
        the types of its key, value and partition, its size), without sending it: for a group
        commit, which sends a request's records only once they all pass."""
        if not isinstance(topic, str) or topic not in self._known_topics:
            self._check_topic(topic)
        for what, data in (("key", key), ("value", value)):
            if data is not None and not isinstance(data, (bytes, str)):
                raise self._refused(TypeError(f"the {what} is a {type(data).__name__}"), topic,
                                    value, key)
        if partition is not None and (not isinstance(partition, int) or partition < 0):
            raise self._refused(TypeError(f"partition {partition!r}"), topic, value, key)
        limit = int(self._config.get("message.max.bytes", 1_000_000))
        size = _size(key) + _size(value)
        if size > limit:
            raise RecordTooLargeError(
                topic, f"produce to {topic!r}: the record's key and value are {size} bytes, more "
                f"than the client's message.max.bytes={limit}", size=size,
                limit=f"message.max.bytes={limit}")

    def _check_topic(self, topic: str) -> None:
        """Ask for ``topic``'s metadata on its first use by this producer (one round trip, then
        cached): librdkafka reports a missing topic only after ``message.timeout.ms``, a
        topic it may not describe as a purge."""
        assert self._producer is not None
        context = f"produce to {topic!r}: metadata"
        if not isinstance(topic, str) or not topic:
            raise InvalidRecordError(str(topic), f"produce: the topic must be a non-empty str, "
                                     f"not {topic!r}")
        try:
            metadata = self._producer.list_topics(topic, self._timeout_s)
        except KafkaException as exc:
            raise librdkafka_error(exc, context, otherwise=RetriableError) from exc
        found = metadata.topics.get(topic)
        error = found.error if found is not None else None
        if error is not None:
            refused = record_error(KafkaException(error), topic, context)
            if refused is not None:
                raise refused
            return  # e.g. LEADER_NOT_AVAILABLE on a new topic: let librdkafka wait for it
        self._known_topics.add(topic)

    def _refused(self, exc: BaseException, topic: str, value: object,
                 key: object) -> DualWriteError:
        """The error for a record librdkafka did not take. A record it refused by itself (its
        type, its size, its partition) leaves the transaction as it was; any other failure
        fails the transaction (:meth:`_fail`)."""
        if isinstance(exc, (TypeError, ValueError)):
            return InvalidRecordError(
                topic, f"produce to {topic!r}: {exc}; key and value must be bytes, str or None "
                "(serialize other values first, e.g. json.dumps(value).encode()), partition "
                "an int, headers a dict or list of (str, bytes | str) pairs")
        refused = record_error(exc, topic, f"produce to {topic!r}",
                               size=_size(key) + _size(value),
                               client_limit=int(self._config.get("message.max.bytes",
                                                                 1_000_000)))
        if refused is not None:  # refused by librdkafka itself: nothing was enqueued
            return refused
        return self._fail(exc, f"produce to {topic}")

    def _produce_when_room(self, topic: str, value: bytes | str | None,
                           key: bytes | str | None, extra: dict[str, Any]) -> None:
        """Produce, waiting for deliveries to drain while librdkafka's local queue is full."""
        assert self._producer is not None
        extra.setdefault("on_delivery", self._delivered)
        deadline = bounded(self._timeout_s)
        while True:
            try:
                self._producer.produce(topic, value, key, **extra)
                return
            except BufferError:
                if deadline.expired:
                    raise self._queue_full() from None
                self._producer.poll(0.1)

    def _queue_full(self) -> DeliveryTimeoutError:
        self._phase = _Phase.FAILED
        self._unconfirmed = True
        return DeliveryTimeoutError(
            f"librdkafka's queue stayed full for {self._timeout_s:g} s: Kafka at {self._servers} "
            f"is not taking records; abort_transaction() and retry ({self._ids()})")

    def produce_many(self, topic: str, records: Iterable[tuple[bytes | None, bytes | None]]
                     ) -> int:
        """Send many (key, value) records in the current transaction; returns how many.

        The bulk path of :meth:`produce` (one state check, no per-record closures), for tasks
        that write a whole partition of data.
        """
        self._require(_Phase.IN_TRANSACTION, verb="produce_many")
        assert self._producer is not None
        try:
            if topic not in self._known_topics:
                self._check_topic(topic)
        except TypeError as exc:
            raise self._refused(exc, topic, None, None) from exc
        produce, poll = self._producer.produce, self._producer.poll
        delivered = self._delivered
        count = 0
        key = value = None
        try:
            for key, value in records:
                deadline = None
                while True:
                    try:
                        produce(topic, value, key, on_delivery=delivered)
                        break
                    except BufferError:
                        deadline = deadline or bounded(self._timeout_s)
                        if deadline.expired:
                            raise self._queue_full() from None
                        poll(0.1)  # local queue full: let deliveries drain
                count += 1
                if count & 1023 == 0:
                    poll(0)
        except (KafkaException, SystemError, TypeError, ValueError) as exc:
            raise self._refused(exc, topic, value, key) from exc
        finally:
            self._produced += count
        return count

    def _record_delivery(self, err: KafkaError | None, msg: Message) -> None:
        """Delivery report: remember failures and each partition's first offset (the anchor).

        Reports arrive in the thread that polls or flushes, in offset order per partition (the
        producer is idempotent), so the first report of a partition carries its first offset.
        """
        if err is not None:
            topic = str(msg.topic())
            self._delivery_errors.append((topic, msg.partition() or 0, err,
                                          len(msg.key() or b"") + len(msg.value() or b"")))
            self._failed_topics.add(topic)
            return
        self._first_raw.setdefault((msg.topic(), msg.partition()), msg.offset())

    def flush_and_state(self, timeout_s: float | None = None, *,
                        stall_s: float | None = None) -> PreparedTxnState:
        """Flush, fail on any delivery error, and compute the state (no coordinator round trip).

        :meth:`prepare_transaction` is this plus :meth:`verify_prepared`; the DualWriter runs the
        two halves separately so the coordinator check overlaps the database write. Records not
        acknowledged within ``timeout_s`` (default: the producer's), or with none acknowledged
        for ``stall_s``, raise :class:`DeliveryTimeoutError`.
        """
        self._require(_Phase.IN_TRANSACTION, verb="prepare_transaction")
        assert self._producer is not None
        self._unconfirmed = True  # until every record is acknowledged
        wait_s = within(self._timeout_s if timeout_s is None else timeout_s)
        try:
            remaining = self._flush(wait_s, stall_s)
        except (KafkaException, SystemError) as exc:
            raise self._fail(exc, "flush") from exc
        if self._fatal is not None:
            raise self._fail(KafkaException(self._fatal), "flush")
        if remaining:
            self._phase = _Phase.FAILED
            stalled = f", or none acknowledged for {stall_s:g} s" if stall_s else ""
            raise DeliveryTimeoutError(f"{remaining} records not delivered to Kafka at "
                                       f"{self._servers} within {wait_s:.3g} s{stalled}; "
                                       f"abort_transaction() and retry ({self._ids()})")
        if self._delivery_errors:
            self._phase = _Phase.FAILED
            for topic, partition, err, _ in self._delivery_errors:
                failed = librdkafka_error(KafkaException(err), f"delivery to {topic}[{partition}]")
                if isinstance(failed, ProducerFencedError):
                    raise failed
            for topic, partition, err, size in self._delivery_errors:
                # A record the broker rejects for good (too large, invalid, unknown topic):
                # sending the transaction again would fail again.
                refused = record_error(KafkaException(err), topic,
                                       f"delivery to {topic}[{partition}]", size=size)
                if refused is not None:
                    self._known_topics.discard(topic)
                    raise refused
            # librdkafka purges the records of a transaction whose AddPartitionsToTxn failed
            # (e.g. TOPIC_AUTHORIZATION_FAILED) and reports only "Purged in queue".
            try:
                missing = self._cp.missing_topic_acls(self._failed_topics)
            except DualWriteError:
                missing = []
            if missing:
                raise topic_write_denied(missing, f"{len(self._delivery_errors)} records failed "
                                         f"delivery ({self._ids()})")
            topic, partition, err, _ = self._delivery_errors[0]
            raise RetriableError(f"{len(self._delivery_errors)} records failed delivery (first: "
                                 f"{topic}[{partition}]: {err.str()}); abort_transaction() and "
                                 "retry")
        self._first_offsets = {TopicPartition(str(t), int(p)): int(o)
                               for (t, p), o in self._first_raw.items()}
        if not self._first_offsets:
            state = PreparedTxnState.empty()
        else:
            assert self._identity is not None
            anchor_tp = min(self._first_offsets)
            state = PreparedTxnState.of(self._identity.producer_id, self._identity.epoch,
                                        anchor_tp, self._first_offsets[anchor_tp])
        self._prepared = state
        self._phase = _Phase.PREPARED
        self._unconfirmed = False
        return state

    def _flush(self, wait_s: float, stall_s: float | None) -> int:
        """librdkafka's flush, given up after ``wait_s``, or after ``stall_s`` without progress;
        returns the records still unacknowledged."""
        assert self._producer is not None
        started = progressed = time.monotonic()
        least = len(self._producer)
        while True:
            now = time.monotonic()
            left = started + wait_s - now
            with interrupts_kept():  # a Ctrl-C in a delivery report is not lost
                remaining = self._producer.flush(max(0.0, min(0.5, left)) if stall_s else left)
            now = time.monotonic()
            if remaining == 0 or now >= started + wait_s:
                return remaining
            if remaining < least:
                least, progressed = remaining, now
            elif stall_s is not None and now - progressed >= stall_s:
                return remaining

    def verify_prepared(self) -> None:
        """Check with the coordinator that our transaction is open and holds every partition."""
        self._require(_Phase.PREPARED, verb="verify_prepared")
        if self._prepared is None or self._prepared.is_empty:
            return
        desc = self._cp.describe_transaction(self._tid)
        ident = self._identity
        assert ident is not None
        problem = None
        error_class: type[DualWriteError] = RecoverableError
        if desc is None:
            problem = "the coordinator does not know the transactional id"
        elif (desc.producer_id, desc.epoch) != (ident.producer_id, ident.epoch):
            problem = (f"the coordinator has producer_id={desc.producer_id} "
                       f"epoch={desc.epoch}: this producer was fenced")
            error_class = ProducerFencedError
        elif desc.state is not TxnState.ONGOING:
            problem = f"the transaction is {desc.state.value}, not Ongoing (broker timeout?)"
        else:
            missing = set(self._first_offsets) - desc.partitions
            if missing:
                problem = f"the coordinator does not list partitions {sorted(map(str, missing))}"
        if problem is not None:
            self._phase = _Phase.FAILED
            raise error_class(f"prepare failed for {self._ids()}: {problem}")
        log.debug("prepared %s state=%s", self._ids(), self._prepared)

    def prepare_transaction(self) -> PreparedTxnState:
        """Flush and verify; returns the state to store in the database with your rows.

        After this only commit, abort or complete are allowed. An empty transaction prepares to
        the empty state and commits nothing.
        """
        state = self.flush_and_state()
        self.verify_prepared()
        log.info("prepared %s state=%s records=%d", self._ids(), state, self._produced)
        return state

    def commit_transaction(self) -> None:
        """Commit the prepared (or open) transaction; an unknown outcome is resolved, not guessed.

        If librdkafka's commit fails in a way that leaves the outcome open, the coordinator is
        asked and the transaction committed by (producer id, epoch) if it is still open;
        :class:`HeuristicAbortError` if Kafka aborted it. When the coordinator has moved to
        another epoch meanwhile (a newer producer, or the broker's timeout), this producer ends
        nothing and starts no new session — :class:`ProducerFencedError` if its transaction
        committed all the same — and a new producer must take over.
        """
        self._require(_Phase.PREPARED, _Phase.IN_TRANSACTION, verb="commit_transaction")
        if self._phase is _Phase.IN_TRANSACTION:
            self.flush_and_state()
        assert self._producer is not None
        state = self._prepared or PreparedTxnState.empty()
        troubles = self._troubles_so_far()
        try:
            self._commit_with_retries()
        except KafkaException as exc:
            self._phase = _Phase.FAILED
            log.warning("commit failed for %s (%s); asking the coordinator", self._ids(),
                        exc.args[0])
            if state.is_empty:
                raise librdkafka_error(exc, f"commit_transaction with Kafka at {self._servers}"
                                       ) from exc
            self._resolve_failed_commit(state, exc)
        else:
            self._phase = _Phase.READY
            self._fence_late_endtxn(troubles)
        self.last_committed = state
        log.info("committed %s state=%s", self._ids(), state)

    def _resolve_failed_commit(self, state: PreparedTxnState, failure: KafkaException) -> None:
        """Settle our own transaction after librdkafka's commit failed; never guess.

        Only this session's (producer id, epoch) is acted on: if the coordinator has another
        one, a newer producer fenced this one and may be finishing this very transaction (and
        running its own): this producer ends nothing and starts no session, it reports what
        happened to its transaction and stops (:class:`ProducerFencedError`).
        """
        try:
            self._completion.complete(self._tid, state, only_identity=self._identity)
        except (HeuristicAbortError, OutcomeUnreadableError):
            # Nothing is open any more; a new session lets the caller go on once it has dealt
            # with the loss (complete_transaction(state) reports it again until then) — unless
            # the id has a newer epoch, which may be a newer producer's: then the caller starts
            # a new session through its own fencing path (DualWriter claims the id first).
            if not self.fenced_at_coordinator():
                self._restart_session_after_heuristic()
            raise
        except RetriableError as unresolved:
            raise OutcomeUnknownError(
                f"commit of {self._ids()} state={state} has an unknown outcome and the "
                f"coordinator could not be asked ({unresolved}); run `dualwrite recover`"
            ) from failure
        if self.fenced_at_coordinator():
            raise ProducerFencedError(
                f"{self._ids()} was fenced by a newer producer of the same transactional id "
                f"while committing; its transaction state={state} is committed (the database "
                "decided it and Kafka shows it committed). Stop this producer") from failure
        # librdkafka's session is unusable after a failed commit; a new one is needed.
        self._restart_session()

    def _commit_with_retries(self) -> None:
        assert self._producer is not None
        deadline = bounded(self._timeout_s)
        while True:
            try:
                with interrupts_kept():  # it serves delivery reports too
                    self._producer.commit_transaction(deadline.wait_s())
                return
            except KafkaException as exc:
                err: KafkaError = exc.args[0]
                # librdkafka: a retriable commit error means "call commit again".
                if (err.retriable() and not err.txn_requires_abort() and not err.fatal()
                        and not deadline.expired):
                    log.warning("commit of %s retrying after %s", self._ids(), err)
                    time.sleep(0.05)
                    continue
                raise

    def _troubles_so_far(self) -> int:
        """The coordinator-link troubles before this EndTxn: librdkafka's log lines wait in its
        queue until a poll, so the ones already queued (an InitProducerId that timed out while a
        fresh coordinator loaded, say) are served first and not blamed on the EndTxn."""
        assert self._producer is not None
        with contextlib.suppress(KafkaException, SystemError):
            self._producer.poll(0)
        return self._link.troubles

    def _fence_late_endtxn(self, troubles: int) -> None:
        """Start a new session (a new epoch) if librdkafka may have sent this commit's or abort's
        EndTxn twice: a late first copy, fenced by the epoch, then cannot end the next one."""
        assert self._producer is not None
        with contextlib.suppress(KafkaException, SystemError):
            self._producer.poll(0)  # serves the queued log lines
        if self._link.troubles == troubles:
            return
        log.warning("the coordinator connection of %s failed while ending its transaction: "
                    "librdkafka may have sent EndTxn twice; starting a new session so that a "
                    "late copy cannot end the next transaction (KAFKA-17754)", self._ids())
        try:
            self._restart_session()
        except DualWriteError as exc:
            # The transaction ended all the same; the next one must not reuse this epoch.
            self._phase = _Phase.FAILED
            log.warning("no new session for %s yet (%s); the next transaction starts one",
                        self._ids(), exc)

    def _drop_handle(self) -> None:
        """Forget the librdkafka handle without close(), which would abort an open transaction."""
        if self._producer is not None:
            with contextlib.suppress(KafkaException, SystemError):
                self._producer.flush(0)  # re-raises a fatal error; the handle is gone anyway
        self._producer = None

    def _restart_session_after_heuristic(self) -> None:
        try:
            self._restart_session()
        except DualWriteError as exc:
            log.warning("no new session for %s after the heuristic abort: %s", self._ids(), exc)

    def _restart_session(self) -> None:
        self._drop_handle()
        self._fatal = None
        self._start_librdkafka()

    def abort_transaction(self) -> None:
        """Abort the open or prepared transaction; allowed before the database decided commit."""
        self._require(_Phase.IN_TRANSACTION, _Phase.PREPARED, _Phase.FAILED,
                      verb="abort_transaction")
        if (self._unconfirmed or self._producer is None
                or (len(self._producer) and not self._acknowledged_before_abort())):
            self._abort_by_new_session()
            return
        troubles = self._troubles_so_far()
        try:
            with interrupts_kept():
                self._producer.abort_transaction(within(self._timeout_s))
        except KafkaException as exc:
            self._phase = _Phase.FAILED
            raise librdkafka_error(exc, f"abort_transaction with Kafka at {self._servers}"
                                   ) from exc
        self._phase = _Phase.READY
        self._prepared = None
        log.info("aborted %s", self._ids())
        self._fence_late_endtxn(troubles)

    def _acknowledged_before_abort(self) -> bool:
        """Wait (within the bound) for the records still in flight; True once each is
        acknowledged.

        librdkafka's abort purges queued records, but an AddPartitionsToTxn it is retrying
        (CONCURRENT_TRANSACTIONS while the last commit's markers are written, say) can reach
        the coordinator after the abort's EndTxn, or after an abort that sent none because no
        partition was registered yet: the transaction is open again at this epoch, Ongoing until
        the next transaction or the broker's timeout, and read_committed consumers of its
        partitions stall meanwhile (docs/design.md, "An abort while a partition is still being
        added"). A record acknowledged means its partition is registered, so once all are, the
        EndTxn ends them all; otherwise the abort starts a new session, whose epoch fences the
        late request.
        """
        assert self._producer is not None
        failed = len(self._delivery_errors)
        try:
            remaining = self._flush(within(self._timeout_s), None)
        except (KafkaException, SystemError):  # a fatal error: the new session settles it
            return False
        return remaining == 0 and len(self._delivery_errors) == failed

    def _abort_by_new_session(self) -> None:
        """Abort a transaction whose records were not all acknowledged by starting a new session.

        Some of them may be in the log, some still queued or retried by librdkafka with their
        sequence numbers; under fault runs (broker kills) reusing the session after such an
        abort lost a record of a later transaction and ended sessions with
        OUT_OF_ORDER_SEQUENCE_NUMBER. The new session's InitProducerId aborts the open
        transaction and bumps the epoch, so nothing of the old session can land in the next one.
        """
        self._phase = _Phase.FAILED
        if self.fenced_at_coordinator():  # a newer producer owns the id: start nothing
            raise ProducerFencedError(f"abort_transaction: {self._ids()} was fenced by a newer "
                                      "producer of the same transactional id")
        log.warning("aborting %s, whose records were not all acknowledged, by starting a new "
                    "session", self._ids())
        self._restart_session()  # raises a typed error if no session can be started now
        self._prepared = None
        log.info("aborted %s", self._ids())

    def close(self) -> None:
        """Release the producer, leaving an open or prepared transaction open at the coordinator
        for recovery or the next session to finish.

        The librdkafka handle is dropped, not ``close()``d: confluent-kafka's ``Producer.close()``
        aborts an open transaction, destroying the handle sends no EndTxn (docs/broker-facts.md).
        """
        self._drop_handle()
        self._phase = _Phase.CLOSED
        if self._owns_cp:
            self._cp.close()

    def __enter__(self) -> TwoPhaseProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: librdkafka's own default ``socket.timeout.ms``.
_SOCKET_TIMEOUT_MS = 60_000
#: The largest ``socket.timeout.ms`` librdkafka handles: it computes a request's deadline as
#: ``now + socket_timeout_ms * 1000`` in 32-bit ``int`` (2.16.0, rdkafka_buf.c), which wraps past
#: 2,147,483 ms.
_SOCKET_TIMEOUT_MAX_MS = 2_147_483


def _check_socket_timeout(config: Mapping[str, Any]) -> None:
    """Refuse a ``socket.timeout.ms`` librdkafka cannot handle (:data:`_SOCKET_TIMEOUT_MAX_MS`)."""
    value = config.get("socket.timeout.ms")
    if isinstance(value, int | str) and str(value).strip().isdigit() \
            and int(value) > _SOCKET_TIMEOUT_MAX_MS:
        raise ConfigurationError(
            f"socket.timeout.ms={value} is above {_SOCKET_TIMEOUT_MAX_MS}: librdkafka's request "
            "deadlines overflow there and its requests time out at once")


def _bound_socket_timeout(config: dict[str, Any], timeout_s: float) -> None:
    """Keep librdkafka's request timeout where it works.

    Unless set, librdkafka derives ``socket.timeout.ms`` from ``transaction.timeout.ms`` (minus
    100 ms). dualwrite sets the latter to the broker's ``transaction.max.timeout.ms`` (often an
    hour), and past 35.8 minutes the deadline wraps into the past: librdkafka's once-a-second
    timeout scan then fails whatever request is in flight or queued at that moment (``REQTMOUT
    ... Timed out ProduceRequest in flight (after 9ms)``, an AddPartitionsToTxn timed out in the
    out-queue), disconnects and retries: a delay for nothing, on any request
    (docs/benchmark-history.md, "the 0.5 s tail found"). So the socket timeout stays at
    librdkafka's default unless the transaction timeout is shorter (librdkafka wants it 100 ms
    below that), and no longer than the producer's ``timeout_s`` (at least 5 s): a request
    still in flight when its call gave up (an InitProducerId sent to a broker that is down)
    should not reach the broker long after, once it is back, where a delayed request can act
    on a later transaction (KAFKA-17754).
    """
    if "socket.timeout.ms" in config:
        return
    txn_timeout = config.get("transaction.timeout.ms")
    try:
        txn_ms = None if txn_timeout is None else int(txn_timeout)
    except (TypeError, ValueError):
        return  # librdkafka refuses the value itself
    bound = min(_SOCKET_TIMEOUT_MS, max(5_000, int(timeout_s * 1000)))
    if txn_ms is not None and txn_ms - 100 > bound:
        config["socket.timeout.ms"] = bound


def _size(data: object) -> int:
    """Bytes of a key or value as librdkafka sends it."""
    if isinstance(data, str):
        return len(data.encode())
    return len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0
