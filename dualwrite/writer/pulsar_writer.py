"""PulsarDualWriter: the dual-write recipe with a Pulsar transaction as the participant.

Per transaction: lock the state row; commit the transaction the stored state names if this
writer has not seen it committed (the database decided it); open a Pulsar transaction; the block
writes rows and queues messages; the messages are sent, then the anchor (the transaction's last
message, on the writer's own anchor topic); the prepared state is written with the rows and **the
database COMMIT is the decision**; then the Pulsar transaction is committed by its TxnID, and
the writer's durable subscription on its anchor topic lets older anchors go (keeping the topic,
and the anchor the row names, for recovery).

Pulsar differs from Kafka where it matters here (docs/broker-facts.md, "Pulsar transactions"):
a transaction is named by a TxnID that any process may end, so nothing is fenced and nothing
needs a producer session; the coordinator forgets a transaction once it ends, so a finished
one's outcome is read from its anchor (:func:`~dualwrite.participant.pulsar.txn_outcome`); and a
transaction nobody decided (its writer died before the COMMIT) stays open, holding back
read-committed dispatch on the partitions it wrote, until its timeout aborts it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from dualwrite.database import bounded_wait, create_engine, database_error
from dualwrite.deadline import deadline_scope
from dualwrite.errors import (
    ConfigurationError,
    DualWriteError,
    HeuristicAbortError,
    RetriableError,
    TransactionStateError,
)
from dualwrite.participant.pulsar import (
    AnchorSubscription,
    PulsarError,
    PulsarOutcomeUnknownError,
    PulsarParticipant,
    PulsarPreparedTxn,
    PulsarTxnClient,
    full_topic_name,
)
from dualwrite.writer.handle import GuardedConnection
from dualwrite.writer.hooks import HeuristicHook
from dualwrite.writer.state_store import StateRow, StateStore, writer_connection
from dualwrite.writer.transaction import database_committed, what_the_block_committed

__all__ = ["PulsarDualWriter", "PulsarPhaseHooks", "PulsarTransaction", "QueuedMessage",
           "partition_for_key"]

log = logging.getLogger(__name__)

_TOPIC_SAFE = re.compile(r"[A-Za-z0-9_.=-]+")

ANCHOR_SUBSCRIPTION = "dualwrite-anchors"
"""The durable subscription each writer keeps on its anchor topic (:meth:`PulsarDualWriter.
_keep_anchors`)."""
_ANCHORS_RETRY_S = 60.0


def partition_for_key(key: str, partitions: int) -> int:
    """The partition Pulsar's Java client routes ``key`` to by default (``JavaStringHash``:
    ``String.hashCode() & Integer.MAX_VALUE``, modulo the partition count)."""
    h = 0
    for unit in _utf16_units(key):
        h = (31 * h + unit) & 0xFFFFFFFF
    return (h & 0x7FFFFFFF) % partitions


def _utf16_units(text: str) -> Iterator[int]:
    data = text.encode("utf-16-be")
    for i in range(0, len(data), 2):
        yield (data[i] << 8) | data[i + 1]


class PulsarPhaseHooks:
    """Named points of :class:`PulsarDualWriter`'s protocol (fault injection, observability);
    the base class does nothing. Called in the thread running the transaction."""

    def begun(self, txn: str) -> None:
        """The Pulsar transaction is open (nothing sent yet)."""

    def sent(self, txn: str) -> None:
        """The block's messages are stored by the broker, inside the open transaction."""

    def prepared(self, state: PulsarPreparedTxn) -> None:
        """The anchor is stored: ``state`` names the transaction; the decision comes next."""

    def database_committed(self, state: PulsarPreparedTxn) -> None:
        """The database committed ``state``, the decision; Pulsar's commit comes next."""

    def committed(self, state: PulsarPreparedTxn) -> None:
        """Pulsar committed the transaction too: it is complete."""


@dataclass(frozen=True)
class QueuedMessage:
    """A message a block queued: sent when the block ends, in its transaction."""

    topic: str
    value: bytes
    key: str | None
    partition: int | None


class PulsarTransaction:
    """The block's handle: rows through :attr:`connection`, messages through :meth:`send`."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        """The writer's database connection, lent to the block: the transaction is the
        writer's to end (a block's COMMIT or ROLLBACK is refused)."""
        self._messages: list[QueuedMessage] = []
        self._open = True

    def send(self, topic: str, value: bytes | str, *, key: str | None = None,
             partition: int | None = None) -> None:
        """Queue a message for ``topic``; it is sent when the block ends, in the transaction.

        A partitioned topic's partition is ``partition`` if given, else the one Pulsar's Java
        client would choose for ``key`` (:func:`partition_for_key`), else round robin.
        """
        if not self._open:
            raise TransactionStateError("send() after the transaction's block ended")
        if isinstance(value, str):
            value = value.encode()
        if not isinstance(value, bytes | bytearray | memoryview):
            raise ConfigurationError(f"a message value must be bytes or str, not "
                                     f"{type(value).__name__}")
        if key is not None and not isinstance(key, str):
            raise ConfigurationError(f"a message key must be a str, not {type(key).__name__}")
        if partition is not None and (not isinstance(partition, int) or partition < 0):
            raise ConfigurationError(f"partition must be a non-negative int, not {partition!r}")
        self._messages.append(QueuedMessage(full_topic_name(topic), bytes(value), key,
                                            partition))

    @property
    def messages(self) -> tuple[QueuedMessage, ...]:
        """The messages the block queued, in order."""
        return tuple(self._messages)

    def end(self) -> None:
        """The block ended: :meth:`send` refuses from now on."""
        self._open = False


class PulsarDualWriter:
    """Writes database rows and Pulsar messages atomically, for one writer id.

    ``engine``: an SQLAlchemy engine or URL (PostgreSQL, MariaDB, SQLite). ``service_url``:
    ``pulsar://host:port``. ``writer_id`` names the state row (in the same table as
    :class:`~dualwrite.writer.DualWriter`'s transactional ids: keep the names apart) and, by
    default, the anchor topic ``persistent://public/default/dualwrite-anchor-<writer_id>``
    (``anchor_topic`` to choose another; it must be dualwrite's alone: its probes land there).
    One writer serves one thread, one transaction at a time; run one per writer id.

    ``txn_timeout_s``: Pulsar aborts a transaction this long after it opened unless it was
    ended: a writer that dies between the database COMMIT and Pulsar's commit must be followed
    within it by this writer's next transaction or ``dualwrite recover --pulsar-url`` (else
    :class:`HeuristicAbortError`), and a transaction left undecided by a crash holds back
    read-committed dispatch on its partitions until then. ``timeout_s`` bounds each Pulsar
    request and each database lock wait. ``token``: Pulsar token authentication (never logged).

    ``on_heuristic_abort``: called with the error and the next database transaction's
    connection when Pulsar aborted a transaction the database committed; without it the
    writer raises :class:`HeuristicAbortError` at each start until ``dualwrite recover
    --acknowledge-heuristic`` clears the state.
    """

    def __init__(self, engine: Engine | str, service_url: str, *, writer_id: str,
                 anchor_topic: str | None = None, txn_timeout_s: float = 60.0,
                 timeout_s: float = 30.0, token: str | None = None,
                 on_heuristic_abort: HeuristicHook | None = None,
                 hooks: PulsarPhaseHooks | None = None, outcome_wait_s: float = 5.0,
                 state_store: StateStore | None = None) -> None:
        if not isinstance(writer_id, str) or not writer_id:
            raise ConfigurationError("PulsarDualWriter needs a writer_id (a non-empty str)")
        if anchor_topic is None:
            if not _TOPIC_SAFE.fullmatch(writer_id):
                raise ConfigurationError(
                    f"writer_id {writer_id!r} cannot name a topic: pass anchor_topic")
            anchor_topic = f"persistent://public/default/dualwrite-anchor-{writer_id}"
        for name, value in (("txn_timeout_s", txn_timeout_s), ("timeout_s", timeout_s),
                            ("outcome_wait_s", outcome_wait_s)):
            if not isinstance(value, int | float) or not value > 0:
                raise ConfigurationError(f"{name} must be a positive number, not {value!r}")
        self.writer_id = writer_id
        self.anchor_topic = full_topic_name(anchor_topic)
        self.txn_timeout_s = float(txn_timeout_s)
        self.timeout_s = float(timeout_s)
        self._engine = engine if isinstance(engine, Engine) else create_engine(engine)
        self._store = state_store or StateStore(self._engine)
        self._client = PulsarTxnClient(service_url, timeout_s, token=token)
        self._participant = PulsarParticipant(self._client, outcome_wait_s=outcome_wait_s)
        self._on_heuristic_abort = on_heuristic_abort
        self._hooks = hooks or PulsarPhaseHooks()
        self._conn: GuardedConnection | None = None
        self._locked: StateRow | None = None
        self._settled = ""
        """The last state this writer saw committed in Pulsar: found stored, nothing to do."""
        self._partitions: dict[str, list[str]] = {}
        self._anchors: AnchorSubscription | None = None
        self._anchors_retry_at = 0.0
        self._round_robin = 0
        self._busy = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return (f"PulsarDualWriter(writer_id={self.writer_id!r}, "
                f"service_url={self._client.service_url!r})")

    def __enter__(self) -> PulsarDualWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop: the state row is cleared if it names the last transaction this writer
        committed (the next start has nothing to check), the connections closed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._settled:
            try:
                self._store.compare_and_set(self.writer_id, self._settled, "")
            except DualWriteError as exc:  # the next start checks the anchor instead
                log.info("writer_id=%s: could not clear the state row: %s", self.writer_id, exc)
        self._drop_connection()
        if self._anchors is not None:
            self._anchors.close()
        self._client.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[PulsarTransaction]:
        """One atomic unit: rows through ``tx.connection``, messages through ``tx.send``.

        An exception of the block propagates unchanged after both sides were rolled back;
        dualwrite's own failures raise :class:`~dualwrite.errors.DualWriteError` subclasses.
        After the database COMMIT, a Pulsar commit that cannot be confirmed within
        ``timeout_s`` raises :class:`~dualwrite.errors.OutcomeUnknownError` (the rows are
        committed, the messages follow: the next transaction or ``dualwrite recover`` commits
        them; do not write them again).
        """
        if self._closed:
            raise TransactionStateError(f"writer_id={self.writer_id}: the writer is closed")
        if not self._busy.acquire(blocking=False):
            raise TransactionStateError(
                f"writer_id={self.writer_id}: a transaction of this writer is already open; one "
                "PulsarDualWriter serves one thread, one transaction at a time")
        try:
            yield from self._run()
        finally:
            if self._conn is not None:
                self._conn.retire()  # a reference kept from the block refuses from now on
            self._busy.release()

    # -- one transaction -----------------------------------------------------------------

    def _run(self) -> Iterator[PulsarTransaction]:
        # The database's waits are bounded by timeout_s per step (not across the block, which
        # is the application's); each Pulsar request by the client's own timeout_s.
        with deadline_scope(self.timeout_s):
            conn = self._begin_and_lock()
        tx = PulsarTransaction(conn)
        try:
            txn = self._participant.begin(int(self.txn_timeout_s * 1000))
            log.info("writer_id=%s: transaction %s begun", self.writer_id, txn)
            self._hooks.begun(str(txn))
            conn.lend()
            try:
                yield tx
            finally:
                tx.end()
                misuse = conn.take_back()
            if misuse is not None:
                raise misuse
            self._send(tx)
            self._hooks.sent(str(txn))
            payload = f"dualwrite anchor {self.writer_id} {txn}".encode()
            prepared = self._participant.prepare(self.anchor_topic, payload)
            self._hooks.prepared(prepared)
        except BaseException as exc:
            with deadline_scope(self.timeout_s):
                self._undo(conn, exc)
            raise
        try:
            with deadline_scope(self.timeout_s):
                self._decide(conn, prepared)
        except BaseException:
            self._drop_connection()  # after a failure mid-commit its state is not known
            raise

    def _begin_and_lock(self) -> GuardedConnection:
        """Begin on the writer's connection, lock the state row, and settle what it names."""
        for attempt in (1, 2):
            conn = self._own_connection()
            try:
                try:
                    conn.begin()
                except sa.exc.SQLAlchemyError as exc:
                    raise database_error(exc, self._engine.url) from exc
                row = self._locked = self._store.lock_row(conn, self.writer_id,
                                                          timeout_s=self.timeout_s)
                break
            except BaseException as exc:
                self._drop_connection()
                if attempt == 2 or not isinstance(exc, RetriableError):
                    raise
                log.info("writer_id=%s: database connection lost while idle; reconnecting",
                         self.writer_id)
        stored = row.prepared_txn_state
        if stored and stored != self._settled:
            try:
                self._settle(conn, stored)
            except BaseException:
                self._rollback(conn)
                raise
        return conn

    def _settle(self, conn: GuardedConnection, stored: str) -> None:
        """Commit the transaction the stored state names: the database decided it (by this
        writer's earlier run, or another process's). A heuristic abort goes to the hook, inside
        this transaction, which then clears the state; without a hook it is raised."""
        prepared = PulsarPreparedTxn.parse(stored)
        log.info("writer_id=%s: committing the stored state %s", self.writer_id, stored)
        try:
            self._participant.commit(prepared)
        except HeuristicAbortError as exc:
            if self._on_heuristic_abort is None:
                raise
            log.error("writer_id=%s: heuristic abort of %s handed to on_heuristic_abort: %s",
                      self.writer_id, stored, exc)
            self._on_heuristic_abort(exc, conn)
            self._store.write(conn, self.writer_id, "")
            return
        self._settled = stored
        self._keep_anchors(prepared)

    def _send(self, tx: PulsarTransaction) -> None:
        """Send the queued messages, grouped by partition (order kept within each)."""
        groups: dict[str, tuple[list[bytes], list[str | None]]] = {}
        for m in tx.messages:
            values, keys = groups.setdefault(self._route(m), ([], []))
            values.append(m.value)
            keys.append(m.key)
        for partition, (values, keys) in groups.items():
            self._participant.send(partition, values,
                                   keys if any(k is not None for k in keys) else None)

    def _route(self, m: QueuedMessage) -> str:
        names = self._partitions.get(m.topic)
        if names is None:
            names = self._partitions[m.topic] = self._client.partitions(m.topic)
        if len(names) == 1 and names[0] == m.topic:
            if m.partition not in (None, 0):
                raise ConfigurationError(f"{m.topic} is not partitioned: no partition "
                                         f"{m.partition}")
            return m.topic
        if m.partition is not None:
            if m.partition >= len(names):
                raise ConfigurationError(f"{m.topic} has {len(names)} partitions: no partition "
                                         f"{m.partition}")
            return names[m.partition]
        if m.key is not None:
            return names[partition_for_key(m.key, len(names))]
        self._round_robin += 1
        return names[self._round_robin % len(names)]

    def _decide(self, conn: GuardedConnection, prepared: PulsarPreparedTxn) -> None:
        """The database COMMIT (the decision), then Pulsar's commit; an unknown database
        outcome is asked, never guessed."""
        state = str(prepared)
        try:
            self._store.write_and_commit(conn, self.writer_id, state)
        except TransactionStateError:
            self._participant.abort_prepared_quietly(prepared)
            self._drop_connection()
            raise
        except DualWriteError as exc:
            log.warning("writer_id=%s: database COMMIT of state=%s failed (%s); asking the "
                        "database for the outcome", self.writer_id, state, type(exc).__name__)
            locked = self._locked
            self._drop_connection()
            if not database_committed(self._store, self.writer_id, self.timeout_s, state,
                                      locked, participant="Pulsar"):
                self._participant.abort_prepared_quietly(prepared)
                raise
            log.warning("writer_id=%s: the database did commit state=%s", self.writer_id, state)
        self._hooks.database_committed(prepared)
        try:
            self._participant.commit(prepared)
        except RetriableError as exc:
            raise PulsarOutcomeUnknownError(
                f"writer_id={self.writer_id}: the database committed state={state}, Pulsar's "
                f"commit could not be confirmed ({exc}); the rows are committed and the "
                "messages follow: the writer's next transaction or `dualwrite recover "
                "--pulsar-url` commits them (do not write them again)") from exc
        self._settled = state
        log.info("writer_id=%s: transaction %s committed", self.writer_id, prepared.txn)
        self._keep_anchors(prepared)
        self._hooks.committed(prepared)

    def _keep_anchors(self, prepared: PulsarPreparedTxn) -> None:
        """Keep the anchor the row now names, and let older ones go, through the writer's
        durable subscription on its anchor topic: without one, Pulsar deletes the topic once
        no producer has used it for a while (``brokerDeleteInactiveTopicsEnabled``, on by
        default) or trims its ledgers, and a crash then leaves the committed transaction's
        outcome unreadable. Best effort: a failure is logged and tried again a minute later
        (not at each transaction: making the subscription may wait up to ``timeout_s``)."""
        if prepared.anchor_topic != self.anchor_topic:  # a row from before anchor_topic changed
            return
        try:
            if self._anchors is None or self._anchors.closed:
                if time.monotonic() < self._anchors_retry_at:
                    return
                self._anchors_retry_at = time.monotonic() + _ANCHORS_RETRY_S
                self._anchors = self._client.anchor_subscription(self.anchor_topic,
                                                                 ANCHOR_SUBSCRIPTION)
            self._anchors.keep_from(prepared.anchor, time.monotonic() + self.timeout_s)
        except PulsarError as exc:
            log.warning("writer_id=%s: cannot keep the anchors of %s with subscription %s "
                        "(%s); an anchor may be deleted before recovery reads it",
                        self.writer_id, self.anchor_topic, ANCHOR_SUBSCRIPTION, exc)
            if self._anchors is not None:
                self._anchors.close()
                self._anchors = None

    def _undo(self, conn: GuardedConnection, exc: BaseException) -> None:
        """Roll both sides back after a failure before the decision; raise what a statement
        of the block committed itself instead of ``exc``."""
        left = conn.left_transaction
        self._participant.abort_open()
        if conn.misused is not None or left or isinstance(exc, TransactionStateError):
            self._drop_connection()
        else:
            self._rollback(conn)
        if left:
            committed = what_the_block_committed(self._store, self.writer_id, self._locked,
                                                 self._on_heuristic_abort, "writer")
            if committed is not None:
                raise committed from exc

    # -- the connection ------------------------------------------------------------------

    def _own_connection(self) -> GuardedConnection:
        if self._conn is None:
            conn = writer_connection(self._engine, GuardedConnection)
            assert isinstance(conn, GuardedConnection)
            self._conn = conn
        self._conn.reclaim()
        return self._conn

    def _rollback(self, conn: Connection) -> None:
        try:
            with bounded_wait(conn, "ROLLBACK"):
                conn.rollback()
        except (sa.exc.SQLAlchemyError, DualWriteError):
            self._drop_connection()

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.reclaim()
        with contextlib.suppress(Exception):
            raw = conn.connection.dbapi_connection if not conn.invalidated else None
            conn.invalidate()
            if raw is not None:
                raw.close()
        with contextlib.suppress(sa.exc.SQLAlchemyError):
            conn.close()

