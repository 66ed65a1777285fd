"""The driver side of an exactly-once batch sink: decide, commit, recover.

The driver is the external transaction coordinator of each batch. Tasks open one Kafka
transaction per non-empty partition (the participants) and prepare it; the driver then

1. verifies that every participant is still open under the producer id and epoch it prepared
   with (a late zombie attempt could have re-initialised the id and aborted it);
2. records the decision with :class:`~dualwrite.decision_log.DecisionLog` (one database
   transaction, which also publishes the batch's staged rows);
3. commits every participant by (producer id, epoch) in parallel, from this process;
4. marks the batch completed and aborts every other open transaction of the sink (losing task
   attempts, speculative copies).

At the start of a run, :meth:`BatchCoordinator.recover` commits the participants of a decided but
not completed batch and aborts everything else the sink left open. Participant transactional ids
come from a bounded pool: ``<sink>-b<batch parity>-p<partition>-a<attempt>``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from dualwrite.completion import (
    Completion,
    complete,
    end_open_transaction,
    names_open_transaction,
    prefetch,
)
from dualwrite.control_plane import ControlPlane, TxnState
from dualwrite.decision_log import (
    DecisionLog,
    Participant,
    SinkRecord,
    StagingTable,
    check_sink_id,
)
from dualwrite.errors import (
    BatchHeuristicAbortError,
    DualWriteError,
    HeuristicAbortError,
    RetriableError,
)
from dualwrite.prepared_state import PreparedTxnState

__all__ = ["BatchCoordinator", "BatchTimings", "SinkRecovery", "transactional_id"]

log = logging.getLogger(__name__)

_OPEN_STATES = [TxnState.ONGOING, TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT]


def transactional_id(sink_id: str, batch_id: int, partition_id: int, attempt: int) -> str:
    """The pooled transactional id of one task attempt.

    Batch parity keeps a task of batch N+1 from re-initialising (and so aborting) a participant
    of batch N that a slow driver has not committed yet; the attempt number keeps retries and
    speculative copies of one partition from fencing each other.
    """
    return f"{sink_id}-b{batch_id % 2}-p{partition_id}-a{attempt}"


def _pool_pattern(sink_id: str) -> re.Pattern[str]:
    return re.compile(re.escape(sink_id) + r"-b[01]-p\d+-a\d+")


@dataclass
class BatchTimings:
    """Seconds spent in each driver phase of one batch (for logs and the benchmark)."""

    verify_s: float = 0.0
    decide_s: float = 0.0
    commit_s: float = 0.0
    complete_s: float = 0.0
    sweep_s: float = 0.0
    cleanup_s: float = 0.0
    """Deleting the batch's staged rows, after the commit (not part of the decision)."""
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
                 timeout_s: float = 30.0, parallelism: int = 16) -> None:
        self.sink_id = check_sink_id(sink_id)
        self.log = DecisionLog(engine)
        self.staging = staging
        self._config = dict(kafka_config)
        self._owns_cp = control_plane is None
        self.cp = control_plane or ControlPlane(kafka_config, timeout_s=timeout_s)
        self._timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(parallelism, thread_name_prefix=f"dualwrite-{sink_id}")
        self._pattern = _pool_pattern(sink_id)
        self.phase_hook: Callable[[str, int], None] | None = None
        """Called with a phase ("decided", "committed-one", "committed", "completed") and the batch
        id; the crash tests pause the driver there."""

    def _phase(self, name: str, batch_id: int) -> None:
        if self.phase_hook is not None:
            self.phase_hook(name, batch_id)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._owns_cp:
            self.cp.close()

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
        with self.log.locked(self.sink_id) as (conn, record):
            if record is not None and record.in_doubt:
                log.info("sink=%s batch=%d was decided but not completed: committing %d "
                         "participants", self.sink_id, record.last_batch_id,
                         len(record.participants))
                # Abort the others first: one that began earlier on a participant's partition
                # holds the stable offset below its anchor, where the check of a participant
                # that is no longer open would wait in vain.
                aborted = self.sweep(keep={p.transactional_id for p in record.participants})
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

    # -- one batch -----------------------------------------------------------------------------

    def verify(self, participants: Sequence[Participant]) -> None:
        """Raise :class:`RetriableError` unless every participant is open as it was prepared."""
        states = {p.transactional_id: p.state for p in participants}
        if not states:
            return
        found = prefetch(self.cp, states)
        lost = [tid for tid, state in states.items()
                if (desc := found.descriptions.get(tid)) is None
                or not names_open_transaction(self.cp, desc, state, found)]
        if lost:
            raise RetriableError(
                f"sink {self.sink_id!r}: participants {lost} are no longer open as prepared "
                "(re-initialised by a late task attempt, or timed out); the batch was not "
                "decided and will be written again")

    def decide(self, batch_id: int, participants: Sequence[Participant], *,
               verify: bool = True) -> bool:
        """Verify and record the decision under the sink's lock; False for a replay.

        Verifying under the lock serializes it with :meth:`recover` (e.g. a `dualwrite recover`
        run while the query is running): recovery either aborts the participants first, and
        verification fails, or sees the decision and commits them.
        """
        check = (lambda: self.verify(participants)) if verify else None
        return self.log.decide(self.sink_id, batch_id, participants, self.staging, check)

    def commit(self, batch_id: int, participants: Sequence[Participant]) -> int:
        """Commit every participant in parallel; returns how many are committed.

        A participant that is no longer open under its epoch is checked at its anchor offset:
        committed before is fine, aborted raises :class:`BatchHeuristicAbortError`.
        """
        if not participants:
            return 0
        # The first one alone, so that a crash test can stop the driver between two commits.
        committed = [self._commit_direct(participants[0])]
        self._phase("committed-one", batch_id)
        committed += self._pool.map(self._commit_direct, participants[1:])
        unsettled = [p for p, done in zip(participants, committed, strict=True) if not done]
        if not unsettled:
            return len(participants)
        # An open loser on a participant's partition holds the stable offset below the anchor
        # that the check has to read: abort the losers first.
        self.sweep(keep={p.transactional_id for p in participants})
        results = list(self._pool.map(self._complete, unsettled))
        heuristic = [r for r in results if isinstance(r, HeuristicAbortError)]
        if heuristic:
            raise BatchHeuristicAbortError(self.sink_id, batch_id, heuristic)
        return sum(committed) + sum(1 for r in results if r is Completion.COMMITTED)

    def _commit_direct(self, p: Participant) -> bool:
        """EndTxn(commit) by the prepared producer id and epoch; False if that did not settle it."""
        state = p.state
        try:
            self.cp.end_transaction(p.transactional_id, state.producer_id, state.epoch,
                                    commit=True)
            return True
        except DualWriteError as exc:
            # Fenced or invalid state: not open under this epoch any more. Unknown outcome:
            # never guess. Both are settled by reading the coordinator and the anchor.
            log.info("sink=%s transactional_id=%s producer_id=%d epoch=%d direct commit "
                     "failed (%s); completing from the prepared state", self.sink_id,
                     p.transactional_id, state.producer_id, state.epoch, exc)
            return False

    def _complete(self, p: Participant) -> Completion | HeuristicAbortError:
        state = p.state
        try:
            return complete(self.cp, self._config, p.transactional_id, state,
                            timeout_s=self._timeout_s)
        except HeuristicAbortError as exc:
            log.error("sink=%s transactional_id=%s producer_id=%d epoch=%d heuristic abort: %s",
                      self.sink_id, p.transactional_id, state.producer_id, state.epoch,
                      exc.detail)
            return exc

    def sweep(self, keep: Sequence[str] | set[str]) -> list[str]:
        """Abort every open transaction of the sink's id pool except ``keep``."""
        listed = self.cp.list_transactions(states=_OPEN_STATES, prefix=self.sink_id)
        lingering = [t.transactional_id for t in listed
                     if self._pattern.fullmatch(t.transactional_id)
                     and t.transactional_id not in keep]
        empty = PreparedTxnState.empty()

        def abort(tid: str) -> str | None:
            done, _ = end_open_transaction(self.cp, tid, empty, timeout_s=self._timeout_s)
            if done is Completion.ABORTED:
                log.info("sink=%s aborted lingering transactional_id=%s", self.sink_id, tid)
                return tid
            return None

        return [tid for tid in self._pool.map(abort, lingering) if tid is not None]

    def _decide_or_ask(self, batch_id: int, participants: Sequence[Participant],
                       verify: Callable[[], None]) -> bool:
        """:meth:`decide`; if it fails, ask the database whether the decision was recorded.

        Recorded: go on and commit. Not recorded: abort the participants (they would stall
        read_committed readers until the next run) and re-raise. The database cannot answer:
        leave everything to recovery, never guess.
        """
        try:
            return self.log.decide(self.sink_id, batch_id, participants, self.staging, verify)
        except Exception as failure:
            try:
                record = self.log.read(self.sink_id)
            except Exception:
                log.error("sink=%s batch=%d: the decision failed (%s) and the database cannot "
                          "say whether it was recorded; restart the query or run `dualwrite "
                          "recover`", self.sink_id, batch_id, failure)
                raise failure from None
            if (record is not None and record.last_batch_id == batch_id
                    and {p.transactional_id for p in record.participants}
                    == {p.transactional_id for p in participants}):
                log.warning("sink=%s batch=%d: the decision reported %r but was recorded; "
                            "committing", self.sink_id, batch_id, failure)
                return True
            if record is None or record.last_batch_id < batch_id:
                self.sweep(keep=())  # not decided: nothing may stay open
            raise

    def finish(self, batch_id: int, participants: Sequence[Participant]) -> BatchTimings | None:
        """Verify, decide, commit, complete, sweep. None if the batch was decided before."""
        timings = BatchTimings()
        t0 = time.perf_counter()

        def verify() -> None:
            started = time.perf_counter()
            self.verify(participants)
            timings.verify_s = time.perf_counter() - started

        if not self._decide_or_ask(batch_id, participants, verify):
            self.sweep(keep=())
            return None
        t2 = time.perf_counter()
        log.info("sink=%s batch=%d decided participants=%s", self.sink_id, batch_id,
                 ",".join(p.transactional_id for p in participants) or "-")
        self._phase("decided", batch_id)
        self.commit(batch_id, participants)
        t3 = time.perf_counter()
        self._phase("committed", batch_id)
        if participants:
            self.log.mark_completed(self.sink_id, batch_id)
        t4 = time.perf_counter()
        self._phase("completed", batch_id)
        timings.aborted = self.sweep(keep={p.transactional_id for p in participants})
        t5 = time.perf_counter()
        if self.staging is not None:
            self.staging.purge(self.sink_id, up_to_batch=batch_id)
        t6 = time.perf_counter()
        timings.decide_s, timings.commit_s = t2 - t0 - timings.verify_s, t3 - t2
        timings.complete_s, timings.sweep_s, timings.cleanup_s = t4 - t3, t5 - t4, t6 - t5
        log.info("sink=%s batch=%d committed %d participants (%d records); verify %.0f ms, "
                 "decide %.0f ms, commit %.0f ms, sweep %.0f ms, aborted %d", self.sink_id,
                 batch_id, len(participants), sum(p.records for p in participants),
                 timings.verify_s * 1e3, timings.decide_s * 1e3,
                 (timings.commit_s + timings.complete_s) * 1e3, timings.sweep_s * 1e3,
                 len(timings.aborted))
        return timings
