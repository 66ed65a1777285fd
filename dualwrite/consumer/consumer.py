"""ExactlyOnceConsumer: consume → database rows + Kafka records, each input decided once.

Per batch of input messages (bounded by count and time) one DualWriter transaction: the handler
writes rows and produces records, then the consumer writes the batch's input positions beside
them, after checking under the rows' lock that this consumer still owns each input partition
(:mod:`dualwrite.consumer.positions`). The database COMMIT decides rows, output records and input
positions together; Kafka commits after, and recovery finishes a crash between the two as for any
writer. On assignment the consumer seeks to the decided positions; the group's Kafka offsets are
committed after each decision only for lag tools. See "Exactly-once consumer" in docs/design.md.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaException
from confluent_kafka import Message as KafkaMessage
from confluent_kafka import TopicPartition as KafkaPartition
from sqlalchemy import Engine

from dualwrite import metrics
from dualwrite.consumer.positions import NO_POSITION, Partition, PositionStore
from dualwrite.database import MAX_SINK_ID, create_engine, database_error
from dualwrite.errors import (
    ConfigurationError,
    DualWriteError,
    FatalError,
    PartitionFencedError,
    RetriableError,
)
from dualwrite.participant.client_config import (
    check_kafka_config,
    check_timeout,
    librdkafka_config,
)
from dualwrite.participant.kafka_errors import librdkafka_error
from dualwrite.writer import DualWriter, DualWriteTransaction, Leases, PhaseHooks

__all__ = ["ConsumedMessage", "ExactlyOnceConsumer", "Handler"]

log = logging.getLogger(__name__)

# librdkafka settings that only the producer takes (the consumer would warn about them).
_PRODUCER_ONLY = ("transactional.id", "transaction.timeout.ms", "linger.ms",
                  "queue.buffering.max.ms", "acks", "enable.idempotence", "compression.type",
                  "batch.size", "message.timeout.ms", "delivery.timeout.ms")
# Settings the consumer sets itself: the decision owns the input positions.
_FIXED = {"enable.auto.commit": False, "enable.auto.offset.store": False,
          "isolation.level": "read_committed"}
# The session unless the application sets one: a dead worker's partitions move to a live one
# after 10 s, not librdkafka's 45 s; heartbeats at most a third of the session apart.
_SESSION_MS = 10_000
_HEARTBEAT_MS = 2_000


@dataclass(frozen=True)
class ConsumedMessage:
    """One input record handed to the handler."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    timestamp_ms: int | None


Handler = Callable[[Sequence[ConsumedMessage], DualWriteTransaction], None]
"""``handler(messages, tx)``: write rows with ``tx.connection``, produce with ``tx.produce``."""


def _message(msg: KafkaMessage) -> ConsumedMessage:
    """The handler's copy of ``msg`` (once per input record: the common case, bytes and no
    headers, takes no conversion)."""
    kind, ts = msg.timestamp()
    key, value, raw = msg.key(), msg.value(), msg.headers()
    if key is not None and type(key) is not bytes:
        key = str(key).encode()
    if value is not None and type(value) is not bytes:
        value = str(value).encode()
    headers = () if not raw else tuple(
        (str(h[0]), h[1] if h[1] is None or isinstance(h[1], bytes) else str(h[1]).encode())
        for h in raw)
    return ConsumedMessage(msg.topic(), msg.partition(), msg.offset(),  # type: ignore[arg-type]
                           key, value, headers, ts if kind else None)


class ExactlyOnceConsumer:
    """Consumes ``topics`` as a member of ``group_id`` and runs ``handler(messages, tx)`` per
    batch, each batch one atomic decision of rows, output records and input positions.

    ``engine``: SQLAlchemy engine or URL (dualwrite's migrations applied, 0004 or later).
    ``kafka_config``: librdkafka settings for both the consumer and the producer
    (``consumer_config`` adds consumer-only ones). Unless either sets them,
    ``session.timeout.ms`` is 10000 and ``heartbeat.interval.ms`` 2000 (at most a third of the
    session): librdkafka's 45 s would leave a killed worker's partitions unread for 45 s (the
    broker's ``group.min.session.timeout.ms``, 6 s by default, is the lower bound). The group
    must use an eager assignor (``range``/``roundrobin``, librdkafka's default), the classic
    protocol.

    Transactional ids: ``{transactional_id_prefix}-{n}``, ``n`` the lowest instance number whose
    lease no live process holds (``instance`` fixes it), so the workers of a group never share
    an id, a restarted worker takes a crashed one's id back (and finishes its in-doubt
    transaction), and ``dualwrite recover`` sees them as any writer's. The prefix defaults to
    ``dualwrite-consumer-{group_id}``.

    ``max_batch`` messages or ``max_batch_s`` seconds after a batch's first message, whichever
    comes first, close a batch. ``hooks`` are the writer's :class:`PhaseHooks`.
    """

    def __init__(self, engine: Engine | str, kafka_config: Mapping[str, Any], *,
                 group_id: str, topics: Sequence[str],
                 transactional_id_prefix: str | None = None, instance: int | None = None,
                 max_instances: int = 64, max_batch: int = 500, max_batch_s: float = 0.2,
                 timeout_s: float = 30.0, consumer_config: Mapping[str, Any] | None = None,
                 hooks: PhaseHooks | None = None) -> None:
        config = check_kafka_config(kafka_config)
        if not isinstance(group_id, str) or not group_id or len(group_id) > MAX_SINK_ID:
            raise ConfigurationError("ExactlyOnceConsumer needs a group_id (a non-empty str of "
                                     f"at most {MAX_SINK_ID} characters)")
        if isinstance(topics, str) or not topics or not all(isinstance(t, str) and t
                                                            for t in topics):
            raise ConfigurationError("topics must be a non-empty list of topic names")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigurationError(f"max_batch must be a positive int, not {max_batch!r}")
        self._max_batch_s = check_timeout(max_batch_s, "max_batch_s")
        self._timeout_s = check_timeout(timeout_s)
        self._engine = engine if isinstance(engine, Engine) else create_engine(engine)
        self._group = group_id
        self._topics = list(topics)
        self._max_batch = max_batch
        self._prefix = transactional_id_prefix or f"dualwrite-consumer-{group_id}"
        self._instance = instance
        self._max_instances = max_instances
        self._hooks = hooks
        self._producer_config = {k: v for k, v in config.items() if k != "group.id"}
        consumer = {k: v for k, v in config.items() if k not in _PRODUCER_ONLY}
        consumer.update(consumer_config or {})
        consumer.setdefault("auto.offset.reset", "earliest")
        consumer.setdefault("session.timeout.ms", _SESSION_MS)
        if "heartbeat.interval.ms" not in consumer:
            try:
                session_ms = int(consumer["session.timeout.ms"])
            except (TypeError, ValueError):
                raise ConfigurationError("session.timeout.ms must be a number of milliseconds, "
                                         f"not {consumer['session.timeout.ms']!r}") from None
            consumer["heartbeat.interval.ms"] = max(1, min(_HEARTBEAT_MS, session_ms // 3))
        strategy = str(consumer.get("partition.assignment.strategy", "range"))
        if "cooperative" in strategy or str(consumer.get("group.protocol", "classic")) != \
                "classic":
            raise ConfigurationError(
                "ExactlyOnceConsumer needs an eager assignor (range or roundrobin) and the "
                "classic group protocol: its revoke must end the whole assignment")
        consumer.update(_FIXED, **{"group.id": group_id})
        self._consumer_config = consumer
        self._from_start = str(consumer["auto.offset.reset"]) in ("earliest", "smallest",
                                                                   "beginning")
        self._store = PositionStore(self._engine, group_id)
        self._owner = f"{self._prefix}/{uuid.uuid4().hex[:12]}"
        self._writer: DualWriter | None = None
        self._consumer: Consumer | None = None
        self._generations: dict[Partition, int] = {}
        """The partitions this consumer owns, with the generation it took them at."""
        self._next: dict[Partition, int] = {}
        """Per owned partition, the offset the next message must have at least."""
        self._pending: list[ConsumedMessage] = []
        self._callback_error: DualWriteError | None = None
        self._resync: set[Partition] = set()
        self._stop = threading.Event()
        self.decided = 0
        """Messages decided by this consumer so far."""
        self.fenced_batches = 0
        """Batches refused because a rebalance moved one of their partitions away (also
        ``dualwrite_consumer_fenced_batches_total{group}``)."""

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def transactional_id(self) -> str | None:
        """This instance's transactional id, once started."""
        return None if self._writer is None else self._writer.transactional_id

    def start(self) -> None:
        """Take a transactional id, finish what its last session left in doubt, and join the
        group (``run`` starts on first use)."""
        if self._writer is None:
            self._writer = self._start_writer()
        if self._consumer is not None:
            return
        try:
            self._consumer = Consumer(librdkafka_config(self._consumer_config))
            self._consumer.subscribe(self._topics, on_assign=self._on_assign,
                                     on_revoke=self._on_revoke, on_lost=self._on_revoke)
        except KafkaException as exc:
            raise librdkafka_error(exc, f"consumer group {self._group}: subscribe",
                                   otherwise=FatalError) from exc

    def _start_writer(self) -> DualWriter:
        numbers = [self._instance] if self._instance is not None else \
            list(range(self._max_instances))
        leases = Leases(self._engine)
        for n in numbers:
            tid = f"{self._prefix}-{n}"
            if self._instance is None and leases.supported and not self._lease_free(leases, tid):
                continue
            writer = DualWriter(self._engine, self._producer_config, transactional_id=tid,
                                timeout_s=self._timeout_s, hooks=self._hooks,
                                metrics_role="consumer")
            try:
                # An empty transaction: takes the lease and the row lock, finishes the last
                # session's in-doubt transaction (its records block read_committed readers).
                with writer.transaction() as tx:
                    tx.connection.execute(sa.text("SELECT 1"))
            except FatalError:
                writer.close()
                if self._instance is None and not self._lease_free(leases, tid):
                    continue  # another worker took this number between the probe and the start
                raise
            except BaseException:
                writer.close()
                raise
            log.info("consumer group %s: transactional_id=%s started", self._group, tid)
            return writer
        raise FatalError(f"consumer group {self._group}: every transactional id "
                         f"{self._prefix}-0..{self._max_instances - 1} is in use by a live "
                         "process: raise max_instances")

    def _lease_free(self, leases: Leases, tid: str) -> bool:
        try:
            with self._engine.connect() as conn:
                lease = leases.try_acquire(conn, tid)
                conn.rollback()
                if lease is not None:
                    lease.release()
                return lease is not None
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, self._engine.url) from exc

    def stop(self) -> None:
        """Ask ``run`` to return after the batch it is deciding (any thread)."""
        self._stop.set()

    def close(self) -> None:
        """Leave the group and stop the writer (its state cleared after a clean run)."""
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            try:
                consumer.close()
            except (KafkaException, RuntimeError) as exc:
                log.info("consumer group %s: close: %s", self._group, exc)
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def __enter__(self) -> ExactlyOnceConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- rebalance ---------------------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[KafkaPartition]) -> None:
        wanted = [(str(p.topic), int(p.partition)) for p in partitions]
        try:
            taken = self._store.take(wanted, self._owner)
        except DualWriteError as exc:
            # Assign nothing readable: without the decided positions no record may be read.
            self._callback_error = exc
            consumer.assign([])
            return
        assign = []
        for (topic, number), (offset, generation) in taken.items():
            self._generations[(topic, number)] = generation
            start = offset if offset != NO_POSITION else \
                (OFFSET_BEGINNING if self._from_start else OFFSET_END)
            self._next[(topic, number)] = max(offset, 0)
            assign.append(KafkaPartition(topic, number, start))
        log.info("consumer group %s: %s assigned %s", self._group, self.transactional_id,
                 {f"{t}[{n}]": (o, g) for (t, n), (o, g) in taken.items()})
        consumer.assign(assign)

    def _on_revoke(self, consumer: Consumer, partitions: list[KafkaPartition]) -> None:
        revoked = {(str(p.topic), int(p.partition)) for p in partitions}
        # A batch being collected is abandoned for the revoked partitions (nothing of it was
        # written yet): the new owner reads them from the decided position.
        self._pending = [m for m in self._pending if (m.topic, m.partition) not in revoked]
        for partition in revoked:
            metrics.forget_consumer_lag(self._group, *partition)
            self._generations.pop(partition, None)
            self._next.pop(partition, None)
            self._resync.discard(partition)
        log.info("consumer group %s: %s revoked %s", self._group, self.transactional_id,
                 sorted(f"{t}[{n}]" for t, n in revoked))
        try:
            consumer.unassign()
        except KafkaException as exc:
            log.info("consumer group %s: unassign: %s", self._group, exc)

    # -- the loop ----------------------------------------------------------------------------

    def run(self, handler: Handler, *, stop_after: int | None = None,
            idle_s: float | None = None) -> int:
        """Consume and decide batches until :meth:`stop`, until ``stop_after`` messages were
        decided by this call, or until no message came for ``idle_s`` seconds while it owned
        partitions; returns the number decided.

        An exception of the handler or of the decision propagates after both sides rolled back;
        the consumer finds its place again from the database on the next call. A batch refused
        because a rebalance moved its partition (:class:`PartitionFencedError`) is logged and
        dropped: the new owner decides it.
        """
        self.start()
        done = 0
        idle_since = time.monotonic()
        while not self._stop.is_set():
            batch = self._collect()
            if not batch:
                if not self._generations:  # no partition (yet, or mid-rebalance): not idle
                    idle_since = time.monotonic()
                elif idle_s is not None and time.monotonic() - idle_since >= idle_s:
                    break
                continue
            idle_since = time.monotonic()
            done += self._decide(batch, handler)
            for (topic, number), behind in self.lag().items():
                metrics.observe_consumer_lag(self._group, topic, number, behind)
            if stop_after is not None and done >= stop_after:
                break
        return done

    def _collect(self) -> list[ConsumedMessage]:
        consumer = self._consumer
        assert consumer is not None
        self._find_place()
        self._pending = []
        deadline: float | None = None
        while len(self._pending) < self._max_batch:
            wait = 0.5 if deadline is None else deadline - time.monotonic()
            if wait <= 0:
                break
            try:
                msgs = consumer.consume(self._max_batch - len(self._pending), wait)
            except KafkaException as exc:
                raise librdkafka_error(exc, f"consumer group {self._group}: consume",
                                       otherwise=RetriableError) from exc
            self._raise_callback_error()
            owned, next_offsets, pending = self._generations, self._next, self._pending
            for msg in msgs:
                error = msg.error()
                if error is not None:
                    if error.fatal():
                        raise librdkafka_error(KafkaException(error),
                                               f"consumer group {self._group}: consume")
                    log.info("consumer group %s: %s", self._group, error)
                    continue
                partition, offset = (msg.topic(), msg.partition()), msg.offset() or 0
                if partition not in owned or offset < next_offsets[partition]:
                    continue  # revoked meanwhile, or fetched before a seek back
                next_offsets[partition] = offset + 1
                pending.append(_message(msg))
            if self._pending and deadline is None:
                deadline = time.monotonic() + self._max_batch_s
            if not self._pending:
                break
        return self._pending

    def _raise_callback_error(self) -> None:
        """An assignment whose positions could not be read left this member with nothing to
        read: leave the group (the next ``run`` joins again) and raise what failed."""
        error, self._callback_error = self._callback_error, None
        if error is not None:
            consumer, self._consumer = self._consumer, None
            self._generations.clear()
            self._next.clear()
            self._resync.clear()
            if consumer is not None:
                try:
                    consumer.close()
                except (KafkaException, RuntimeError) as exc:
                    log.info("consumer group %s: close: %s", self._group, exc)
            raise error

    def _decide(self, batch: list[ConsumedMessage], handler: Handler) -> int:
        writer = self._writer
        assert writer is not None
        positions: dict[Partition, int] = {}
        for message in batch:
            positions[(message.topic, message.partition)] = message.offset + 1
        generations = dict(self._generations)
        try:
            with writer.transaction() as tx:
                handler(tuple(batch), tx)
                self._store.decide(tx.connection, positions, generations)
        except PartitionFencedError as exc:
            self.fenced_batches += 1
            metrics.consumer_fenced_batch(self._group)
            log.warning("consumer group %s: transactional_id=%s: %s", self._group,
                        writer.transactional_id, exc)
            self._resync.update(positions)
            return 0
        except BaseException:
            # Whether the decision committed is the database's to say (an unknown COMMIT
            # outcome included): read it back before the next batch.
            self._resync.update(positions)
            raise
        self.decided += len(batch)
        self._commit_advisory(positions)
        return len(batch)

    def _find_place(self) -> None:
        """After a batch that did not decide: seek each of its partitions still owned to the
        position the database holds, and drop those whose generation moved on."""
        wanted = sorted(p for p in self._resync if p in self._generations)
        if not wanted:
            self._resync.clear()
            return
        stored = self._store.read(wanted)
        consumer = self._consumer
        assert consumer is not None
        for partition in wanted:
            offset, generation = stored.get(partition, (NO_POSITION, -1))
            if generation != self._generations[partition]:
                log.warning("consumer group %s: %s[%d] is owned by another consumer now",
                            self._group, *partition)
                self._generations.pop(partition, None)
                self._next.pop(partition, None)
                continue
            start = offset if offset != NO_POSITION else \
                (OFFSET_BEGINNING if self._from_start else OFFSET_END)
            try:
                consumer.seek(KafkaPartition(partition[0], partition[1], start))
            except KafkaException as exc:
                raise librdkafka_error(exc, f"consumer group {self._group}: seek",
                                       otherwise=RetriableError) from exc
            self._next[partition] = max(offset, 0)
        self._resync.clear()

    def _commit_advisory(self, positions: Mapping[Partition, int]) -> None:
        """The group's Kafka offsets, for lag tools only (the database holds the truth)."""
        consumer = self._consumer
        assert consumer is not None
        try:
            consumer.commit(offsets=[KafkaPartition(t, n, o) for (t, n), o in positions.items()],
                            asynchronous=True)
        except KafkaException as exc:
            log.debug("consumer group %s: advisory offset commit: %s", self._group, exc)

    # -- observation -------------------------------------------------------------------------

    def positions(self) -> dict[Partition, int]:
        """The next offset this consumer reads per owned partition."""
        return dict(self._next)

    def lag(self) -> dict[Partition, int]:
        """Per owned (topic, partition): records between the decided position and the end of
        the log as last fetched (read_committed: the last stable offset)."""
        consumer = self._consumer
        if consumer is None:
            return {}
        out = {}
        for (topic, number), position in list(self._next.items()):
            try:
                _low, high = consumer.get_watermark_offsets(KafkaPartition(topic, number),
                                                            cached=True)
            except KafkaException:
                continue
            if high is not None and high >= 0:
                out[(topic, number)] = max(int(high) - position, 0)
        return out
