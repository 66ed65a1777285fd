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
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from dualwrite import metrics
from dualwrite.database import bounded_wait, create_engine, database_error, is_mysql
from dualwrite.deadline import MARGIN_S, Deadline, current_deadline, deadline_scope
from dualwrite.errors import (
    BlockCommittedError,
    ConfigurationError,
    DatabaseUnreachableError,
    DualWriteError,
    FatalError,
    HeuristicAbortError,
    HeuristicCommitError,
    HeuristicOutcomeError,
    OutcomeUnknownError,
    ProducerFencedError,
    RetriableError,
    TransactionStateError,
)
from dualwrite.participant.client_config import check_kafka_config, check_timeout
from dualwrite.participant.completion import committed_at_anchor
from dualwrite.participant.identifiers import TopicPartition
from dualwrite.participant.prepared_state import PreparedTxnState
from dualwrite.participant.producer import Headers, TwoPhaseProducer
from dualwrite.writer.handle import GuardedConnection
from dualwrite.writer.lease import Lease, Leases, pooler_error
from dualwrite.writer.state_store import StateRow, StateStore, writer_connection

__all__ = ["DualWriteTransaction", "DualWriter", "PhaseHooks"]

log = logging.getLogger(__name__)

HeuristicHook = Callable[[HeuristicAbortError, Connection], None]

# How often a writer claims its id again when another process claimed it in between.
_CLAIM_ATTEMPTS = 5

# How long a starting writer waits for its id's lease (recovery holds it while it resolves the
# id) before it concludes that a live writer holds it (bounded by ``timeout_s`` too).
_LEASE_WAIT_S = 5.0

_Record = tuple[str, bytes | str | None, bytes | str | None, int | None, Headers | None]

LateLock = Callable[[TwoPhaseProducer, Sequence[_Record]],
                    tuple[GuardedConnection, TwoPhaseProducer]]
"""Takes a transaction's deferred state-row lock, given its producer and the records it sent
before; returns the connection and producer the transaction goes on with (both new if it had to
start over). Raises, with nothing of the transaction left open under a new producer, if it
cannot."""


_T = TypeVar("_T")
_P = ParamSpec("_P")


class _NotATransactionError(TransactionStateError, AttributeError):
    """A transaction's call made on ``transaction()``'s context manager (``with`` forgotten);
    an AttributeError too, so that ``hasattr`` and ``getattr(x, name, default)`` still work."""


class TransactionContext(contextlib.AbstractContextManager[_T]):
    """What ``transaction()`` returns: a context manager whose ``with`` opens the transaction.
    A transaction's call made on it instead (``w.transaction().produce(...)``) raises
    :class:`~dualwrite.errors.TransactionStateError` saying to use ``with``."""

    def __init__(self, inner: contextlib.AbstractContextManager[_T], what: str) -> None:
        self._inner = inner
        self._what = what

    def __enter__(self) -> _T:
        return self._inner.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        return self._inner.__exit__(*exc)

    if not TYPE_CHECKING:  # at run time only: type checkers still flag the misuse
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            raise _NotATransactionError(
                f"{self._what}() returns a context manager, not the transaction: write "
                f"`with {self._what}() as tx:` and call tx.{name} inside the block")


def transaction_context(what: str) -> Callable[[Callable[_P, Iterator[_T]]],
                                              Callable[_P, TransactionContext[_T]]]:
    """``@contextmanager`` for ``transaction()`` methods: returns a :class:`TransactionContext`
    (named ``what`` in its misuse message)."""
    def decorate(fn: Callable[_P, Iterator[_T]]) -> Callable[_P, TransactionContext[_T]]:
        managed = contextmanager(fn)

        @functools.wraps(fn)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> TransactionContext[_T]:
            return TransactionContext(managed(*args, **kwargs), what)
        return wrapper
    return decorate


class PhaseHooks:
    """Named points of the writer's protocol: the fault-injection and observability seam.

    Pass a subclass as ``DualWriter(hooks=...)`` and override the points of interest; the base
    class does nothing. Each is called at the point its name says, in the thread running the
    transaction (``verified`` excepted); a transaction that starts over (docs/design.md,
    "Claims") passes ``locked`` and ``kafka_begun`` again. An exception a hook raises fails the
    transaction there, as if the next step had failed (after ``kafka_committed`` it only
    propagates); the crash tests stop the process at a point and kill it.
    """

    def kafka_begun(self) -> None:
        """The Kafka transaction has begun (librdkafka's begin is local; nothing is sent)."""

    def before_late_lock(self, records_sent: int) -> None:
        """The writer is about to take its deferred state-row lock: after the block's first
        record (``records_sent`` 1, which may already be in the log), or at its first use of
        ``tx.connection`` or its end (0)."""

    def locked(self) -> None:
        """The state row is locked under this writer's claim and the stored state settled."""

    def resending(self, records: int) -> None:
        """The flush stalled: the transaction was aborted by a new session, which sends its
        ``records`` again (before ``prepared``)."""

    def prepared(self, state: PreparedTxnState) -> None:
        """The records are flushed and acknowledged; ``state`` names the transaction."""

    def verified(self, state: PreparedTxnState) -> None:
        """The coordinator confirmed the prepared transaction. Called on the writer's helper
        thread, while the state row is being written; only when verification runs."""

    def database_committed(self, state: PreparedTxnState) -> None:
        """The database committed ``state``, the decision; Kafka's commit comes next."""

    def kafka_committed(self, state: PreparedTxnState) -> None:
        """Kafka committed the transaction too: it is complete."""


_NO_HOOKS = PhaseHooks()


class DualWriteTransaction:
    """Handle for the body of ``DualWriter.transaction()``: a DB connection and ``produce``.

    Once a writer's session is established it begins with no connection and a ``late_lock``
    (:data:`LateLock`), taken at the block's first record or first use of :attr:`connection`.
    The connection is lent to the block (:class:`~dualwrite.writer.handle.GuardedConnection`):
    ending its transaction there is refused and abandons the transaction; after the block the
    handle refuses everything.
    """

    def __init__(self, connection: GuardedConnection | None, producer: TwoPhaseProducer,
                 late_lock: LateLock | None = None) -> None:
        self._connection = connection
        self._producer = producer
        self._late_lock = late_lock
        self._records: list[_Record] = []
        """Every record of the transaction, sent again should it start over in a new session."""
        self._ended = False
        self._misuse: TransactionStateError | None = None
        self.state: PreparedTxnState | None = None
        """The prepared state, set once the block has prepared (for logging and tests)."""
        if connection is not None:
            connection.lend()

    @property
    def connection(self) -> Connection:
        """The SQLAlchemy connection of the database transaction; write your rows with it.

        The first use may take the state-row lock (unless a record was produced first, which
        takes it instead, while the record travels). It refuses ``commit()``, ``rollback()``,
        ``begin()``, ``close()`` and the like (:class:`TransactionStateError`): the writer
        ends the transaction; savepoints (``begin_nested()``) are fine.
        """
        self._refuse_if_ended("connection")
        self._take_late_lock()
        assert self._connection is not None
        return self._connection

    def produce(self, topic: str, value: bytes | str | None = None,
                key: bytes | str | None = None, *, partition: int | None = None,
                headers: Headers | None = None) -> None:
        """Send a record in this transaction; it becomes visible iff the rows commit."""
        self._refuse_if_ended("produce()")
        if self._connection is not None and self._connection.misused is not None:
            raise TransactionStateError(
                "tx.produce() refused: this transaction's connection was misused; the "
                "transaction is abandoned: leave the block (nothing of it commits)")
        self._producer.produce(topic, value, key, partition=partition, headers=headers)
        self._records.append((topic, value, key, partition, headers))
        if self._late_lock is not None:
            # The first record is on its way (AddPartitionsToTxn first): lock now.
            self._take_late_lock()

    def records(self) -> tuple[_Record, ...]:
        """The records produced so far, in order."""
        return tuple(self._records)

    def check(self, records: Sequence[_Record]) -> None:
        """Raise what :meth:`produce` would raise for the first of ``records`` that the client
        refuses by itself, sending none of them (a group's request, before its records join)."""
        for topic, value, key, partition, _ in records:
            self._producer.check_record(topic, value, key, partition=partition)

    def bound(self) -> tuple[GuardedConnection | None, TwoPhaseProducer]:
        """The connection (None until the deferred lock is taken) and the producer the
        transaction uses now, without taking the lock: what the DualWriter ends it with."""
        return self._connection, self._producer

    def end(self) -> None:
        """The block is over: the handle refuses from now on, and the writer takes its
        connection back (see :attr:`misuse`)."""
        if not self._ended:
            self._ended = True
            if self._connection is not None:
                self._misuse = self._connection.take_back()

    @property
    def misuse(self) -> TransactionStateError | None:
        """What the block was refused, if it misused the connection (after :meth:`end`)."""
        return self._misuse

    def lock(self) -> GuardedConnection:
        """The connection, taking the deferred lock if the block did not (for the writer)."""
        self._take_late_lock()
        assert self._connection is not None
        return self._connection

    def _refuse_if_ended(self, what: str) -> None:
        if self._ended:
            raise TransactionStateError(
                f"tx.{what} refused: the dual-write transaction's block has ended; use the "
                "handle of the next `with writer.transaction() as tx:`")

    def _take_late_lock(self) -> None:
        late_lock, self._late_lock = self._late_lock, None
        if late_lock is not None:
            self._connection, self._producer = late_lock(self._producer, self.records())
            if not self._ended:
                self._connection.lend()


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
        self._role = metrics_role
        self._heuristic_counted = ""
        """The last heuristic outcome counted (one raised again at each start counts once)."""
        self._verify_mode = verify
        self._hooks = hooks if hooks is not None else _NO_HOOKS
        config = check_kafka_config(kafka_config)
        timeout_s = check_timeout(timeout_s)
        # Its errors name the URL with the password masked, or not at all.
        self._engine = engine if isinstance(engine, Engine) else create_engine(engine)
        if "linger.ms" not in config and "queue.buffering.max.ms" not in config:
            # Records leave at once, in flight while the block writes its rows; librdkafka's
            # default (5 ms) would hold them until the prepare's flush.
            config["linger.ms"] = 0
        if transactional_id is not None:
            config["transactional.id"] = transactional_id
        if not config.get("transactional.id") or not isinstance(config["transactional.id"], str):
            raise ConfigurationError("DualWriter needs a transactional_id (a non-empty str)")
        self._tid = str(config["transactional.id"])
        self._config = config
        self._timeout_s = timeout_s
        self._store = state_store or StateStore(self._engine)
        self._hook = on_heuristic_abort
        self._producer: TwoPhaseProducer | None = None
        self._conn: GuardedConnection | None = None
        self._busy = threading.Lock()
        """Held while a transaction of this writer is open (one at a time, one thread)."""
        self._busy_thread: threading.Thread | None = None
        self._claimed: int | None = None
        """The fencing generation this writer claimed when its session started."""
        self._generation: int | None = None
        """The claim, once seen under the lock: no one has acted on the id since."""
        self._settled = ""
        """The stored state this writer last finished or committed itself."""
        self._leases = Leases(self._engine)
        self._lease: Lease | None = None
        """Held while this writer may begin transactions before taking the row lock."""
        self._locked: StateRow | None = None
        """The row as locked by the database transaction holding the lock; on PostgreSQL its
        transaction id and server name the decision (:meth:`StateStore.commit_status`)."""
        self._lease_check: Future[str] | None = None
        """The check of the lease begun after the last Kafka commit (:meth:`_check_lease`)."""
        self._helper = ThreadPoolExecutor(1, thread_name_prefix=f"dualwrite-{self._tid}")
        self._take_over = take_over
        self._started = False
        """Whether this writer's first session started (the lease check is done)."""
        self._closed = False
        """Set by :meth:`close`: the writer refuses to be used again."""
        self._budget_left = timeout_s
        """What is left of the running transaction's deadline while its block runs."""

    @property
    def transactional_id(self) -> str:
        return self._tid

    @property
    def producer(self) -> TwoPhaseProducer:
        if self._producer is None:
            if self._closed:
                raise self._closed_error()
            if not self._started:
                self._check_lease_at_start()
            # Claim the id (its state row, committed) before the session can act on Kafka: it
            # creates the row, so that recovery, which visits state rows, finds a crash in the
            # very first transaction too. A pooler that would make the lease meaningless is
            # refused first (Leases.check_sessions).
            with deadline_scope(self._timeout_s):  # inside transaction(): its deadline
                self._leases.check_sessions()
                self._claim()
                producer = TwoPhaseProducer(self._config, timeout_s=self._timeout_s)
            producer.init_transactions(keep_prepared_txn=True)
            self._producer = producer
            self._started = True
        return self._producer

    def _check_lease_at_start(self) -> None:
        """Before the first session fences anyone: take the id's lease, or refuse to start if
        a live process holds it (unless ``take_over``); see "Leases" in docs/design.md.

        Recovery holds a lease only while it resolves the id, so the writer waits a little
        for it first; a live writer holds it for its whole session.
        """
        if self._lease is not None or not self._leases.supported:
            return
        wait_s = 0.0 if self._take_over else min(self._timeout_s, _LEASE_WAIT_S)
        deadline = time.monotonic() + wait_s
        while True:
            conn = self._own_connection()
            try:
                held = self._take_lease(conn)
            finally:
                self._rollback(conn)  # PostgreSQL's session-level lock outlives it
            if held or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if held:
            return
        if not self._take_over:
            raise FatalError(
                f"transactional_id={self._tid} is in use: another live process (a writer of "
                "this id, or recovery resolving it) holds its lease. Two writers must not share "
                "a transactional id: stop the other writer, or pass DualWriter(..., "
                "take_over=True) to fence it")
        log.warning("transactional_id=%s: another live process holds its lease; taking over "
                    "(take_over=True): that writer is fenced, and this one locks its state row "
                    "first until the lease is free", self._tid)

    def close(self) -> None:
        """Stop; after a clean run the state row is cleared so the next start needs no check.

        The lease is given back, so a new writer of the id starts at once. Idempotent; the
        writer is not used again (:class:`TransactionStateError`).
        """
        if self._closed:
            return
        self._closed = True
        with deadline_scope(self._timeout_s):
            self._close()

    def _close(self) -> None:
        """Each step also when one before it failed: the lease must not outlive close()."""

        def release_lease() -> None:  # a file lock; PostgreSQL's went with the connection
            lease, self._lease = self._lease, None
            if lease is not None:
                lease.release()

        def clear_state(last: PreparedTxnState) -> None:
            try:
                self._store.compare_and_set(self._tid, str(last), "")
            except DualWriteError as exc:  # the next start checks the anchor instead
                log.info("could not clear the state of transactional_id=%s: %s", self._tid, exc)

        producer, self._producer = self._producer, None
        last = producer.last_committed if producer is not None else None
        with contextlib.ExitStack() as steps:  # the callbacks run last to first
            steps.callback(self._helper.shutdown, wait=False)
            steps.callback(release_lease)
            if last is not None and not last.is_empty and producer is not None \
                    and not producer.has_open_transaction:
                # Once the connection is gone: a transaction interrupted between its row lock
                # and its end (a KeyboardInterrupt) holds that lock until then. The swap only
                # applies to the state this writer committed, lease or not.
                steps.callback(clear_state, last)
            steps.callback(self._drop_connection)
            steps.callback(self._lease_verdict)  # a check still running uses the connection
            if producer is not None:
                steps.callback(producer.close)

    def _closed_error(self) -> TransactionStateError:
        return TransactionStateError(f"transactional_id={self._tid}: the writer is closed; "
                                     "make a new DualWriter")

    def __enter__(self) -> DualWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _finish_in_doubt(self, conn: Connection, producer: TwoPhaseProducer, stored: str) -> bool:
        """Finish what the stored state says, unless this session committed it itself.

        A heuristic abort handed to the hook is settled in its own database transaction: the
        hook's re-publish and the cleared state commit together, here, so that nothing that
        fails later (the block, the Kafka begin) can roll the re-publish back while the loss is
        forgotten. Returns True then (``conn``'s transaction is committed and the lock gone).
        """
        state = PreparedTxnState.parse(stored)
        try:
            producer.complete_transaction(state, owner_alive=self._owner_alive(conn))
        except HeuristicAbortError as exc:
            if self._hook is None:
                raise
            log.error("heuristic abort, calling the re-publish hook: %s", exc)
            metrics.heuristic_outcome(self._role, exc)
            self._hook(exc, conn)
            self._store.write(conn, self._tid, "")
            try:
                conn.commit()
            except sa.exc.SQLAlchemyError as failed:
                raise database_error(failed, self._engine.url) from failed
            log.warning("transactional_id=%s: the re-publish of state=%s is committed and the "
                        "loss acknowledged", self._tid, stored)
            return True
        return False

    def _owner_alive(self, conn: Connection) -> Callable[[], bool] | None:
        """Whether another writer may still run the session that prepared the stored state.

        Only a lease holder begins transactions before the row lock, so only while another
        process holds the lease could an EndTxn by (producer id, epoch) land on a later
        transaction than the one the stored state names. None: nobody else can hold it.
        """
        if self._lease is not None or not self._leases.supported:
            return None
        return lambda: not self._take_lease(conn)

    def _take_lease(self, conn: Connection) -> bool:
        """Take this id's lease if free (on ``conn``'s session on PostgreSQL); True if held."""
        if self._lease is None and self._leases.supported:
            try:
                self._lease = self._leases.try_acquire(conn, self._tid)
            except sa.exc.SQLAlchemyError as exc:
                raise database_error(exc, self._engine.url) from exc
            if self._lease is not None:
                log.info("transactional_id=%s: lease taken; later transactions lock the state "
                         "row after their first record", self._tid)
        return self._lease is not None

    def _lease_intact(self) -> bool:
        """Whether the next transaction may begin before its row lock.

        Only while this writer's lease has been held without a break since its last Kafka
        commit. Recovery (or a second writer) commits a transaction by (producer id, epoch) only
        once it holds the lease, and only if it found that transaction open: before this
        writer's Kafka commit of it. A check after that commit which finds the session that
        took the lease still running, and the id unclaimed, proves nobody did; the session lost
        instead (a restart, pg_terminate_backend, idle_session_timeout, a failover), someone
        may have, with an EndTxn still on its way that would land on the next transaction of
        this session. So the writer starts a new producer session (the epoch moves and such a
        request is refused) and locks first. The lease lost later than the check changes
        nothing: the transactions begun since are not decided yet, so whoever acts can only
        abort them, and the late lock shows their claim (then the writer starts over, again
        in a new session).
        """
        verdict = self._lease_verdict()
        if self._generation is None or self._lease is None:
            return False
        if not self._lease.ends_with_connection:
            return True  # a file lock: held as long as this process lives
        if verdict is None:  # no Kafka commit since the lease was taken: ask now
            verdict = self._check_lease()
            self._lease_check = None
        if verdict == "intact":
            return True
        if verdict == "moved":
            held = self._lease.backend_pid
            self._drop_connection()
            self._generation = None
            raise pooler_error(self._engine, f"the writer's lease is still held by backend "
                                             f"{held}, its connection was moved to another one")
        if verdict == "lost":
            log.warning("transactional_id=%s: the database session that held the lease ended "
                        "(server restart, terminated backend, failover?); starting a new "
                        "producer session and locking first", self._tid)
            self._drop_connection()
            self._close_producer()
            self._generation = None
        else:
            self._lease_check = None  # claimed: locking first settles it
        return False

    def _lease_verdict(self) -> str | None:
        """The answer of the check begun after the last Kafka commit (waited for), if any."""
        check = self._lease_check
        return None if check is None else check.result()

    def _check_lease(self) -> str:
        """``"intact"``: the writer's connection still runs the session that took the lease
        and the id's generation is still this writer's; ``"claimed"``: someone claimed it;
        ``"moved"``: the connection runs on another session while the lease's still holds it
        (a transaction pooler); ``"lost"``: the session is another one, or did not answer."""
        conn, lease, generation = self._conn, self._lease, self._generation
        if conn is None or lease is None:
            return "lost"
        try:
            # Bounded on the helper thread too: a silent peer must not hold the next transaction.
            with conn.own_use(), deadline_scope(self._timeout_s):
                stored, backend_pid = self._store.generation_on(conn, self._tid)
        except DualWriteError as exc:
            log.info("transactional_id=%s: checking the lease's session failed (%s)", self._tid,
                     exc)
            return "lost"
        if not lease.held_by_session(backend_pid):
            try:
                with conn.own_use(), deadline_scope(self._timeout_s):
                    moved = self._leases.still_held_by_its_session(conn, lease)
            except DualWriteError as exc:
                log.info("transactional_id=%s: asking who holds the lease failed (%s)",
                         self._tid, exc)
                return "lost"
            return "moved" if moved else "lost"
        return "intact" if stored == generation else "claimed"

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
        if self._closed:
            raise self._closed_error()
        if not self._busy.acquire(blocking=False):
            where = ("nested in the open one" if self._busy_thread is threading.current_thread()
                     else f"while thread {getattr(self._busy_thread, 'name', '?')} has one open")
            raise TransactionStateError(
                f"transactional_id={self._tid}: transaction() called {where}: a transaction of "
                "this writer is already open. One DualWriter serves one thread at a time, one "
                "transaction at a time; run one writer (with its own transactional id) per "
                "thread")
        self._busy_thread = threading.current_thread()
        ended: BaseException | None = None
        try:
            yield from self._transaction(metrics.PhaseClock(self._role))
        except BaseException as exc:
            ended = exc
            raise
        finally:
            self._count(ended)
            if self._conn is not None:
                self._conn.retire()  # a reference kept from the block refuses from now on
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
        metrics.transaction_ended(self._role, exc)

    def _transaction(self, clock: metrics.PhaseClock
                     ) -> Generator[DualWriteTransaction, None, None]:
        """:meth:`transaction`'s protocol, once it is known to be the only one open."""
        # One deadline for dualwrite's own waits (dualwrite.deadline), paused while the block
        # runs: the application's own time is not dualwrite's to bound.
        with deadline_scope(self._timeout_s) as deadline:
            if self._producer is not None and self._producer.has_open_transaction:
                # The last transaction could not be ended (its abort or commit failed): a new
                # session finishes it from the stored state, as after a restart.
                self._close_producer()
            late = self._lease_intact()
            producer = self.producer
            if late and producer.ready:
                producer.begin_transaction()
                tx = DualWriteTransaction(None, producer, self._lock_late)
            else:
                conn, producer = self._lock_and_settle(producer)
                try:
                    self._hooks.locked()
                    producer.begin_transaction()
                except BaseException:
                    self._rollback(conn)
                    raise
                tx = DualWriteTransaction(conn, producer)
        self._budget_left = deadline.left()
        clock.lap("begin")
        try:
            self._hooks.kafka_begun()
            try:
                yield tx
            finally:
                tx.end()
                clock.restart()  # the block's time is the application's
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
                self._hooks.prepared(state)
                verify = self._needs_verification(producer)
                if verify:
                    # The coordinator round trip overlaps the state-row write.
                    verified = self._helper.submit(contextvars.copy_context().run,
                                                   self._verify, producer, state)
                    self._store.write(conn, self._tid, str(state))
                    verified.result()
            clock.lap("prepare")
        except BaseException as exc:
            tx.end()  # (a hook may fail before the block ran)
            held, producer = tx.bound()
            left = held is not None and held.left_transaction
            with self._resumed_deadline():
                if tx.misuse is not None:
                    self._discard_connection()
                elif held is not None:
                    self._rollback(held)
                self._abort_quietly(producer)
                committed = self._what_the_block_committed() if left else None
            if committed is not None:
                raise committed from exc
            lost = self._database_lost(exc)
            if lost is not None:
                self._drop_connection()
                raise lost from exc
            raise
        try:
            with self._resumed_deadline():
                self._decide(conn, producer, state, state_written=verify, clock=clock)
        except BaseException:
            self._drop_connection()  # after a failure mid-commit its state is not known
            # Commit failures can start a new producer session: claim again before the next.
            self._generation = self._claimed = None
            raise
        self._settled = str(state)
        self._lease_check = None
        if self._lease is not None and self._lease.ends_with_connection:
            # Only now, after the Kafka commit: see _lease_intact. In the background, so that
            # it costs the next transaction nothing if the application pauses in between.
            self._lease_check = self._helper.submit(self._check_lease)
        self._hooks.kafka_committed(state)

    @contextmanager
    def _resumed_deadline(self) -> Iterator[Deadline]:
        """The running transaction's deadline, resumed where its block paused it."""
        with deadline_scope(Deadline(time.monotonic() + self._budget_left,
                                     self._timeout_s)) as deadline:
            try:
                yield deadline
            finally:
                self._budget_left = deadline.left()

    def _what_the_block_committed(self) -> BlockCommittedError | None:
        """A statement of the block ended the database transaction (the driver said so): None if
        the database rolled it back; otherwise the heuristic outcome, handed to the hook.

        On PostgreSQL the transaction's id tells; elsewhere it cannot be known, and a possible
        commit is reported as one (never silent)."""
        locked = self._locked
        xid = locked.locked_by_xid if locked is not None else None
        status: str | None = ""
        if xid is not None:
            try:
                status = self._store.transaction_status(xid)
            except DualWriteError as exc:
                status = f"unknown ({exc})"
            if status == "aborted":
                return None
            detail = (f"a statement of the block ended the database transaction ({status})"
                      if status != "committed"
                      else "a statement of the block committed the database transaction")
        else:
            detail = ("a statement of the block ended the database transaction, and this "
                      "database cannot tell whether it committed")
        heuristic = BlockCommittedError(self._tid, detail, certain=status == "committed")
        log.error("heuristic outcome: %s", heuristic)
        metrics.heuristic_outcome(self._role, heuristic)
        if self._hook is not None:
            try:
                with self._engine.begin() as conn:
                    self._hook(heuristic, conn)
            except Exception as exc:
                log.error("transactional_id=%s: the re-publish hook failed: %s", self._tid, exc)
        return heuristic

    def _flush(self, tx: DualWriteTransaction, producer: TwoPhaseProducer) -> PreparedTxnState:
        """Flush; if no record is acknowledged for half the timeout (a leader election, a
        coordinator move, a paused broker, a connection librdkafka waits out) or the flush fails
        retriably (OUT_OF_ORDER_SEQUENCE_NUMBER after a timed-out request), send the records
        once more in a new session, under the same row lock, within the rest of the timeout.

        The abort starts the new session (the records were not all acknowledged): its
        InitProducerId aborts the stuck transaction and bumps the epoch, so nothing the old
        session still has in flight can land in the new transaction (KAFKA-17754).
        """
        deadline = time.monotonic() + self._timeout_s
        try:
            return producer.flush_and_state(stall_s=self._timeout_s / 2)
        except RetriableError as exc:  # stalled, or the session lost track of its sequence
            records = tx.records()
            log.warning("transactional_id=%s: %s; sending its %d records again in a new session",
                        self._tid, exc, len(records))
        producer.abort_transaction()
        self._hooks.resending(len(records))
        producer.begin_transaction()
        for topic, value, key, partition, headers in records:
            producer.produce(topic, value, key, partition=partition, headers=headers)
        return producer.flush_and_state(max(deadline - time.monotonic(), self._timeout_s / 4))

    def _database_lost(self, exc: BaseException) -> DualWriteError | None:
        """:class:`DatabaseUnreachableError` when the block's own statement failed because the
        database went away (its transaction is lost, nothing was decided); None for the other
        errors of the application's statements, which reach it unchanged."""
        if not isinstance(exc, sa.exc.DBAPIError):
            return None
        typed = database_error(exc, self._engine.url)
        return typed if isinstance(typed, DatabaseUnreachableError) else None

    def _verify(self, producer: TwoPhaseProducer, state: PreparedTxnState) -> None:
        """The coordinator check, on the helper thread."""
        producer.verify_prepared()
        self._hooks.verified(state)

    def _lock_late(self, producer: TwoPhaseProducer, sent: Sequence[_Record]
                   ) -> tuple[GuardedConnection, TwoPhaseProducer]:
        """The deferred lock (:data:`LateLock`), after the block's first record or at its first
        use of the database (or at its end); start over if anyone claimed the id meanwhile.

        ``producer`` runs the transaction, ``sent`` are the records it produced so far. Returns
        the connection holding the lock and the producer to go on with.
        """
        with self._resumed_deadline():
            return self._lock_late_within(producer, sent)

    def _lock_late_within(self, producer: TwoPhaseProducer, sent: Sequence[_Record]
                          ) -> tuple[GuardedConnection, TwoPhaseProducer]:
        self._hooks.before_late_lock(len(sent))
        conn, row = self._begin_and_lock()
        if (row.fencing_generation == self._generation
                and row.prepared_txn_state in ("", self._settled)):
            try:
                self._hooks.locked()
            except BaseException:
                self._rollback(conn)
                raise
            return conn, producer
        # Someone claimed the id since this writer's claim (recovery, a new writer, or this one
        # after a failure): they may have ended or fenced the transaction whose records already
        # left. Only those records exist so far; abort them and begin again under a claim of
        # this writer's own.
        log.warning("transactional_id=%s was claimed by another process (fencing generation "
                    "%d, this writer's %s) before its lock was granted; starting the "
                    "transaction over", self._tid, row.fencing_generation, self._generation)
        self._generation = None
        self._rollback(conn)
        left = self._flush_quietly(producer) if sent else None
        self._abort_after_claim(producer)
        conn, again = self._lock_and_settle(self.producer)  # a new session, its own claim
        try:
            self._hooks.locked()
            if left is not None:
                # Nothing of that transaction is open any more (aborted above, or by the
                # settling): it is visible only if someone committed it by (producer id, epoch).
                self._refuse_if_committed(left, {r[0] for r in sent})
            again.begin_transaction()
            self._hooks.kafka_begun()
            for topic, value, key, partition, headers in sent:
                again.produce(topic, value, key, partition=partition, headers=headers)
        except BaseException:
            self._rollback(conn)
            # The handle still holds ``producer`` (aborted above): end what ``again`` began.
            self._abort_quietly(again)
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
        if committed_at_anchor(self._config, tp, anchor.offset, self._timeout_s,
                               transactional_id=self._tid, state=str(left)):
            raise HeuristicCommitError(
                self._tid, str(left), "another process committed it by producer id and epoch "
                "before this writer's lock was granted")
        log.info("transactional_id=%s: the records sent before the lock were aborted (%s); "
                 "sending them again", self._tid, left)

    def _abort_after_claim(self, producer: TwoPhaseProducer) -> None:
        """Abort the transaction started before the lock and end the session; stop if a newer
        producer fenced it.

        Whoever claimed the id may have sent an EndTxn by this session's (producer id, epoch)
        that is still on its way; on the TV1 path it would land on the session's next
        transaction (KAFKA-17754). The new session's InitProducerId bumps the epoch, so such a
        late request is refused.
        """
        try:
            producer.abort_transaction()
            fenced = producer.fenced_at_coordinator()
        except ProducerFencedError:
            fenced = True
        except DualWriteError as exc:
            # Whoever acted may have ended the transaction already; the new session aborts
            # whatever is still open.
            log.info("abort of transactional_id=%s failed (%s)", self._tid, exc)
            fenced = producer.fenced_at_coordinator()
        if not fenced:
            log.info("transactional_id=%s was claimed while its transaction was starting; "
                     "starting a new session", self._tid)
            self._close_producer()
        if fenced:
            raise self._taken_over("while this writer's transaction was starting")

    def _taken_over(self, when: str) -> ProducerFencedError:
        return ProducerFencedError(
            f"transactional_id={self._tid}: a newer producer of this transactional id took over "
            f"{when}; nothing was committed. Stop this writer (two writers must not share a "
            "transactional id)")

    def _claim(self) -> None:
        self._generation = None
        self._claimed = self._store.claim([self._tid], timeout_s=self._timeout_s)[self._tid]

    def _lock_and_settle(self, producer: TwoPhaseProducer, *, claim: bool = False
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
        attempts = 0
        while attempts < _CLAIM_ATTEMPTS:
            if claim:
                self._claim()
            conn, row = self._begin_and_lock()
            if row.fencing_generation not in (self._generation, self._claimed):
                self._rollback(conn)
                attempts += 1
                claim = producer.identity is None
                if not claim:
                    if producer.fenced_at_coordinator():
                        raise self._taken_over("since this writer's last transaction")
                    log.warning("transactional_id=%s was claimed by another process (fencing "
                                "generation %d); starting a new producer session", self._tid,
                                row.fencing_generation)
                    self._close_producer()
                    producer = self.producer  # claims
                continue
            try:
                self._take_lease(conn)
                published = self._finish_in_doubt(conn, producer, row.prepared_txn_state)
            except BaseException:
                # Not settled (e.g. a heuristic abort awaiting recovery): the next transaction
                # locks first again, before its body runs.
                self._generation = None
                self._rollback(conn)
                raise
            if published:
                claim = False  # the loss is settled and committed: lock again for the block
                continue
            self._generation, self._settled = row.fencing_generation, row.prepared_txn_state
            return conn, producer
        raise RetriableError(f"transactional_id={self._tid} was claimed by other processes "
                             f"{_CLAIM_ATTEMPTS} times in a row; is another writer or recovery "
                             "running for it?")

    def _own_connection(self) -> GuardedConnection:
        """The writer's connection (opened if there is none), back in the writer's hands."""
        if self._conn is None:
            conn = writer_connection(self._engine, GuardedConnection)
            assert isinstance(conn, GuardedConnection)
            self._conn = conn
        self._conn.reclaim()
        return self._conn

    def _begin_and_lock(self) -> tuple[GuardedConnection, StateRow]:
        """Begin on the writer's connection and lock the state row.

        The connection is kept between transactions (no pool checkout, no ping). One that died
        while idle is replaced once: nothing of the transaction has happened yet.
        """
        for attempt in (1, 2):
            conn = self._own_connection()
            try:
                try:
                    conn.begin()
                except sa.exc.SQLAlchemyError as exc:
                    raise database_error(exc, self._engine.url) from exc
                row = self._store.lock_row(conn, self._tid, timeout_s=self._timeout_s)
                self._locked = row
                held = self._lease.backend_pid if self._lease is not None else None
                if None not in (held, row.locked_by_pid) and held != row.locked_by_pid:
                    # The connection holding the lease is on another server session now: a
                    # transaction pooler the start-up check did not catch (a busy one).
                    raise pooler_error(self._engine, f"the writer's lease is held by backend "
                                                     f"{held}, its transaction ran on "
                                                     f"{row.locked_by_pid}")
                return conn, row
            except BaseException as exc:
                self._drop_connection()
                lost = isinstance(exc, DatabaseUnreachableError)
                deadline = current_deadline()
                if attempt == 2 or not lost or (deadline is not None and deadline.expired):
                    raise
                log.info("database connection of transactional_id=%s was lost while idle; "
                         "reconnecting", self._tid)
        raise AssertionError("unreachable")

    def _rollback(self, conn: Connection) -> None:
        """Roll back (freeing the row lock); a connection that cannot is dropped instead."""
        try:
            with bounded_wait(conn, "ROLLBACK"):
                conn.rollback()
        except (sa.exc.SQLAlchemyError, DualWriteError):
            self._drop_connection()

    def _close_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.close()

    def _drop_connection(self) -> None:
        """Let go of the writer's connection; what it held is rolled back, freeing the row lock
        (and, on PostgreSQL, the lease: the next transaction locks first again)."""
        conn, self._conn = self._conn, None
        raw: Any = None
        if conn is not None:
            conn.reclaim()
            if not conn.closed and not conn.invalidated:
                raw = conn.connection.dbapi_connection
        if self._lease is not None and self._lease.ends_with_connection:
            self._lease.release()
            self._lease = None
            self._lease_check = None
            if raw is not None:
                # The release invalidated the connection: a pooled one is closed by that, a
                # detached one (psycopg's writer connection) only forgotten; close it here so
                # that its session, and the lease with it, ends now and not when it is
                # garbage-collected (a writer made next for the id would find the lease held).
                with contextlib.suppress(Exception):
                    raw.close()
        if conn is not None:
            try:
                conn.close()
            except sa.exc.SQLAlchemyError as exc:
                log.debug("closing the connection of transactional_id=%s: %s", self._tid, exc)

    def _discard_connection(self) -> None:
        """Close the writer's connection at the driver, which rolls back what it held: after a
        misuse SQLAlchemy's view of the transaction may not match the database's, so neither
        its rollback nor the pool's reset on return can be trusted to end it."""
        conn = self._conn
        if conn is not None:
            conn.reclaim()
            # (PyMySQL raises its own error closing a connection the invalidation closed.)
            driver_error = self._engine.dialect.loaded_dbapi.Error
            with contextlib.suppress(sa.exc.SQLAlchemyError, driver_error):
                raw = conn.connection.dbapi_connection
                conn.invalidate()  # closes a pooled driver connection, only forgets a detached one
                if raw is not None:
                    raw.close()  # the detached one (psycopg's writer connection)
        self._drop_connection()

    def _needs_verification(self, producer: TwoPhaseProducer) -> bool:
        if self._verify_mode == "always":
            return True
        timeout_ms = producer.transaction_timeout_ms
        return timeout_ms is None or producer.open_for_s * 1000 > timeout_ms / 2

    def _decide(self, conn: Connection, producer: TwoPhaseProducer, state: PreparedTxnState,
                *, state_written: bool, clock: metrics.PhaseClock) -> None:
        """Commit the database (the decision), then Kafka; an unknown DB outcome is asked for."""
        try:
            if state_written:
                with bounded_wait(conn, "COMMIT"):
                    conn.commit()
            else:  # the state row and the COMMIT in one round trip
                self._store.write_and_commit(conn, self._tid, str(state))
        except TransactionStateError:
            self._abort_quietly(producer)  # the database committed without this decision
            raise
        except (DualWriteError, sa.exc.SQLAlchemyError) as exc:
            # StateStore raises the translated error (chained from the driver's); a raw one
            # comes from ``conn.commit()``.
            log.warning("database COMMIT of transactional_id=%s state=%s failed (%s); asking the "
                        "database for the outcome", self._tid, state, exc.__class__.__name__)
            locked = self._locked
            self._drop_connection()  # a failed pipeline can leave the row locked until then
            if not self._database_committed(state, locked):
                self._abort_quietly(producer)
                if isinstance(exc, DualWriteError):
                    raise
                raise database_error(exc, self._engine.url) from exc
            log.warning("the database did commit transactional_id=%s state=%s", self._tid, state)
        clock.lap("decide")
        self._hooks.database_committed(state)
        producer.commit_transaction()
        clock.lap("kafka_commit")

    def _database_committed(self, state: PreparedTxnState, locked: StateRow | None) -> bool:
        """Whether the decision's database transaction committed: asked by its id of the server
        that ran it, never by comparing stored states alone (an empty block stores the same
        ``""`` as before, and recovery may clear a state in between); after a failover or crash
        restart, where the id may name another transaction, by the state row version it wrote
        (:meth:`StateStore.commit_status`). Waits, bounded, while it is still in progress.

        SQLite (no ``xid``): a COMMIT that raised was not applied — SQLite commits atomically,
        and a failed COMMIT leaves the transaction open (busy) or rolls it back (I/O error).
        """
        unknown = (f"the database COMMIT of transactional_id={self._tid} state={state} has an "
                   "unknown outcome")
        xid = locked.locked_by_xid if locked is not None else None
        if locked is None or (xid is None and not is_mysql(self._engine)):
            if self._engine.dialect.name == "sqlite":
                return False
            raise OutcomeUnknownError(f"{unknown}: the lock returned no transaction id to ask "
                                      "about; run `dualwrite recover`")
        # Asked on a new connection, within what is left of the deadline; after a COMMIT that
        # used it all, within the part of the documented margin kept for this question.
        current = current_deadline()
        left = self._timeout_s if current is None else current.left()
        with deadline_scope(Deadline.after(max(left, MARGIN_S / 2)), past_outer=True) as asking:
            return self._ask_outcome(locked, state, asking, unknown)

    def _ask_outcome(self, locked: StateRow, state: PreparedTxnState, asking: Deadline,
                     unknown: str) -> bool:
        deadline = asking.at
        while True:
            try:
                status = self._store.commit_status(locked, str(state))
            except DatabaseUnreachableError as exc:
                # A restarting server or a cut connection: ask again until the deadline. The
                # outcome is not known, so it must not reach the caller as "retry".
                if time.monotonic() > deadline:
                    raise OutcomeUnknownError(
                        f"{unknown} and the database could not be asked within "
                        f"{self._timeout_s:g} s ({exc}); the Kafka transaction stays open: the "
                        "next transaction of this writer, or `dualwrite recover`, finishes it "
                        "once the database is back") from exc
                time.sleep(0.2)
                continue
            if status in ("committed", "aborted"):
                return status == "committed"
            if status is None or time.monotonic() > deadline:
                said = status or ("unknown (too old, claimed since, or run by a server it "
                                  "failed over from)")
                raise OutcomeUnknownError(
                    f"{unknown}: the database reports transaction "
                    f"{locked.locked_by_xid or f'of session {locked.locked_by_pid}'} as "
                    f"{said}; "
                    "the Kafka transaction stays open: run `dualwrite recover` once the "
                    "database transaction has ended (it decides by the state row)")
            time.sleep(0.05)

    def _abort_quietly(self, producer: TwoPhaseProducer) -> None:
        if not producer.has_open_transaction:
            return
        try:
            producer.abort_transaction()
        except Exception as exc:
            log.warning("abort of transactional_id=%s failed: %s (the next transaction starts a "
                        "new session, which aborts it)", self._tid, exc)

