"""What became of a transaction that is no longer open, read at its anchor record.

The anchor is the offset of the transaction's first record on one partition
(:class:`~dualwrite.participant.prepared_state.Anchor`): a read_committed consumer returns that
record iff the transaction committed. Completion, the writer and ``dualwrite probe`` ask here.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException
from confluent_kafka import TopicPartition as CKTopicPartition

from dualwrite.deadline import bounded, wait_s
from dualwrite.errors import (
    FatalError,
    OutcomeUnknownError,
    OutcomeUnreadableError,
    RetriableError,
)
from dualwrite.participant.client_config import librdkafka_config
from dualwrite.participant.identifiers import TopicPartition
from dualwrite.participant.kafka_errors import librdkafka_error, raise_for_code
from dualwrite.participant.prepared_state import Anchor, PreparedTxnState

__all__ = ["VERIFY_GROUP_PREFIX", "AnchorReader"]

log = logging.getLogger(__name__)

VERIFY_GROUP_PREFIX = "dualwrite-verify-"
"""Group ids of the anchor check's consumers; they need DESCRIBE on Group by this prefix."""


class AnchorReader:
    """Reads anchor records with throw-away consumers built from one client configuration
    (no group membership, no commits)."""

    def __init__(self, consumer_config: Mapping[str, Any]) -> None:
        self._config = consumer_config

    def committed(self, tp: TopicPartition, offset: int, timeout_s: float = 30.0, *,
                  transactional_id: str = "?", state: str = "?") -> bool:
        """Whether the transaction whose first record on ``tp`` is at ``offset`` committed.

        True: a read_committed consumer returns the record at ``offset``. False only on
        positive evidence of an abort: a read_uncommitted consumer returns that record and
        read_committed, having read past it, skips it. :class:`OutcomeUnreadableError` when the
        record is gone from the log (compacted away, below the log start, topic deleted): either
        outcome is possible. :class:`OutcomeUnknownError` when it cannot be read within
        ``timeout_s`` (an open transaction may keep the stable offset below it).
        ``transactional_id`` and ``state`` name it in errors.
        """
        deadline = bounded(timeout_s).at
        while True:
            try:
                why = self._unreadable(tp, offset, deadline)
                break
            except RetriableError as exc:
                # A leader election or a broker restart (NOT_LEADER_FOR_PARTITION,
                # OFFSET_NOT_AVAILABLE while the new leader catches up): ask again until the
                # deadline, then let the caller see it.
                if time.monotonic() + 0.5 > deadline:
                    raise
                log.info("reading the offsets of %s for transactional_id=%s: %s; retrying", tp,
                         transactional_id, exc)
                time.sleep(0.5)
        if why is None:
            seen = self._first_offset_at(tp, offset, "read_committed", deadline)
            if seen == offset:
                return True
            seen = self._first_offset_at(tp, offset, "read_uncommitted", deadline)
            if seen == offset:
                return False  # in the log, and read_committed skipped it: aborted
            why = (f"no record at {tp} offset {offset} for read_committed or read_uncommitted "
                   f"(next offset {seen}): removed by the log cleaner (compaction), retention or "
                   "truncation")
        raise OutcomeUnreadableError(transactional_id, state, why)

    def partition(self, tid: str, state: PreparedTxnState, anchor: Anchor,
                  partitions: frozenset[TopicPartition], timeout_s: float) -> TopicPartition:
        """The partition ``anchor`` names, among ``partitions`` (the coordinator's list of the
        transaction) or else the cluster's; :class:`OutcomeUnreadableError` if no topic has
        it."""
        tp = anchor.resolve(partitions)
        if tp is None:
            # Hashed topic and the transaction ended (the coordinator lists no partitions any
            # more): find the topic among the cluster's by its digest.
            tp = self._resolve_hashed(anchor, timeout_s)
        if tp is None:
            raise OutcomeUnreadableError(
                tid, str(state), f"no topic of the cluster has the digest {anchor.topic} "
                "(deleted?)")
        return tp

    def _consumer(self, isolation: str) -> Consumer:
        """A throw-away consumer (no group membership, no commits) built from the config."""
        conf = {k: v for k, v in self._config.items() if not k.startswith("transaction")}
        for key in ("transactional.id", "enable.idempotence", "acks", "linger.ms", "error_cb",
                    "stats_cb", "on_delivery"):
            conf.pop(key, None)
        conf.update({
            "group.id": f"{VERIFY_GROUP_PREFIX}{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "isolation.level": isolation,
            "enable.partition.eof": True,
            "auto.offset.reset": "error",
        })
        try:
            return Consumer(librdkafka_config(conf))
        except KafkaException as exc:
            raise librdkafka_error(exc, "cannot create a Kafka consumer from the configuration",
                                   otherwise=FatalError) from exc

    def _unreadable(self, tp: TopicPartition, offset: int, deadline: float) -> str | None:
        """Why the record at ``offset`` of ``tp`` cannot be in the log any more, or None."""
        consumer = self._consumer("read_uncommitted")
        try:
            md = consumer.list_topics(tp.topic, timeout=_left(deadline)).topics.get(tp.topic)
            if md is None or (md.error is not None
                              and md.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
                return f"the topic {tp.topic} no longer exists"
            if md.error is not None:
                raise RetriableError(f"metadata of {tp.topic}: {md.error}")
            if tp.partition not in md.partitions:
                return f"the topic {tp.topic} has no partition {tp.partition} any more"
            low, high = consumer.get_watermark_offsets(
                CKTopicPartition(tp.topic, tp.partition), timeout=_left(deadline))
        except KafkaException as exc:
            raise librdkafka_error(exc, f"reading the offsets of {tp}",
                                   otherwise=RetriableError) from exc
        finally:
            consumer.close()
        if low > offset:
            return (f"{tp} offset {offset} is below the log start {low} (retention or "
                    "DeleteRecords removed it)")
        if high <= offset:
            return (f"{tp} ends at offset {high}, below {offset} (the log was truncated or "
                    "recreated)")
        return None

    def _first_offset_at(self, tp: TopicPartition, offset: int, isolation: str,
                         deadline: float) -> int:
        """The offset of the first record at or after ``offset`` that ``isolation`` returns, or
        the position it reached past ``offset`` without returning one (end of partition)."""
        consumer = self._consumer(isolation)
        try:
            consumer.assign([CKTopicPartition(tp.topic, tp.partition, offset)])
            while time.monotonic() < deadline:
                msg = consumer.poll(0.2)
                if msg is None:
                    continue
                err = msg.error()
                if err is not None:
                    if err.code() in (KafkaError._AUTO_OFFSET_RESET,
                                      KafkaError.OFFSET_OUT_OF_RANGE):
                        # Retention moved the log start past the anchor while it was being read?
                        low, _high = consumer.get_watermark_offsets(
                            CKTopicPartition(tp.topic, tp.partition), timeout=_left(deadline))
                        if low > offset:
                            return int(low)
                    if err.code() == KafkaError.GROUP_AUTHORIZATION_FAILED:
                        raise_for_code(err.code(), f"reading {tp} at {offset} ({isolation}): "
                                       f"{err.str()}", resource=f"prefix '{VERIFY_GROUP_PREFIX}'")
                    if err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                        raise_for_code(err.code(), f"Fetch {tp} at {offset}: {err.str()}",
                                       resource=tp.topic)
                    if err.code() != KafkaError._PARTITION_EOF:
                        raise librdkafka_error(KafkaException(err), f"reading {tp} at {offset}",
                                               otherwise=RetriableError)
                    position = consumer.position(
                        [CKTopicPartition(tp.topic, tp.partition)])[0].offset
                    if position != OFFSET_INVALID and position > offset:
                        return int(position)  # read past the anchor and nothing was returned
                    continue
                msg_offset = msg.offset()
                if msg_offset is not None and msg_offset >= offset:
                    return int(msg_offset)
        except KafkaException as exc:
            raise librdkafka_error(exc, f"reading {tp} at {offset} ({isolation})",
                                   otherwise=RetriableError) from exc
        finally:
            consumer.close()
        raise OutcomeUnknownError(
            f"could not read {tp} at offset {offset} ({isolation}) in time (an open transaction "
            "may hold the last stable offset below it); retry recovery")

    def _resolve_hashed(self, anchor: Anchor, timeout_s: float) -> TopicPartition | None:
        """The partition a hashed anchor names, found among the cluster's topics by digest."""
        consumer = self._consumer("read_uncommitted")
        try:
            topics = consumer.list_topics(timeout=wait_s(timeout_s)).topics
        except KafkaException as exc:
            raise librdkafka_error(exc, "listing the cluster's topics",
                                   otherwise=RetriableError) from exc
        finally:
            consumer.close()
        candidates = {TopicPartition(t, anchor.partition) for t in topics}
        return anchor.resolve(candidates)


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())
