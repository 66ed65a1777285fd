"""Recovery: resolve every in-doubt transaction named in the state table, and report.

For each transactional id the state row is locked (so a live writer and recovery serialize), the
stored prepared state is completed (commit the named open transaction, abort any other, confirm an
earlier commit), and a resolved state is cleared so the next writer starts fast. A heuristic
outcome (the database committed, Kafka aborted) is reported and left in place until acknowledged.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine

from dualwrite.completion import Completion, Prefetched, complete, end_open_transaction, prefetch
from dualwrite.control_plane import ControlPlane, TransactionDescription, TxnState
from dualwrite.database import create_engine, transaction
from dualwrite.errors import (
    BrokerUnreachableError,
    DatabaseUnreachableError,
    DualWriteError,
    HeuristicAbortError,
)
from dualwrite.prepared_state import PreparedTxnState
from dualwrite.state_store import StateRow, StateStore

__all__ = [
    "InDoubt",
    "Outcome",
    "RecoveryReport",
    "RecoveryResult",
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
    ACKNOWLEDGED = "heuristic-acknowledged"
    FAILED = "failed"

    @property
    def resolved(self) -> bool:
        return self not in (Outcome.HEURISTIC_ABORT, Outcome.FAILED)


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
class RecoveryReport:
    """What :func:`recover` did, per transactional id."""

    results: tuple[RecoveryResult, ...]
    elapsed_s: float

    @property
    def heuristic(self) -> list[RecoveryResult]:
        return [r for r in self.results if r.outcome is Outcome.HEURISTIC_ABORT]

    @property
    def failed(self) -> list[RecoveryResult]:
        return [r for r in self.results if r.outcome is Outcome.FAILED]

    @property
    def ok(self) -> bool:
        return all(r.outcome.resolved for r in self.results)

    def count(self, outcome: Outcome) -> int:
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
        }


def _resolve_chunk(store: StateStore, engine: Engine, cp: ControlPlane,
                   consumer_config: Mapping[str, Any], ids: Sequence[str],
                   acknowledge_heuristic: bool, timeout_s: float, first_pass: bool,
                   aborted_first: set[str]) -> list[RecoveryResult | None]:
    """Resolve a few ids in one database transaction that holds their state-row locks.

    Holding the locks keeps live writers of these ids out while the bulk answers are used. The
    first pass only ends open transactions and returns None for ids whose named transaction
    must still be checked at its anchor.
    """
    stored: dict[str, str] = {}
    try:
        with transaction(engine) as conn:
            for tid in sorted(ids):  # one lock order for every locker: no deadlocks
                stored[tid] = store.lock(conn, tid)
            states: dict[str, PreparedTxnState] = {}
            results: dict[str, RecoveryResult | None] = {}
            for tid, text in stored.items():
                try:
                    states[tid] = PreparedTxnState.parse(text)
                except DualWriteError as exc:
                    results[tid] = RecoveryResult(tid, text, Outcome.FAILED, str(exc))
            prefetched = prefetch(cp, states)
            for tid, state in states.items():
                results[tid] = _resolve_one(store, conn, cp, consumer_config, tid, state,
                                            acknowledge_heuristic, timeout_s, prefetched,
                                            first_pass, aborted_first)
            return [results[tid] for tid in ids]
    except (BrokerUnreachableError, DatabaseUnreachableError) as exc:
        return [RecoveryResult(tid, stored.get(tid, ""), Outcome.FAILED, str(exc),
                               unreachable=True) for tid in ids]
    except DualWriteError as exc:
        log.error("recovery of %d transactional ids failed: %s", len(ids), exc)
        return [RecoveryResult(tid, stored.get(tid, ""), Outcome.FAILED, str(exc))
                for tid in ids]


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
    except HeuristicAbortError as exc:
        if not acknowledge_heuristic:
            return RecoveryResult(tid, stored, Outcome.HEURISTIC_ABORT, exc.detail)
        log.warning("acknowledged heuristic abort of transactional_id=%s state=%s", tid, stored)
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


def recover(engine: Engine | str, kafka_config: Mapping[str, Any],
            transactional_ids: Sequence[str] | None = None, *, parallelism: int = 8,
            acknowledge_heuristic: bool = False, timeout_s: float = 30.0,
            progress: Callable[[RecoveryResult], None] | None = None) -> RecoveryReport:
    """Resolve all (or the given) transactional ids of the state table; safe to run twice.

    Returns a report; it does not raise for per-id problems (see ``report.ok``). With
    ``acknowledge_heuristic`` a heuristic abort is recorded as seen and its state cleared, after
    the application re-published the lost records.
    """
    started = time.monotonic()
    engine = create_engine(engine) if isinstance(engine, str) else engine
    store = StateStore(engine)
    if transactional_ids is None:
        ids = [r.transactional_id for r in store.read_all()]
    else:
        ids = list(dict.fromkeys(transactional_ids))
    results: list[RecoveryResult] = []
    if ids:
        with ControlPlane(kafka_config, timeout_s=timeout_s) as cp, \
                ThreadPoolExecutor(max(1, parallelism), thread_name_prefix="dualwrite-recover") \
                as pool:
            aborted_first: set[str] = set()
            by_id: dict[str, RecoveryResult] = {}
            pending = ids
            # Pass 1 ends every open transaction; pass 2 checks anchors of the ones that had
            # already ended (an open transaction of another id could hold their stable offset).
            for first_pass in (True, False):
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
    report = RecoveryReport(tuple(results), time.monotonic() - started)
    log.info("recovery finished in %.2f s: %s", report.elapsed_s, report.as_dict()["counts"])
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


@dataclass(frozen=True)
class StatusReport:
    rows: tuple[InDoubt, ...]
    hanging: tuple[TransactionDescription, ...]
    """Open at the broker, but no state row names the transactional id."""

    @property
    def active_transaction_open_time_max_ms(self) -> int:
        """The KIP's ActiveTransactionOpenTimeMaxMs over the ids this report covers."""
        times = [r.open_for_ms for r in self.rows if r.open_for_ms is not None]
        times += [h.open_for_ms() or 0 for h in self.hanging]
        return max(times, default=0)

    def as_dict(self) -> dict[str, Any]:
        def broker(d: TransactionDescription | None) -> dict[str, Any] | None:
            if d is None:
                return None
            return {"state": d.state.value, "producer_id": d.producer_id, "epoch": d.epoch,
                    "open_for_ms": d.open_for_ms(), "timeout_ms": d.timeout_ms,
                    "partitions": sorted(str(p) for p in d.partitions)}

        return {
            "active_transaction_open_time_max_ms": self.active_transaction_open_time_max_ms,
            "transactional_ids": [
                {"transactional_id": r.transactional_id, "state": r.state,
                 "in_doubt": r.in_doubt,
                 "updated_at": r.updated_at.isoformat() if r.updated_at else None,
                 "broker": broker(r.broker)} for r in self.rows],
            "hanging": [dict(transactional_id=h.transactional_id, **(broker(h) or {}))
                        for h in self.hanging],
        }


def status(engine: Engine | str, kafka_config: Mapping[str, Any], *,
           prefix: str | None = None, timeout_s: float = 30.0) -> StatusReport:
    """State rows joined with the coordinator's view, plus hanging transactions.

    A hanging transaction is open at the broker under a transactional id that has no state row
    (optionally only ids starting with ``prefix``): nothing in the database will ever finish it.
    """
    engine = create_engine(engine) if isinstance(engine, str) else engine
    rows: list[StateRow] = StateStore(engine).read_all()
    known = {r.transactional_id for r in rows}
    with ControlPlane(kafka_config, timeout_s=timeout_s) as cp:
        described = cp.describe_transactions([r.transactional_id for r in rows])
        open_states = [TxnState.ONGOING, TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT]
        listed = cp.list_transactions(states=open_states, prefix=prefix)
        others = [t.transactional_id for t in listed if t.transactional_id not in known]
        hanging = [d for d in cp.describe_transactions(others).values() if d.state.in_flight]
    joined = tuple(InDoubt(r.transactional_id, r.prepared_txn_state, r.updated_at.astimezone(UTC),
                           described.get(r.transactional_id)) for r in rows)
    return StatusReport(joined, tuple(sorted(hanging, key=lambda d: d.transactional_id)))
