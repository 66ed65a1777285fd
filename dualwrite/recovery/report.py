"""What recovery and status report: per transactional id, per batch sink, as JSON too.

The outcomes are :class:`~dualwrite.participant.outcome.Outcome`, the enum completion returns.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from dualwrite.batch.prepared_writes import SinkPrepared
from dualwrite.participant.control_plane import TransactionDescription
from dualwrite.participant.outcome import Outcome
from dualwrite.participant.prepared_state import PreparedTxnState
from dualwrite.recovery.transactions import OpenTransaction

__all__ = [
    "Condition",
    "InDoubt",
    "RecoveryReport",
    "RecoveryResult",
    "SinkParticipantStatus",
    "SinkRecoveryResult",
    "SinkStatus",
    "StatusReport",
]


@dataclass(frozen=True)
class RecoveryResult:
    transactional_id: str
    state: str
    outcome: Outcome
    detail: str = ""
    unreachable: bool = False
    fatal: bool = False
    """Failed with a :class:`~dualwrite.errors.FatalError`: retrying will not help."""


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


class Condition(enum.Enum):
    """What ``status`` found for one transactional id of the state table."""

    CLEAR = "clear"
    """No stored prepared state and nothing open at the coordinator."""
    IN_DOUBT = "in-doubt"
    """A decision is still to be carried out: the stored state names a transaction still open
    (its commit is pending), another transaction of the id is open and nothing will end it
    (its abort is pending), the coordinator is still writing markers, or the stored
    transaction's outcome could not be confirmed (see ``detail``). ``dualwrite recover``
    carries it out."""
    COMPLETED = "completed"
    """The stored state names a transaction that is committed at the broker: a writer stopped
    without ``close()`` (which clears it). Nothing to do; the next writer or recover clears it."""
    LIVE_WRITER = "left-to-live-writer"
    """A live writer holds the id's lease: it finishes its own transactions."""
    HEURISTIC = "heuristic"
    """Kafka aborted the transaction the database decided to commit, or the log no longer shows
    its outcome: a human must act (``dualwrite recover`` reports it, see the README)."""


@dataclass(frozen=True)
class InDoubt:
    """One transactional id of the state table as the database and the coordinator see it
    (every row, not only those in doubt: see :attr:`condition`)."""

    transactional_id: str
    state: str
    updated_at: datetime | None
    broker: TransactionDescription | None
    condition: Condition | None = None
    """None when built without a classification (then :attr:`in_doubt` is the coarse rule: a
    stored state, or something open at the coordinator)."""
    detail: str = ""
    """Why it has this condition, in a sentence."""

    @property
    def open_for_ms(self) -> int | None:
        return self.broker.open_for_ms() if self.broker is not None else None

    @property
    def in_doubt(self) -> bool:
        """A decision is still to be carried out (``dualwrite recover`` does)."""
        if self.condition is not None:
            return self.condition is Condition.IN_DOUBT
        return bool(self.state) or (self.broker is not None and self.broker.state.in_flight)

    @property
    def heuristic(self) -> bool:
        return self.condition is Condition.HEURISTIC


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
    database_gid: str | None = None
    """Write-once mode: the gid of the participant's prepared database transaction."""

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
    prepared: tuple[SinkPrepared, ...] = ()
    """The sink's prepared database transactions (write-once mode): an in-doubt batch's
    participants' rows, or lingering ones as above. Each holds its rows' locks (and holds
    back vacuum) until it is finished."""

    def prepared_is_participant(self, gid: str) -> bool:
        return self.in_doubt and any(p.database_gid == gid for p in self.participants)

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
                 "state": str(p.state), "records": p.records, "database_gid": p.database_gid,
                 "open_as_prepared": p.open_as_prepared, "broker": _broker_dict(p.broker)}
                for p in self.participants],
            "lingering": [dict(transactional_id=d.transactional_id, **(_broker_dict(d) or {}))
                          for d in self.lingering],
            "prepared_database_transactions": [
                {"gid": t.gid, "prepared_at": t.prepared_at.isoformat(),
                 "held_s": round(t.held_s(), 3),
                 "participant": self.prepared_is_participant(t.gid)}
                for t in self.prepared],
        }


@dataclass(frozen=True)
class StatusReport:
    """What :func:`~dualwrite.recovery.status` found: every state row classified, the batch
    sinks, and the open transactions nothing in the database names."""

    rows: tuple[InDoubt, ...]
    hanging: tuple[TransactionDescription, ...]
    """Open at the broker, no state row names the transactional id, and no batch sink owns it
    (a live producer's transaction, or one nothing will finish before its timeout)."""
    sinks: tuple[SinkStatus, ...] = ()
    """The batch sinks of the decision log (empty if the database predates it)."""

    @property
    def in_doubt(self) -> list[InDoubt]:
        """State rows with a decision still to carry out."""
        return [r for r in self.rows if r.in_doubt]

    @property
    def sinks_in_doubt(self) -> list[SinkStatus]:
        """Batch sinks whose last decided batch is not completed."""
        return [s for s in self.sinks if s.in_doubt]

    @property
    def heuristic(self) -> list[InDoubt]:
        """State rows whose decided transaction Kafka aborted (or whose outcome is gone)."""
        return [r for r in self.rows if r.heuristic]

    @property
    def ok(self) -> bool:
        """Nothing in doubt and nothing heuristic (live writers and completed rows are fine)."""
        return not (self.in_doubt or self.sinks_in_doubt or self.heuristic)

    @property
    def open_transactions(self) -> list[OpenTransaction]:
        """The hanging transactions in the form :func:`dualwrite.open_transactions` returns."""
        return [OpenTransaction.of(h) for h in self.hanging]

    def count(self, condition: Condition) -> int:
        return sum(1 for r in self.rows if r.condition is condition)

    @property
    def active_transaction_open_time_max_ms(self) -> int:
        """The KIP's ActiveTransactionOpenTimeMaxMs over the ids this report covers."""
        times = [r.open_for_ms for r in self.rows if r.open_for_ms is not None]
        times += [h.open_for_ms() or 0 for h in self.hanging]
        times += [t for s in self.sinks for t in s.open_times_ms()]
        return max(times, default=0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "in_doubt": len(self.in_doubt) + len(self.sinks_in_doubt),
            "heuristic": len(self.heuristic),
            "counts": {c.value: self.count(c) for c in Condition if self.count(c)},
            "active_transaction_open_time_max_ms": self.active_transaction_open_time_max_ms,
            "transactional_ids": [
                {"transactional_id": r.transactional_id, "state": r.state,
                 "condition": r.condition.value if r.condition else None,
                 "in_doubt": r.in_doubt, "detail": r.detail,
                 "updated_at": r.updated_at.isoformat() if r.updated_at else None,
                 "broker": _broker_dict(r.broker)} for r in self.rows],
            "hanging": [dict(transactional_id=h.transactional_id, **(_broker_dict(h) or {}))
                        for h in self.hanging],
            "sinks": [s.as_dict() for s in self.sinks],
        }
