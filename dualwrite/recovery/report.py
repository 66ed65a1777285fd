"""What recovery and status report: per transactional id, per batch sink, as JSON too.

The outcomes are :class:`~dualwrite.participant.outcome.Outcome`, the enum completion returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from dualwrite.participant.control_plane import TransactionDescription
from dualwrite.participant.outcome import Outcome
from dualwrite.participant.prepared_state import PreparedTxnState

__all__ = [
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
