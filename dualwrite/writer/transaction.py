"""One transaction of a DualWriter, as an object that owns its steps: begin (locking first, or
after the block's first record while the lease is intact), the block, prepare, decide (the
database COMMIT), the Kafka commit, and the way back on a failure at each step."""

from __future__ import annotations

import contextvars
import time
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import sqlalchemy as sa
from sqlalchemy import Connection

from dualwrite import metrics
from dualwrite.database import backend_for, bounded_wait, database_error
from dualwrite.deadline import MARGIN_S, Deadline, current_deadline, deadline_scope
from dualwrite.errors import (
    BlockCommittedError,
    DatabaseUnreachableError,
    DualWriteError,
    FatalError,
    HeuristicCommitError,
    OutcomeUnknownError,
    RetriableError,
    TransactionStateError,
)
from dualwrite.participant.anchor_reader import AnchorReader
from dualwrite.participant.identifiers import TopicPartition
from dualwrite.participant.prepared_state import PreparedTxnState
from dualwrite.participant.producer import TwoPhaseProducer
from dualwrite.writer.commit_inquiry import CommitStatus
from dualwrite.writer.handle import GuardedConnection
from dualwrite.writer.hooks import HeuristicHook
from dualwrite.writer.lease import pooler_error
from dualwrite.writer.lease_keeper import LeaseVerdict
from dualwrite.writer.ownership import Ownership
from dualwrite.writer.settings import WriterSettings, log
from dualwrite.writer.state_store import StateRow, StateStore
from dualwrite.writer.transaction_handle import DualWriteTransaction, Record

__all__ = ["RunningTransaction", "database_committed", "what_the_block_committed"]


class RunningTransaction:
    """The protocol of one ``with writer.transaction() as tx:``, once it is known to be the only
    one open; :meth:`run` yields the block's handle. Made per transaction: it holds what is left
    of the transaction's deadline while the block runs."""

    def __init__(self, settings: WriterSettings, owner: Ownership, helper: ThreadPoolExecutor,
                 clock: metrics.PhaseClock) -> None:
        self._settings = settings
        self._tid = settings.transactional_id
        self._owner = owner
        self._connection = owner.connection
        self._helper = helper
        self._clock = clock
        self._budget_left = settings.timeout_s
        """What is left of the transaction's deadline while its block runs."""

    def run(self) -> Generator[DualWriteTransaction, None, None]:
        """The whole transaction: yields the block's handle, then prepares and decides."""
        hooks, clock = self._settings.hooks, self._clock
        tx = self._begin()
        clock.lap("begin")
        try:
            hooks.kafka_begun()
            try:
                yield tx
            finally:
                tx.end()
                clock.restart()  # the block's time is the application's
            conn, producer, state, verify = self._prepare(tx)
            clock.lap("prepare")
        except BaseException as exc:
            self._undo(tx, exc)
            raise
        try:
            with self._resumed_deadline():
                self._decide(conn, producer, state, state_written=verify)
        except BaseException:
            self._connection.drop()  # after a failure mid-commit its state is not known
            # Commit failures can start a new producer session: claim again before the next.
            self._owner.forget_claim()
            raise
        self._owner.settled = str(state)
        # Only now, after the Kafka commit: see LeaseKeeper.verdict_before_next.
        owner = self._owner
        owner.lease.check_after_commit(
            self._helper, lambda: owner.lease.check(owner.connection.current, owner.generation))
        hooks.kafka_committed(state)

    def _begin(self) -> DualWriteTransaction:
        """Begin the Kafka transaction, under the row lock unless the lease is intact."""
        # One deadline for dualwrite's own waits (dualwrite.deadline), paused while the block
        # runs: the application's own time is not dualwrite's to bound.
        owner = self._owner
        with deadline_scope(self._settings.timeout_s) as deadline:
            if owner.current is not None and owner.current.has_open_transaction:
                # The last transaction could not be ended (its abort or commit failed): a new
                # session finishes it from the stored state, as after a restart.
                owner.close_producer()
            late = self._lease_intact()
            producer = owner.producer()
            if late and producer.ready:
                producer.begin_transaction()
                tx = DualWriteTransaction(None, producer, self._lock_late)
            else:
                conn, producer = owner.lock_and_settle(producer)
                try:
                    self._settings.hooks.locked()
                    producer.begin_transaction()
                except BaseException:
                    self._connection.rollback(conn)
                    raise
                tx = DualWriteTransaction(conn, producer)
        self._budget_left = deadline.left()
        return tx

    def _lease_intact(self) -> bool:
        """Whether this transaction may begin before its row lock; acts on a lease found lost
        (a new producer session) or moved (a transaction pooler, refused)."""
        owner = self._owner
        lease = owner.lease
        verdict = lease.verdict_before_next(owner.connection.current, owner.generation)
        if verdict is LeaseVerdict.INTACT:
            return True
        if verdict is LeaseVerdict.MOVED:
            held = lease.lease.backend_pid if lease.lease is not None else None
            self._connection.drop()
            owner.generation = None
            raise pooler_error(self._settings.engine, f"the writer's lease is still held by "
                                                      f"backend {held}, its connection was "
                                                      "moved to another one")
        if verdict is LeaseVerdict.LOST:
            log.warning("transactional_id=%s: the database session that held the lease ended "
                        "(server restart, terminated backend, failover?); starting a new "
                        "producer session and locking first", self._tid)
            self._connection.drop()
            owner.close_producer()
            owner.generation = None
        return False

    def _prepare(self, tx: DualWriteTransaction
                 ) -> tuple[GuardedConnection, TwoPhaseProducer, PreparedTxnState, bool]:
        """After the block: refuse what it misused, take the lock if it did not, flush, and
        write the state row (verified by the coordinator meanwhile, when asked for)."""
        if tx.misuse is not None:  # the application caught the refusal and went on
            raise TransactionStateError(
                f"transactional_id={self._tid}: the block misused tx.connection and was "
                f"abandoned; nothing of it committed ({tx.misuse})") from tx.misuse
        held, _ = tx.bound()
        failed = held.went_on_after_a_failure() if held is not None else None
        if failed is not None:
            raise failed
        with self._resumed_deadline():
            conn = tx.lock()  # takes the deferred lock if the block did not
            _, producer = tx.bound()
            state = self._flush(tx, producer)
            tx.state = state
            self._settings.hooks.prepared(state)
            verify = self._needs_verification(producer)
            if verify:
                # The coordinator round trip overlaps the state-row write.
                verified = self._helper.submit(contextvars.copy_context().run,
                                               self._verify, producer, state)
                self._settings.store.write(conn, self._tid, str(state))
                verified.result()
        return conn, producer, state, verify

    def _undo(self, tx: DualWriteTransaction, exc: BaseException) -> None:
        """Roll both sides back after a failure before the decision; raise what the block
        committed itself, or the lost database, instead of ``exc`` (which the caller raises)."""
        tx.end()  # (a hook may fail before the block ran)
        held, producer = tx.bound()
        left = held is not None and held.left_transaction
        with self._resumed_deadline():
            if tx.misuse is not None:
                self._connection.discard()
            elif held is not None:
                self._connection.rollback(held)
            abort_quietly(producer, self._tid)
            committed = self._what_the_block_committed() if left else None
        if committed is not None:
            raise committed from exc
        lost = self._database_lost(exc)
        if lost is not None:
            self._connection.drop()
            raise lost from exc

    @contextmanager
    def _resumed_deadline(self) -> Iterator[Deadline]:
        """The transaction's deadline, resumed where its block paused it."""
        with deadline_scope(Deadline(time.monotonic() + self._budget_left,
                                     self._settings.timeout_s)) as deadline:
            try:
                yield deadline
            finally:
                self._budget_left = deadline.left()

    def _what_the_block_committed(self) -> BlockCommittedError | None:
        settings = self._settings
        return what_the_block_committed(settings.store, self._tid, self._connection.locked,
                                        settings.on_heuristic_abort, settings.role)

    def _flush(self, tx: DualWriteTransaction, producer: TwoPhaseProducer) -> PreparedTxnState:
        """Flush; if no record is acknowledged for half the timeout (a leader election, a
        coordinator move, a paused broker, a connection librdkafka waits out) or the flush fails
        retriably (OUT_OF_ORDER_SEQUENCE_NUMBER after a timed-out request), send the records
        once more in a new session, under the same row lock, within the rest of the timeout.

        The abort starts the new session (the records were not all acknowledged): its
        InitProducerId aborts the stuck transaction and bumps the epoch, so nothing the old
        session still has in flight can land in the new transaction (KAFKA-17754).
        """
        timeout_s = self._settings.timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            return producer.flush_and_state(stall_s=timeout_s / 2)
        except RetriableError as exc:  # stalled, or the session lost track of its sequence
            records = tx.records()
            log.warning("transactional_id=%s: %s; sending its %d records again in a new session",
                        self._tid, exc, len(records))
        producer.abort_transaction()
        self._settings.hooks.resending(len(records))
        producer.begin_transaction()
        for topic, value, key, partition, headers in records:
            producer.produce(topic, value, key, partition=partition, headers=headers)
        return producer.flush_and_state(max(deadline - time.monotonic(), timeout_s / 4))

    def _database_lost(self, exc: BaseException) -> DualWriteError | None:
        """:class:`DatabaseUnreachableError` when the block's own statement failed because the
        database went away (its transaction is lost, nothing was decided); None for the other
        errors of the application's statements, which reach it unchanged."""
        if not isinstance(exc, sa.exc.DBAPIError):
            return None
        typed = database_error(exc, self._settings.engine.url)
        return typed if isinstance(typed, DatabaseUnreachableError) else None

    def _verify(self, producer: TwoPhaseProducer, state: PreparedTxnState) -> None:
        """The coordinator check, on the helper thread."""
        producer.verify_prepared()
        self._settings.hooks.verified(state)

    def _lock_late(self, producer: TwoPhaseProducer, sent: Sequence[Record]
                   ) -> tuple[GuardedConnection, TwoPhaseProducer]:
        """The deferred lock (:data:`~dualwrite.writer.transaction_handle.LateLock`), after the
        block's first record or at its first use of the database (or at its end); start over if
        anyone claimed the id meanwhile.

        ``producer`` runs the transaction, ``sent`` are the records it produced so far. Returns
        the connection holding the lock and the producer to go on with.
        """
        with self._resumed_deadline():
            return self._lock_late_within(producer, sent)

    def _lock_late_within(self, producer: TwoPhaseProducer, sent: Sequence[Record]
                          ) -> tuple[GuardedConnection, TwoPhaseProducer]:
        hooks, owner, connection = self._settings.hooks, self._owner, self._connection
        hooks.before_late_lock(len(sent))
        conn, row = connection.begin_and_lock()
        if (row.fencing_generation == owner.generation
                and row.prepared_txn_state in ("", owner.settled)):
            try:
                hooks.locked()
            except BaseException:
                connection.rollback(conn)
                raise
            return conn, producer
        # Someone claimed the id since this writer's claim (recovery, a new writer, or this one
        # after a failure): they may have ended or fenced the transaction whose records already
        # left. Only those records exist so far; abort them and begin again under a claim of
        # this writer's own.
        log.warning("transactional_id=%s was claimed by another process (fencing generation "
                    "%d, this writer's %s) before its lock was granted; starting the "
                    "transaction over", self._tid, row.fencing_generation, owner.generation)
        owner.generation = None
        connection.rollback(conn)
        left = self._flush_quietly(producer) if sent else None
        owner.abort_after_claim(producer)
        conn, again = owner.lock_and_settle(owner.producer())  # a new session, its own claim
        try:
            hooks.locked()
            if left is not None:
                # Nothing of that transaction is open any more (aborted above, or by the
                # settling): it is visible only if someone committed it by (producer id, epoch).
                self._refuse_if_committed(left, {r[0] for r in sent})
            again.begin_transaction()
            hooks.kafka_begun()
            for topic, value, key, partition, headers in sent:
                again.produce(topic, value, key, partition=partition, headers=headers)
        except BaseException:
            connection.rollback(conn)
            # The handle still holds ``producer`` (aborted above): end what ``again`` began.
            abort_quietly(again, self._tid)
            raise
        return conn, again

    def _flush_quietly(self, producer: TwoPhaseProducer) -> PreparedTxnState | None:
        """The state naming the records that left before the lock, or None if none arrived."""
        try:
            state = producer.flush_and_state()
        except DualWriteError as exc:  # refused (fenced) or undelivered: nothing can be visible
            log.info("transactional_id=%s: the records sent before the lock did not all arrive "
                     "(%s)", self._tid, exc)
            return None
        return None if state.is_empty else state

    def _refuse_if_committed(self, left: PreparedTxnState, topics: set[str]) -> None:
        """Raise :class:`HeuristicCommitError` if the transaction ``left`` names was committed
        by another process: sending its records again would duplicate them."""
        anchor = left.anchor
        assert anchor is not None
        tp = anchor.resolve({TopicPartition(t, anchor.partition) for t in topics})
        if tp is None:
            raise FatalError(f"transactional_id={self._tid}: cannot resolve the anchor {left}")
        settings = self._settings
        if AnchorReader(settings.kafka_config).committed(tp, anchor.offset, settings.timeout_s,
                                                         transactional_id=self._tid,
                                                         state=str(left)):
            raise HeuristicCommitError(
                self._tid, str(left), "another process committed it by producer id and epoch "
                "before this writer's lock was granted")
        log.info("transactional_id=%s: the records sent before the lock were aborted (%s); "
                 "sending them again", self._tid, left)

    def _needs_verification(self, producer: TwoPhaseProducer) -> bool:
        if self._settings.verify == "always":
            return True
        timeout_ms = producer.transaction_timeout_ms
        return timeout_ms is None or producer.open_for_s * 1000 > timeout_ms / 2

    def _decide(self, conn: Connection, producer: TwoPhaseProducer, state: PreparedTxnState,
                *, state_written: bool) -> None:
        """Commit the database (the decision), then Kafka; an unknown DB outcome is asked for."""
        settings = self._settings
        try:
            if state_written:
                with bounded_wait(conn, "COMMIT"):
                    conn.commit()
            else:  # the state row and the COMMIT in one round trip
                settings.store.write_and_commit(conn, self._tid, str(state))
        except TransactionStateError:
            abort_quietly(producer, self._tid)  # the database committed without this decision
            raise
        except (DualWriteError, sa.exc.SQLAlchemyError) as exc:
            # StateStore raises the translated error (chained from the driver's); a raw one
            # comes from ``conn.commit()``.
            log.warning("database COMMIT of transactional_id=%s state=%s failed (%s); asking the "
                        "database for the outcome", self._tid, state, exc.__class__.__name__)
            locked = self._connection.locked
            self._connection.drop()  # a failed pipeline can leave the row locked until then
            if not database_committed(settings.store, self._tid, settings.timeout_s, str(state),
                                      locked):
                abort_quietly(producer, self._tid)
                if isinstance(exc, DualWriteError):
                    raise
                raise database_error(exc, settings.engine.url) from exc
            log.warning("the database did commit transactional_id=%s state=%s", self._tid, state)
        self._clock.lap("decide")
        settings.hooks.database_committed(state)
        producer.commit_transaction()
        self._clock.lap("kafka_commit")


def what_the_block_committed(store: StateStore, transactional_id: str, locked: StateRow | None,
                             on_heuristic_abort: HeuristicHook | None, role: metrics.Role
                             ) -> BlockCommittedError | None:
    """A statement of the block ended the database transaction that locked ``locked`` (the
    driver said so): None if the database rolled it back; otherwise the heuristic outcome,
    handed to ``on_heuristic_abort``.

    On PostgreSQL the transaction's id tells; elsewhere it cannot be known, and a possible
    commit is reported as one (never silent)."""
    xid = locked.locked_by_xid if locked is not None else None
    status: CommitStatus | str | None = ""
    if xid is not None:
        try:
            status = store.inquiry.transaction_status(xid)
        except DualWriteError as exc:
            status = f"unknown ({exc})"
        if status is CommitStatus.ABORTED:
            return None
        detail = (f"a statement of the block ended the database transaction ({status})"
                  if status is not CommitStatus.COMMITTED
                  else "a statement of the block committed the database transaction")
    else:
        detail = ("a statement of the block ended the database transaction, and this "
                  "database cannot tell whether it committed")
    heuristic = BlockCommittedError(transactional_id, detail,
                                    certain=status is CommitStatus.COMMITTED)
    log.error("heuristic outcome: %s", heuristic)
    metrics.heuristic_outcome(role, heuristic)
    if on_heuristic_abort is not None:
        try:
            with store.engine.begin() as conn:
                on_heuristic_abort(heuristic, conn)
        except Exception as exc:
            log.error("transactional_id=%s: the re-publish hook failed: %s", transactional_id,
                      exc)
    return heuristic


def database_committed(store: StateStore, transactional_id: str, timeout_s: float, state: str,
                       locked: StateRow | None, *, participant: str = "Kafka") -> bool:
    """Whether the decision's database transaction (locking ``locked``, writing ``state`` to
    ``transactional_id``'s row of ``store``) committed: asked by its id of the server that ran
    it, never by comparing stored states alone (an empty block stores the same ``""`` as
    before, and recovery may clear a state in between); after a failover or crash restart,
    where the id may name another transaction, by the state row version it wrote
    (:meth:`~dualwrite.writer.commit_inquiry.CommitInquiry.commit_status`). Waits, bounded by
    ``timeout_s`` or the current deadline, while it is still in progress.

    False where a COMMIT that raised is known not to have been applied (SQLite:
    :attr:`~dualwrite.database.Backend.failed_commit_rolled_back`). ``participant`` names the
    other side in the errors (whose transaction stays open while this is unknown).
    """
    backend = backend_for(store.engine)
    if backend.failed_commit_rolled_back:
        return False
    unknown = (f"the database COMMIT of transactional_id={transactional_id} "
               f"state={state} has an unknown outcome")
    xid = locked.locked_by_xid if locked is not None else None
    if locked is None or (xid is None and not backend.commit_by_row_version):
        raise OutcomeUnknownError(f"{unknown}: the lock returned no transaction id to ask "
                                  "about; run `dualwrite recover`")
    # Asked on a new connection, within what is left of the deadline; after a COMMIT that
    # used it all, within the part of the documented margin kept for this question.
    current = current_deadline()
    left = timeout_s if current is None else current.left()
    with deadline_scope(Deadline.after(max(left, MARGIN_S / 2)), past_outer=True) as asking:
        return _ask_outcome(store, locked, state, asking, unknown, timeout_s, participant)


def _ask_outcome(store: StateStore, locked: StateRow, state: str, asking: Deadline,
                 unknown: str, timeout_s: float, participant: str) -> bool:
    deadline = asking.at
    while True:
        try:
            status = store.inquiry.commit_status(locked, state)
        except DatabaseUnreachableError as exc:
            # A restarting server or a cut connection: ask again until the deadline. The
            # outcome is not known, so it must not reach the caller as "retry".
            if time.monotonic() > deadline:
                raise OutcomeUnknownError(
                    f"{unknown} and the database could not be asked within "
                    f"{timeout_s:g} s ({exc}); the {participant} transaction stays open: the "
                    "next transaction of this writer, or `dualwrite recover`, finishes it "
                    "once the database is back") from exc
            time.sleep(0.2)
            continue
        if status in (CommitStatus.COMMITTED, CommitStatus.ABORTED):
            return status is CommitStatus.COMMITTED
        if status is None or time.monotonic() > deadline:
            said = status or ("unknown (too old, claimed since, or run by a server it "
                              "failed over from)")
            raise OutcomeUnknownError(
                f"{unknown}: the database reports transaction "
                f"{locked.locked_by_xid or f'of session {locked.locked_by_pid}'} as "
                f"{said}; "
                f"the {participant} transaction stays open: run `dualwrite recover` once the "
                "database transaction has ended (it decides by the state row)")
        time.sleep(0.05)


def abort_quietly(producer: TwoPhaseProducer, transactional_id: str) -> None:
    """Abort ``producer``'s open transaction, if any; a failure is only logged (the next
    transaction starts a new session, which aborts it)."""
    if not producer.has_open_transaction:
        return
    try:
        producer.abort_transaction()
    except Exception as exc:
        log.warning("abort of transactional_id=%s failed: %s (the next transaction starts a "
                    "new session, which aborts it)", transactional_id, exc)
