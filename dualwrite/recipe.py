"""DualWriter: KIP-939's dual-write recipe as one ``with`` block.

Per transaction: lock the state row; finish whatever the stored state says is in doubt; begin the
Kafka transaction; the application writes rows and produces records; prepare; write the new state
in the same database transaction; **the database commit is the decision**; commit Kafka.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from dualwrite.database import create_engine, transaction
from dualwrite.errors import (
    DatabaseUnreachableError,
    DualWriteError,
    FatalError,
    HeuristicAbortError,
    TransactionStateError,
)
from dualwrite.prepared_state import PreparedTxnState
from dualwrite.producer import Headers, TwoPhaseProducer
from dualwrite.state_store import StateStore, writer_connection

__all__ = ["DualWriteTransaction", "DualWriter"]

log = logging.getLogger(__name__)

HeuristicHook = Callable[[HeuristicAbortError, Connection], None]


class DualWriteTransaction:
    """Handle for the body of ``DualWriter.transaction()``: a DB connection and ``produce``."""

    def __init__(self, connection: Connection, producer: TwoPhaseProducer) -> None:
        self.connection = connection
        """The SQLAlchemy connection of the database transaction; write your rows with it."""
        self._producer = producer
        self.state: PreparedTxnState | None = None
        """The prepared state, set once the block has prepared (for logging and tests)."""

    def produce(self, topic: str, value: bytes | str | None = None,
                key: bytes | str | None = None, *, partition: int | None = None,
                headers: Headers | None = None) -> None:
        """Send a record in this transaction; it becomes visible iff the rows commit."""
        self._producer.produce(topic, value, key, partition=partition, headers=headers)


class DualWriter:
    """Writes database rows and Kafka records atomically, for one transactional id.

    ``engine`` is an SQLAlchemy engine or URL (SQLite and PostgreSQL). One DualWriter serves one
    thread at a time; run one per transactional id for parallelism. ``on_heuristic_abort`` is
    called (inside the next database transaction, with its connection) when Kafka aborted a
    transaction the database committed, so the application can re-publish those rows; without it
    :class:`HeuristicAbortError` is raised and the writer refuses to continue until recovery
    acknowledges it.

    ``verify``: before the database commit, ask the coordinator whether the Kafka transaction is
    still open under this producer's epoch. ``"auto"`` (default) asks only when the answer is in
    question: when the transaction has been open for more than half its
    ``transaction.timeout.ms``. Younger, nothing can have ended it: the broker cannot have timed
    it out, and fencing it takes a writer of the same transactional id, which waits for the
    state-row lock this transaction holds (a fence before it, or a delivery failure, fails the
    flush instead). ``"always"`` asks every time. Either way a commit that Kafka refuses later is
    reported, never ignored (:class:`HeuristicAbortError`).

    ``linger.ms`` defaults to 0 (unless ``kafka_config`` sets it): the records travel while the
    rows are written. The writer keeps one database connection between transactions (see
    :func:`~dualwrite.state_store.writer_connection`); :meth:`close` closes it.
    """

    def __init__(self, engine: Engine | str, kafka_config: Mapping[str, Any], *,
                 transactional_id: str | None = None,
                 on_heuristic_abort: HeuristicHook | None = None,
                 timeout_s: float = 30.0, state_store: StateStore | None = None,
                 verify: Literal["auto", "always"] = "auto") -> None:
        if verify not in ("auto", "always"):
            raise ValueError(f"verify must be 'auto' or 'always', not {verify!r}")
        self._verify_mode = verify
        self._engine = create_engine(engine) if isinstance(engine, str) else engine
        config = dict(kafka_config)
        if "linger.ms" not in config and "queue.buffering.max.ms" not in config:
            # Records leave at once, in flight while the block writes its rows; librdkafka's
            # default (5 ms) would hold them until the prepare's flush.
            config["linger.ms"] = 0
        if transactional_id is not None:
            config["transactional.id"] = transactional_id
        if not config.get("transactional.id"):
            raise FatalError("DualWriter needs a transactional_id")
        self._tid = str(config["transactional.id"])
        self._config = config
        self._timeout_s = timeout_s
        self._store = state_store or StateStore(self._engine)
        self._hook = on_heuristic_abort
        self._producer: TwoPhaseProducer | None = None
        self._conn: Connection | None = None
        self._verifier = ThreadPoolExecutor(1, thread_name_prefix=f"dualwrite-verify-{self._tid}")

    @property
    def transactional_id(self) -> str:
        return self._tid

    @property
    def producer(self) -> TwoPhaseProducer:
        if self._producer is None:
            # Register the id (an empty state row, committed) before any Kafka transaction can
            # open under it, so that recovery, which visits state rows, finds a crash in the very
            # first transaction too.
            with transaction(self._engine) as conn:
                self._store.lock(conn, self._tid)
            producer = TwoPhaseProducer(self._config, timeout_s=self._timeout_s)
            producer.init_transactions(keep_prepared_txn=True)
            self._producer = producer
        return self._producer

    def close(self) -> None:
        """Stop; after a clean run the state row is cleared so the next start needs no check."""
        producer, self._producer = self._producer, None
        if producer is not None:
            last = producer.last_committed
            if last is not None and not last.is_empty and not producer.has_open_transaction:
                try:
                    self._store.compare_and_set(self._tid, str(last), "")
                except DualWriteError as exc:  # the next start checks the anchor instead
                    log.info("could not clear the state of transactional_id=%s: %s", self._tid,
                             exc)
            producer.close()
        self._drop_connection()
        self._verifier.shutdown(wait=False)

    def __enter__(self) -> DualWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _finish_in_doubt(self, conn: Connection, producer: TwoPhaseProducer, stored: str) -> None:
        """Finish what the stored state says, unless this session committed it itself."""
        state = PreparedTxnState.parse(stored)
        try:
            producer.complete_transaction(state)
        except HeuristicAbortError as exc:
            if self._hook is None:
                raise
            log.error("heuristic abort, calling the re-publish hook: %s", exc)
            self._hook(exc, conn)

    @contextmanager
    def transaction(self) -> Iterator[DualWriteTransaction]:
        """One atomic unit: rows written with ``tx.connection`` and records from ``tx.produce``."""
        producer = self.producer
        conn, stored = self._begin_and_lock()
        try:
            self._finish_in_doubt(conn, producer, stored)
            producer.begin_transaction()
            tx = DualWriteTransaction(conn, producer)
            yield tx
            state = producer.flush_and_state()
            tx.state = state
            verify = self._needs_verification(producer)
            if verify:
                # The coordinator round trip overlaps the state-row write.
                verified = self._verifier.submit(producer.verify_prepared)
                self._store.write(conn, self._tid, str(state))
                verified.result()
        except BaseException:
            try:
                conn.rollback()
            except sa.exc.SQLAlchemyError:
                self._drop_connection()
            self._abort_quietly(producer)
            raise
        try:
            self._decide(conn, producer, state, state_written=verify)
        except BaseException:
            self._drop_connection()  # after a failure mid-commit its state is not known
            raise

    def _begin_and_lock(self) -> tuple[Connection, str]:
        """Begin on the writer's connection and lock the state row; returns the stored state.

        The connection is kept between transactions (no pool checkout, no ping). One that died
        while idle is replaced once: nothing of the transaction has happened yet.
        """
        for attempt in (1, 2):
            if self._conn is None:
                self._conn = writer_connection(self._engine)
            conn = self._conn
            try:
                conn.begin()
                return conn, self._store.lock(conn, self._tid)
            except BaseException as exc:
                self._drop_connection()
                lost = isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated
                if attempt == 2 or not lost:
                    raise
                log.info("database connection of transactional_id=%s was lost while idle; "
                         "reconnecting", self._tid)
        raise AssertionError("unreachable")

    def _drop_connection(self) -> None:
        """Let go of the writer's connection; what it held is rolled back, freeing the row lock."""
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except sa.exc.SQLAlchemyError as exc:
                log.debug("closing the connection of transactional_id=%s: %s", self._tid, exc)

    def _needs_verification(self, producer: TwoPhaseProducer) -> bool:
        if self._verify_mode == "always":
            return True
        timeout_ms = producer.transaction_timeout_ms
        return timeout_ms is None or producer.open_for_s * 1000 > timeout_ms / 2

    def _decide(self, conn: Connection, producer: TwoPhaseProducer, state: PreparedTxnState,
                *, state_written: bool) -> None:
        """Commit the database (the decision), then Kafka; an unknown DB outcome is asked for."""
        try:
            if state_written:
                conn.commit()
            else:  # the state row and the COMMIT in one round trip
                self._store.write_and_commit(conn, self._tid, str(state))
        except TransactionStateError:
            self._abort_quietly(producer)  # the database committed without this decision
            raise
        except sa.exc.DBAPIError as exc:
            log.warning("database COMMIT of transactional_id=%s state=%s failed (%s); asking the "
                        "database for the outcome", self._tid, state, exc.__class__.__name__)
            self._drop_connection()  # a failed pipeline can leave the row locked until then
            if not self._database_committed(state):
                self._abort_quietly(producer)
                raise
            log.warning("the database did commit transactional_id=%s state=%s", self._tid, state)
        producer.commit_transaction()

    def _database_committed(self, state: PreparedTxnState) -> bool:
        """Whether the decision reached the database; waits for the row lock to be sure."""
        try:
            with transaction(self._engine) as conn:
                # Taking the lock waits for the failed session's transaction to end either way.
                return self._store.lock(conn, self._tid) == str(state)
        except DatabaseUnreachableError as exc:
            raise DatabaseUnreachableError(
                f"the database COMMIT of transactional_id={self._tid} state={state} has an "
                f"unknown outcome and the database cannot be asked ({exc}); the Kafka transaction "
                "stays open: run `dualwrite recover` when the database is back"
            ) from exc

    def _abort_quietly(self, producer: TwoPhaseProducer) -> None:
        if not producer.has_open_transaction:
            return
        try:
            producer.abort_transaction()
        except Exception as exc:
            log.warning("abort of transactional_id=%s failed: %s (the next transaction or "
                        "recovery aborts it)", self._tid, exc)

