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
import enum
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine

from dualwrite.batch.coordinator import BatchCoordinator, _pool_pattern
from dualwrite.batch.decision_log import DecisionLog, SinkRecord, check_sink_id
from dualwrite.database import create_engine, transaction
from dualwrite.errors import (
    BatchHeuristicAbortError,
    BrokerUnreachableError,
    DatabaseUnreachableError,
    DualWriteError,
    HeuristicAbortError,
    OutcomeUnreadableError,
)
from dualwrite.participant.completion import (
    Completion,
    Prefetched,
    complete,
    end_open_transaction,
    prefetch,
)
from dualwrite.participant.control_plane import ControlPlane, TransactionDescription, TxnState
from dualwrite.participant.prepared_state import PreparedTxnState
from dualwrite.writer.lease import Leases
from dualwrite.writer.state_store import StateRow, StateStore

__all__ = [
    "InDoubt",
    "Outcome",
    "RecoveryReport",
    "RecoveryResult",
    "SinkParticipantStatus",
    "SinkRecoveryResult",
    "SinkStatus",
    "StatusReport",
    "recover",
    "status",
]

log = logging.getLogger(__name__)

# Ids resolved per database transaction and bulk request.
_CHUNK = 25


class Outcome(enum.Enum):
    COMMITTED = "committed"
    ALREADY_COMMITTED = "already-committed"
    ABORTED = "aborted"
    NOTHING = "nothing-to-do"
    HEURISTIC_ABORT = "heuristic-abort"
    OUTCOME_UNREADABLE = "outcome-unreadable"
    """The log no longer shows whether the named transaction committed (its anchor record was
    compacted or deleted): like a heuristic abort, it waits for --acknowledge-heuristic."""
    ACKNOWLEDGED = "heuristic-acknowledged"
    LEFT_TO_WRITER = "left-to-live-writer"
    """A live writer holds the id's lease: it finishes its own transactions (and recovery,
    acting by producer id and epoch, could end the writer's next one instead)."""
    FAILED = "failed"

    @property
    def resolved(self) -> bool:
        return self not in (Outcome.HEURISTIC_ABORT, Outcome.OUTCOME_UNREADABLE, Outcome.FAILED)


_FROM_COMPLETION = {
    Completion.COMMITTED: Outcome.COMMITTED,
    Completion.ALREADY_COMMITTED: Outcome.ALREADY_COMMITTED,
    Completion.ABORTED: Outcome.ABORTED,
    Completion.NOTHING: Outcome.NOTHING,
}


@dataclass(frozen=True)
class RecoveryResult:
    transactional_id: str
    state: str
    outcome: Outcome
    detail: str = ""
    unreachable: bool = False


@dataclass(frozen=True)
class SinkRecoveryResult:
    """What :func:`recover` did for one batch sink (see :mod:`dualwrite.batch.coordinator`)."""

    sink_id: str
    batch_id: int | None
    """The sink's last decided batch (None: the decision log has no entry for the sink)."""
    was_in_doubt: bool
    """That batch was decided but not every participant was known to be committed."""
    outcome: Outcome
    """COMMITTED / ALREADY_COMMITTED (an in-doubt batch was completed), ABORTED (only lingering
    transactions were aborted), NOTHING, HEURISTIC_ABORT, ACKNOWLEDGED or FAILED."""
    committed: int = 0
    """Participants that were still open and have been committed now."""
    aborted: tuple[str, ...] = ()
    """Lingering transactions of the sink's id pool that were aborted."""
    detail: str = ""
    unreachable: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"sink_id": self.sink_id, "batch_id": self.batch_id,
                "was_in_doubt": self.was_in_doubt, "outcome": self.outcome.value,
                "committed": self.committed, "aborted": list(self.aborted),
                "detail": self.detail}


@dataclass(frozen=True)
class RecoveryReport:
    """What :func:`recover` did, per transactional id and per batch sink."""

    results: tuple[RecoveryResult, ...]
    elapsed_s: float
    sinks: tuple[SinkRecoveryResult, ...] = ()

    @property
    def heuristic(self) -> list[RecoveryResult]:
        return [r for r in self.results
                if r.outcome in (Outcome.HEURISTIC_ABORT, Outcome.OUTCOME_UNREADABLE)]

    @property
    def failed(self) -> list[RecoveryResult]:
        return [r for r in self.results if r.outcome is Outcome.FAILED]

    @property
    def heuristic_sinks(self) -> list[SinkRecoveryResult]:
        return [s for s in self.sinks if s.outcome is Outcome.HEURISTIC_ABORT]

    @property
    def failed_sinks(self) -> list[SinkRecoveryResult]:
        return [s for s in self.sinks if s.outcome is Outcome.FAILED]

    @property
    def ok(self) -> bool:
        return (all(r.outcome.resolved for r in self.results)
                and all(s.outcome.resolved for s in self.sinks))

    def count(self, outcome: Outcome) -> int:
        """Transactional ids (of the state table) with this outcome."""
        return sum(1 for r in self.results if r.outcome is outcome)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "elapsed_s": round(self.elapsed_s, 3),
            "counts": {o.value: self.count(o) for o in Outcome if self.count(o)},
            "results": [
                {"transactional_id": r.transactional_id, "state": r.state,
                 "outcome": r.outcome.value, "detail": r.detail}
                for r in self.results
            ],
            "sinks": [s.as_dict() for s in self.sinks],
        }


_LIVE_WRITER = ("a live writer holds this transactional id's lease and finishes its own "
                "transactions; recovery leaves it alone")


def _resolve_chunk(store: StateStore, engine: Engine, cp: ControlPlane,
                   consumer_config: Mapping[str, Any], ids: Sequence[str],
                   acknowledge_heuristic: bool, timeout_s: float, first_pass: bool,
                   aborted_first: set[str]) -> list[RecoveryResult | None]:
    """Resolve a few ids in one database transaction that holds their state-row locks.

    Only ids whose lease is free are touched (:mod:`dualwrite.writer.lease`): a live writer that
    holds its lease may begin its next transaction under the same (producer id, epoch) at any
    moment, where an EndTxn decided here could land; it is left alone, unclaimed, undisturbed. The
    others are claimed (their fencing generation raised and committed) and acted on only under locks
    that still show that claim: a writer whose lease lapsed learns from the generation that recovery
    may have acted. Holding the locks keeps writers of these ids out while the bulk answers are
    used. The first pass only ends open transactions and returns None for ids whose named
    transaction must still be checked at its anchor.
    """
    stored: dict[str, str] = {}
    try:
        with Leases(engine).hold_free(engine, ids) as held:
            results: dict[str, RecoveryResult | None] = {
                tid: RecoveryResult(tid, "", Outcome.LEFT_TO_WRITER, _LIVE_WRITER)
                for tid in ids if tid not in held.ids}
            acting = [tid for tid in ids if tid in held.ids]
            if acting:
                _resolve_held(store, engine, held.connection, cp, consumer_config, acting,
                              acknowledge_heuristic, timeout_s, first_pass, aborted_first,
                              stored, results)
            return [results[tid] for tid in ids]
    except (BrokerUnreachableError, DatabaseUnreachableError) as exc:
        return [RecoveryResult(tid, stored.get(tid, ""), Outcome.FAILED, str(exc),
                               unreachable=True) for tid in ids]
    except DualWriteError as exc:
        log.error("recovery of %d transactional ids failed: %s", len(ids), exc)
        return [RecoveryResult(tid, stored.get(tid, ""), Outcome.FAILED, str(exc))
                for tid in ids]


def _resolve_held(store: StateStore, engine: Engine, lease_conn: Connection | None,
                  cp: ControlPlane, consumer_config: Mapping[str, Any], ids: Sequence[str],
                  acknowledge_heuristic: bool, timeout_s: float, first_pass: bool,
                  aborted_first: set[str], stored: dict[str, str],
                  results: dict[str, RecoveryResult | None]) -> None:
    """:func:`_resolve_chunk` for ids whose leases recovery holds (on ``lease_conn``'s session,
    which then does the work too: one connection per chunk)."""
    claimed = store.claim(ids, connection=lease_conn)
    with transaction(engine, connection=lease_conn) as conn:
        states: dict[str, PreparedTxnState] = {}
        for tid, row in store.lock_rows(conn, ids).items():
            text = stored[tid] = row.prepared_txn_state
            if row.fencing_generation != claimed[tid]:
                results[tid] = RecoveryResult(
                    tid, text, Outcome.FAILED, "a writer of this transactional id started "
                    "while recovery was about to act on it; nothing was done: run recovery "
                    "again once that writer has stopped (or let it finish the id itself)")
                continue
            try:
                states[tid] = PreparedTxnState.parse(text)
            except DualWriteError as exc:
                results[tid] = RecoveryResult(tid, text, Outcome.FAILED, str(exc))
        prefetched = prefetch(cp, states)
        for tid, state in states.items():
            results[tid] = _resolve_one(store, conn, cp, consumer_config, tid, state,
                                        acknowledge_heuristic, timeout_s, prefetched,
                                        first_pass, aborted_first)


def _resolve_one(store: StateStore, conn: Connection, cp: ControlPlane,
                 consumer_config: Mapping[str, Any], tid: str, state: PreparedTxnState,
                 acknowledge_heuristic: bool, timeout_s: float,
                 prefetched: Prefetched, first_pass: bool, aborted_first: set[str]
                 ) -> RecoveryResult | None:
    stored = str(state)
    try:
        if first_pass:
            ended, _ = end_open_transaction(cp, tid, state, timeout_s=timeout_s,
                                            prefetched=prefetched)
            if ended is Completion.ABORTED:
                aborted_first.add(tid)
            if ended is not Completion.COMMITTED and not state.is_empty:
                return None  # the anchor check waits until every open transaction ended
            done = ended or Completion.NOTHING
        else:
            done = complete(cp, consumer_config, tid, state, timeout_s=timeout_s,
                            prefetched=prefetched)
            if done is Completion.ALREADY_COMMITTED and tid in aborted_first:
                done = Completion.ABORTED
    except (HeuristicAbortError, OutcomeUnreadableError) as exc:
        kind = (Outcome.HEURISTIC_ABORT if isinstance(exc, HeuristicAbortError)
                else Outcome.OUTCOME_UNREADABLE)
        if not acknowledge_heuristic:
            return RecoveryResult(tid, stored, kind, exc.detail)
        log.warning("acknowledged %s of transactional_id=%s state=%s", kind.value, tid, stored)
        store.write(conn, tid, "")
        return RecoveryResult(tid, stored, Outcome.ACKNOWLEDGED, exc.detail)
    except (BrokerUnreachableError, DatabaseUnreachableError):
        raise
    except DualWriteError as exc:
        log.error("recovery of transactional_id=%s failed: %s", tid, exc)
        return RecoveryResult(tid, stored, Outcome.FAILED, str(exc))
    if stored:
        store.write(conn, tid, "")  # resolved: the next writer starts without a check
    return RecoveryResult(tid, stored, _FROM_COMPLETION[done])


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


def _recover_sink(cp: ControlPlane, engine: Engine, kafka_config: Mapping[str, Any],
                  sink_id: str, record: SinkRecord | None, acknowledge_heuristic: bool,
                  timeout_s: float) -> SinkRecoveryResult:
    """``BatchCoordinator.recover`` for one sink, as a result instead of an exception."""
    batch = record.last_batch_id if record is not None else None
    in_doubt = record is not None and record.in_doubt
    try:
        with BatchCoordinator(sink_id, engine, kafka_config, control_plane=cp,
                              timeout_s=timeout_s) as coordinator:
            try:
                done = coordinator.recover()
            except BatchHeuristicAbortError as exc:
                if not acknowledge_heuristic:
                    return SinkRecoveryResult(sink_id, exc.batch_id, True,
                                              Outcome.HEURISTIC_ABORT, detail=str(exc))
                # Asked without acknowledging first, so that the report can say it happened;
                # again, acknowledging: the batch is marked completed, lingering ones aborted.
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
    return SinkRecoveryResult(sink_id, batch, in_doubt, outcome, done.committed, done.aborted)


def _recover_sinks(cp: ControlPlane, engine: Engine, kafka_config: Mapping[str, Any],
                   sinks: list[tuple[str, SinkRecord | None]], acknowledge_heuristic: bool,
                   timeout_s: float) -> list[SinkRecoveryResult]:
    """Recover every sink; lingering transactions of all of them are aborted first.

    Checking whether a participant that is no longer open committed reads its anchor offset
    with read_committed, which an open transaction that started earlier on that partition
    blocks: a lingering transaction of this or another sink, which only the later sweep would
    end. So every sink's pool is swept first (keeping an in-doubt batch's participants), and a
    sink that failed is tried once more after the others were completed. Each sweep runs under
    the sink's decision lock, so it may run beside the sink's running query: it can abort a
    batch that is not decided yet (the driver's verification fails and the batch is written
    again), never one that is being or has been decided.
    """
    swept: dict[str, list[str]] = {}
    for sink_id, _ in sinks:
        try:
            with BatchCoordinator(sink_id, engine, kafka_config, control_plane=cp,
                                  timeout_s=timeout_s) as coordinator:
                # Under the decision lock a running driver verifies and decides under: the
                # keep-set is read there, and no decision can land while the sweep runs.
                swept[sink_id] = coordinator.abort_lingering()
        except DualWriteError as exc:  # reported by the recovery proper below
            log.warning("sink=%s aborting lingering transactions failed: %s", sink_id, exc)
    results = {s: _recover_sink(cp, engine, kafka_config, s, r, acknowledge_heuristic,
                                timeout_s) for s, r in sinks}
    for sink_id, record in sinks:
        if results[sink_id].outcome is Outcome.FAILED and not results[sink_id].unreachable:
            retry = _recover_sink(cp, engine, kafka_config, sink_id, record,
                                  acknowledge_heuristic, timeout_s)
            if retry.outcome is not Outcome.FAILED:
                results[sink_id] = retry
    out = []
    for sink_id, _ in sinks:
        result = results[sink_id]
        first = swept.get(sink_id, [])
        if first:
            aborted = tuple(dict.fromkeys([*first, *result.aborted]))
            outcome = Outcome.ABORTED if result.outcome is Outcome.NOTHING else result.outcome
            result = dataclasses.replace(result, aborted=aborted, outcome=outcome)
        out.append(result)
    return out


def recover(engine: Engine | str, kafka_config: Mapping[str, Any],
            transactional_ids: Sequence[str] | None = None, *,
            sink_ids: Sequence[str] | None = None, parallelism: int = 8,
            acknowledge_heuristic: bool = False, timeout_s: float = 30.0,
            progress: Callable[[RecoveryResult], None] | None = None) -> RecoveryReport:
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
    engine = create_engine(engine) if isinstance(engine, str) else engine
    store = StateStore(engine)
    if transactional_ids is None:
        ids = [r.transactional_id for r in store.read_all()]
    else:
        ids = list(dict.fromkeys(transactional_ids))
    sinks = _sinks_to_recover(engine, transactional_ids, sink_ids)
    results: list[RecoveryResult] = []
    sink_results: list[SinkRecoveryResult] = []
    if ids or sinks:
        with ControlPlane(kafka_config, timeout_s=timeout_s) as cp, \
                ThreadPoolExecutor(max(1, parallelism), thread_name_prefix="dualwrite-recover") \
                as pool:
            aborted_first: set[str] = set()
            by_id: dict[str, RecoveryResult] = {}
            pending = ids
            # Pass 1 ends every open transaction; pass 2 checks anchors of the ones that had
            # already ended (an open transaction of another id could hold their stable offset).
            # The sinks run in between: their anchor checks need pass 1's aborts, and pass 2's
            # need their lingering transactions ended.
            for first_pass in (True, False):
                if not first_pass and sinks:
                    sink_results = _recover_sinks(cp, engine, kafka_config, sinks,
                                                  acknowledge_heuristic, timeout_s)
                chunks = [pending[i:i + _CHUNK] for i in range(0, len(pending), _CHUNK)]
                futures = [pool.submit(_resolve_chunk, store, engine, cp, kafka_config, chunk,
                                       acknowledge_heuristic, timeout_s, first_pass,
                                       aborted_first) for chunk in chunks]
                for chunk, future in zip(chunks, futures, strict=True):
                    for tid, result in zip(chunk, future.result(), strict=True):
                        if result is None:
                            continue
                        by_id[tid] = result
                        if progress is not None:
                            progress(result)
                pending = [tid for tid in pending if tid not in by_id]
            results = [by_id[tid] for tid in ids]
    report = RecoveryReport(tuple(results), time.monotonic() - started, tuple(sink_results))
    log.info("recovery finished in %.2f s: %s; sinks %s", report.elapsed_s,
             report.as_dict()["counts"], {s.sink_id: s.outcome.value for s in report.sinks})
    return report


@dataclass(frozen=True)
class InDoubt:
    """One transactional id as the database and the coordinator see it."""

    transactional_id: str
    state: str
    updated_at: datetime | None
    broker: TransactionDescription | None

    @property
    def open_for_ms(self) -> int | None:
        return self.broker.open_for_ms() if self.broker is not None else None

    @property
    def in_doubt(self) -> bool:
        return bool(self.state) or (self.broker is not None and self.broker.state.in_flight)


def _broker_dict(d: TransactionDescription | None) -> dict[str, Any] | None:
    if d is None:
        return None
    return {"state": d.state.value, "producer_id": d.producer_id, "epoch": d.epoch,
            "open_for_ms": d.open_for_ms(), "timeout_ms": d.timeout_ms,
            "partitions": sorted(str(p) for p in d.partitions)}


@dataclass(frozen=True)
class SinkParticipantStatus:
    """One participant of a sink's last decided batch, with the coordinator's view."""

    partition_id: int
    transactional_id: str
    state: PreparedTxnState
    records: int
    broker: TransactionDescription | None

    @property
    def open_as_prepared(self) -> bool:
        """Still open at the coordinator under the producer id and epoch it prepared with."""
        b = self.broker
        return (b is not None and b.state.in_flight
                and (b.producer_id, b.epoch) == (self.state.producer_id, self.state.epoch))


@dataclass(frozen=True)
class SinkStatus:
    """A batch sink's last decision and the open transactions of its id pool."""

    sink_id: str
    last_batch_id: int
    completed: bool
    decided_at: datetime
    completed_at: datetime | None
    participants: tuple[SinkParticipantStatus, ...]
    lingering: tuple[TransactionDescription, ...]
    """Open transactions of the sink's id pool that are not participants of an in-doubt batch:
    task attempts of an undecided batch, losers, or leftovers of a crash."""

    @property
    def in_doubt(self) -> bool:
        return not self.completed

    def decided_age_s(self, now: datetime | None = None) -> float:
        return max(0.0, ((now or datetime.now(UTC)) - self.decided_at).total_seconds())

    def open_times_ms(self) -> list[int]:
        times = [p.broker.open_for_ms() for p in self.participants if p.broker is not None]
        times += [d.open_for_ms() for d in self.lingering]
        return [t for t in times if t is not None]

    def as_dict(self) -> dict[str, Any]:
        return {
            "sink_id": self.sink_id,
            "last_batch_id": self.last_batch_id,
            "completed": self.completed,
            "in_doubt": self.in_doubt,
            "decided_at": self.decided_at.isoformat(),
            "decided_age_s": round(self.decided_age_s(), 3),
            "completed_at": self.completed_at.isoformat() if self.completed_at else None,
            "participants": [
                {"partition_id": p.partition_id, "transactional_id": p.transactional_id,
                 "state": str(p.state), "records": p.records,
                 "open_as_prepared": p.open_as_prepared, "broker": _broker_dict(p.broker)}
                for p in self.participants],
            "lingering": [dict(transactional_id=d.transactional_id, **(_broker_dict(d) or {}))
                          for d in self.lingering],
        }


@dataclass(frozen=True)
class StatusReport:
    rows: tuple[InDoubt, ...]
    hanging: tuple[TransactionDescription, ...]
    """Open at the broker, no state row names the transactional id, and no batch sink owns it."""
    sinks: tuple[SinkStatus, ...] = ()
    """The batch sinks of the decision log (empty if the database predates it)."""

    @property
    def active_transaction_open_time_max_ms(self) -> int:
        """The KIP's ActiveTransactionOpenTimeMaxMs over the ids this report covers."""
        times = [r.open_for_ms for r in self.rows if r.open_for_ms is not None]
        times += [h.open_for_ms() or 0 for h in self.hanging]
        times += [t for s in self.sinks for t in s.open_times_ms()]
        return max(times, default=0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "active_transaction_open_time_max_ms": self.active_transaction_open_time_max_ms,
            "transactional_ids": [
                {"transactional_id": r.transactional_id, "state": r.state,
                 "in_doubt": r.in_doubt,
                 "updated_at": r.updated_at.isoformat() if r.updated_at else None,
                 "broker": _broker_dict(r.broker)} for r in self.rows],
            "hanging": [dict(transactional_id=h.transactional_id, **(_broker_dict(h) or {}))
                        for h in self.hanging],
            "sinks": [s.as_dict() for s in self.sinks],
        }


def status(engine: Engine | str, kafka_config: Mapping[str, Any], *,
           prefix: str | None = None, timeout_s: float = 30.0) -> StatusReport:
    """State rows joined with the coordinator's view, batch sinks, and hanging transactions.

    A hanging transaction is open at the broker under a transactional id that has no state row
    and is not in the id pool of a batch sink of the decision log (optionally only ids starting
    with ``prefix``): nothing in the database will ever finish it. Open transactions of a sink's
    pool are reported under the sink: its in-doubt batch's participants, and the others as
    lingering (``dualwrite recover`` or the sink's next start aborts them).
    """
    engine = create_engine(engine) if isinstance(engine, str) else engine
    rows: list[StateRow] = StateStore(engine).read_all()
    decisions = DecisionLog(engine)
    records = decisions.read_all() if decisions.has_tables() else []
    known = {r.transactional_id for r in rows}
    pools = [(r.sink_id, _pool_pattern(r.sink_id)) for r in records]

    def owner(tid: str) -> str | None:
        return next((sink for sink, pattern in pools if pattern.fullmatch(tid)), None)

    participant_ids = [p.transactional_id for r in records for p in r.participants]
    with ControlPlane(kafka_config, timeout_s=timeout_s) as cp:
        described = cp.describe_transactions([r.transactional_id for r in rows]
                                             + participant_ids)
        open_states = [TxnState.ONGOING, TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT]
        # The sinks' pools need every open transaction, not only those matching ``prefix``.
        listed = cp.list_transactions(states=open_states, prefix=None if pools else prefix)
        others = [t.transactional_id for t in listed if t.transactional_id not in known
                  and (owner(t.transactional_id) is not None or prefix is None
                       or t.transactional_id.startswith(prefix))]
        open_now = [d for d in cp.describe_transactions(others).values() if d.state.in_flight]
    hanging = [d for d in open_now if owner(d.transactional_id) is None]
    lingering: dict[str, list[TransactionDescription]] = {}
    for r in records:
        keep = {p.transactional_id for p in r.participants} if r.in_doubt else set()
        lingering[r.sink_id] = sorted(
            (d for d in open_now if owner(d.transactional_id) == r.sink_id
             and d.transactional_id not in keep), key=lambda d: d.transactional_id)
    sinks = tuple(
        SinkStatus(r.sink_id, r.last_batch_id, r.completed, r.decided_at, r.completed_at,
                   tuple(SinkParticipantStatus(p.partition_id, p.transactional_id, p.state,
                                               p.records, described.get(p.transactional_id))
                         for p in r.participants),
                   tuple(lingering[r.sink_id]))
        for r in records)
    joined = tuple(InDoubt(r.transactional_id, r.prepared_txn_state, r.updated_at.astimezone(UTC),
                           described.get(r.transactional_id)) for r in rows)
    return StatusReport(joined, tuple(sorted(hanging, key=lambda d: d.transactional_id)), sinks)
