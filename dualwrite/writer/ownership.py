"""A writer's hold on its transactional id: its claim (the fencing generation it took), the
producer session that acts under it, and finishing what the stored state leaves in doubt
("Claims" in docs/design.md)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy import Connection

from dualwrite import metrics
from dualwrite.database import database_error
from dualwrite.deadline import deadline_scope
from dualwrite.errors import (
    DualWriteError,
    HeuristicAbortError,
    ProducerFencedError,
    RetriableError,
    TransactionStateError,
)
from dualwrite.participant.prepared_state import PreparedTxnState
from dualwrite.participant.producer import TwoPhaseProducer
from dualwrite.writer.connection import WriterConnection
from dualwrite.writer.handle import GuardedConnection
from dualwrite.writer.lease_keeper import LeaseKeeper
from dualwrite.writer.settings import WriterSettings, log

__all__ = ["Ownership"]

# How often a writer claims its id again when another process claimed it in between.
_CLAIM_ATTEMPTS = 5


class Ownership:
    """The id's claim and producer session: who may act on the id's Kafka transactions now."""

    def __init__(self, settings: WriterSettings, connection: WriterConnection,
                 lease: LeaseKeeper) -> None:
        self._settings = settings
        self.connection = connection
        self.lease = lease
        self.current: TwoPhaseProducer | None = None
        """The producer session, once started (:meth:`producer`)."""
        self._started = False
        """Whether the first session started (the lease check is done)."""
        self.closed = False
        """Set when the writer closes: no session starts again."""
        self._claimed: int | None = None
        """The fencing generation this writer claimed when its session started."""
        self.generation: int | None = None
        """The claim, once seen under the lock: no one has acted on the id since."""
        self.settled = ""
        """The stored state this writer last finished or committed itself."""

    def producer(self) -> TwoPhaseProducer:
        """The producer session, started (and the id claimed) if there is none."""
        if self.current is None:
            if self.closed:
                raise self.closed_error()
            if not self._started:
                self.lease.take_at_start(self.connection)
            # Claim the id (its state row, committed) before the session can act on Kafka: it
            # creates the row, so that recovery, which visits state rows, finds a crash in the
            # very first transaction too. A pooler that would make the lease meaningless is
            # refused first (Leases.check_sessions).
            with deadline_scope(self._settings.timeout_s):  # inside transaction(): its deadline
                self.lease.check_sessions()
                self.claim()
                producer = TwoPhaseProducer(self._settings.kafka_config,
                                            timeout_s=self._settings.timeout_s)
            producer.init_transactions(keep_prepared_txn=True)
            self.current = producer
            self._started = True
        return self.current

    def close_producer(self) -> None:
        """End the producer session; the next :meth:`producer` starts a new one."""
        producer, self.current = self.current, None
        if producer is not None:
            producer.close()

    def end(self) -> TwoPhaseProducer | None:
        """The writer closes: no session starts again. Returns the producer, to be closed."""
        self.closed = True
        producer, self.current = self.current, None
        return producer

    def closed_error(self) -> TransactionStateError:
        return TransactionStateError(f"transactional_id={self._settings.transactional_id}: the "
                                     "writer is closed; make a new DualWriter")

    def claim(self) -> None:
        tid = self._settings.transactional_id
        self.generation = None
        self._claimed = self._settings.store.claim([tid], timeout_s=self._settings.timeout_s)[tid]

    def forget_claim(self) -> None:
        """Claim again before the next transaction (a failed commit may start a new session)."""
        self.generation = self._claimed = None

    def lock_and_settle(self, producer: TwoPhaseProducer, *, claim: bool = False
                        ) -> tuple[GuardedConnection, TwoPhaseProducer]:
        """Lock first, make sure the id is still this writer's claim, finish what is in doubt.
        Returns the connection holding the lock and the producer to go on with.

        Another process's claim since this writer's means it may have acted on the id: claim
        again, so that whatever this writer does next under the lock is its own to do, and if
        ``producer``'s session has started, start a new one. Whoever claimed may have sent an
        EndTxn by that session's (producer id, epoch) that got no answer and is still on its
        way; on the TV1 path it would land on the session's next transaction (KAFKA-17754),
        while the new session's InitProducerId bumps the epoch, so the coordinator refuses it.
        If the claim was a newer producer's, which fenced this one, the writer stops instead
        (:class:`ProducerFencedError`), as it does when that shows at a late lock.
        """
        tid = self._settings.transactional_id
        attempts = 0
        while attempts < _CLAIM_ATTEMPTS:
            if claim:
                self.claim()
            conn, row = self.connection.begin_and_lock()
            if row.fencing_generation not in (self.generation, self._claimed):
                self.connection.rollback(conn)
                attempts += 1
                claim = producer.identity is None
                if not claim:
                    if producer.fenced_at_coordinator():
                        raise self.taken_over("since this writer's last transaction")
                    log.warning("transactional_id=%s was claimed by another process (fencing "
                                "generation %d); starting a new producer session", tid,
                                row.fencing_generation)
                    self.close_producer()
                    producer = self.producer()  # claims
                continue
            try:
                self.lease.take(conn)
                published = self._finish_in_doubt(conn, producer, row.prepared_txn_state)
            except BaseException:
                # Not settled (e.g. a heuristic abort awaiting recovery): the next transaction
                # locks first again, before its body runs.
                self.generation = None
                self.connection.rollback(conn)
                raise
            if published:
                claim = False  # the loss is settled and committed: lock again for the block
                continue
            self.generation, self.settled = row.fencing_generation, row.prepared_txn_state
            return conn, producer
        raise RetriableError(f"transactional_id={tid} was claimed by other processes "
                             f"{_CLAIM_ATTEMPTS} times in a row; is another writer or recovery "
                             "running for it?")

    def _finish_in_doubt(self, conn: Connection, producer: TwoPhaseProducer, stored: str) -> bool:
        """Finish what the stored state says, unless this session committed it itself.

        A heuristic abort handed to the hook is settled in its own database transaction: the
        hook's re-publish and the cleared state commit together, here, so that nothing that
        fails later (the block, the Kafka begin) can roll the re-publish back while the loss is
        forgotten. Returns True then (``conn``'s transaction is committed and the lock gone).
        """
        settings = self._settings
        state = PreparedTxnState.parse(stored)
        try:
            producer.complete_transaction(state, owner_alive=self.lease.owner_alive(conn))
        except HeuristicAbortError as exc:
            if settings.on_heuristic_abort is None:
                raise
            log.error("heuristic abort, calling the re-publish hook: %s", exc)
            metrics.heuristic_outcome(settings.role, exc)
            settings.on_heuristic_abort(exc, conn)
            settings.store.write(conn, settings.transactional_id, "")
            try:
                conn.commit()
            except sa.exc.SQLAlchemyError as failed:
                raise database_error(failed, settings.engine.url) from failed
            log.warning("transactional_id=%s: the re-publish of state=%s is committed and the "
                        "loss acknowledged", settings.transactional_id, stored)
            return True
        return False

    def abort_after_claim(self, producer: TwoPhaseProducer) -> None:
        """Abort the transaction started before the lock and end the session; stop if a newer
        producer fenced it.

        Whoever claimed the id may have sent an EndTxn by this session's (producer id, epoch)
        that is still on its way; on the TV1 path it would land on the session's next
        transaction (KAFKA-17754). The new session's InitProducerId bumps the epoch, so such a
        late request is refused.
        """
        tid = self._settings.transactional_id
        try:
            producer.abort_transaction()
            fenced = producer.fenced_at_coordinator()
        except ProducerFencedError:
            fenced = True
        except DualWriteError as exc:
            # Whoever acted may have ended the transaction already; the new session aborts
            # whatever is still open.
            log.info("abort of transactional_id=%s failed (%s)", tid, exc)
            fenced = producer.fenced_at_coordinator()
        if not fenced:
            log.info("transactional_id=%s was claimed while its transaction was starting; "
                     "starting a new session", tid)
            self.close_producer()
        if fenced:
            raise self.taken_over("while this writer's transaction was starting")

    def taken_over(self, when: str) -> ProducerFencedError:
        return ProducerFencedError(
            f"transactional_id={self._settings.transactional_id}: a newer producer of this "
            f"transactional id took over {when}; nothing was committed. Stop this writer (two "
            "writers must not share a transactional id)")
