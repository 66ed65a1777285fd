"""Finishing an in-doubt transaction from its prepared state: the heart of recovery.

Used by :meth:`TwoPhaseProducer.complete_transaction`, by :func:`dualwrite.recover` and by the
batch coordinator, each through one :class:`Completion`. The rules:

- The coordinator has an Ongoing transaction and it *is* the one the state names (same producer
  id and epoch, and the anchor partition's open transaction starts at the anchor offset) → commit
  it by (producer id, epoch).
- It has an Ongoing transaction that is *not* the named one → abort that one.
- The named transaction is no longer open → find out what happened to it: the record at the
  anchor offset is visible to a read_committed reader iff it committed
  (:class:`~dualwrite.participant.anchor_reader.AnchorReader`). Committed → nothing to do.
  Aborted although the database decided commit → :class:`HeuristicAbortError`, never silence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dualwrite.deadline import bounded, deadline_scope, wait_s
from dualwrite.errors import (
    BrokerUnreachableError,
    DualWriteError,
    HeuristicAbortError,
    OutcomeUnknownError,
    ProducerFencedError,
    RetriableError,
)
from dualwrite.participant.anchor_reader import AnchorReader
from dualwrite.participant.control_plane import (
    ActiveProducer,
    ControlPlane,
    TransactionDescription,
    TxnState,
)
from dualwrite.participant.identifiers import ProducerIdentity, TopicPartition
from dualwrite.participant.kafka_errors import FatalKafkaError, FencedKafkaError
from dualwrite.participant.outcome import Outcome
from dualwrite.participant.prepared_state import Anchor, PreparedTxnState

__all__ = [
    "Completion",
    "Outcome",
    "OwnerAlive",
    "Prefetched",
    "complete",
]

log = logging.getLogger(__name__)

_INVALID_TXN_STATE = 48
# How often completion re-reads a transactional id that changed under it (a live writer racing).
_RACE_ATTEMPTS = 5
# How long the lost-marker check may ask the anchor's leader (Completion.find_lost_commit_marker).
_LOST_MARKER_CHECK_S = 5.0
_UNANSWERED_GRACE_S = 2.0
"""How long an EndTxn(commit) whose answer was lost is given to show at the coordinator: a
request read before its connection broke is still handled by the broker."""


@dataclass(frozen=True)
class Prefetched:
    """Coordinator and partition-leader answers fetched in bulk, under the state-row lock.

    Recovery describes many ids and anchor partitions in one request each instead of one per id.
    """

    descriptions: Mapping[str, TransactionDescription]
    producers: Mapping[TopicPartition, list[ActiveProducer]]


OwnerAlive = Callable[[], bool]
"""Asked before committing the named open transaction by (producer id, epoch): True while the
writer that prepared it may still be running its session (it holds the id's lease, see
:mod:`dualwrite.writer.lease`). On librdkafka's TV1 path that session reuses the (producer
id, epoch) for its next transaction, so an EndTxn decided now could land on that one instead:
the live writer is left to commit its own transaction."""


class Completion:
    """Finishes in-doubt transactions of one cluster: the coordinator's view through
    ``control_plane``, the anchor records read with ``consumer_config``; every wait bounded by
    ``timeout_s``. Thread-safe as the control plane is (it keeps no state of its own)."""

    def __init__(self, control_plane: ControlPlane, consumer_config: Mapping[str, Any], *,
                 timeout_s: float = 30.0) -> None:
        self._cp = control_plane
        self._anchors = AnchorReader(consumer_config)
        self._timeout_s = timeout_s

    def prefetch(self, states: Mapping[str, PreparedTxnState]) -> Prefetched:
        """One DescribeTransactions per coordinator and one DescribeProducers per anchor
        leader."""
        described = self._cp.describe_transactions(states)
        anchors = set()
        for tid, desc in described.items():
            anchor = states[tid].anchor
            if anchor is not None and desc.state is TxnState.ONGOING:
                tp = anchor.resolve(desc.partitions)
                if tp is not None and tp in desc.partitions:
                    anchors.add(tp)
        return Prefetched(described, self._cp.describe_producers(anchors))

    def names_open_transaction(self, desc: TransactionDescription, state: PreparedTxnState,
                               prefetched: Prefetched | None = None) -> bool:
        """Whether the coordinator's Ongoing transaction is exactly the one ``state`` names."""
        if state.is_empty or desc.state is not TxnState.ONGOING:
            return False
        if (desc.producer_id, desc.epoch) != (state.producer_id, state.epoch):
            return False
        anchor = state.anchor
        if anchor is None:
            # Java's "pid:epoch" form: unique only under KIP-890 part 2 epoch bumps.
            log.warning("transactional_id=%s state %s has no anchor; matching by producer id "
                        "and epoch alone", desc.transactional_id, state)
            return True
        tp = anchor.resolve(desc.partitions)
        if tp is None or tp not in desc.partitions:
            return False
        if prefetched is not None and tp in prefetched.producers:
            producers = prefetched.producers[tp]
        else:
            producers = self._cp.describe_producers([tp]).get(tp, [])
        return any(p.producer_id == state.producer_id
                   and p.current_txn_start_offset == anchor.offset for p in producers)

    def complete(self, transactional_id: str, state: PreparedTxnState, *,
                 prefetched: Prefetched | None = None, owner_alive: OwnerAlive | None = None,
                 only_identity: ProducerIdentity | None = None) -> Outcome:
        """Commit the transaction ``state`` names if it is open, abort any other open one.

        Idempotent: running it again after success returns ``ALREADY_COMMITTED`` or
        ``NOTHING``. Raises :class:`HeuristicAbortError` when the named transaction was aborted
        by Kafka. ``owner_alive`` and ``only_identity``: see :meth:`end_open_transaction`.
        """
        tid = transactional_id
        done, desc = self.end_open_transaction(tid, state, prefetched=prefetched,
                                               owner_alive=owner_alive,
                                               only_identity=only_identity)
        if done is Outcome.COMMITTED:
            return done
        aborted_other = done is Outcome.ABORTED
        if state.is_empty:
            return Outcome.ABORTED if aborted_other else Outcome.NOTHING
        repaired = not aborted_other and self.commit_lost_marker(tid, state, desc)
        if self.named_transaction_committed(tid, state, desc):
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

    def end_open_transaction(self, transactional_id: str, state: PreparedTxnState, *,
                             prefetched: Prefetched | None = None,
                             owner_alive: OwnerAlive | None = None,
                             only_identity: ProducerIdentity | None = None
                             ) -> tuple[Outcome | None, TransactionDescription | None]:
        """First half of :meth:`complete`: commit the open transaction if ``state`` names it,
        else abort it. Returns ``COMMITTED``, ``ABORTED`` or None (nothing was open), and the
        last description read. It returns only once the coordinator finished writing the
        markers (EndTxn answers while the transaction is still PrepareCommit / PrepareAbort), so
        a ``status`` right after recovery shows nothing in flight.

        ``owner_alive``: see :data:`OwnerAlive`; while it answers True the named transaction is
        not committed here but waited for (up to ``timeout_s``, then :class:`RetriableError`).
        ``only_identity``: the caller is the producer session with this identity, finishing its
        own transaction; an open transaction of any other producer id or epoch belongs to
        whoever fenced it, so nothing is ended and :class:`ProducerFencedError` is raised.
        """
        tid = transactional_id
        first = prefetched.descriptions.get(tid) if prefetched is not None else None
        acting_on: tuple[int, int, int | None] | None = None
        for attempt in range(_RACE_ATTEMPTS):
            hint = prefetched if attempt == 0 else None
            desc = self._wait_until_settled(tid, hint)
            if desc is None or desc.state is not TxnState.ONGOING:
                return None, desc
            # Only the transaction first seen is ended: the caller decided from that view, under
            # its locks. One begun since (the first settled, or an EndTxn was fenced) is a
            # writer's that claimed the id once those locks were gone (a terminated session
            # frees them while the caller goes on), and it may be deciding to commit it
            # (docs/design.md, "Claims").
            seen = (desc.producer_id, desc.epoch, desc.start_time_ms)
            if acting_on is None and first is not None and first.state is not TxnState.ONGOING:
                acting_on = (first.producer_id, first.epoch, None)  # it settled: not this one
            if acting_on is not None and seen != acting_on:
                raise RetriableError(
                    f"transactional id {tid!r}: another transaction (producer_id="
                    f"{desc.producer_id} epoch={desc.epoch}) began while this one ended it; "
                    "whoever began it acts on the id now, so nothing more is done here: retry "
                    "(recovery finishes it at a later pass if it is left in doubt)")
            acting_on = seen
            if only_identity is not None and (desc.producer_id, desc.epoch) != (
                    only_identity.producer_id, only_identity.epoch):
                raise ProducerFencedError(
                    f"transactional_id={tid}: the coordinator has an open transaction of "
                    f"producer_id={desc.producer_id} epoch={desc.epoch}, not of this producer "
                    f"(producer_id={only_identity.producer_id} epoch={only_identity.epoch}): a "
                    "newer producer took over; this one ends nothing and must stop")
            if self.names_open_transaction(desc, state, hint):
                if owner_alive is not None and owner_alive():
                    self._wait_for_live_owner(tid, state, owner_alive)
                    # A fresh view: the caller waited for the owner, its locks held, and may end
                    # the owner's next transaction (a take-over fences it).
                    first = acting_on = None
                    continue
                log.info("commit in-doubt transaction transactional_id=%s producer_id=%d "
                         "epoch=%d state=%s", tid, desc.producer_id, desc.epoch, state)
                try:
                    self._cp.end_transaction(tid, desc.producer_id, desc.epoch, commit=True)
                except OutcomeUnknownError as unanswered:
                    return None, self._ask_after_unanswered_commit(desc, unanswered)
                return Outcome.COMMITTED, self._wait_until_settled(tid, None)
            log.info("abort open transaction not named by the prepared state transactional_id=%s "
                     "producer_id=%d epoch=%d state=%r", tid, desc.producer_id, desc.epoch,
                     str(state))
            try:
                self._cp.end_transaction(tid, desc.producer_id, desc.epoch, commit=False)
            except (FencedKafkaError, FatalKafkaError) as exc:
                # Its owner ended it (or a newer producer took over) between describe and abort:
                # look again rather than report a failure.
                if isinstance(exc, FatalKafkaError) and exc.info.code != _INVALID_TXN_STATE:
                    raise
                log.info("transactional_id=%s changed while aborting (%s); describing again",
                         tid, exc.info.name)
                continue
            return Outcome.ABORTED, self._wait_until_settled(tid, None)
        raise RetriableError(f"transactional id {tid!r} kept changing while being completed; "
                             "is a writer still running? retry recovery")

    def named_transaction_committed(self, tid: str, state: PreparedTxnState,
                                    desc: TransactionDescription | None) -> bool:
        """Whether the transaction ``state`` names, no longer open (``desc``: the coordinator's
        view, None if it does not know the id), committed: by its anchor (or, without one, by
        the coordinator's CompleteCommit under the same producer id and epoch). Raises like
        :meth:`AnchorReader.committed`."""
        anchor = state.anchor
        if anchor is None:
            if desc is None:
                raise OutcomeUnknownError(f"{tid!r}: the coordinator no longer knows this id and "
                                          f"the state {state} has no anchor to check")
            same = (desc.producer_id, desc.epoch) == (state.producer_id, state.epoch)
            if same and desc.state is TxnState.EMPTY:
                # Apache Kafka says CompleteCommit or CompleteAbort after EndTxn at this epoch;
                # franz-go's kfake says Empty either way, which tells neither outcome.
                raise OutcomeUnknownError(
                    f"{tid!r}: the coordinator reports Empty at the stored producer id and "
                    f"epoch, not how the transaction ended, and the state {state} has no anchor "
                    "to check")
            return same and desc.state is TxnState.COMPLETE_COMMIT
        tp = self._anchor_partition(tid, state, anchor, desc)
        return self._anchors.committed(tp, anchor.offset, self._timeout_s,
                                       transactional_id=tid, state=str(state))

    def find_lost_commit_marker(self, tid: str, state: PreparedTxnState,
                                desc: TransactionDescription | None
                                ) -> tuple[TopicPartition, ActiveProducer] | None:
        """The anchor partition and its open transaction, if the coordinator completed the
        commit of the transaction ``state`` names but that partition never got the commit
        marker.

        Kafka's TransactionMarkerChannelManager skips a partition whose leader endpoint it
        cannot look up ("likely deleted already") and still completes the transaction. A broker
        that restarts as the only replica of the partition, its old registration not yet
        expired (it is fenced, leaderless, then elected again), does that to a PrepareCommit it
        reloads: the coordinator says CompleteCommit, and the partition keeps the transaction
        open for ever, its last stable offset stuck at the anchor (docs/design.md). The
        coordinator's CompleteCommit at the stored producer id and epoch is the stored
        transaction's (see :meth:`named_transaction_committed`), and the partition's open
        transaction of that producer id and epoch starts at the anchor offset: it is that
        transaction's.
        """
        anchor = state.anchor
        if (anchor is None or desc is None or desc.state is not TxnState.COMPLETE_COMMIT
                or (desc.producer_id, desc.epoch) != (state.producer_id, state.epoch)):
            return None
        tp = self._anchor_partition(tid, state, anchor, desc)
        try:
            with deadline_scope(min(self._timeout_s, _LOST_MARKER_CHECK_S)):
                producers = self._cp.describe_producers([tp]).get(tp, [])
        except BrokerUnreachableError:
            raise
        except DualWriteError as exc:
            # The topic or partition is gone (UNKNOWN_TOPIC_OR_PARTITION is retried up to the
            # bound above), or DescribeProducers is not allowed: nothing to repair here, and the
            # anchor check that follows says what became of the transaction.
            log.debug("transactional_id=%s: no lost-marker check on %s (%s)", tid, tp, exc)
            return None
        for producer in producers:
            if ((producer.producer_id, producer.epoch) == (state.producer_id, state.epoch)
                    and producer.current_txn_start_offset == anchor.offset):
                return tp, producer
        return None

    def commit_lost_marker(self, tid: str, state: PreparedTxnState,
                           desc: TransactionDescription | None) -> bool:
        """Write the commit marker :meth:`find_lost_commit_marker` finds missing; True if
        written.

        The outcome written is the coordinator's own decision, on the one partition known to be
        in the transaction (the coordinator no longer lists the others).
        """
        lost = self.find_lost_commit_marker(tid, state, desc)
        if lost is None:
            return False
        tp, producer = lost
        log.warning("transactional_id=%s producer_id=%d epoch=%d state=%s: the coordinator "
                    "completed the commit but %s never got its marker (its transaction is still "
                    "open at the anchor offset); writing the commit marker", tid,
                    state.producer_id, state.epoch, state, tp)
        self._cp.write_txn_marker(tp, state.producer_id, state.epoch, producer.coordinator_epoch,
                                  commit=True)
        return True

    def _anchor_partition(self, tid: str, state: PreparedTxnState, anchor: Anchor,
                          desc: TransactionDescription | None) -> TopicPartition:
        partitions = desc.partitions if desc is not None else frozenset()
        return self._anchors.partition(tid, state, anchor, partitions, self._timeout_s)

    def _wait_until_settled(self, tid: str, prefetched: Prefetched | None
                            ) -> TransactionDescription | None:
        """Describe ``tid``, waiting while the coordinator is mid-way through writing
        markers."""
        deadline = bounded(self._timeout_s).at
        if prefetched is not None:
            desc = prefetched.descriptions.get(tid)  # absent: the coordinator does not know it
        else:
            desc = self._cp.describe_transaction(tid)
        while True:
            if desc is None or desc.state not in (TxnState.PREPARE_COMMIT,
                                                  TxnState.PREPARE_ABORT,
                                                  TxnState.PREPARE_EPOCH_FENCE):
                return desc
            if time.monotonic() > deadline:
                raise RetriableError(f"transactional id {tid!r} stayed in {desc.state.value} "
                                     f"for {self._timeout_s:g} s; retry recovery")
            time.sleep(0.05)
            desc = self._cp.describe_transaction(tid)

    def _ask_after_unanswered_commit(self, sent: TransactionDescription,
                                     unanswered: OutcomeUnknownError
                                     ) -> TransactionDescription | None:
        """The coordinator's view after an EndTxn(commit) of ``sent`` got no answer (a cut
        connection, a timeout): once that transaction is no longer open, its description, and
        :meth:`complete` reads the outcome at the anchor. Still open, the unknown outcome
        stands: the EndTxn may arrive later, and one sent again could then meet a later
        transaction of the same producer id and epoch (KAFKA-17754); ``complete`` run again
        asks afresh."""
        tid = sent.transactional_id
        give_up = time.monotonic() + wait_s(_UNANSWERED_GRACE_S)
        try:
            while True:
                desc = self._wait_until_settled(tid, None)
                still_open = (desc is not None and desc.state is TxnState.ONGOING
                              and (desc.producer_id, desc.epoch) == (sent.producer_id,
                                                                     sent.epoch))
                if not still_open:
                    log.info("transactional_id=%s producer_id=%d epoch=%d: the EndTxn(commit) "
                             "got no answer; the coordinator now says %s", tid, sent.producer_id,
                             sent.epoch, "nothing" if desc is None else desc.state.value)
                    return desc
                if time.monotonic() >= give_up:
                    raise unanswered
                time.sleep(0.1)
        except OutcomeUnknownError:
            raise
        except DualWriteError as exc:
            raise unanswered from exc

    def _wait_for_live_owner(self, tid: str, state: PreparedTxnState,
                             owner_alive: OwnerAlive) -> None:
        """Wait while the named transaction is open and its writer alive (it is committing
        it)."""
        log.info("transactional_id=%s state=%s is open and its writer holds the lease: waiting "
                 "for it to commit its own transaction", tid, state)
        deadline = bounded(self._timeout_s).at
        while time.monotonic() < deadline:
            time.sleep(0.05)
            desc = self._cp.describe_transaction(tid)
            if (desc is None or not self.names_open_transaction(desc, state)
                    or not owner_alive()):
                return
        raise RetriableError(
            f"transactional_id={tid}: the transaction named by the stored state {state} is "
            f"still open after {self._timeout_s:g} s and the writer that prepared it still holds "
            "the id's lease (it may be paused); it is left to that writer — retry later, or stop "
            "that writer")


def complete(cp: ControlPlane, consumer_config: Mapping[str, Any], transactional_id: str,
             state: PreparedTxnState, *, timeout_s: float = 30.0,
             prefetched: Prefetched | None = None, owner_alive: OwnerAlive | None = None,
             only_identity: ProducerIdentity | None = None) -> Outcome:
    """Commit the transaction ``state`` names if it is open, abort any other open one.

    Idempotent: running it again after success returns ``ALREADY_COMMITTED`` or ``NOTHING``.
    Raises :class:`HeuristicAbortError` when the named transaction was aborted by Kafka.
    ``owner_alive`` and ``only_identity``: see :meth:`Completion.end_open_transaction`.
    """
    return Completion(cp, consumer_config, timeout_s=timeout_s).complete(
        transactional_id, state, prefetched=prefetched, owner_alive=owner_alive,
        only_identity=only_identity)
