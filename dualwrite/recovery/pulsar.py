"""Recovery of :class:`~dualwrite.writer.pulsar_writer.PulsarDualWriter` ids: commit what the
database decided, by TxnID, and clear the state row.

A stored ``dwp1:`` state names a Pulsar transaction the database decided to commit (the writer
writes it with its rows). Under the row's lock, recovery commits it (a transaction already
committed reads so at its anchor) and clears the row in the same database transaction. Nothing
else is ever ended here: a transaction nobody decided has no row naming it, and Pulsar's
timeout aborts it. A live writer holding the row waits for recovery, or recovery for it
(``timeout_s``, then the id is reported failed, to retry).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import UTC

from sqlalchemy import Engine

from dualwrite.database import transaction
from dualwrite.errors import (
    BrokerUnreachableError,
    DatabaseUnreachableError,
    DualWriteError,
    FatalError,
    HeuristicAbortError,
    OutcomeUnreadableError,
)
from dualwrite.participant.outcome import Outcome
from dualwrite.participant.prepared_state import is_pulsar_state
from dualwrite.participant.pulsar import (
    PulsarParticipant,
    PulsarPreparedTxn,
    PulsarTxnClient,
    PulsarTxnOutcome,
    txn_outcome,
)
from dualwrite.recovery.report import Condition, InDoubt, RecoveryReport, RecoveryResult
from dualwrite.writer.state_store import StateStore

__all__ = ["pulsar_status", "recover_pulsar"]

log = logging.getLogger(__name__)


def recover_pulsar(engine: Engine, service_url: str, writer_ids: Sequence[str] | None = None,
                   *, token: str | None = None, timeout_s: float = 30.0,
                   outcome_wait_s: float = 5.0, acknowledge_heuristic: bool = False,
                   store: StateStore | None = None) -> RecoveryReport:
    """Finish every Pulsar transaction the state table names (or those of ``writer_ids``).

    Per id: COMMITTED (committed now), ALREADY_COMMITTED, NOTHING (the row changed meanwhile),
    HEURISTIC_ABORT / OUTCOME_UNREADABLE (cleared with ``acknowledge_heuristic``: ACKNOWLEDGED),
    or FAILED with the reason (Pulsar or the database unreachable, a live writer holding the
    row past ``timeout_s``).
    """
    started = time.monotonic()
    store = store or StateStore(engine)
    rows = [r for r in store.read_all(writer_ids) if is_pulsar_state(r.prepared_txn_state)]
    results: list[RecoveryResult] = []
    if rows:
        with PulsarTxnClient(service_url, timeout_s, token=token) as client:
            participant = PulsarParticipant(client, outcome_wait_s=outcome_wait_s)
            for row in rows:
                results.append(_recover_one(engine, store, participant, row.transactional_id,
                                            row.prepared_txn_state, timeout_s,
                                            acknowledge_heuristic))
    return RecoveryReport(tuple(results), time.monotonic() - started)


def _recover_one(engine: Engine, store: StateStore, participant: PulsarParticipant, wid: str,
                 seen: str, timeout_s: float, acknowledge: bool) -> RecoveryResult:
    try:
        with transaction(engine) as conn:
            text = store.lock_row(conn, wid, timeout_s=timeout_s).prepared_txn_state
            if not is_pulsar_state(text):
                return RecoveryResult(wid, text, Outcome.NOTHING,
                                      "the row no longer names a Pulsar transaction")
            prepared = PulsarPreparedTxn.parse(text)
            try:
                now = participant.commit(prepared)
            except (HeuristicAbortError, OutcomeUnreadableError) as exc:
                kind = (Outcome.HEURISTIC_ABORT if isinstance(exc, HeuristicAbortError)
                        else Outcome.OUTCOME_UNREADABLE)
                if not acknowledge:
                    log.error("writer_id=%s: %s of state=%s", wid, kind.value, text)
                    return RecoveryResult(wid, text, kind, exc.detail)
                log.warning("writer_id=%s: acknowledged %s of state=%s", wid, kind.value, text)
                store.write(conn, wid, "")
                return RecoveryResult(wid, text, Outcome.ACKNOWLEDGED, exc.detail)
            store.write(conn, wid, "")
            outcome = Outcome.COMMITTED if now else Outcome.ALREADY_COMMITTED
            log.info("writer_id=%s: state=%s %s", wid, text, outcome.value)
            return RecoveryResult(wid, text, outcome)
    except DualWriteError as exc:
        log.warning("writer_id=%s: recovery of state=%s failed: %s", wid, seen, exc)
        return RecoveryResult(
            wid, seen, Outcome.FAILED, str(exc),
            unreachable=isinstance(exc, BrokerUnreachableError | DatabaseUnreachableError),
            fatal=isinstance(exc, FatalError))


_CONDITIONS = {
    PulsarTxnOutcome.COMMITTED: (Condition.COMPLETED, "committed in Pulsar; the row is cleared "
                                 "by the writer's close(), its next transaction or recover"),
    PulsarTxnOutcome.OPEN: (Condition.IN_DOUBT, "the database decided to commit it and it is "
                            "still open in Pulsar (or an earlier transaction on its anchor "
                            "partition is): its commit is pending, run `dualwrite recover "
                            "--pulsar-url`"),
    PulsarTxnOutcome.ABORTED: (Condition.HEURISTIC, "Pulsar aborted what the database decided "
                               "to commit (its timeout passed): `dualwrite recover` reports it"),
    PulsarTxnOutcome.UNREADABLE: (Condition.HEURISTIC, "its anchor's ledger is no longer stored: "
                                  "whether it committed cannot be read"),
}


def pulsar_status(engine: Engine, service_url: str, writer_ids: Sequence[str] | None = None,
                  *, token: str | None = None, timeout_s: float = 30.0,
                  outcome_wait_s: float = 2.0) -> tuple[InDoubt, ...]:
    """Each row naming a Pulsar transaction (or those of ``writer_ids``), classified by what
    its anchor says: committed (COMPLETED), still open (IN_DOUBT), aborted or unreadable
    (HEURISTIC). Changes no row; reading an outcome sends one probe to the anchor topic
    (dualwrite's own). A row whose outcome could not be read is IN_DOUBT with the reason."""
    rows = [r for r in StateStore(engine).read_all(writer_ids)
            if is_pulsar_state(r.prepared_txn_state)]
    if not rows:
        return ()
    found = []
    with PulsarTxnClient(service_url, timeout_s, token=token) as client:
        for row in rows:
            text = row.prepared_txn_state
            try:
                outcome = txn_outcome(client, PulsarPreparedTxn.parse(text), outcome_wait_s)
                condition, detail = _CONDITIONS[outcome]
            except DualWriteError as exc:
                condition, detail = Condition.IN_DOUBT, f"its outcome could not be read: {exc}"
            found.append(InDoubt(row.transactional_id, text, row.updated_at.astimezone(UTC),
                                 None, condition, detail))
    return tuple(found)
