"""Reading a whole topic as a read_committed consumer sees it, to its end.

The one reader of whole topics: ``dualwrite verify`` (:func:`dualwrite.verify`), the demos and
the development helpers (``dualwrite.dev.read_committed``). Where "the end" is matters: a
read_committed consumer stops at each partition's last stable offset (LSO), the first offset of
the oldest transaction still open there. :func:`read_committed` takes the partitions' high
watermarks when it starts and, with ``wait_for_open``, reads until every partition's LSO has
passed them: every transaction open at the start has ended and its records (if committed) were
read. A partition whose open transaction does not end within the timeout is reported open.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import (
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

from dualwrite.errors import ConfigurationError, DualWriteError, RetriableError
from dualwrite.participant.client_config import (
    check_kafka_config,
    check_timeout,
    librdkafka_config,
)
from dualwrite.participant.kafka_errors import librdkafka_error, raise_for_code

__all__ = ["READER_GROUP_PREFIX", "RecordSink", "TopicRead", "read_committed"]

log = logging.getLogger(__name__)

READER_GROUP_PREFIX = "dualwrite-verify-"
"""Group ids of the reader's consumers (never joined, never committed): the same prefix as the
anchor check's, so its documented ACL (DESCRIBE on Group by prefix) covers both."""

RecordSink = Callable[[bytes | None, bytes | None], None]
"""Called with each record's (key, value), in log order per partition."""

# Producer-only settings a caller's client configuration may carry; a consumer refuses some.
_PRODUCER_ONLY = ("transactional.id", "enable.idempotence", "acks", "linger.ms", "error_cb",
                  "stats_cb", "on_delivery", "delivery.timeout.ms", "message.timeout.ms",
                  "queue.buffering.max.ms", "compression.type", "retries")

# Consumer errors that no wait cures; librdkafka retries the others (transport, leader moves).
_STOPS_THE_READ = frozenset({KafkaError.TOPIC_AUTHORIZATION_FAILED,
                             KafkaError.GROUP_AUTHORIZATION_FAILED,
                             KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC})


@dataclass(frozen=True)
class TopicRead:
    """What :func:`read_committed` read, and which partitions it could not read to the end."""

    topic: str
    records: tuple[tuple[bytes | None, bytes | None], ...]
    """Every (key, value) read, per partition in log order; empty when ``on_record`` took them."""
    count: int
    """How many records were read."""
    partitions: int
    open_partitions: tuple[int, ...]
    """Partitions whose last stable offset stayed below the end taken at the start: a
    transaction open then (in doubt, or a live writer's) did not end within the timeout."""
    unread_partitions: tuple[int, ...]
    """Partitions not read up to their last stable offset within the timeout."""

    @property
    def unfinished(self) -> tuple[int, ...]:
        """Every partition not read to the end it was asked for, open or unread."""
        return tuple(sorted({*self.open_partitions, *self.unread_partitions}))


def _client_config(config: Mapping[str, Any]) -> dict[str, Any]:
    conf = {k: v for k, v in config.items()
            if not k.startswith("transaction") and k not in _PRODUCER_ONLY}
    return librdkafka_config(conf)


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def _partitions(admin: AdminClient, topic: str, deadline: float) -> list[int]:
    """The topic's partition numbers; ConfigurationError if it does not exist."""
    try:
        meta = admin.list_topics(topic, timeout=_left(deadline)).topics.get(topic)
    except KafkaException as exc:
        raise librdkafka_error(exc, f"cannot read the metadata of topic {topic!r}",
                               otherwise=RetriableError) from exc
    err = meta.error if meta is not None else None
    if meta is None or (err is not None and err.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART,
                                                           KafkaError._UNKNOWN_TOPIC)):
        raise ConfigurationError(f"topic {topic!r} does not exist in the Kafka cluster: check "
                                 "the name (and the cluster's bootstrap.servers)")
    if err is not None:
        raise_for_code(err.code(), f"metadata of topic {topic!r}", resource=topic)
        raise RetriableError(f"metadata of topic {topic!r}: {err.str()}")
    if not meta.partitions:
        raise RetriableError(f"topic {topic!r} has no partitions yet (being created?); retry")
    return sorted(meta.partitions)


def _offsets(admin: AdminClient, topic: str, partitions: list[int], spec: Any,
             isolation: Any, deadline: float) -> dict[int, int]:
    """One ListOffsets of every partition: earliest, or latest at ``isolation`` (read_committed:
    the last stable offset; read_uncommitted: the high watermark)."""
    request = {TopicPartition(topic, p): spec for p in partitions}
    try:
        futures = admin.list_offsets(request, isolation_level=isolation,
                                     request_timeout=_left(deadline))
        return {tp.partition: fut.result().offset for tp, fut in futures.items()}
    except KafkaException as exc:
        raise librdkafka_error(exc, f"cannot list the offsets of topic {topic!r}",
                               otherwise=RetriableError) from exc


def read_committed(config: Mapping[str, Any], topic: str, *, timeout_s: float = 60.0,
                   wait_for_open: bool = True, on_record: RecordSink | None = None,
                   progress: Callable[[int, int], None] | None = None) -> TopicRead:
    """Every record a read_committed consumer sees in ``topic``, from each partition's start to
    its end, within ``timeout_s`` seconds.

    ``wait_for_open``: read past the transactions open when the read starts (each partition up
    to its high watermark then), waiting for them to end; without it, stop where the consumer
    meets each partition's end (its last stable offset then), not waiting. ``on_record`` takes
    each (key, value) instead of keeping them in :attr:`TopicRead.records` (a large topic need
    not fit in memory).
    ``progress`` is called after each batch with (records read, offsets to read), the second
    counting aborted records and transaction markers too.

    Raises :class:`ConfigurationError` for a bad configuration or a topic that does not exist,
    :class:`BrokerUnreachableError` when no broker answers, and other dualwrite errors for what
    the brokers refuse (an :class:`AuthorizationError` names the missing ACL).
    """
    conf = _client_config(check_kafka_config(config))
    deadline = time.monotonic() + check_timeout(timeout_s)
    try:
        admin = AdminClient(conf)
    except KafkaException as exc:
        raise librdkafka_error(exc, "cannot create a Kafka client from the configuration",
                               otherwise=ConfigurationError) from exc
    partitions = _partitions(admin, topic, deadline)
    earliest = OffsetSpec.earliest()  # type: ignore[no-untyped-call]
    start = _offsets(admin, topic, partitions, earliest, IsolationLevel.READ_UNCOMMITTED,
                     deadline)
    latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
    # The high watermarks, also without wait_for_open: a transaction just committed may not
    # have its markers on the partition yet (EndTxn returns before they are written), so the
    # last stable offset taken now could leave out what its caller just committed.
    end = _offsets(admin, topic, partitions, latest, IsolationLevel.READ_UNCOMMITTED, deadline)
    total = sum(max(0, end[p] - start[p]) for p in partitions)
    log.debug("reading topic %s read_committed: %d partitions, offsets %s to %s", topic,
              len(partitions), start, end)

    try:
        consumer = Consumer({**conf, "group.id": f"{READER_GROUP_PREFIX}{uuid.uuid4().hex}",
                             "isolation.level": "read_committed", "enable.auto.commit": False,
                             "enable.partition.eof": True, "auto.offset.reset": "earliest"})
    except KafkaException as exc:
        raise librdkafka_error(exc, "cannot create a Kafka consumer from the configuration",
                               otherwise=ConfigurationError) from exc
    records: list[tuple[bytes | None, bytes | None]] = []
    keep = on_record if on_record is not None else (lambda k, v: records.append((k, v)))
    count = 0
    pending = {p for p in partitions if end[p] > start[p]}
    reached = dict(start)  # where each partition's read got to (records, EOFs, positions)
    try:
        consumer.assign([TopicPartition(topic, p, start[p]) for p in sorted(pending)])
        while pending and time.monotonic() < deadline:
            for msg in consumer.consume(10_000, min(0.5, _left(deadline))):
                err = msg.error()
                if err is None:
                    keep(msg.key(), msg.value())
                    count += 1
                elif err.code() == KafkaError._PARTITION_EOF:  # at the last stable offset
                    reached[msg.partition() or 0] = max(reached[msg.partition() or 0],
                                                        msg.offset() or 0)
                    if not wait_for_open:  # the end as it is now, open transactions or not
                        pending.discard(msg.partition() or 0)
                elif err.fatal() or err.code() in _STOPS_THE_READ:
                    raise librdkafka_error(KafkaException(err), f"reading topic {topic!r}",
                                           otherwise=RetriableError)
                else:  # librdkafka retries by itself (a broker down, a leader moving)
                    log.debug("reading topic %s: %s", topic, err.str())
            # The position passes aborted records and transaction markers too (the LSO).
            for tp in consumer.position([TopicPartition(topic, p) for p in sorted(pending)]):
                reached[tp.partition] = max(reached[tp.partition], tp.offset)
                if reached[tp.partition] >= end[tp.partition]:
                    pending.discard(tp.partition)
            if progress is not None:
                progress(count, total)
    except KafkaException as exc:
        raise librdkafka_error(exc, f"reading topic {topic!r}", otherwise=RetriableError) from exc
    finally:
        consumer.close()
    open_parts: tuple[int, ...] = ()
    if pending:
        # Which of them stopped at a last stable offset (an open transaction) rather than in
        # the middle of committed records (too slow, or the broker stopped answering)?
        try:
            stable = _offsets(admin, topic, sorted(pending), latest,
                              IsolationLevel.READ_COMMITTED, time.monotonic() + 5)
        except DualWriteError:
            stable = {}
        open_parts = tuple(p for p in sorted(pending)
                           if p in stable and reached[p] >= stable[p])
    unread = tuple(p for p in sorted(pending) if p not in open_parts)
    if pending:
        log.info("topic %s: partitions %s still have an open transaction, %s not read to the "
                 "end within %.1f s", topic, list(open_parts), list(unread), timeout_s)
    return TopicRead(topic, tuple(records), count, len(partitions), open_parts, unread)
