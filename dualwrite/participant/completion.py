"""Finishing an in-doubt transaction from its prepared state: the heart of recovery.

Used by :meth:`TwoPhaseProducer.complete_transaction` and by :func:`dualwrite.recover`. The rules:

- The coordinator has an Ongoing transaction and it *is* the one the state names (same producer
  id and epoch, and the anchor partition's open transaction starts at the anchor offset) → commit
  it by (producer id, epoch).
- It has an Ongoing transaction that is *not* the named one → abort that one.
- The named transaction is no longer open → find out what happened to it: the record at the
  anchor offset is visible to a read_committed reader iff it committed. Committed → nothing to do.
  Aborted although the database decided commit → :class:`HeuristicAbortError`, never silence.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException
from confluent_kafka import TopicPartition as CKTopicPartition

from dualwrite.deadline import bounded, deadline_scope, wait_s
from dualwrite.errors import (
    BrokerUnreachableError,
    DualWriteError,
    FatalError,
    HeuristicAbortError,
    OutcomeUnknownError,
    OutcomeUnreadableError,
    ProducerFencedError,
    RetriableError,
)
from dualwrite.participant.client_config import librdkafka_config
from dualwrite.participant.control_plane import (
    ActiveProducer,
    ControlPlane,
    TransactionDescription,
    TxnState,
)
from dualwrite.participant.identifiers import ProducerIdentity, TopicPartition
from dualwrite.participant.kafka_errors import (
    FatalKafkaError,
    FencedKafkaError,
    librdkafka_error,
    raise_for_code,
)
from dualwrite.participant.outcome import Outcome
from dualwrite.participant.prepared_state import Anchor, PreparedTxnState

__all__ = [
    "Outcome",
    "OwnerAlive",
    "Prefetched",
    "commit_lost_marker",
    "committed_at_anchor",
    "complete",
    "end_open_transaction",
    "find_lost_commit_marker",
    "named_transaction_committed",
    "names_open_transaction",
    "prefetch",
]

log = logging.getLogger(__name__)

_INVALID_TXN_STATE = 48
# How often completion re-reads a transactional id that changed under it (a live writer racing).
_RACE_ATTEMPTS = 5
# How long the lost-marker check may ask the anchor's leader (find_lost_commit_marker).
_LOST_MARKER_CHECK_S = 5.0


@dataclass(frozen=True)
class Prefetched:
    """Coordinator and partition-leader answers fetched in bulk, under the state-row lock.

    Recovery describes many ids and anchor partitions in one request each instead of one per id.
    """

    descriptions: Mapping[str, TransactionDescription]
    producers: Mapping[TopicPartition, list[ActiveProducer]]


def prefetch(cp: ControlPlane, states: Mapping[str, PreparedTxnState]) -> Prefetched:
    """One DescribeTransactions per coordinator and one DescribeProducers per anchor leader."""
    described = cp.describe_transactions(states)
    anchors = set()
    for tid, desc in described.items():
        anchor = states[tid].anchor
        if anchor is not None and desc.state is TxnState.ONGOING:
            tp = anchor.resolve(desc.partitions)
            if tp is not None and tp in desc.partitions:
                anchors.add(tp)
    return Prefetched(described, cp.describe_producers(anchors))


def _wait_until_settled(cp: ControlPlane, tid: str, timeout_s: float,
                        prefetched: Prefetched | None) -> TransactionDescription | None:
    """Describe ``tid``, waiting while the coordinator is mid-way through writing markers."""
    deadline = bounded(timeout_s).at
    if prefetched is not None:
        desc = prefetched.descriptions.get(tid)  # absent: the coordinator does not know the id
    else:
        desc = cp.describe_transaction(tid)
    while True:
        if desc is None or desc.state not in (TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT,
                                              TxnState.PREPARE_EPOCH_FENCE):
            return desc
        if time.monotonic() > deadline:
            raise RetriableError(f"transactional id {tid!r} stayed in {desc.state.value} for "
                                 f"{timeout_s:g} s; retry recovery")
        time.sleep(0.05)
        desc = cp.describe_transaction(tid)


def names_open_transaction(cp: ControlPlane, desc: TransactionDescription,
                           state: PreparedTxnState, prefetched: Prefetched | None = None) -> bool:
    """Whether the coordinator's Ongoing transaction is exactly the one ``state`` names."""
    if state.is_empty or desc.state is not TxnState.ONGOING:
        return False
    if (desc.producer_id, desc.epoch) != (state.producer_id, state.epoch):
        return False
    anchor = state.anchor
    if anchor is None:
        # Java's "pid:epoch" form: unique only under KIP-890 part 2 epoch bumps.
        log.warning("transactional_id=%s state %s has no anchor; matching by producer id and "
                    "epoch alone", desc.transactional_id, state)
        return True
    tp = anchor.resolve(desc.partitions)
    if tp is None or tp not in desc.partitions:
        return False
    if prefetched is not None and tp in prefetched.producers:
        producers = prefetched.producers[tp]
    else:
        producers = cp.describe_producers([tp]).get(tp, [])
    return any(p.producer_id == state.producer_id and p.current_txn_start_offset == anchor.offset
               for p in producers)


def committed_at_anchor(consumer_config: Mapping[str, Any], tp: TopicPartition, offset: int,
                        timeout_s: float = 30.0, *, transactional_id: str = "?",
                        state: str = "?") -> bool:
    """Whether the transaction whose first record on ``tp`` is at ``offset`` committed.

    True: a read_committed consumer returns the record at ``offset``. False only on positive
    evidence of an abort: a read_uncommitted consumer returns that record and read_committed,
    having read past it, skips it. :class:`OutcomeUnreadableError` when the record is gone from
    the log (compacted away, below the log start, topic deleted): either outcome is possible.
    :class:`OutcomeUnknownError` when it cannot be read within ``timeout_s`` (an open transaction
    may keep the stable offset below it). ``transactional_id`` and ``state`` name it in errors.
    """
    deadline = bounded(timeout_s).at
    while True:
        try:
            why = _anchor_unreadable(consumer_config, tp, offset, deadline)
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
        seen = _first_offset_at(consumer_config, tp, offset, "read_committed", deadline)
        if seen == offset:
            return True
        seen = _first_offset_at(consumer_config, tp, offset, "read_uncommitted", deadline)
        if seen == offset:
            return False  # in the log, and read_committed skipped it: aborted
        why = (f"no record at {tp} offset {offset} for read_committed or read_uncommitted "
               f"(next offset {seen}): removed by the log cleaner (compaction), retention or "
               "truncation")
    raise OutcomeUnreadableError(transactional_id, state, why)


OwnerAlive = Callable[[], bool]
"""Asked before committing the named open transaction by (producer id, epoch): True while the
writer that prepared it may still be running its session (it holds the id's lease, see
:mod:`dualwrite.writer.lease`). On librdkafka's TV1 path that session reuses the (producer
id, epoch) for its next transaction, so an EndTxn decided now could land on that one instead:
the live writer is left to commit its own transaction."""


def end_open_transaction(cp: ControlPlane, transactional_id: str, state: PreparedTxnState, *,
                         timeout_s: float = 30.0, prefetched: Prefetched | None = None,
                         owner_alive: OwnerAlive | None = None,
                         only_identity: ProducerIdentity | None = None
                         ) -> tuple[Outcome | None, TransactionDescription | None]:
    """First half of :func:`complete`: commit the open transaction if ``state`` names it, else
    abort it. Returns ``COMMITTED``, ``ABORTED`` or None (nothing was open), and the last
    description read. It returns only once the coordinator finished writing the markers (EndTxn
    answers while the transaction is still PrepareCommit / PrepareAbort), so a ``status`` right
    after recovery shows nothing in flight.

    ``owner_alive``: see :data:`OwnerAlive`; while it answers True the named transaction is not
    committed here but waited for (up to ``timeout_s``, then :class:`RetriableError`).
    ``only_identity``: the caller is the producer session with this identity, finishing its own
    transaction; an open transaction of any other producer id or epoch belongs to whoever fenced
    it, so nothing is ended and :class:`ProducerFencedError` is raised.
    """
    tid = transactional_id
    for attempt in range(_RACE_ATTEMPTS):
        hint = prefetched if attempt == 0 else None
        desc = _wait_until_settled(cp, tid, timeout_s, hint)
        if desc is None or desc.state is not TxnState.ONGOING:
            return None, desc
        if only_identity is not None and (desc.producer_id, desc.epoch) != (
                only_identity.producer_id, only_identity.epoch):
            raise ProducerFencedError(
                f"transactional_id={tid}: the coordinator has an open transaction of "
                f"producer_id={desc.producer_id} epoch={desc.epoch}, not of this producer "
                f"(producer_id={only_identity.producer_id} epoch={only_identity.epoch}): a "
                "newer producer took over; this one ends nothing and must stop")
        if names_open_transaction(cp, desc, state, hint):
            if owner_alive is not None and owner_alive():
                _wait_for_live_owner(cp, tid, state, timeout_s, owner_alive)
                continue
            log.info("commit in-doubt transaction transactional_id=%s producer_id=%d epoch=%d "
                     "state=%s", tid, desc.producer_id, desc.epoch, state)
            try:
                cp.end_transaction(tid, desc.producer_id, desc.epoch, commit=True)
            except OutcomeUnknownError as unanswered:
                return None, _ask_after_unanswered_commit(cp, desc, timeout_s, unanswered)
            return Outcome.COMMITTED, _wait_until_settled(cp, tid, timeout_s, None)
        log.info("abort open transaction not named by the prepared state transactional_id=%s "
                 "producer_id=%d epoch=%d state=%r", tid, desc.producer_id, desc.epoch, str(state))
        try:
            cp.end_transaction(tid, desc.producer_id, desc.epoch, commit=False)
        except (FencedKafkaError, FatalKafkaError) as exc:
            # Its owner ended it (or a newer producer took over) between describe and abort:
            # look again rather than report a failure.
            if isinstance(exc, FatalKafkaError) and exc.info.code != _INVALID_TXN_STATE:
                raise
            log.info("transactional_id=%s changed while aborting (%s); describing again", tid,
                     exc.info.name)
            continue
        return Outcome.ABORTED, _wait_until_settled(cp, tid, timeout_s, None)
    raise RetriableError(f"transactional id {tid!r} kept changing while being completed; "
                         "is a writer still running? retry recovery")


_UNANSWERED_GRACE_S = 2.0
"""How long an EndTxn(commit) whose answer was lost is given to show at the coordinator: a
request read before its connection broke is still handled by the broker."""


def _ask_after_unanswered_commit(cp: ControlPlane, sent: TransactionDescription,
                                 timeout_s: float, unanswered: OutcomeUnknownError
                                 ) -> TransactionDescription | None:
    """The coordinator's view after an EndTxn(commit) of ``sent`` got no answer (a cut
    connection, a timeout): once that transaction is no longer open, its description, and
    :func:`complete` reads the outcome at the anchor. Still open, the unknown outcome stands:
    the EndTxn may arrive later, and one sent again could then meet a later transaction of the
    same producer id and epoch (KAFKA-17754); ``complete`` run again asks afresh."""
    tid = sent.transactional_id
    give_up = time.monotonic() + wait_s(_UNANSWERED_GRACE_S)
    try:
        while True:
            desc = _wait_until_settled(cp, tid, timeout_s, None)
            still_open = (desc is not None and desc.state is TxnState.ONGOING
                          and (desc.producer_id, desc.epoch) == (sent.producer_id, sent.epoch))
            if not still_open:
                log.info("transactional_id=%s producer_id=%d epoch=%d: the EndTxn(commit) got no "
                         "answer; the coordinator now says %s", tid, sent.producer_id,
                         sent.epoch, "nothing" if desc is None else desc.state.value)
                return desc
            if time.monotonic() >= give_up:
                raise unanswered
            time.sleep(0.1)
    except OutcomeUnknownError:
        raise
    except DualWriteError as exc:
        raise unanswered from exc


def _wait_for_live_owner(cp: ControlPlane, tid: str, state: PreparedTxnState, timeout_s: float,
                         owner_alive: OwnerAlive) -> None:
    """Wait while the named transaction is open and its writer alive (it is committing it)."""
    log.info("transactional_id=%s state=%s is open and its writer holds the lease: waiting for "
             "it to commit its own transaction", tid, state)
    deadline = bounded(timeout_s).at
    while time.monotonic() < deadline:
        time.sleep(0.05)
        desc = cp.describe_transaction(tid)
        if desc is None or not names_open_transaction(cp, desc, state) or not owner_alive():
            return
    raise RetriableError(
        f"transactional_id={tid}: the transaction named by the stored state {state} is still "
        f"open after {timeout_s:g} s and the writer that prepared it still holds the id's lease "
        "(it may be paused); it is left to that writer — retry later, or stop that writer")


def complete(cp: ControlPlane, consumer_config: Mapping[str, Any], transactional_id: str,
             state: PreparedTxnState, *, timeout_s: float = 30.0,
             prefetched: Prefetched | None = None, owner_alive: OwnerAlive | None = None,
             only_identity: ProducerIdentity | None = None) -> Outcome:
    """Commit the transaction ``state`` names if it is open, abort any other open one.

    Idempotent: running it again after success returns ``ALREADY_COMMITTED`` or ``NOTHING``.
    Raises :class:`HeuristicAbortError` when the named transaction was aborted by Kafka.
    ``owner_alive`` and ``only_identity``: see :func:`end_open_transaction`.
    """
    tid = transactional_id
    done, desc = end_open_transaction(cp, tid, state, timeout_s=timeout_s,
                                      prefetched=prefetched, owner_alive=owner_alive,
                                      only_identity=only_identity)
    if done is Outcome.COMMITTED:
        return done
    aborted_other = done is Outcome.ABORTED
    if state.is_empty:
        return Outcome.ABORTED if aborted_other else Outcome.NOTHING
    repaired = not aborted_other and commit_lost_marker(cp, consumer_config, tid, state, desc,
                                                        timeout_s)
    if named_transaction_committed(cp, consumer_config, tid, state, desc, timeout_s):
        if repaired:
            return Outcome.COMMITTED
        log.info("prepared transaction already committed transactional_id=%s producer_id=%d "
                 "epoch=%d state=%s", tid, state.producer_id, state.epoch, state)
        return Outcome.ABORTED if aborted_other else Outcome.ALREADY_COMMITTED
    detail = "aborted by Kafka"
    if desc is not None and desc.producer_id == state.producer_id and desc.epoch > state.epoch:
        detail = (f"the coordinator's epoch is now {desc.epoch} (state {desc.state.value}): "
                  "either the transaction outlived transaction.timeout.ms "
                  f"({desc.timeout_ms} ms) or a producer re-initialised the id before it was "
                  "committed")
    raise HeuristicAbortError(tid, str(state), detail)


def named_transaction_committed(cp: ControlPlane, consumer_config: Mapping[str, Any], tid: str,
                                state: PreparedTxnState, desc: TransactionDescription | None,
                                timeout_s: float) -> bool:
    """Whether the transaction ``state`` names, no longer open (``desc``: the coordinator's
    view, None if it does not know the id), committed: by its anchor (or, without one, by the
    coordinator's CompleteCommit under the same producer id and epoch). Raises like
    :func:`committed_at_anchor`."""
    anchor = state.anchor
    if anchor is None:
        if desc is None:
            raise OutcomeUnknownError(f"{tid!r}: the coordinator no longer knows this id and the "
                                      f"state {state} has no anchor to check")
        same = (desc.producer_id, desc.epoch) == (state.producer_id, state.epoch)
        if same and desc.state is TxnState.EMPTY:
            # Apache Kafka says CompleteCommit or CompleteAbort after EndTxn at this epoch;
            # franz-go's kfake says Empty either way, which tells neither outcome.
            raise OutcomeUnknownError(
                f"{tid!r}: the coordinator reports Empty at the stored producer id and epoch, "
                f"not how the transaction ended, and the state {state} has no anchor to check")
        return same and desc.state is TxnState.COMPLETE_COMMIT
    tp = _anchor_partition(consumer_config, tid, state, anchor, desc, timeout_s)
    return committed_at_anchor(consumer_config, tp, anchor.offset, timeout_s,
                               transactional_id=tid, state=str(state))


def _anchor_partition(consumer_config: Mapping[str, Any], tid: str, state: PreparedTxnState,
                      anchor: Anchor, desc: TransactionDescription | None,
                      timeout_s: float) -> TopicPartition:
    """The partition ``anchor`` names; :class:`OutcomeUnreadableError` if no topic has it."""
    tp = anchor.resolve(desc.partitions if desc is not None else frozenset())
    if tp is None:
        # Hashed topic and the transaction ended (the coordinator lists no partitions any more):
        # find the topic among the cluster's by its digest.
        tp = _resolve_hashed_anchor(consumer_config, anchor, timeout_s)
    if tp is None:
        raise OutcomeUnreadableError(
            tid, str(state), f"no topic of the cluster has the digest {anchor.topic} (deleted?)")
    return tp


def find_lost_commit_marker(cp: ControlPlane, consumer_config: Mapping[str, Any], tid: str,
                            state: PreparedTxnState, desc: TransactionDescription | None,
                            timeout_s: float) -> tuple[TopicPartition, ActiveProducer] | None:
    """The anchor partition and its open transaction, if the coordinator completed the commit
    of the transaction ``state`` names but that partition never got the commit marker.

    Kafka's TransactionMarkerChannelManager skips a partition whose leader endpoint it cannot
    look up ("likely deleted already") and still completes the transaction. A broker that
    restarts as the only replica of the partition, its old registration not yet expired (it is
    fenced, leaderless, then elected again), does that to a PrepareCommit it reloads: the
    coordinator says CompleteCommit, and the partition keeps the transaction open for ever, its
    last stable offset stuck at the anchor (seen with Kafka 4.3.1; docs/design.md). The
    coordinator's CompleteCommit at the stored producer id and epoch is the stored transaction's
    (see :func:`named_transaction_committed`), and the partition's open transaction of that
    producer id and epoch starts at the anchor offset: it is that transaction's.
    """
    anchor = state.anchor
    if (anchor is None or desc is None or desc.state is not TxnState.COMPLETE_COMMIT
            or (desc.producer_id, desc.epoch) != (state.producer_id, state.epoch)):
        return None
    tp = _anchor_partition(consumer_config, tid, state, anchor, desc, timeout_s)
    try:
        with deadline_scope(min(timeout_s, _LOST_MARKER_CHECK_S)):
            producers = cp.describe_producers([tp]).get(tp, [])
    except BrokerUnreachableError:
        raise
    except DualWriteError as exc:
        # The topic or partition is gone (UNKNOWN_TOPIC_OR_PARTITION is retried up to the bound
        # above), or DescribeProducers is not allowed: nothing to repair here, and the anchor
        # check that follows says what became of the transaction.
        log.debug("transactional_id=%s: no lost-marker check on %s (%s)", tid, tp, exc)
        return None
    for producer in producers:
        if ((producer.producer_id, producer.epoch) == (state.producer_id, state.epoch)
                and producer.current_txn_start_offset == anchor.offset):
            return tp, producer
    return None


def commit_lost_marker(cp: ControlPlane, consumer_config: Mapping[str, Any], tid: str,
                       state: PreparedTxnState, desc: TransactionDescription | None,
                       timeout_s: float) -> bool:
    """Write the commit marker :func:`find_lost_commit_marker` finds missing; True if written.

    The outcome written is the coordinator's own decision, on the one partition known to be in
    the transaction (the coordinator no longer lists the others).
    """
    lost = find_lost_commit_marker(cp, consumer_config, tid, state, desc, timeout_s)
    if lost is None:
        return False
    tp, producer = lost
    log.warning("transactional_id=%s producer_id=%d epoch=%d state=%s: the coordinator "
                "completed the commit but %s never got its marker (its transaction is still "
                "open at the anchor offset); writing the commit marker", tid, state.producer_id,
                state.epoch, state, tp)
    cp.write_txn_marker(tp, state.producer_id, state.epoch, producer.coordinator_epoch,
                        commit=True)
    return True


_VERIFY_GROUP_PREFIX = "dualwrite-verify-"
"""Group ids of the anchor check's consumers; they need DESCRIBE on Group by this prefix."""


def _consumer(consumer_config: Mapping[str, Any], isolation: str) -> Consumer:
    """A throw-away consumer (no group membership, no commits) built from a client config."""
    conf = {k: v for k, v in consumer_config.items() if not k.startswith("transaction")}
    for key in ("transactional.id", "enable.idempotence", "acks", "linger.ms", "error_cb",
                "stats_cb", "on_delivery"):
        conf.pop(key, None)
    conf.update({
        "group.id": f"{_VERIFY_GROUP_PREFIX}{uuid.uuid4().hex[:8]}",
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


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def _anchor_unreadable(consumer_config: Mapping[str, Any], tp: TopicPartition, offset: int,
                       deadline: float) -> str | None:
    """Why the record at ``offset`` of ``tp`` cannot be in the log any more, or None."""
    consumer = _consumer(consumer_config, "read_uncommitted")
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
        return f"{tp} ends at offset {high}, below {offset} (the log was truncated or recreated)"
    return None


def _first_offset_at(consumer_config: Mapping[str, Any], tp: TopicPartition, offset: int,
                     isolation: str, deadline: float) -> int:
    """The offset of the first record at or after ``offset`` that ``isolation`` returns, or the
    position it reached past ``offset`` without returning one (end of partition)."""
    consumer = _consumer(consumer_config, isolation)
    try:
        consumer.assign([CKTopicPartition(tp.topic, tp.partition, offset)])
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
                    # Retention moved the log start past the anchor while it was being read?
                    low, _high = consumer.get_watermark_offsets(
                        CKTopicPartition(tp.topic, tp.partition), timeout=_left(deadline))
                    if low > offset:
                        return int(low)
                if err.code() == KafkaError.GROUP_AUTHORIZATION_FAILED:
                    raise_for_code(err.code(), f"reading {tp} at {offset} ({isolation}): "
                                   f"{err.str()}", resource=f"prefix '{_VERIFY_GROUP_PREFIX}'")
                if err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                    raise_for_code(err.code(), f"Fetch {tp} at {offset}: {err.str()}",
                                   resource=tp.topic)
                if err.code() != KafkaError._PARTITION_EOF:
                    raise librdkafka_error(KafkaException(err), f"reading {tp} at {offset}",
                                           otherwise=RetriableError)
                position = consumer.position([CKTopicPartition(tp.topic, tp.partition)])[0].offset
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


def _resolve_hashed_anchor(consumer_config: Mapping[str, Any], anchor: Anchor,
                           timeout_s: float) -> TopicPartition | None:
    """The partition a hashed anchor names, found among the cluster's topics by digest."""
    consumer = _consumer(consumer_config, "read_uncommitted")
    try:
        topics = consumer.list_topics(timeout=wait_s(timeout_s)).topics
    except KafkaException as exc:
        raise librdkafka_error(exc, "listing the cluster's topics",
                               otherwise=RetriableError) from exc
    finally:
        consumer.close()
    candidates = {TopicPartition(t, anchor.partition) for t in topics}
    return anchor.resolve(candidates)
