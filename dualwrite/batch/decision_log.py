"""The database side of a batch sink: the decision log and the staging table.

A batch sink (the Spark ``foreachBatch`` sink) writes each batch to Kafka through several
participant transactions, one per non-empty partition, and to SQL tables through a staging table
(or, write-once, through the tasks' prepared database transactions: see
:mod:`dualwrite.batch.prepared_writes`). The driver then records its decision in one database
transaction, whose size does not depend on the batch's rows:

- ``dualwrite_batch_sink``: the sink's last decided batch id, whether it is completed, and which
  staged rows (the winning attempts') the batch publishes, or which prepared database
  transactions hold its rows (migration 0002, ``pending_apply`` 0005);
- ``dualwrite_batch_participant``: the prepared state of each participant of that batch.

That commit is the decision: a restart (or ``dualwrite recover``) commits the recorded participants
and aborts every other open transaction of the sink. A batch id at or below the last decided one
was decided before and is skipped when Spark replays it. Staging: after the participants are
committed, one more transaction (:meth:`DecisionLog.mark_completed`) moves the winners' staged
rows into the target, deletes the batch's staged rows and marks the batch completed, all or
nothing: the rows become visible to the table's readers at that commit, as the records do at
their EndTxn.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from dualwrite.batch.prepared_writes import PreparedDatabaseTxn
from dualwrite.batch.target import ArrowCopy, target_columns
from dualwrite.database import (
    SINK_LOCKS,
    SessionLocks,
    as_utc,
    backend_for,
    database_error,
    transaction,
)
from dualwrite.database.schema import BATCH_PARTICIPANT as _PARTICIPANTS
from dualwrite.database.schema import BATCH_SINK as _SINKS
from dualwrite.database.schema import MAX_SINK_ID, PARTICIPANT_TABLE, SINK_TABLE
from dualwrite.errors import (
    BatchInDoubtError,
    FatalError,
    InvalidPreparedStateError,
    LockTimeoutError,
    MigrationRequiredError,
    TransactionStateError,
)
from dualwrite.participant.prepared_state import PreparedTxnState

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "PARTICIPANT_TABLE",
    "SINK_TABLE",
    "DecisionLog",
    "Participant",
    "SinkRecord",
    "StagingTable",
]

log = logging.getLogger(__name__)

_SINK_ID = re.compile(r"[A-Za-z0-9._-]{1,200}")
# Columns the staging table adds to the target's.
_STAGING_COLUMNS = ("dw_sink_id", "dw_batch_id", "dw_attempt")


def check_sink_id(sink_id: str) -> str:
    """Sink ids become transactional-id prefixes: letters, digits, ``.``, ``_``, ``-`` only."""
    if not isinstance(sink_id, str) or not _SINK_ID.fullmatch(sink_id):
        raise ValueError(f"sink id {sink_id!r} must be 1-{MAX_SINK_ID} characters of "
                         "[A-Za-z0-9._-]")
    return sink_id


@dataclass(frozen=True)
class Participant:
    """One partition's prepared Kafka transaction (and staged rows) in a batch."""

    partition_id: int
    transactional_id: str
    state: PreparedTxnState
    records: int
    attempt_key: str = ""
    """Tags the attempt's staged rows; only the winning attempt's rows are published."""
    database_txn: PreparedDatabaseTxn | None = None
    """Write-once mode: the task's prepared database transaction holding its rows."""


@dataclass(frozen=True)
class SinkRecord:
    """A sink's last decision as the database holds it."""

    sink_id: str
    last_batch_id: int
    completed: bool
    decided_at: datetime
    completed_at: datetime | None
    participants: tuple[Participant, ...]
    invalid: str | None = None
    """Why a participant row of the decided batch could not be read (then ``participants`` is
    empty): this sink cannot be recovered until the row is repaired; other sinks can."""

    @property
    def in_doubt(self) -> bool:
        """Decided, but not every participant is known to be committed yet."""
        return not self.completed


def _missing_table(exc: sa.exc.DBAPIError) -> bool:
    """A table or column of the decision log is missing: the schema predates a migration."""
    orig = exc.orig
    text = str(orig).lower()
    return (getattr(orig, "sqlstate", None) in ("42P01", "42703") or "no such table" in text
            or ("no such column" in text and "pending_apply" in text))


def _with_database_txns(participants: list[Participant], pending: str) -> list[Participant]:
    """``participants`` with the prepared database transactions a write-once decision names."""
    spec = json.loads(pending)
    if "prepared" not in spec:
        return participants
    txns = {str(tid): PreparedDatabaseTxn.parse(str(text))
            for tid, text in spec["prepared"].items()}
    return [dataclasses.replace(p, database_txn=txns[p.transactional_id])
            if p.transactional_id in txns else p for p in participants]


class DecisionLog:
    """Reads and writes the batch sinks' decisions."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._locks = SessionLocks(engine, SINK_LOCKS)
        """The sinks' decision locks: see :meth:`_file_lock`, :meth:`_session_lock` and
        :meth:`_lock`."""

    @contextmanager
    def _file_lock(self, sink_id: str, timeout_s: float) -> Iterator[None]:
        """SQLite: the sink's decision lock, an exclusive ``flock`` on a file beside the database.

        The driver verifies and recovery sweeps under the decision lock, both Kafka I/O; as a
        file lock it does not hold SQLite's database-wide write lock meanwhile, which every
        other writer of the database needs (the write lock is taken only to write). Waiting is
        bounded by ``timeout_s``, then :class:`LockTimeoutError`; the kernel drops the lock
        when the process dies.
        """
        if not self._locks.wait_file(sink_id, timeout_s):
            raise LockTimeoutError(
                f"sink {sink_id!r}: the decision lock stayed held by another process (the "
                f"sink's driver or `dualwrite recover`) for {timeout_s:g} s; retry")
        try:
            yield
        finally:
            self._locks.give_back(sink_id)

    @contextmanager
    def _session_lock(self, sink_id: str, timeout_s: float) -> Iterator[Connection | None]:
        """A server without transaction-level locks (MariaDB): the sink's decision lock, a
        session lock (``GET_LOCK``) of a connection of its own, yielded for the locked
        transaction to run on; released after that transaction ended, so a session that waits
        for it sees the outcome of a COMMIT still in flight (as PostgreSQL's transaction-level
        advisory lock does). None on other databases.
        """
        if not self._locks.on_server or self._locks.backend.transaction_locks:
            yield None
            return
        try:
            conn = self.engine.connect()
        except sa.exc.DBAPIError as exc:
            raise self._typed(exc, sink_id) from exc
        with conn:
            try:
                got = self._locks.wait(conn, sink_id, timeout_s)
                conn.commit()  # a session lock outlives the transaction
            except sa.exc.DBAPIError as exc:
                raise self._typed(exc, sink_id) from exc
            if not got:
                raise LockTimeoutError(
                    f"sink {sink_id!r}: the decision lock stayed held by another process (the "
                    f"sink's driver or `dualwrite recover`) for {timeout_s:g} s; retry")
            try:
                yield conn
            finally:
                try:
                    self._locks.give_back(sink_id, conn)
                    conn.commit()
                except sa.exc.SQLAlchemyError:
                    conn.invalidate()  # the session's end releases it

    def _migration_error(self, exc: sa.exc.DBAPIError) -> MigrationRequiredError:
        return MigrationRequiredError(
            f"the batch-sink tables are missing ({exc.orig}); run `dualwrite db upgrade --db URL`")

    def _typed(self, exc: sa.exc.DBAPIError, sink_id: str | None) -> Exception:
        """The :mod:`dualwrite.errors` exception for a database error of the decision log
        (:func:`~dualwrite.database.database_error`, with the sink named)."""
        if _missing_table(exc):
            return self._migration_error(exc)
        typed = database_error(exc, self.engine.url)
        what = f"sink {sink_id!r}: " if sink_id else ""
        if isinstance(typed, LockTimeoutError):
            return LockTimeoutError(
                f"{what}the decision lock stayed held by another process (the sink's driver "
                f"or `dualwrite recover`) past the lock timeout ({typed}); retry")
        return type(typed)(f"{what}the decision log transaction failed: {typed}")

    def read(self, sink_id: str) -> SinkRecord | None:
        found = self.read_all([sink_id])
        return found[0] if found else None

    def read_all(self, sink_ids: Sequence[str] | None = None) -> list[SinkRecord]:
        """Every sink's (or the given sinks') last decision, with its participants."""
        try:
            with transaction(self.engine, read_only=True) as conn:
                return self._read(conn, sink_ids)
        except sa.exc.DBAPIError as exc:
            raise self._typed(exc, None) from exc

    def _read(self, conn: Connection, sink_ids: Sequence[str] | None) -> list[SinkRecord]:
        query = sa.select(_SINKS).order_by(_SINKS.c.sink_id)
        parts = sa.select(_PARTICIPANTS).order_by(_PARTICIPANTS.c.partition_id)
        if sink_ids is not None:
            query = query.where(_SINKS.c.sink_id.in_(list(sink_ids)))
            parts = parts.where(_PARTICIPANTS.c.sink_id.in_(list(sink_ids)))
        sinks = conn.execute(query).all()
        by_sink: dict[str, list[Participant]] = {}
        invalid: dict[str, str] = {}
        last = {row.sink_id: row.last_batch_id for row in sinks}
        for p in conn.execute(parts):
            if last.get(p.sink_id) != p.batch_id:
                continue
            try:
                state = PreparedTxnState.parse(p.prepared_txn_state)
            except InvalidPreparedStateError as exc:
                # One bad row must not hide every other sink's decision: report this sink only.
                log.error("sink=%s batch=%d transactional_id=%s unreadable participant row: %s",
                          p.sink_id, p.batch_id, p.transactional_id, exc)
                invalid.setdefault(p.sink_id, f"participant {p.transactional_id!r}: {exc}")
                continue
            by_sink.setdefault(p.sink_id, []).append(Participant(
                p.partition_id, p.transactional_id, state, p.records))
        for s in sinks:
            if s.pending_apply and s.sink_id in by_sink and s.sink_id not in invalid:
                try:
                    by_sink[s.sink_id] = _with_database_txns(by_sink[s.sink_id], s.pending_apply)
                except (InvalidPreparedStateError, ValueError, KeyError) as exc:
                    log.error("sink=%s batch=%d unreadable prepared database transactions: %s",
                              s.sink_id, s.last_batch_id, exc)
                    invalid[s.sink_id] = f"prepared database transactions: {exc}"
        return [SinkRecord(s.sink_id, s.last_batch_id, s.completed, as_utc(s.decided_at),
                           as_utc(s.completed_at) if s.completed_at else None,
                           () if s.sink_id in invalid else tuple(by_sink.get(s.sink_id, ())),
                           invalid.get(s.sink_id)) for s in sinks]

    @contextmanager
    def locked(self, sink_id: str, *, timeout_s: float = 30.0
               ) -> Iterator[tuple[Connection | None, SinkRecord | None]]:
        """Hold the sink's decision lock and yield its last decision.

        Recovery works under it, so it cannot abort participants that a running driver verified
        and is about to decide: the driver verifies under the same lock (see :meth:`decide`).
        The lock exists before the sink's first decision (see :meth:`_lock`); waiting for it is
        bounded by ``timeout_s``, then :class:`LockTimeoutError`. The connection is in the
        locked transaction; it is None on an SQLite file, whose lock is a file lock and whose
        writes under it (:meth:`mark_completed`) are short transactions of their own.
        """
        if self._locks.folder is not None:
            with self._file_lock(sink_id, timeout_s):
                try:
                    with transaction(self.engine, read_only=True) as conn:
                        found = self._read(conn, [sink_id])
                except sa.exc.DBAPIError as exc:
                    raise self._typed(exc, sink_id) from exc
                yield None, (found[0] if found else None)
            return
        try:
            with (self._session_lock(sink_id, timeout_s) as own,
                  transaction(self.engine, connection=own) as conn):
                self._lock(conn, sink_id, timeout_s)
                found = self._read(conn, [sink_id])
                yield conn, (found[0] if found else None)
        except sa.exc.DBAPIError as exc:
            raise self._typed(exc, sink_id) from exc

    def has_tables(self) -> bool:
        with transaction(self.engine, read_only=True) as conn:
            return sa.inspect(conn).has_table(SINK_TABLE)

    def decide(self, sink_id: str, batch_id: int, participants: Sequence[Participant],
               staging: StagingTable | None = None,
               verify: Callable[[], None] | None = None, *, timeout_s: float = 30.0,
               progress: list[str] | None = None) -> bool:
        """Record the decision to commit ``batch_id``; False if it (or a later one) was decided.

        With ``staging``, the decision names the winning attempts' staged rows, which
        :meth:`mark_completed` moves into the target table after the participants' commit (the
        decision writes O(participants) rows, whatever the batch's size). ``verify`` runs
        under the sink's lock before anything is written; if it raises,
        nothing is decided. Raises :class:`BatchInDoubtError`, writing nothing, while the last
        decided batch is not completed: a decision must never overwrite an in-doubt one.
        ``progress`` receives ``"commit"`` when the COMMIT is about to be sent: an error before
        that decided nothing, one after it has an unknown outcome.
        """
        now = datetime.now(UTC)
        try:
            if self._locks.folder is not None:
                with self._file_lock(sink_id, timeout_s):
                    with transaction(self.engine, read_only=True) as conn:
                        last, completed = self._last(conn, sink_id)
                    if not self._may_decide(sink_id, batch_id, last, completed):
                        return False
                    if verify is not None:
                        verify()  # Kafka I/O: under the file lock, not the database's write lock
                    with transaction(self.engine) as conn:
                        self._write(conn, sink_id, batch_id, participants, staging, last, now)
                        if progress is not None:
                            progress.append("commit")
                return True
            with (self._session_lock(sink_id, timeout_s) as own,
                  transaction(self.engine, connection=own) as conn):
                last, completed = self._lock(conn, sink_id, timeout_s)
                if not self._may_decide(sink_id, batch_id, last, completed):
                    return False
                if verify is not None:
                    verify()
                self._write(conn, sink_id, batch_id, participants, staging, last, now)
                if progress is not None:
                    progress.append("commit")
        except sa.exc.DBAPIError as exc:
            raise self._typed(exc, sink_id) from exc
        return True

    @staticmethod
    def _may_decide(sink_id: str, batch_id: int, last: int | None, completed: bool) -> bool:
        if last is not None and not completed:
            raise BatchInDoubtError(sink_id, last)
        if last is not None and batch_id <= last:
            log.info("sink=%s batch=%d was decided before (last decided %d); skipping",
                     sink_id, batch_id, last)
            return False
        return True

    @staticmethod
    def _write(conn: Connection, sink_id: str, batch_id: int,
               participants: Sequence[Participant], staging: StagingTable | None,
               last: int | None, now: datetime) -> None:
        """The decision's writes, in the locked transaction (SQLite: under the write lock)."""
        conn.execute(sa.delete(_PARTICIPANTS).where(_PARTICIPANTS.c.sink_id == sink_id))
        if participants:
            conn.execute(sa.insert(_PARTICIPANTS), [
                {"sink_id": sink_id, "transactional_id": p.transactional_id,
                 "batch_id": batch_id, "partition_id": p.partition_id,
                 "prepared_txn_state": str(p.state), "records": p.records}
                for p in participants])
        keys = [p.attempt_key for p in participants if p.attempt_key]
        prepared = {p.transactional_id: str(p.database_txn) for p in participants
                    if p.database_txn is not None}
        pending = (staging.pending(keys) if staging is not None and keys else
                   json.dumps({"prepared": prepared}, separators=(",", ":")) if prepared else
                   None)
        values = {"last_batch_id": batch_id, "completed": not participants,
                  "decided_at": now, "completed_at": now if not participants else None,
                  "pending_apply": pending}
        if last is None:
            conn.execute(sa.insert(_SINKS).values(sink_id=sink_id, **values))
        else:
            conn.execute(sa.update(_SINKS).where(_SINKS.c.sink_id == sink_id).values(**values))

    def _lock(self, conn: Connection, sink_id: str,
              timeout_s: float) -> tuple[int | None, bool]:
        """Take the sink's decision lock; the last decided batch id and whether it is completed.

        PostgreSQL: a transaction-level advisory lock on a key derived from the sink id. Unlike
        ``SELECT ... FOR UPDATE`` it exists before the sink's first decision (no row to lock
        yet), and it is held until the transaction's COMMIT has finished on the server, so a
        session that waits for it sees the outcome of a COMMIT still in flight. MariaDB: the
        caller holds :meth:`_session_lock` already. SQLite in memory:
        the transaction holds the write lock already (BEGIN IMMEDIATE); an SQLite file uses
        :meth:`_file_lock` instead.
        """
        if self._locks.backend.transaction_locks:
            self._locks.lock_for_transaction(conn, sink_id, timeout_s)
        return self._last(conn, sink_id)

    @staticmethod
    def _last(conn: Connection, sink_id: str) -> tuple[int | None, bool]:
        row = conn.execute(sa.select(_SINKS.c.last_batch_id, _SINKS.c.completed)
                           .where(_SINKS.c.sink_id == sink_id)).one_or_none()
        if row is None:
            return None, True
        return int(row.last_batch_id), bool(row.completed)

    def mark_completed(self, sink_id: str, batch_id: int, conn: Connection | None = None) -> int:
        """Every participant of ``batch_id`` is committed: apply its staged rows and mark it
        completed, in one transaction; returns the rows moved into the target.

        Idempotent: the sink's row is locked and read first, and a batch already completed (or
        superseded by a later one) is left alone, so a crash anywhere moves the rows at most
        once, and a retry after it moves them. ``conn``: the transaction of :meth:`locked`, when
        called under the lock.
        """
        try:
            if conn is not None:
                return self._complete(conn, sink_id, batch_id)
            with transaction(self.engine) as own:
                return self._complete(own, sink_id, batch_id)
        except sa.exc.IntegrityError as exc:
            # Deterministic: retrying cannot help, and the batch is decided (its records are
            # committed or will be). The rows stay staged and the batch in doubt until fixed.
            raise FatalError(
                f"sink {sink_id!r} batch {batch_id} is decided, but the target table refused "
                f"its staged rows ({exc.orig}); they stay staged and the batch in doubt: remove "
                "the conflicting rows from the target (or relax its constraint), then restart "
                "the query or run `dualwrite recover`, which apply them") from exc
        except sa.exc.DBAPIError as exc:
            raise self._typed(exc, sink_id) from exc

    @staticmethod
    def _complete(conn: Connection, sink_id: str, batch_id: int) -> int:
        where = (_SINKS.c.sink_id == sink_id, _SINKS.c.last_batch_id == batch_id,
                 _SINKS.c.completed.is_(False))
        # FOR UPDATE: a concurrent completer (recovery beside the driver) waits here, then
        # reads the row again and finds the batch completed (SQLite: the write lock).
        row = conn.execute(sa.select(_SINKS.c.pending_apply).where(*where)
                           .with_for_update()).one_or_none()
        if row is None:
            return 0
        moved = 0
        # Write-once ("prepared" in it): the participants' rows were committed with them.
        if row.pending_apply and "staging" in json.loads(row.pending_apply):
            moved = StagingTable.apply(conn, sink_id, batch_id, row.pending_apply)
            log.info("sink=%s batch=%d applied %d staged rows", sink_id, batch_id, moved)
        conn.execute(sa.update(_SINKS).where(*where).values(
            completed=True, completed_at=datetime.now(UTC), pending_apply=None))
        return moved

    def forget(self, sink_id: str) -> None:
        """Drop a sink's decisions, e.g. before starting it over with a new checkpoint."""
        with transaction(self.engine) as conn:
            conn.execute(sa.delete(_PARTICIPANTS).where(_PARTICIPANTS.c.sink_id == sink_id))
            conn.execute(sa.delete(_SINKS).where(_SINKS.c.sink_id == sink_id))


class StagingTable:
    """``<target>_dw_staging``: the target's columns plus the sink, batch and attempt tags.

    Tasks write their partition's rows here in parallel (COPY on PostgreSQL); the decision
    records which attempts won (:meth:`pending`), and the transaction that completes the batch
    moves their rows into the target with one INSERT ... SELECT (:meth:`apply`).
    """

    def __init__(self, engine: Engine, target: str, columns: Sequence[str] | None = None) -> None:
        self.engine = engine
        self.target = target
        target_table, names = target_columns(engine, target, columns)
        clash = [c for c in names if c in _STAGING_COLUMNS]
        if clash:
            raise FatalError(f"target columns {clash} clash with the staging tags")
        self.columns: tuple[str, ...] = names
        self.name = f"{target}_dw_staging"
        meta = sa.MetaData()
        self.table = sa.Table(
            self.name, meta,
            *(sa.Column(c, target_table.c[c].type) for c in names),
            sa.Column("dw_sink_id", sa.String(MAX_SINK_ID), nullable=False),
            sa.Column("dw_batch_id", sa.BigInteger, nullable=False),
            sa.Column("dw_attempt", sa.String(64), nullable=False),
        )

    @contextmanager
    def _transaction(self, *, read_only: bool = False) -> Iterator[Connection]:
        """:func:`~dualwrite.database.transaction` for the staging table's own statements,
        whose failures are translated too: the sink's close and ``dualwrite recover`` purge."""
        try:
            with transaction(self.engine, read_only=read_only) as conn:
                yield conn
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, self.engine.url) from exc

    def create(self) -> None:
        """Create the staging table if it does not exist (idempotent, safe concurrently).

        No index: it holds little more than the batch in flight (the apply deletes it), which
        the apply reads whole, and an index on the tags would slow every task's COPY
        (docs/benchmark-history.md, "the decision no longer copies the batch"). An index left
        by an earlier version is dropped.
        """
        with self._transaction() as conn:
            self.table.create(conn, checkfirst=True)
            if conn.dialect.name in ("postgresql", "sqlite"):  # MariaDB's came without it
                conn.execute(sa.text(f'DROP INDEX IF EXISTS "ix_{self.name}_batch"'))

    def write(self, sink_id: str, batch_id: int, attempt_key: str,
              rows: Iterable[Sequence[Any]]) -> int:
        """Stage ``rows`` (tuples in :attr:`columns` order) for one task attempt, as a task's
        :meth:`writer` does; returns the count."""
        import pyarrow as pa  # here, not at import: the CLI never needs it

        columns = list(zip(*rows, strict=True)) or [() for _ in self.columns]
        batch = pa.RecordBatch.from_arrays([pa.array(list(c)) for c in columns],
                                           names=list(self.columns))
        with self.writer(sink_id, batch_id, attempt_key) as stage:
            return stage(batch)

    @contextmanager
    def writer(self, sink_id: str, batch_id: int, attempt_key: str
               ) -> Iterator[Callable[[pa.RecordBatch], int]]:
        """Stage Arrow record batches for one task attempt.

        Yields a function that stages one batch (the :attr:`columns` are taken from it by name)
        and returns its row count. PostgreSQL: one ``COPY ... (FORMAT csv)`` fed with the CSV
        that pyarrow writes, no Python per row (columns that CSV cannot carry, such as binary,
        make it a row-by-row COPY), committed when the block ends. SQLite: one ``executemany``
        of tuples per batch, each in its own short write transaction (staged rows of an attempt
        that is not decided are never applied, so partial staging is harmless).
        """
        tags = (sink_id, batch_id, attempt_key)
        if not backend_for(self.engine).copy_from_client:
            def insert(batch: pa.RecordBatch) -> int:
                # A transaction per batch: SQLite's one write lock is not held while the task
                # produces to Kafka, so the other tasks stage meanwhile.
                columns = [batch.column(c).to_pylist() for c in self.columns]
                with self._transaction() as conn:
                    return self._insert_many(conn, [(*row, *tags) for row in
                                                    zip(*columns, strict=True)])
            yield insert
            return
        try:
            raw = self.engine.raw_connection()
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, self.engine.url) from exc
        try:
            with (raw.driver_connection.cursor() as cur,  # type: ignore[union-attr]
                  ArrowCopy(cur, self.name, self.columns, list(zip(_STAGING_COLUMNS, tags,
                                                                   strict=True))) as copy):
                yield copy.write
            raw.commit()
        except BaseException:
            raw.rollback()
            raise
        finally:
            raw.close()

    def _insert_many(self, conn: Connection, rows: list[tuple[Any, ...]]) -> int:
        """One ``executemany`` of plain tuples where the backend has one (SQLite: no per-row
        dictionaries); other databases (MariaDB) through SQLAlchemy's insert."""
        if not rows:
            return 0
        names = [*self.columns, *_STAGING_COLUMNS]
        insert = backend_for(conn).tuple_insert_sql(self.name, names)
        if insert is None:
            conn.execute(sa.insert(self.table), [dict(zip(names, row, strict=True))
                                                 for row in rows])
        else:
            conn.exec_driver_sql(insert, rows)
        return len(rows)

    def pending(self, attempt_keys: Sequence[str]) -> str:
        """What a decision records so that :meth:`apply` can move the winners' rows later,
        without this object (``dualwrite recover`` does not know the sink's target)."""
        return json.dumps({"staging": self.name, "target": self.target,
                           "columns": list(self.columns), "attempts": sorted(attempt_keys)},
                          separators=(",", ":"))

    @staticmethod
    def apply(conn: Connection, sink_id: str, batch_id: int, pending: str) -> int:
        """Move a decided batch's winning staged rows into the target, delete the sink's staged
        rows of that batch and older ones; returns the rows moved.

        Runs in the transaction that marks the batch completed (:meth:`DecisionLog.mark_completed`),
        so the move, the deletion and the mark commit together or not at all.
        """
        if not conn.in_transaction():
            raise TransactionStateError("StagingTable.apply() runs inside the completing "
                                        "transaction")
        spec = json.loads(pending)
        columns = [str(c) for c in spec["columns"]]
        staged = sa.table(str(spec["staging"]), *(sa.column(c) for c in columns),
                          sa.column("dw_sink_id"), sa.column("dw_batch_id"),
                          sa.column("dw_attempt"))
        target = sa.table(str(spec["target"]), *(sa.column(c) for c in columns))
        s = staged.c
        select = sa.select(*(s[c] for c in columns)).where(
            s.dw_sink_id == sink_id, s.dw_batch_id == batch_id,
            s.dw_attempt.in_([str(k) for k in spec["attempts"]]))
        # SQLAlchemy keeps an INSERT's row count only when asked (else -1 on PostgreSQL).
        insert = sa.insert(target).from_select(columns, select)
        moved = conn.execute(insert.execution_options(preserve_rowcount=True)).rowcount
        conn.execute(sa.delete(staged).where(s.dw_sink_id == sink_id,
                                             s.dw_batch_id <= batch_id))
        return int(moved)

    def purge(self, sink_id: str, *, up_to_batch: int | None = None) -> int:
        """Delete the sink's staged rows: all of them at a start (undecided batches are replayed),
        or those of ``up_to_batch`` and older once that batch is committed."""
        s = self.table.c
        condition = s.dw_sink_id == sink_id
        if up_to_batch is not None:
            condition = condition & (s.dw_batch_id <= up_to_batch)
        with self._transaction() as conn:
            result = conn.execute(sa.delete(self.table).where(condition))
        return result.rowcount

    def discard(self, sink_id: str, batch_id: int, attempt_key: str) -> int:
        """Delete one task attempt's staged rows (a straggler of a batch already decided)."""
        s = self.table.c
        with self._transaction() as conn:
            result = conn.execute(sa.delete(self.table).where(
                s.dw_sink_id == sink_id, s.dw_batch_id == batch_id, s.dw_attempt == attempt_key))
        return result.rowcount

    def count(self, sink_id: str | None = None) -> int:
        query = sa.select(sa.func.count()).select_from(self.table)
        if sink_id is not None:
            query = query.where(self.table.c.dw_sink_id == sink_id)
        with self._transaction(read_only=True) as conn:
            return int(conn.execute(query).scalar_one())
