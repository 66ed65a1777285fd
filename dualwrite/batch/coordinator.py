"""The driver side of an exactly-once batch sink: decide, commit, recover.

The driver is the external transaction coordinator of each batch. Tasks open one Kafka
transaction per non-empty partition (the participants) and prepare it; the driver then

1. verifies that every participant is still open under the producer id and epoch it prepared
   with (a late zombie attempt could have re-initialised the id and aborted it);
2. records the decision with :class:`~dualwrite.batch.decision_log.DecisionLog` (one database
   transaction of O(participants) rows, naming the batch's winning staged rows);
3. commits every participant by (producer id, epoch) in parallel, from this process;
4. marks the batch completed, in one transaction with moving its staged rows into the target
   table, and aborts every other open transaction of the sink (losing task attempts,
   speculative copies).

Once a batch is decided it is only ever completed, never written again (its tasks would
re-initialise the pooled ids and abort its participants); an in-doubt batch is completed before
the next is decided or its replay skipped. At the start of a run, :meth:`BatchCoordinator.recover`
commits the participants of a decided but not completed batch and aborts everything else the sink
left open. All of it happens under the sink's decision lock (:meth:`DecisionLog.locked`).
Participant transactional ids come from a bounded pool (:mod:`dualwrite.batch.naming`).
Fault injection goes through :class:`CoordinatorHooks`, named points of the protocol.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from sqlalchemy import Engine

from dualwrite import metrics
from dualwrite.batch.decision_log import (
    DecisionLog,
    Participant,
    SinkRecord,
    StagingTable,
    check_sink_id,
)
from dualwrite.batch.naming import pool_pattern, transactional_id
from dualwrite.batch.prepared_writes import PreparedTransactions, gid_prefix
from dualwrite.errors import (
    BatchHeuristicAbortError,
    BatchInDoubtError,
    DualWriteError,
    FatalError,
    HeuristicAbortError,
    OutcomeUnknownError,
    OutcomeUnreadableError,
    PreparedRowsLostError,
    RecoverableError,
    RetriableError,
)
from dualwrite.participant.completion import Completion
from dualwrite.participant.control_plane import ControlPlane, TxnState
from dualwrite.participant.outcome import Outcome
from dualwrite.participant.prepared_state import PreparedTxnState

__all__ = ["BatchCoordinator", "BatchTimings", "CoordinatorHooks", "Point", "SinkRecovery"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_OPEN_STATES = [TxnState.ONGOING, TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT]


Point = Literal["verified", "decided", "committed-one", "committed", "completed"]
"""The named points of one batch, in order, at which :class:`CoordinatorHooks` is called."""


class CoordinatorHooks:
    """The seam for fault injection into the driver: called at named points of each batch.

    The default does nothing. A crash test subclasses it and raises (a driver crash, a broker
    going away) or pauses at a point; :mod:`dualwrite.spark.faults` is the implementation the
    Spark sink uses, driven by an environment variable. The points (see :data:`Point`):

    - ``verified``: under the sink's decision lock, participants verified, nothing decided yet;
    - ``decided``: the decision is recorded, no participant committed (again before each retry
      of the commits);
    - ``committed-one``: the first participant is committed, the others not yet;
    - ``committed``: every participant is committed, the batch not marked completed;
    - ``completed``: the batch is marked completed, losing attempts not aborted yet.

    An exception raised at a point is what the driver sees from the step that follows it.
    """

    def at(self, point: Point, batch_id: int) -> None:
        """Called at ``point`` of batch ``batch_id``."""


@dataclass
class BatchTimings:
    """Seconds spent in each driver phase of one batch (for logs and the benchmark)."""

    verify_s: float = 0.0
    decide_s: float = 0.0
    commit_s: float = 0.0
    complete_s: float = 0.0
    sweep_s: float = 0.0
    aborted: list[str] = field(default_factory=list)

    @property
    def commit_phase_s(self) -> float:
        """Decision plus participant commits: the fixed cost the sink adds to a batch."""
        return self.decide_s + self.commit_s + self.complete_s


@dataclass(frozen=True)
class SinkRecovery:
    """What :meth:`BatchCoordinator.recover` did at the start of a run."""

    sink_id: str
    completed_batch: int | None
    """The decided batch whose participants were committed now, if one was in doubt."""
    committed: int
    aborted: tuple[str, ...]
    purged_rows: int


class BatchCoordinator:
    """Decides and commits one sink's batches; one instance per running query (driver)."""

    def __init__(self, sink_id: str, engine: Engine, kafka_config: Mapping[str, Any], *,
                 staging: StagingTable | None = None, control_plane: ControlPlane | None = None,
                 timeout_s: float = 30.0, parallelism: int = 16,
                 hooks: CoordinatorHooks | None = None) -> None:
        """``control_plane``: a client the caller owns and closes (shared with others); without
        one the coordinator creates its own and :meth:`close` closes it. ``hooks``: see
        :class:`CoordinatorHooks` (default: none)."""
        self.sink_id = check_sink_id(sink_id)
        self.log = DecisionLog(engine)
        self.staging = staging
        self._config = dict(kafka_config)
        self._owns_cp = control_plane is None
        self._cp = control_plane or ControlPlane(kafka_config, timeout_s=timeout_s)
        self._timeout_s = timeout_s
        self._completion = Completion(self._cp, self._config, timeout_s=timeout_s)
        self._pool = ThreadPoolExecutor(parallelism, thread_name_prefix=f"dualwrite-{sink_id}")
        self._pattern = pool_pattern(sink_id)
        self._hooks = hooks or CoordinatorHooks()
        self._prepared = PreparedTransactions(engine)

    @property
    def control_plane(self) -> ControlPlane:
        """The control-plane client the coordinator acts through (not for closing)."""
        return self._cp

    def close(self) -> None:
        """Stop the commit threads; close the control plane if the coordinator created it."""
        self._pool.shutdown(wait=True)
        if self._owns_cp:
            self._cp.close()

    def __enter__(self) -> BatchCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def transactional_id(self, batch_id: int, partition_id: int, attempt: int) -> str:
        return transactional_id(self.sink_id, batch_id, partition_id, attempt)

    # -- start of a run ------------------------------------------------------------------------

    def recover(self, *, acknowledge_heuristic: bool = False) -> SinkRecovery:
        """Finish the last decided batch, abort every other open transaction, drop staged rows.

        Raises :class:`BatchHeuristicAbortError` if Kafka aborted a participant of the decided
        batch (the batch stays in doubt unless ``acknowledge_heuristic``).
        """
        completed_batch = None
        committed = 0
        aborted: list[str] = []
        with self.log.locked(self.sink_id, timeout_s=self._timeout_s) as (conn, record):
            self._check_readable(record)
            if record is not None and record.in_doubt:
                log.info("sink=%s batch=%d was decided but not completed: committing %d "
                         "participants", self.sink_id, record.last_batch_id,
                         len(record.participants))
                # Abort the others first: one that began earlier on a participant's partition
                # holds the stable offset below its anchor, where the check of a participant
                # that is no longer open would wait in vain.
                aborted = self.sweep(keep=record.participants)
                try:
                    committed = self.commit(record.last_batch_id, record.participants)
                except BatchHeuristicAbortError:
                    if not acknowledge_heuristic:
                        raise
                    log.warning("sink=%s batch=%d heuristic abort acknowledged", self.sink_id,
                                record.last_batch_id)
                self.log.mark_completed(self.sink_id, record.last_batch_id, conn)
                completed_batch = record.last_batch_id
            aborted += self.sweep(keep=())
        purged = self.staging.purge(self.sink_id) if self.staging is not None else 0
        if aborted or purged:
            log.info("sink=%s aborted %d lingering transactions, dropped %d staged rows",
                     self.sink_id, len(aborted), purged)
        return SinkRecovery(self.sink_id, completed_batch, committed, tuple(aborted), purged)

    def last_decided(self) -> SinkRecord | None:
        return self.log.read(self.sink_id)

    def _check_readable(self, record: SinkRecord | None) -> None:
        if record is not None and record.invalid is not None:
            raise FatalError(f"sink {self.sink_id!r} batch {record.last_batch_id}: the decision "
                             f"log holds an unreadable {record.invalid}; repair that row")

    def settle(self) -> int | None:
        """Complete the sink's in-doubt batch, if any, under its decision lock; its id or None.

        A decided batch is finished before anything else happens to the sink: before the next
        batch is decided, and before a replay of it is skipped.
        """
        with self.log.locked(self.sink_id, timeout_s=self._timeout_s) as (conn, record):
            self._check_readable(record)
            if record is None or not record.in_doubt:
                return None
            log.info("sink=%s batch=%d is in doubt: committing its %d participants first",
                     self.sink_id, record.last_batch_id, len(record.participants))
            self.commit(record.last_batch_id, record.participants)
            self.log.mark_completed(self.sink_id, record.last_batch_id, conn)
            return record.last_batch_id

    def should_write(self, batch_id: int) -> bool:
        """Whether ``batch_id`` still has to be written; False for a replay of a decided batch.

        An in-doubt batch is completed first (:meth:`settle`), never skipped blindly nor
        written again: its tasks would re-initialise the pooled ids and abort its participants.
        """
        record = self.log.read(self.sink_id)
        if record is not None and record.in_doubt:
            self.settle()
        if record is not None and batch_id <= record.last_batch_id:
            log.info("sink=%s batch=%d already decided (last %d): skipping the replay",
                     self.sink_id, batch_id, record.last_batch_id)
            return False
        return True

    # -- one batch -----------------------------------------------------------------------------

    def verify(self, participants: Sequence[Participant]) -> None:
        """Raise :class:`RetriableError` unless every participant is open as it was prepared."""
        states = {p.transactional_id: p.state for p in participants}
        if not states:
            return
        found = self._completion.prefetch(states)
        lost = [tid for tid, state in states.items()
                if (desc := found.descriptions.get(tid)) is None
                or not self._completion.names_open_transaction(desc, state, found)]
        txns = {p.database_txn: p.transactional_id for p in participants
                if p.database_txn is not None}
        rows_lost = []
        if txns:
            prepared = self._prepared.still_prepared(list(txns))
            rows_lost = [tid for txn, tid in txns.items() if txn.gid not in prepared]
        if lost or rows_lost:
            what = " and ".join(
                f"the {kind} of participants {tids}" for kind, tids in (
                    ("Kafka transactions", lost), ("prepared database transactions", rows_lost))
                if tids)
            raise RetriableError(
                f"sink {self.sink_id!r}: {what} are no longer open as prepared "
                "(re-initialised or rolled back by a late task attempt, or timed out); the "
                "batch was not decided and will be written again")

    def decide(self, batch_id: int, participants: Sequence[Participant], *,
               verify: bool = True) -> bool:
        """Verify and record the decision under the sink's lock; False for a replay.

        Verifying under the lock serializes it with :meth:`recover` (e.g. a `dualwrite recover`
        run while the query is running): recovery either aborts the participants first, and
        verification fails, or sees the decision and commits them.
        """
        check = (lambda: self.verify(participants)) if verify else None
        return self.log.decide(self.sink_id, batch_id, participants, self.staging, check,
                               timeout_s=self._timeout_s)

    def commit(self, batch_id: int, participants: Sequence[Participant]) -> int:
        """Commit every participant in parallel; returns how many are committed.

        A participant that is no longer open under its epoch is checked at its anchor offset:
        committed before is fine, aborted raises :class:`BatchHeuristicAbortError`.
        """
        if not participants:
            return 0
        # The first one alone, so that a crash test can stop the driver between two commits.
        lost: list[PreparedRowsLostError | OutcomeUnreadableError] = []
        committed = self._commit_direct(participants[:1], lost)
        self._hooks.at("committed-one", batch_id)
        committed += self._commit_direct(participants[1:], lost)
        unsettled = [p for p, done in zip(participants, committed, strict=True) if not done]
        results: list[Outcome | HeuristicAbortError] = []
        if unsettled:
            # An open loser on a participant's partition holds the stable offset below the
            # anchor that the check has to read: abort the losers first.
            self.sweep(keep=participants)
            results = list(self._pool.map(self._complete, unsettled))
        heuristic: list[HeuristicAbortError | OutcomeUnreadableError | PreparedRowsLostError] = [
            *(r for r in results if isinstance(r, HeuristicAbortError)), *lost]
        if heuristic:
            raise BatchHeuristicAbortError(self.sink_id, batch_id, heuristic)
        return sum(committed) + sum(1 for r in results if r is Outcome.COMMITTED)

    def _commit_direct(self, participants: Sequence[Participant],
                       lost: list[PreparedRowsLostError | OutcomeUnreadableError]
                       ) -> list[bool]:
        """EndTxn(commit) by each prepared producer id and epoch, all sent at once (one
        connection per coordinator, see :meth:`ControlPlane.end_transactions`); for each, False
        if that did not settle it. Their prepared database transactions are committed at the
        same time, one connection each; one rolled back by someone else (or no longer
        answerable) goes to ``lost``.

        Sending them at once, and again after a failure (here, in :meth:`_complete` and in
        :meth:`_complete_decided`'s retries), is safe against KAFKA-17754 (a delayed EndTxn
        landing on a later transaction of the same producer id and epoch) because a
        participant's (producer id, epoch) is used for one transaction only: its task closed the
        producer after preparing, and a later attempt or batch on the pooled id initialises it
        again, which bumps the epoch. A late copy can only end this transaction, which the
        decision says to commit.
        """
        if not participants:
            return []
        rows = [self._pool.submit(self._prepared.commit, p.transactional_id, p.database_txn)
                for p in participants if p.database_txn is not None]
        ends = [(p.transactional_id, p.state.producer_id, p.state.epoch) for p in participants]
        try:
            results = self._cp.end_transactions(ends, commit=True)
        except DualWriteError as exc:
            results = [exc] * len(participants)
        failed: list[BaseException] = []
        for future in rows:  # all of them, so that a retry never overlaps one still running
            try:
                future.result()
            except (PreparedRowsLostError, OutcomeUnreadableError) as exc:
                lost.append(exc)
            except Exception as exc:  # typed by PreparedTransactions; waited for all the same
                failed.append(exc)
        if failed:
            raise failed[0]
        for p, error in zip(participants, results, strict=True):
            if error is not None:
                # Fenced or invalid state: not open under this epoch any more. Unknown outcome:
                # never guess. Both are settled by reading the coordinator and the anchor.
                log.info("sink=%s transactional_id=%s producer_id=%d epoch=%d direct commit "
                         "failed (%s); completing from the prepared state", self.sink_id,
                         p.transactional_id, p.state.producer_id, p.state.epoch, error)
        return [error is None for error in results]

    def _complete(self, p: Participant) -> Outcome | HeuristicAbortError:
        state = p.state
        try:
            return self._completion.complete(p.transactional_id, state)
        except HeuristicAbortError as exc:
            log.error("sink=%s transactional_id=%s producer_id=%d epoch=%d heuristic abort: %s",
                      self.sink_id, p.transactional_id, state.producer_id, state.epoch,
                      exc.detail)
            return exc

    def abort_lingering(self) -> list[str]:
        """Abort the pool's open transactions except an in-doubt batch's participants, and drop
        the staged rows of decided batches (a straggler can stage after its batch's clean-up).

        The keep-set is read and the sweep runs under the sink's decision lock, so a decision in
        progress (by a driver beside it) is waited for and its participants are kept.
        """
        with self.log.locked(self.sink_id, timeout_s=self._timeout_s) as (_, record):
            if record is not None and record.invalid is not None:
                self._check_readable(record)
            keep = record.participants if record is not None and record.in_doubt else ()
            aborted = self.sweep(keep=keep)
        if self.staging is not None and record is not None:
            # A completed batch's winners were applied; what is left of it and older batches is
            # garbage. An in-doubt batch's rows wait for its completion, which applies them.
            last = record.last_batch_id if not record.in_doubt else record.last_batch_id - 1
            purged = self.staging.purge(self.sink_id, up_to_batch=last)
            if purged:
                log.info("sink=%s dropped %d staged rows of decided batches (stragglers)",
                         self.sink_id, purged)
        return aborted

    def sweep(self, keep: Sequence[Participant]) -> list[str]:
        """Abort every open transaction of the sink's id pool, and roll back every prepared
        database transaction of the sink, except those of the participants in ``keep``.

        Returns the transactional ids and gids it ended.
        """
        keep_tids = {p.transactional_id for p in keep}
        keep_gids = {p.database_txn.gid for p in keep if p.database_txn is not None}
        listed = self._cp.list_transactions(states=_OPEN_STATES, prefix=self.sink_id)
        lingering = [t.transactional_id for t in listed
                     if self._pattern.fullmatch(t.transactional_id)
                     and t.transactional_id not in keep_tids]
        prepared = [t.gid for t in self._prepared.list(gid_prefix(self.sink_id))
                    if t.gid not in keep_gids]
        empty = PreparedTxnState.empty()

        def abort(tid: str) -> str | None:
            done, _ = self._completion.end_open_transaction(tid, empty)
            if done is Outcome.ABORTED:
                log.info("sink=%s aborted lingering transactional_id=%s", self.sink_id, tid)
                return tid
            return None

        def roll_back(gid: str) -> str | None:
            if self._prepared.rollback(gid):
                log.info("sink=%s rolled back lingering prepared database transaction gid=%s",
                         self.sink_id, gid)
                return gid
            return None

        ended = [*self._pool.map(abort, lingering), *self._pool.map(roll_back, prepared)]
        return [x for x in ended if x is not None]

    def _decide_or_ask(self, batch_id: int, participants: Sequence[Participant],
                       verify: Callable[[], None]) -> bool:
        """Decide; an in-doubt earlier batch is completed first; a failure is asked about.

        Recorded: go on and commit. Not recorded: abort what the batch left open (it would stall
        read_committed readers until the next run) and re-raise. The database cannot answer:
        :class:`OutcomeUnknownError`, everything left to recovery, nothing aborted.
        """
        for _ in range(3):
            progress: list[str] = []
            try:
                return self.log.decide(self.sink_id, batch_id, participants, self.staging,
                                       verify, timeout_s=self._timeout_s, progress=progress)
            except BatchInDoubtError:
                self.settle()  # nothing was written; complete the earlier batch, then decide
            except Exception as failure:
                if not progress:  # failed before its COMMIT was sent: certainly not decided
                    self._quietly("abort the undecided batch's participants",
                                  self.abort_lingering, list[str]())
                    raise
                return self._ask(batch_id, participants, failure)
        raise RetriableError(f"sink {self.sink_id!r} batch {batch_id}: an earlier batch stays in "
                             "doubt (is another driver of this sink running?); not decided")

    def _ask(self, batch_id: int, participants: Sequence[Participant],
             failure: Exception) -> bool:
        """Whether the failed decision was recorded, asked under the sink's decision lock.

        The lock is held by a failed session until its COMMIT has ended on the server (slow
        fsync, synchronous replication, a cut connection), so the answer cannot be the stale
        "not decided" of a COMMIT still in flight. The sweep of an undecided batch runs under
        the same lock, so no decision can land between the answer and the aborts.
        """
        tids = {p.transactional_id for p in participants}
        decided: bool | None = None
        try:
            with self.log.locked(self.sink_id, timeout_s=self._timeout_s) as (_, record):
                decided = (record is not None and record.last_batch_id == batch_id
                           and record.invalid is None
                           and {p.transactional_id for p in record.participants} == tids)
                if not decided and (record is None or record.last_batch_id < batch_id):
                    keep = (record.participants
                            if record is not None and record.in_doubt else ())
                    try:
                        self.sweep(keep=keep)  # not decided: nothing of this batch may stay open
                    except DualWriteError as exc:
                        log.warning("sink=%s batch=%d not decided; aborting its participants "
                                    "failed (%s): the next batch or start aborts them",
                                    self.sink_id, batch_id, exc)
        except DualWriteError as exc:
            if decided is None:
                log.error("sink=%s batch=%d: the decision failed (%s) and the database cannot "
                          "say whether it was recorded (%s); nothing is aborted, the sink's "
                          "next start or `dualwrite recover` finishes it", self.sink_id,
                          batch_id, failure, exc)
                raise OutcomeUnknownError(
                    f"sink {self.sink_id!r} batch {batch_id}: the decision failed ({failure}) and "
                    f"the database cannot say whether it was recorded ({exc}); restart the query "
                    "or run `dualwrite recover`, which finish what the database decided") \
                    from failure
        if decided:
            log.warning("sink=%s batch=%d: the decision reported %r but was recorded; "
                        "committing", self.sink_id, batch_id, failure)
            return True
        raise failure

    @metrics.records_batches
    def finish(self, batch_id: int, participants: Sequence[Participant]) -> BatchTimings | None:
        """Verify, decide, commit, complete, sweep. None if the batch was decided before.

        Raises :class:`RetriableError` only when the batch was not decided (write it again).
        Once it is decided no error may lead to writing it again (its tasks would re-initialise
        the pooled ids and abort its participants): its completion is retried for up to the
        coordinator's ``timeout_s``, then :class:`RecoverableError` says that the next batch,
        the next start or `dualwrite recover` completes it.
        """
        timings = BatchTimings()
        t0 = time.perf_counter()

        def verify() -> None:
            started = time.perf_counter()
            self.verify(participants)
            timings.verify_s = time.perf_counter() - started
            self._hooks.at("verified", batch_id)

        if not self._decide_or_ask(batch_id, participants, verify):
            self._quietly("abort lingering transactions", lambda: self.sweep(keep=()), list[str]())
            return None
        t2 = time.perf_counter()
        log.info("sink=%s batch=%d decided participants=%s", self.sink_id, batch_id,
                 ",".join(p.transactional_id for p in participants) or "-")
        t3 = self._complete_decided(batch_id, participants)
        t4 = time.perf_counter()
        self._hooks.at("completed", batch_id)
        timings.aborted = self._quietly("abort losing attempts",
                                        lambda: self.sweep(keep=participants),
                                        list[str]())
        t5 = time.perf_counter()
        timings.decide_s, timings.commit_s = t2 - t0 - timings.verify_s, t3 - t2
        timings.complete_s, timings.sweep_s = t4 - t3, t5 - t4
        log.info("sink=%s batch=%d committed %d participants (%d records); verify %.0f ms, "
                 "decide %.0f ms, commit %.0f ms, sweep %.0f ms, aborted %d", self.sink_id,
                 batch_id, len(participants), sum(p.records for p in participants),
                 timings.verify_s * 1e3, timings.decide_s * 1e3,
                 (timings.commit_s + timings.complete_s) * 1e3, timings.sweep_s * 1e3,
                 len(timings.aborted))
        return timings

    def _complete_decided(self, batch_id: int, participants: Sequence[Participant]) -> float:
        """Commit a decided batch's participants and mark it completed, retrying transient
        failures until ``timeout_s``; returns when the commits ended (perf_counter)."""
        deadline = time.monotonic() + self._timeout_s
        delay = 0.2
        while True:
            try:
                self._hooks.at("decided", batch_id)
                self.commit(batch_id, participants)
                committed_at = time.perf_counter()
                self._hooks.at("committed", batch_id)
                if participants:
                    self.log.mark_completed(self.sink_id, batch_id)
                return committed_at
            except RetriableError as exc:
                if time.monotonic() + delay > deadline:
                    log.error("sink=%s batch=%d decided, completing it failed for %.0f s (%s); "
                              "left to the next batch, start or `dualwrite recover`",
                              self.sink_id, batch_id, self._timeout_s, exc)
                    raise RecoverableError(
                        f"sink {self.sink_id!r} batch {batch_id} was decided but committing its "
                        f"participants (and applying its rows) failed ({exc}); do not "
                        "write it again: the sink completes it before its next batch or at its "
                        "next start, or run `dualwrite recover`") from exc
                log.warning("sink=%s batch=%d decided; completing it failed (%s), retrying in "
                            "%.1f s", self.sink_id, batch_id, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _quietly(self, what: str, action: Callable[[], _T], default: _T) -> _T:
        """Run cleanup that follows a completed batch; a failure is logged, not raised (the next
        batch or start repeats it)."""
        try:
            return action()
        except DualWriteError as exc:
            log.warning("sink=%s: %s failed (%s); the next batch or start does it", self.sink_id,
                        what, exc)
            return default
