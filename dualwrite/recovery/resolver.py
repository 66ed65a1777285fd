"""Recovery: resolve every in-doubt transaction named in the state table, and report.

For each transactional id the state row is locked (so a live writer and recovery serialize), the
stored prepared state is completed (commit the named open transaction, abort any other, confirm an
earlier commit), and a resolved state is cleared so the next writer starts fast. A heuristic
outcome (the database committed, Kafka aborted) is reported and left in place until acknowledged.

Batch sinks (the Spark sink, :mod:`dualwrite.batch.coordinator`) keep their decisions in the
decision log instead of the state table: for each sink there, recovery commits the participants of
a decided but not completed batch and aborts every other open transaction of the sink's id pool,
exactly as the sink does itself when it starts.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC
from typing import Any

from sqlalchemy import Connection, Engine

from dualwrite.batch.coordinator import BatchCoordinator
from dualwrite.batch.decision_log import DecisionLog, SinkRecord, check_sink_id
from dualwrite.batch.naming import pool_pattern
from dualwrite.batch.prepared_writes import PreparedTransactions, gid_prefix
from dualwrite.database import create_engine, transaction
from dualwrite.deadline import deadline_scope
from dualwrite.errors import (
    BatchHeuristicAbortError,
    BrokerUnreachableError,
    DatabaseUnreachableError,
    DualWriteError,
    FatalError,
    HeuristicAbortError,
    OutcomeUnreadableError,
)
from dualwrite.participant.client_config import check_kafka_config
from dualwrite.participant.completion import Completion, Prefetched
from dualwrite.participant.control_plane import ControlPlane, TransactionDescription, TxnState
from dualwrite.participant.outcome import Outcome
from dualwrite.participant.prepared_state import PreparedTxnState, is_pulsar_state
from dualwrite.recovery import report as reports
from dualwrite.recovery.report import Condition, RecoveryResult, SinkRecoveryResult
from dualwrite.recovery.transactions import describe_open
from dualwrite.writer.lease import Leases
from dualwrite.writer.state_store import StateRow, StateStore

__all__ = ["PULSAR_ROW", "RecoveryRun", "pulsar_rows_left", "recover", "status"]

log = logging.getLogger(__name__)

# Ids resolved per database transaction and bulk request.
_CHUNK = 25

PULSAR_ROW = ("the row names a Pulsar transaction (a PulsarDualWriter's): recover it with "
              "`dualwrite recover --pulsar-url URL`")
_LIVE_WRITER = ("a live writer holds this transactional id's lease and finishes its own "
                "transactions; recovery leaves it alone")

Progress = Callable[[RecoveryResult], None]

# How long status waits to read one anchor (an open transaction may hold the partition's last
# stable offset below it): status answers quickly and says "could not be confirmed" instead.
_STATUS_ANCHOR_S = 5.0


class RecoveryRun:
    """One :func:`recover` run: its clients and options, and the state its threads share.

    The transactional ids of the state table are resolved in chunks on a thread pool, in two
    passes (:meth:`run`); the batch sinks in between (:meth:`recover_sinks`).
    """

    def __init__(self, engine: Engine, control_plane: ControlPlane,
                 kafka_config: Mapping[str, Any], *, acknowledge_heuristic: bool,
                 timeout_s: float, parallelism: int) -> None:
        self._engine = engine
        self._cp = control_plane
        self._config = kafka_config
        self._store = StateStore(engine)
        self._leases = Leases(engine)
        self._acknowledge = acknowledge_heuristic
        self._timeout_s = timeout_s
        self._completion = Completion(control_plane, kafka_config, timeout_s=timeout_s)
        self._parallelism = max(1, parallelism)
        self._lock = threading.Lock()
        self._aborted_first: set[str] = set()
        """Ids whose open transaction the first pass aborted (guarded by ``_lock``): the second
        pass reports them aborted, not already committed."""

    def run(self, ids: Sequence[str], sinks: Sequence[tuple[str, SinkRecord | None]],
            progress: Progress | None = None
            ) -> tuple[list[RecoveryResult], list[SinkRecoveryResult]]:
        """Resolve ``ids`` and recover ``sinks``; results in the order given.

        Pass 1 ends every open transaction; pass 2 checks anchors of the ones that had already
        ended (an open transaction of another id could hold their stable offset). The sinks run
        in between: their anchor checks need pass 1's aborts, and pass 2's need their lingering
        transactions ended.
        """
        with ThreadPoolExecutor(self._parallelism,
                                thread_name_prefix="dualwrite-recover") as pool:
            by_id = self._pass(pool, ids, first_pass=True, progress=progress)
            sink_results = self.recover_sinks(sinks) if sinks else []
            pending = [tid for tid in ids if tid not in by_id]
            by_id.update(self._pass(pool, pending, first_pass=False, progress=progress))
        return [by_id[tid] for tid in ids], sink_results

    # -- transactional ids of the state table --------------------------------------------------

    def _pass(self, pool: ThreadPoolExecutor, ids: Sequence[str], *, first_pass: bool,
              progress: Progress | None) -> dict[str, RecoveryResult]:
        """One pass over ``ids`` in chunks; the ids it resolved (the first pass leaves some)."""
        chunks = [ids[i:i + _CHUNK] for i in range(0, len(ids), _CHUNK)]
        futures = [pool.submit(self._resolve_chunk, chunk, first_pass) for chunk in chunks]
        resolved: dict[str, RecoveryResult] = {}
        for chunk, future in zip(chunks, futures, strict=True):
            for tid, result in zip(chunk, future.result(), strict=True):
                if result is None:
                    continue
                resolved[tid] = result
                if progress is not None:
                    progress(result)
        return resolved

    def _resolve_chunk(self, ids: Sequence[str], first_pass: bool
                       ) -> list[RecoveryResult | None]:
        """Resolve a few ids in one database transaction that holds their state-row locks.

        Only ids whose lease is free are touched (:mod:`dualwrite.writer.lease`): a live writer
        that holds its lease may begin its next transaction under the same (producer id, epoch)
        at any moment, where an EndTxn decided here could land; it is left alone, unclaimed,
        undisturbed. The others are claimed (their fencing generation raised and committed) and
        acted on only under locks that still show that claim: a writer whose lease lapsed learns
        from the generation that recovery may have acted. Holding the locks keeps writers of
        these ids out while the bulk answers are used. The first pass only ends open
        transactions and returns None for ids whose named transaction must still be checked at
        its anchor.
        """
        stored: dict[str, str] = {}
        try:
            with self._leases.hold_free(self._engine, ids) as held:
                results: dict[str, RecoveryResult | None] = {
                    tid: RecoveryResult(tid, "", Outcome.LEFT_TO_WRITER, _LIVE_WRITER)
                    for tid in ids if tid not in held.ids}
                acting = [tid for tid in ids if tid in held.ids]
                if acting:
                    results.update(self._resolve_held(held.connection, held.backend_pid,
                                                      acting, first_pass, stored))
                return [results[tid] for tid in ids]
        except (BrokerUnreachableError, DatabaseUnreachableError) as exc:
            return [RecoveryResult(tid, stored.get(tid, ""), Outcome.FAILED, str(exc),
                                   unreachable=True) for tid in ids]
        except DualWriteError as exc:
            log.error("recovery of %d transactional ids failed: %s", len(ids), exc)
            return [RecoveryResult(tid, stored.get(tid, ""), Outcome.FAILED, str(exc),
                                   fatal=isinstance(exc, FatalError)) for tid in ids]

    def _resolve_held(self, lease_conn: Connection | None, lease_pid: int | None,
                      ids: Sequence[str], first_pass: bool, stored: dict[str, str]
                      ) -> dict[str, RecoveryResult | None]:
        """:meth:`_resolve_chunk` for ids whose leases recovery holds (on ``lease_conn``'s
        session, server process ``lease_pid``, which then does the work too: one connection
        per chunk). Fills ``stored`` with each id's state text as read, for the chunk's failure
        report."""
        results: dict[str, RecoveryResult | None] = {}
        # A row held by an orphaned session (idle in transaction): LockTimeoutError after
        # timeout_s, not a wait without end.
        claimed = self._store.claim(ids, connection=lease_conn, timeout_s=self._timeout_s)
        with transaction(self._engine, connection=lease_conn) as conn:
            self._leases.verify_session(conn, lease_pid)
            states: dict[str, PreparedTxnState] = {}
            rows = self._store.lock_rows(conn, ids, timeout_s=self._timeout_s)
            for tid, row in rows.items():
                text = stored[tid] = row.prepared_txn_state
                if row.fencing_generation != claimed[tid]:
                    results[tid] = RecoveryResult(
                        tid, text, Outcome.FAILED, "a writer of this transactional id started "
                        "while recovery was about to act on it; nothing was done: run recovery "
                        "again once that writer has stopped (or let it finish the id itself)")
                    continue
                if is_pulsar_state(text):
                    results[tid] = RecoveryResult(tid, text, Outcome.FAILED, PULSAR_ROW)
                    continue
                try:
                    states[tid] = PreparedTxnState.parse(text)
                except DualWriteError as exc:
                    results[tid] = RecoveryResult(tid, text, Outcome.FAILED, str(exc))
            prefetched = self._completion.prefetch(states)
            for tid, state in states.items():
                results[tid] = self._resolve_one(conn, tid, state, prefetched, first_pass)
        return results

    def _resolve_one(self, conn: Connection, tid: str, state: PreparedTxnState,
                     prefetched: Prefetched, first_pass: bool) -> RecoveryResult | None:
        """One id under its row lock; None if the first pass must leave it to the second."""
        stored = str(state)
        try:
            if first_pass:
                done = self._end_open(tid, state, prefetched)
                if done is None:
                    return None
            else:
                done = self._complete(tid, state, prefetched)
        except (HeuristicAbortError, OutcomeUnreadableError) as exc:
            kind = (Outcome.HEURISTIC_ABORT if isinstance(exc, HeuristicAbortError)
                    else Outcome.OUTCOME_UNREADABLE)
            if not self._acknowledge:
                return RecoveryResult(tid, stored, kind, exc.detail)
            log.warning("acknowledged %s of transactional_id=%s state=%s", kind.value, tid,
                        stored)
            self._store.write(conn, tid, "")
            return RecoveryResult(tid, stored, Outcome.ACKNOWLEDGED, exc.detail)
        except (BrokerUnreachableError, DatabaseUnreachableError):
            raise
        except DualWriteError as exc:
            log.error("recovery of transactional_id=%s failed: %s", tid, exc)
            return RecoveryResult(tid, stored, Outcome.FAILED, str(exc),
                                  fatal=isinstance(exc, FatalError))
        if stored:
            self._store.write(conn, tid, "")  # resolved: the next writer starts without a check
        return RecoveryResult(tid, stored, done)

    def _end_open(self, tid: str, state: PreparedTxnState, prefetched: Prefetched
                  ) -> Outcome | None:
        """First pass: end the id's open transaction; None while its anchor must be checked."""
        ended, _ = self._completion.end_open_transaction(tid, state, prefetched=prefetched)
        if ended is Outcome.ABORTED:
            with self._lock:
                self._aborted_first.add(tid)
        if ended is not Outcome.COMMITTED and not state.is_empty:
            return None  # the anchor check waits until every open transaction ended
        return ended or Outcome.NOTHING

    def _complete(self, tid: str, state: PreparedTxnState, prefetched: Prefetched) -> Outcome:
        """Second pass: complete the state; an abort of the first pass is reported as such."""
        done = self._completion.complete(tid, state, prefetched=prefetched)
        with self._lock:
            aborted_first = tid in self._aborted_first
        return Outcome.ABORTED if done is Outcome.ALREADY_COMMITTED and aborted_first else done

    # -- batch sinks of the decision log -------------------------------------------------------

    def _coordinator(self, sink_id: str) -> BatchCoordinator:
        return BatchCoordinator(sink_id, self._engine, self._config, control_plane=self._cp,
                                timeout_s=self._timeout_s)

    def recover_sinks(self, sinks: Sequence[tuple[str, SinkRecord | None]]
                      ) -> list[SinkRecoveryResult]:
        """Recover every sink; lingering transactions of all of them are aborted first.

        Checking whether a participant that is no longer open committed reads its anchor offset
        with read_committed, which an open transaction that started earlier on that partition
        blocks: a lingering transaction of this or another sink, which only the later sweep
        would end. So every sink's pool is swept first (keeping an in-doubt batch's
        participants), and a sink that failed is tried once more after the others were
        completed. Each sweep runs under the sink's decision lock, so it may run beside the
        sink's running query: it can abort a batch that is not decided yet (the driver's
        verification fails and the batch is written again), never one that is being or has
        been decided.
        """
        swept = {sink_id: self._sweep(sink_id) for sink_id, _ in sinks}
        results = {s: self._recover_sink(s, r) for s, r in sinks}
        for sink_id, record in sinks:
            if results[sink_id].outcome is Outcome.FAILED and not results[sink_id].unreachable:
                retry = self._recover_sink(sink_id, record)
                if retry.outcome is not Outcome.FAILED:
                    results[sink_id] = retry
        out = []
        for sink_id, _ in sinks:
            result = results[sink_id]
            first = swept[sink_id]
            if first:
                aborted = tuple(dict.fromkeys([*first, *result.aborted]))
                outcome = Outcome.ABORTED if result.outcome is Outcome.NOTHING else result.outcome
                result = dataclasses.replace(result, aborted=aborted, outcome=outcome)
            out.append(result)
        return out

    def _sweep(self, sink_id: str) -> list[str]:
        """Abort the sink's lingering transactions; a failure is reported by the recovery
        proper, which runs next."""
        try:
            with self._coordinator(sink_id) as coordinator:
                # Under the decision lock a running driver verifies and decides under: the
                # keep-set is read there, and no decision can land while the sweep runs.
                return coordinator.abort_lingering()
        except DualWriteError as exc:
            log.warning("sink=%s aborting lingering transactions failed: %s", sink_id, exc)
            return []

    def _recover_sink(self, sink_id: str, record: SinkRecord | None) -> SinkRecoveryResult:
        """``BatchCoordinator.recover`` for one sink, as a result instead of an exception."""
        batch = record.last_batch_id if record is not None else None
        in_doubt = record is not None and record.in_doubt
        try:
            with self._coordinator(sink_id) as coordinator:
                try:
                    done = coordinator.recover()
                except BatchHeuristicAbortError as exc:
                    if not self._acknowledge:
                        return SinkRecoveryResult(sink_id, exc.batch_id, True,
                                                  Outcome.HEURISTIC_ABORT, detail=str(exc))
                    # Asked without acknowledging first, so that the report can say it
                    # happened; again, acknowledging: the batch is marked completed, lingering
                    # ones aborted.
                    log.warning("sink=%s batch=%d acknowledged heuristic abort: %s", sink_id,
                                exc.batch_id, exc)
                    done = coordinator.recover(acknowledge_heuristic=True)
                    return SinkRecoveryResult(sink_id, exc.batch_id, True, Outcome.ACKNOWLEDGED,
                                              done.committed, done.aborted, str(exc))
        except (BrokerUnreachableError, DatabaseUnreachableError) as exc:
            return SinkRecoveryResult(sink_id, batch, in_doubt, Outcome.FAILED, detail=str(exc),
                                      unreachable=True)
        except DualWriteError as exc:
            log.error("recovery of sink=%s failed: %s", sink_id, exc)
            return SinkRecoveryResult(sink_id, batch, in_doubt, Outcome.FAILED, detail=str(exc))
        if done.completed_batch is not None:
            outcome = Outcome.COMMITTED if done.committed else Outcome.ALREADY_COMMITTED
            batch = done.completed_batch
        else:
            outcome = Outcome.ABORTED if done.aborted else Outcome.NOTHING
        return SinkRecoveryResult(sink_id, batch, in_doubt, outcome, done.committed,
                                  done.aborted)


def _sinks_to_recover(engine: Engine, transactional_ids: Sequence[str] | None,
                      sink_ids: Sequence[str] | None) -> list[tuple[str, SinkRecord | None]]:
    """The sinks :func:`recover` handles, with their last decision (None: not in the log)."""
    if sink_ids is None:
        if transactional_ids is not None:
            return []  # only the given transactional ids
        decisions = DecisionLog(engine)
        if not decisions.has_tables():
            return []  # a schema before revision 0002: no batch sinks
        return [(r.sink_id, r) for r in decisions.read_all()]
    wanted = [check_sink_id(s) for s in dict.fromkeys(sink_ids)]
    if not wanted:
        return []
    decisions = DecisionLog(engine)
    # Missing tables with explicit sinks: the coordinator reports MigrationRequiredError.
    found = {r.sink_id: r for r in decisions.read_all(wanted)} if decisions.has_tables() else {}
    return [(s, found.get(s)) for s in wanted]


def pulsar_rows_left(engine: Engine, transactional_ids: Sequence[str] | None = None
                     ) -> list[RecoveryResult]:
    """The ids (all, or these) whose rows name a Pulsar transaction, as failed results: what
    recovery without a Pulsar URL says of them (they are ``recover_pulsar``'s)."""
    return [RecoveryResult(r.transactional_id, r.prepared_txn_state, Outcome.FAILED, PULSAR_ROW)
            for r in StateStore(engine).read_all(transactional_ids)
            if is_pulsar_state(r.prepared_txn_state)]


def recover(engine: Engine | str, kafka_config: Mapping[str, Any],
            transactional_ids: Sequence[str] | None = None, *,
            sink_ids: Sequence[str] | None = None, parallelism: int = 8,
            acknowledge_heuristic: bool = False, timeout_s: float = 30.0,
            progress: Progress | None = None) -> reports.RecoveryReport:
    """Resolve all (or the given) transactional ids of the state table and the batch sinks of
    the decision log; safe to run twice.

    ``sink_ids``: the batch sinks to recover; by default every sink in the decision log (none if
    the database predates it), or none when ``transactional_ids`` are given. For each sink the
    participants of a decided, not completed batch are committed and every other open
    transaction of its id pool is aborted (:meth:`BatchCoordinator.recover`; staged rows are
    left to the sink), under the sink's decision lock: it may run beside the sink's running
    query (a batch not decided yet may be aborted and is written again; a decided one is kept).
    An id whose live writer holds its lease is left to that writer (``left-to-live-writer``).

    Returns a report; it does not raise for per-id or per-sink problems (see ``report.ok``).
    With ``acknowledge_heuristic`` a heuristic abort is recorded as seen (its state cleared, or
    its batch marked completed), after the application re-published the lost records.
    """
    started = time.monotonic()
    kafka_config = check_kafka_config(kafka_config)  # bad input fails before any work
    engine = create_engine(engine) if isinstance(engine, str) else engine
    with deadline_scope(timeout_s):  # the start: an unreachable side fails it within timeout_s
        if transactional_ids is None:  # a PulsarDualWriter's rows are recover_pulsar's
            ids = [r.transactional_id for r in StateStore(engine).read_all()
                   if not is_pulsar_state(r.prepared_txn_state)]
        else:
            ids = list(dict.fromkeys(transactional_ids))
        sinks = _sinks_to_recover(engine, transactional_ids, sink_ids)
        cp = ControlPlane(kafka_config, timeout_s=timeout_s) if ids or sinks else None
    results: list[RecoveryResult] = []
    sink_results: list[SinkRecoveryResult] = []
    if cp is not None:
        with cp:
            run = RecoveryRun(engine, cp, kafka_config, acknowledge_heuristic=acknowledge_heuristic,
                              timeout_s=timeout_s, parallelism=parallelism)
            results, sink_results = run.run(ids, sinks, progress)
    report = reports.RecoveryReport(tuple(results), time.monotonic() - started, tuple(sink_results))
    log.info("recovery finished in %.2f s: %s; sinks %s", report.elapsed_s,
             report.as_dict()["counts"], {s.sink_id: s.outcome.value for s in report.sinks})
    return report


def status(engine: Engine | str, kafka_config: Mapping[str, Any], *,
           prefix: str | None = None, timeout_s: float = 30.0) -> reports.StatusReport:
    """Every state row classified (:class:`~dualwrite.recovery.report.Condition`), batch sinks,
    and hanging transactions.

    A row is *in doubt* only when a decision is still to be carried out: its stored state names
    a transaction still open, another transaction of the id is open, or the stored
    transaction's outcome cannot be confirmed. A row left by a writer that stopped without
    ``close()`` whose transaction is committed at the broker is *completed*, an id whose lease a
    live writer holds is left to it, and a transaction Kafka aborted although the database
    decided commit is *heuristic*. Status changes nothing (it takes free leases only for the
    instant of checking them).

    A hanging transaction is open at the broker under a transactional id that has no state row
    and is not in the id pool of a batch sink of the decision log (optionally only ids starting
    with ``prefix``): nothing in the database will ever finish it. Open transactions of a sink's
    pool are reported under the sink: its in-doubt batch's participants, and the others as
    lingering (``dualwrite recover`` or the sink's next start aborts them).
    """
    kafka_config = check_kafka_config(kafka_config)  # bad input fails before any work
    engine = create_engine(engine) if isinstance(engine, str) else engine
    with deadline_scope(timeout_s):
        return _status(engine, kafka_config, prefix, timeout_s)


def _status(engine: Engine, kafka_config: Mapping[str, Any], prefix: str | None,
            timeout_s: float) -> reports.StatusReport:
    rows: list[StateRow] = StateStore(engine).read_all()
    decisions = DecisionLog(engine)
    records = decisions.read_all() if decisions.has_tables() else []
    known = {r.transactional_id for r in rows}
    pools = [(r.sink_id, pool_pattern(r.sink_id)) for r in records]

    def owner(tid: str) -> str | None:
        return next((sink for sink, pattern in pools if pattern.fullmatch(tid)), None)

    with Leases(engine).hold_free(engine, known) as held:
        live = known - held.ids
    participant_ids = [p.transactional_id for r in records for p in r.participants]
    with ControlPlane(kafka_config, timeout_s=timeout_s) as cp:
        described = cp.describe_transactions([r.transactional_id for r in rows]
                                             + participant_ids)
        completion = Completion(cp, kafka_config, timeout_s=min(timeout_s, _STATUS_ANCHOR_S))
        joined = tuple(_classify(completion, r, described.get(r.transactional_id),
                                 r.transactional_id in live) for r in rows)
        # The sinks' pools need every open transaction, not only those matching ``prefix``.
        open_now = [d for d in describe_open(cp, prefix=None if pools else prefix, exclude=known)
                    if owner(d.transactional_id) is not None or prefix is None
                    or d.transactional_id.startswith(prefix)]
    hanging = [d for d in open_now if owner(d.transactional_id) is None]
    lingering: dict[str, list[TransactionDescription]] = {}
    for r in records:
        keep = {p.transactional_id for p in r.participants} if r.in_doubt else set()
        lingering[r.sink_id] = sorted(
            (d for d in open_now if owner(d.transactional_id) == r.sink_id
             and d.transactional_id not in keep), key=lambda d: d.transactional_id)
    prepared = PreparedTransactions(engine).list() if records else []
    sinks = tuple(
        reports.SinkStatus(
            r.sink_id, r.last_batch_id, r.completed, r.decided_at, r.completed_at,
            tuple(reports.SinkParticipantStatus(
                p.partition_id, p.transactional_id, p.state, p.records,
                described.get(p.transactional_id),
                p.database_txn.gid if p.database_txn is not None else None)
                  for p in r.participants),
            tuple(lingering[r.sink_id]),
            tuple(t for t in prepared if t.gid.startswith(gid_prefix(r.sink_id))))
        for r in records)
    hanging_sorted = tuple(sorted(hanging, key=lambda d: d.transactional_id))
    return reports.StatusReport(joined, hanging_sorted, sinks)


def _classify(completion: Completion, row: StateRow, desc: TransactionDescription | None,
              live: bool) -> reports.InDoubt:
    """One state row with its :class:`~dualwrite.recovery.report.Condition` and why
    (``completion``'s waits bounded for status: it answers quickly and says "could not be
    confirmed" instead)."""
    tid, text = row.transactional_id, row.prepared_txn_state

    def result(condition: Condition, detail: str) -> reports.InDoubt:
        return reports.InDoubt(tid, text, row.updated_at.astimezone(UTC), desc, condition,
                               detail)

    if live:
        return result(Condition.LIVE_WRITER, _LIVE_WRITER)
    if is_pulsar_state(text):
        return result(Condition.IN_DOUBT, "the row names a Pulsar transaction (a "
                      "PulsarDualWriter's): pass --pulsar-url to tell whether it is committed")
    try:
        state = PreparedTxnState.parse(text)
    except DualWriteError as exc:
        return result(Condition.IN_DOUBT, f"{exc}; `dualwrite recover` reports it for a human")
    if desc is not None and desc.state.in_flight:
        who = f"producer_id={desc.producer_id} epoch={desc.epoch}"
        if desc.state is not TxnState.ONGOING:
            return result(Condition.IN_DOUBT, f"the coordinator is writing the markers of "
                          f"{who} ({desc.state.value})")
        try:
            named = completion.names_open_transaction(desc, state)
        except DualWriteError as exc:  # the anchor's leader did not answer: say so, go on
            return result(Condition.IN_DOUBT, f"an open transaction of {who}; whether it is the "
                          f"stored one could not be checked ({exc}): run `dualwrite recover`")
        if named:
            return result(Condition.IN_DOUBT, "the database decided to commit this open "
                          "transaction; its Kafka commit is pending: run `dualwrite recover`")
        return result(Condition.IN_DOUBT, f"an open transaction of {who} that the database did "
                      "not decide (its writer stopped before the database COMMIT): `dualwrite "
                      "recover` aborts it" + ("" if state.is_empty else
                                               " and confirms the stored one's outcome"))
    if state.is_empty:
        return result(Condition.CLEAR, "")
    if (desc is not None and desc.state is TxnState.COMPLETE_COMMIT
            and (desc.producer_id, desc.epoch) == (state.producer_id, state.epoch)):
        # The session's last transaction committed. A writer commits in Kafka only what its
        # database COMMIT stored (recovery only what the state names), and the row keeps the
        # last stored state, so that transaction is the stored one.
        try:
            lost = completion.find_lost_commit_marker(tid, state, desc)
        except (BrokerUnreachableError, DatabaseUnreachableError):
            raise
        except DualWriteError as exc:
            return result(Condition.IN_DOUBT, "committed at the broker (CompleteCommit, same "
                          "producer id and epoch), but whether its anchor partition got the "
                          f"commit marker could not be checked ({exc}): run `dualwrite recover`")
        if lost is not None:
            tp, _ = lost
            return result(Condition.IN_DOUBT, "committed at the broker (CompleteCommit), but "
                          f"{tp} never got the commit marker (a broker lost it: docs/design.md) "
                          "and keeps the transaction open, read_committed consumers stuck: "
                          "`dualwrite recover` writes the marker")
        return result(Condition.COMPLETED, "committed at the broker (CompleteCommit, same "
                      "producer id and epoch): its writer stopped without close()")
    try:
        committed = completion.named_transaction_committed(tid, state, desc)
    except OutcomeUnreadableError as exc:
        return result(Condition.HEURISTIC, exc.detail)
    except (BrokerUnreachableError, DatabaseUnreachableError):
        raise
    except DualWriteError as exc:
        return result(Condition.IN_DOUBT, f"its outcome could not be confirmed ({exc}): run "
                      "`dualwrite recover`")
    if committed:
        return result(Condition.COMPLETED, "committed (its anchor record is visible to "
                      "read_committed): its writer stopped without close()")
    return result(Condition.HEURISTIC, "aborted by Kafka although the database decided to "
                  "commit it: `dualwrite recover` reports it, see the README")
