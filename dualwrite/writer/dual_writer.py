"""DualWriter: KIP-939's dual-write recipe as one ``with`` block.

Per transaction: lock the state row; finish whatever the stored state says is in doubt; begin the
Kafka transaction; the application writes rows and produces records; prepare; write the new state
in the same database transaction; **the database commit is the decision**; commit Kafka.

Once a writer's session is established and it holds its id's lease (:mod:`dualwrite.writer.lease`),
the lock waits for the block's first record or first use of the database: a record produced first is
on its way while the lock is taken, and the row's fencing generation, read under the lock, tells
whether anyone could have ended or fenced its transaction meanwhile (then it starts over; see
"Claims" and "Leases" in docs/design.md). After each Kafka commit the writer checks that the
session holding its lease is still the one that took it; a lost session means a new producer
session and a lock first ("The lease under session loss").

``DualWriter`` is the session: its settings, producer, connection and public API. Its parts:
:class:`~dualwrite.writer.transaction.RunningTransaction` (one transaction's steps),
:class:`~dualwrite.writer.ownership.Ownership` (the claim, the producer session, what is in
doubt), :class:`~dualwrite.writer.lease_keeper.LeaseKeeper` (the lease and its checks) and
:class:`~dualwrite.writer.connection.WriterConnection` (the connection kept between
transactions).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from sqlalchemy import Engine

from dualwrite import metrics
from dualwrite.database import create_engine
from dualwrite.deadline import deadline_scope
from dualwrite.errors import (
    ConfigurationError,
    DualWriteError,
    HeuristicOutcomeError,
    TransactionStateError,
)
from dualwrite.participant.client_config import check_kafka_config, check_timeout
from dualwrite.participant.prepared_state import PreparedTxnState
from dualwrite.participant.producer import TwoPhaseProducer
from dualwrite.writer.connection import WriterConnection
from dualwrite.writer.hooks import NO_HOOKS, HeuristicHook, PhaseHooks
from dualwrite.writer.lease_keeper import LeaseKeeper
from dualwrite.writer.ownership import Ownership
from dualwrite.writer.settings import WriterSettings, log
from dualwrite.writer.state_store import StateStore
from dualwrite.writer.transaction import RunningTransaction
from dualwrite.writer.transaction_handle import (
    DualWriteTransaction,
    LateLock,
    TransactionContext,
    transaction_context,
)

__all__ = ["DualWriteTransaction", "DualWriter", "HeuristicHook", "LateLock", "PhaseHooks",
           "TransactionContext", "transaction_context"]


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
    it out, and ending or fencing it takes a writer of the same transactional id or recovery,
    which claim the id first (:meth:`StateStore.claim`) and act only under the state-row lock.
    A claim before the lock was granted shows in the row's fencing generation, and the writer
    starts the transaction over in a new session (aborting it and sending its records again,
    under a new epoch that a late EndTxn of whoever claimed cannot reach); a fence that
    comes earlier, or a delivery failure, fails the flush instead. ``"always"`` asks every time.
    Either way a commit that Kafka refuses later is reported, never ignored
    (:class:`HeuristicAbortError`).

    ``linger.ms`` defaults to 0 (unless ``kafka_config`` sets it): the records travel while the
    rows are written. The writer keeps one database connection between transactions (see
    :func:`~dualwrite.writer.state_store.writer_connection`); :meth:`close` closes it.

    Errors: what goes wrong in dualwrite's own work (its lock, state row, COMMIT, the question
    after a failed COMMIT, its claim, Kafka) reaches the application as a
    :class:`~dualwrite.errors.DualWriteError` (chained from the driver's exception), grouped by
    what to do next (:func:`dualwrite.database.database_error`): e.g. a lost connection or a
    restarting server is :class:`~dualwrite.errors.DatabaseUnreachableError`, a serialization
    failure or deadlock :class:`~dualwrite.errors.TransactionConflictError`; the writer itself
    stays usable and the next :meth:`transaction` reconnects. An exception raised by the
    application's own statements inside the block (its ``IntegrityError``, say) is the
    application's: it propagates unchanged, after both sides were rolled back.

    ``hooks``: a :class:`PhaseHooks` called at the named points of the protocol (fault injection
    in the crash tests, observability); none by default.

    ``take_over``: start even if a live process holds this id's lease (another writer, which is
    then fenced); without it such a start raises :class:`FatalError` (docs/design.md, "Leases").

    ``metrics_role``: the ``role`` label of its metrics (:mod:`dualwrite.metrics`; ``"pool"``
    for a :class:`~dualwrite.writer.DualWriterPool`'s writers).
    """

    def __init__(self, engine: Engine | str, kafka_config: Mapping[str, Any], *,
                 transactional_id: str | None = None,
                 on_heuristic_abort: HeuristicHook | None = None,
                 timeout_s: float = 30.0, state_store: StateStore | None = None,
                 verify: Literal["auto", "always"] = "auto",
                 hooks: PhaseHooks | None = None, take_over: bool = False,
                 metrics_role: metrics.Role = "writer") -> None:
        if verify not in ("auto", "always"):
            raise ConfigurationError(f"verify must be 'auto' or 'always', not {verify!r}")
        if metrics_role not in metrics.ROLES:
            raise ConfigurationError(f"metrics_role must be one of {metrics.ROLES}")
        config = check_kafka_config(kafka_config)
        timeout_s = check_timeout(timeout_s)
        # Its errors name the URL with the password masked, or not at all.
        engine = engine if isinstance(engine, Engine) else create_engine(engine)
        if "linger.ms" not in config and "queue.buffering.max.ms" not in config:
            # Records leave at once, in flight while the block writes its rows; librdkafka's
            # default (5 ms) would hold them until the prepare's flush.
            config["linger.ms"] = 0
        if transactional_id is not None:
            config["transactional.id"] = transactional_id
        if not config.get("transactional.id") or not isinstance(config["transactional.id"], str):
            raise ConfigurationError("DualWriter needs a transactional_id (a non-empty str)")
        tid = str(config["transactional.id"])
        self._settings = WriterSettings(
            transactional_id=tid, kafka_config=config, timeout_s=timeout_s, engine=engine,
            store=state_store or StateStore(engine), on_heuristic_abort=on_heuristic_abort,
            hooks=hooks if hooks is not None else NO_HOOKS, verify=verify, role=metrics_role,
            take_over=take_over)
        self.lease_keeper = LeaseKeeper(self._settings)
        """The writer's lease and the check of it begun after each Kafka commit."""
        self._connection = WriterConnection(self._settings, self.lease_keeper)
        self._owner = Ownership(self._settings, self._connection, self.lease_keeper)
        self._helper = ThreadPoolExecutor(1, thread_name_prefix=f"dualwrite-{tid}")
        self._busy = threading.Lock()
        """Held while a transaction of this writer is open (one at a time, one thread)."""
        self._busy_thread: threading.Thread | None = None
        self._heuristic_counted = ""
        """The last heuristic outcome counted (one raised again at each start counts once)."""

    @property
    def transactional_id(self) -> str:
        return self._settings.transactional_id

    @property
    def producer(self) -> TwoPhaseProducer:
        return self._owner.producer()

    def close(self) -> None:
        """Stop; after a clean run the state row is cleared so the next start needs no check.

        The lease is given back, so a new writer of the id starts at once. Idempotent; the
        writer is not used again (:class:`TransactionStateError`).
        """
        if self._owner.closed:
            return
        producer = self._owner.end()
        with deadline_scope(self._settings.timeout_s):
            self._close(producer)

    def _close(self, producer: TwoPhaseProducer | None) -> None:
        """Each step also when one before it failed: the lease must not outlive close()."""
        tid, store = self._settings.transactional_id, self._settings.store

        def clear_state(last: PreparedTxnState) -> None:
            try:
                store.compare_and_set(tid, str(last), "")
            except DualWriteError as exc:  # the next start checks the anchor instead
                log.info("could not clear the state of transactional_id=%s: %s", tid, exc)

        last = producer.last_committed if producer is not None else None
        with contextlib.ExitStack() as steps:  # the callbacks run last to first
            steps.callback(self._helper.shutdown, wait=False)
            # A file lock; PostgreSQL's went with the connection.
            steps.callback(self.lease_keeper.release)
            if last is not None and not last.is_empty and producer is not None \
                    and not producer.has_open_transaction:
                # Once the connection is gone: a transaction interrupted between its row lock
                # and its end (a KeyboardInterrupt) holds that lock until then. The swap only
                # applies to the state this writer committed, lease or not.
                steps.callback(clear_state, last)
            steps.callback(self._connection.drop)
            steps.callback(self.lease_keeper.verdict)  # a check still running uses the connection
            if producer is not None:
                steps.callback(producer.close)

    def __enter__(self) -> DualWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @transaction_context("writer.transaction")
    def transaction(self) -> Iterator[DualWriteTransaction]:
        """One atomic unit: rows written with ``tx.connection`` and records from ``tx.produce``.

        Failures of dualwrite's own statements raise :class:`~dualwrite.errors.DualWriteError`
        subclasses; an exception of the application's own statements in the block propagates
        unchanged (see the class docstring). A block that ends ``tx.connection``'s transaction
        itself is refused and abandoned (:class:`TransactionStateError`, see
        :mod:`dualwrite.writer.handle`); so is a second ``transaction()`` while one is open, in
        this thread (nested) or another, at once rather than after waiting for the lock; and
        so is any after :meth:`close`, before anything is opened.
        """
        if self._owner.closed:
            raise self._owner.closed_error()
        if not self._busy.acquire(blocking=False):
            where = ("nested in the open one" if self._busy_thread is threading.current_thread()
                     else f"while thread {getattr(self._busy_thread, 'name', '?')} has one open")
            raise TransactionStateError(
                f"transactional_id={self.transactional_id}: transaction() called {where}: a "
                "transaction of this writer is already open. One DualWriter serves one thread at "
                "a time, one transaction at a time; run one writer (with its own transactional "
                "id) per thread")
        self._busy_thread = threading.current_thread()
        ended: BaseException | None = None
        try:
            clock = metrics.PhaseClock(self._settings.role)
            yield from RunningTransaction(self._settings, self._owner, self._helper, clock).run()
        except BaseException as exc:
            ended = exc
            raise
        finally:
            self._count(ended)
            conn = self._connection.current
            if conn is not None:
                conn.retire()  # a reference kept from the block refuses from now on
            self._busy_thread = None
            self._busy.release()

    def _count(self, exc: BaseException | None) -> None:
        """Count the transaction's outcome; a heuristic outcome raised again (for the same
        stored state, at each start until acknowledged) counts once."""
        if isinstance(exc, HeuristicOutcomeError):
            seen = str(getattr(exc, "state", exc))
            if seen == self._heuristic_counted:
                return
            self._heuristic_counted = seen
        metrics.transaction_ended(self._settings.role, exc)
