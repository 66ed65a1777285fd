"""The prepared-state table: one row per transactional id, written with the application's rows.

The KIP-939 recipe keeps, per transactional id, the prepared-state string of the Kafka transaction
that the last committed database transaction decided to commit. A writer

1. locks the row inside its database transaction with :meth:`StateStore.lock` (on PostgreSQL an
   upsert that takes the row lock and returns the stored state, on MariaDB the same with
   ``INSERT ... ON DUPLICATE KEY UPDATE ... RETURNING``; on SQLite the transaction already
   holds the database write lock through ``BEGIN IMMEDIATE``). The lock is the guard against
   zombies and split brain: two writers of one transactional id run one after the other, and the
   second sees what the first decided. A process about to end or fence the id's Kafka
   transactions first raises the row's fencing generation (:meth:`StateStore.claim`), so that a
   writer whose records left before its lock was granted can tell whether anyone acted
   meanwhile;
2. writes its application rows, prepares the Kafka transaction and stores the new state in the
   same database transaction, :meth:`StateStore.write_and_commit` (or :meth:`StateStore.write`
   then its own commit); the database commit is the decision.

On psycopg both steps cost one round trip each (pipeline mode, :func:`writer_connection`).
See docs/sql.md.

Recovery reads states outside any writer's transaction (:meth:`StateStore.read`,
:meth:`StateStore.read_all`) and clears resolved ones with :meth:`StateStore.compare_and_set`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NoReturn

import sqlalchemy as sa
from sqlalchemy import Connection, Engine
from sqlalchemy.dialects import postgresql

from dualwrite.database import (
    as_utc,
    backend_for,
    bounded_wait,
    database_error,
    is_mysql,
    transaction,
    uses_begin_immediate,
)
from dualwrite.database.schema import MAX_LENGTH, STATE_TABLE, TRANSACTION_STATE, state_table
from dualwrite.deadline import MIN_WAIT_S, current_deadline, wait_s
from dualwrite.errors import TransactionStateError
from dualwrite.writer.commit_inquiry import MYSQL_SERVER_IDENTITY, SERVER_IDENTITY, CommitInquiry

__all__ = ["MAX_LENGTH", "StateRow", "StateStore", "writer_connection"]

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class StateRow:
    """One row of the state table. ``prepared_txn_state`` is ``''`` when nothing is prepared.

    ``fencing_generation`` counts the claims of processes that ended or fenced (or were about to)
    this id's Kafka transactions; see :meth:`StateStore.claim`.
    """

    transactional_id: str
    prepared_txn_state: str
    updated_at: datetime
    fencing_generation: int = 0
    locked_by_xid: int | None = None
    """PostgreSQL: the id (``txid_current()``) of the transaction that locked the row, when the
    row comes from :meth:`StateStore.lock_row`; it names that one database transaction, so its
    outcome can be asked after a failed COMMIT (:meth:`CommitInquiry.commit_status`)."""
    locked_by_pid: int | None = None
    """PostgreSQL, with ``locked_by_xid``: the server process (``pg_backend_pid()``) that ran
    the locking transaction; the writer compares it with its lease's. MariaDB: the session
    (``CONNECTION_ID()``) that ran it."""
    locked_on: str | None = None
    """PostgreSQL, with ``locked_by_xid``: the server that ran the locking transaction (its
    :data:`SERVER_IDENTITY`; on MariaDB its :data:`MYSQL_SERVER_IDENTITY`). A transaction id
    names one transaction on that server only: a promoted standby that never received the
    transaction's WAL, or a server restarted after a crash, may give the same id to another
    transaction."""


def _check(name: str, value: str, *, allow_empty: bool) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")
    if not value and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    if len(value) > MAX_LENGTH:
        raise ValueError(
            f"{name} is {len(value)} characters long; the state table holds at most {MAX_LENGTH}"
        )


def _wait_bounds(conn: Connection, timeout_s: float | None, *,
                 statements: bool = False) -> list[str]:
    """The statements bounding this transaction's waits for locks by ``timeout_s`` (and with
    ``statements`` each statement's run, a little longer), on databases that have them
    (PostgreSQL's lock_timeout and statement_timeout); none without a bound."""
    if timeout_s is None:
        return []
    backend = backend_for(conn)
    found = [backend.lock_timeout_sql(timeout_s)]
    if statements:
        found.append(backend.statement_timeout_sql(timeout_s))
    return [sql for sql in found if sql is not None]


#: After dualwrite's lock, the application's statements of the same transaction run under the
#: session's own settings again (SET LOCAL ... TO DEFAULT restores the session's value).
_RESET_TIMEOUTS_SQL = ("SET LOCAL lock_timeout TO DEFAULT",
                       "SET LOCAL statement_timeout TO DEFAULT")


def _wait_bound(timeout_s: float | None) -> float | None:
    """How long a lock may be waited for: ``timeout_s`` shortened by the current deadline
    (:mod:`dualwrite.deadline`); None when neither bounds it. A little less than the deadline
    itself, so that the server's lock_timeout (LockTimeoutError: another process holds the
    row) answers before the client's guard gives the connection up (bounded_wait)."""
    deadline = current_deadline()
    if timeout_s is not None:
        bound = wait_s(timeout_s)
    elif deadline is not None:
        bound = deadline.wait_s()
    else:
        return None
    return max(MIN_WAIT_S, bound - min(0.3, bound / 10))


def _state_row(row: Any) -> StateRow:
    """A row selected or returned in the order of ``StateStore._columns`` (then, when locked on
    PostgreSQL, the locking transaction's id, its server process and its server's
    :data:`SERVER_IDENTITY`)."""
    xid = int(row[4]) if len(row) > 4 and row[4] is not None else None
    pid = int(row[5]) if len(row) > 5 and row[5] is not None else None
    server = str(row[6]) if len(row) > 6 and row[6] is not None else None
    return StateRow(str(row[0]), str(row[1]), as_utc(row[2]), int(row[3]), xid, pid, server)


def _require_transaction(conn: Connection, method: str) -> None:
    if not conn.in_transaction():
        raise TransactionStateError(
            f"StateStore.{method}() must run inside the caller's open database transaction "
            "(e.g. `with engine.begin() as conn:`)"
        )


def _psycopg_connection(conn: Connection) -> Any | None:
    """The psycopg 3 connection under ``conn``, or None for another driver."""
    if conn.dialect.driver != "psycopg":
        return None
    return conn.connection.dbapi_connection  # (driver_connection is None once detached)


def writer_connection(engine: Engine, connection_class: type[Connection] | None = None
                      ) -> Connection:
    """A connection for a writer that begins each transaction with :meth:`StateStore.lock`
    (an instance of ``connection_class`` if given, which takes the engine).

    On psycopg it leaves the pool (it is closed, not returned, by ``close()``) and runs in the
    driver's autocommit mode: ``lock()`` then sends the BEGIN in the same round trip as the
    upsert, which psycopg's own BEGIN would not allow. Other drivers get a plain connection.
    """
    try:
        conn = engine.connect() if connection_class is None else connection_class(engine)
    except sa.exc.SQLAlchemyError as exc:
        raise database_error(exc, engine.url) from exc
    raw = _psycopg_connection(conn)
    if raw is not None:
        conn.detach()
        try:
            with _as_sqlalchemy_errors(conn, raw, "SET autocommit"):
                raw.autocommit = True
        except sa.exc.SQLAlchemyError as exc:
            conn.close()
            raise database_error(exc, engine.url) from exc
    return conn


def _begin_statement(raw: Any) -> str:
    """The BEGIN psycopg would send for the connection's isolation level and access mode."""
    parts = ["BEGIN"]
    if raw.isolation_level is not None:
        parts.append("ISOLATION LEVEL " + raw.isolation_level.name.replace("_", " "))
    if raw.read_only is not None:
        parts.append("READ ONLY" if raw.read_only else "READ WRITE")
    if raw.deferrable is not None:
        parts.append("DEFERRABLE" if raw.deferrable else "NOT DEFERRABLE")
    return " ".join(parts)


@contextmanager
def _as_sqlalchemy_errors(conn: Connection, raw: Any, statement: str) -> Iterator[None]:
    """Raise psycopg errors of statements sent past SQLAlchemy the way SQLAlchemy would."""
    import psycopg

    try:
        yield
    except psycopg.Error as exc:
        lost = bool(raw.closed or raw.broken)
        if lost:
            conn.invalidate(exc)
        raise sa.exc.DBAPIError.instance(statement, None, exc, psycopg.Error,
                                         connection_invalidated=lost) from exc


class StateStore:
    """Reads and writes ``dualwrite_transaction_state`` (or another table of the same shape)."""

    def __init__(self, engine: Engine, table: str = STATE_TABLE) -> None:
        backend = backend_for(engine)  # FatalError for a database dualwrite does not support
        if backend.single_writer and not uses_begin_immediate(engine):
            logger.warning(
                "SQLite engine not made by dualwrite.database.create_engine: its transactions do "
                "not start with BEGIN IMMEDIATE, so writers may fail with 'database is locked'"
            )
        self.engine = engine
        self.table = TRANSACTION_STATE if table == STATE_TABLE else state_table(table)
        self.inquiry = CommitInquiry(engine, self.table)
        """Asks what became of a transaction that locked a row, after its COMMIT got no
        answer."""
        t = self.table
        self._columns = (t.c.transactional_id, t.c.prepared_txn_state, t.c.updated_at,
                        t.c.fencing_generation)
        """What every read of whole rows selects, in :class:`StateRow`'s order."""
        # psycopg's pipeline mode sends these past SQLAlchemy (see _lock_pipelined).
        quoted = '"' + table.replace('"', '""') + '"'  # the name SQLAlchemy's Table means
        self._pg_lock_sql = (
            f"INSERT INTO {quoted} (transactional_id, prepared_txn_state, updated_at) "
            "VALUES (%s, '', %s) ON CONFLICT (transactional_id) "
            "DO UPDATE SET transactional_id = EXCLUDED.transactional_id "
            "RETURNING transactional_id, prepared_txn_state, updated_at, fencing_generation, "
            f"txid_current(), pg_backend_pid(), {SERVER_IDENTITY}")
        self._pg_write_sql = (f"UPDATE {quoted} SET prepared_txn_state = %s, updated_at = %s "
                              "WHERE transactional_id = %s")
        self._pg_generation_sql = (f"SELECT pg_backend_pid(), (SELECT fencing_generation FROM "
                                   f"{quoted} WHERE transactional_id = %s)")
        backquoted = "`" + table.replace("`", "``") + "`"
        self._mysql_lock_sql = (
            f"INSERT INTO {backquoted} (transactional_id, prepared_txn_state, updated_at) "
            "VALUES (%s, '', UTC_TIMESTAMP(6)) "
            "ON DUPLICATE KEY UPDATE transactional_id = transactional_id "
            "RETURNING transactional_id, prepared_txn_state, updated_at, fencing_generation, "
            f"NULL, CONNECTION_ID(), {MYSQL_SERVER_IDENTITY}")

    # -- inside the caller's transaction -------------------------------------------------------

    def lock(self, conn: Connection, transactional_id: str) -> str:
        """Lock ``transactional_id``'s row until the caller's transaction ends; return its state.

        Creates the row (empty state) the first time. Blocks while another transaction holds the
        lock. Returns ``''`` when no prepared state is stored. A missing table raises
        :class:`MigrationRequiredError` (on PostgreSQL the caller's transaction is then aborted and
        must be rolled back).
        """
        return self.lock_row(conn, transactional_id).prepared_txn_state

    def lock_row(self, conn: Connection, transactional_id: str, *,
                 timeout_s: float | None = None) -> StateRow:
        """:meth:`lock`, returning the whole locked row (with its fencing generation).

        ``timeout_s`` bounds the wait for another holder of the lock on PostgreSQL (SQLite's
        busy timeout bounds it there): :class:`LockTimeoutError` after that.
        """
        _check("transactional_id", transactional_id, allow_empty=False)
        _require_transaction(conn, "lock")
        t, tid = self.table, transactional_id
        timeout_s = _wait_bound(timeout_s)
        try:
            found: Any
            raw = _psycopg_connection(conn)
            if raw is not None:
                with bounded_wait(conn, f"the lock of {tid!r}'s state row"):
                    found = self._lock_pipelined(conn, raw, tid, timeout_s)
            elif conn.dialect.name == "postgresql":
                for bound in _wait_bounds(conn, timeout_s):
                    conn.exec_driver_sql(bound)
                # One round trip: the upsert takes the row lock (like FOR UPDATE) and returns the
                # stored row unchanged.
                upsert = (postgresql.insert(t)
                          .values(transactional_id=tid, prepared_txn_state="",
                                  updated_at=datetime.now(UTC))
                          .on_conflict_do_update(index_elements=[t.c.transactional_id],
                                                 set_={"transactional_id": tid})
                          .returning(*self._columns, sa.func.txid_current(),
                                     sa.func.pg_backend_pid(),
                                     sa.literal_column(SERVER_IDENTITY)))
                found = conn.execute(upsert).one()
            elif is_mysql(conn):
                # One round trip: the upsert takes the row's exclusive lock (also when the row
                # exists) and returns it, with the session and server that hold the lock.
                with bounded_wait(conn, f"the lock of {tid!r}'s state row"):
                    found = conn.exec_driver_sql(
                        backend_for(conn).statement_wait_options(timeout_s)
                        + self._mysql_lock_sql, (tid,)).one()
            else:
                # Any other backend (SQLite here): the row made if missing, then read under its
                # lock where the server has row locks; the branches above do both in one trip.
                for bound in _wait_bounds(conn, timeout_s):
                    conn.exec_driver_sql(bound)
                conn.execute(self._insert_missing(conn, tid))
                query = sa.select(*self._columns).where(t.c.transactional_id == tid)
                if backend_for(conn).row_locks:
                    query = query.with_for_update()
                found = conn.execute(query).one()
        except sa.exc.SQLAlchemyError as exc:
            self._reraise(conn, exc)
        row = _state_row(found)
        logger.debug("locked transactional id %r, stored state %r, fencing generation %d", tid,
                     row.prepared_txn_state, row.fencing_generation)
        return row

    def lock_rows(self, conn: Connection, transactional_ids: Sequence[str], *,
                  timeout_s: float | None = None) -> dict[str, StateRow]:
        """:meth:`lock_row` for many ids in one round trip (locked in id order); ids without a
        row get one, as with :meth:`lock`. ``timeout_s`` (and the current deadline) bound the
        wait for another holder on PostgreSQL: :class:`~dualwrite.errors.LockTimeoutError`."""
        ids = sorted(set(transactional_ids))
        for tid in ids:
            _check("transactional_id", tid, allow_empty=False)
        _require_transaction(conn, "lock_rows")
        t = self.table
        query = (sa.select(*self._columns)
                 .where(t.c.transactional_id.in_(ids)).order_by(t.c.transactional_id))
        if backend_for(conn).row_locks:
            query = query.with_for_update()  # rows are locked as the sorted scan returns them
        timeout_s = _wait_bound(timeout_s)
        try:
            # A row held by an orphaned idle-in-transaction session: LockTimeoutError within
            # the caller's deadline, not a wait without end.
            for bound in _wait_bounds(conn, timeout_s if ids else None):
                conn.exec_driver_sql(bound)
            with (bounded_wait(conn, "the lock of state rows"),
                  backend_for(conn).session_lock_wait(conn, timeout_s if ids else None)):
                found = {r[0]: _state_row(r) for r in conn.execute(query)} if ids else {}
        except sa.exc.SQLAlchemyError as exc:
            self._reraise(conn, exc)
        for tid in ids:
            if tid not in found:
                found[tid] = self.lock_row(conn, tid, timeout_s=timeout_s)
        return found

    def write(self, conn: Connection, transactional_id: str, state: str) -> None:
        """Store ``state`` in the caller's transaction, which must have called :meth:`lock`."""
        _check("transactional_id", transactional_id, allow_empty=False)
        _check("state", state, allow_empty=True)
        _require_transaction(conn, "write")
        t = self.table
        stmt = (
            sa.update(t)
            .where(t.c.transactional_id == transactional_id)
            .values(prepared_txn_state=state, updated_at=backend_for(conn).next_version())
        )
        try:
            with bounded_wait(conn, f"the write of {transactional_id!r}'s state row"):
                result = conn.execute(stmt)
        except sa.exc.SQLAlchemyError as exc:
            self._reraise(conn, exc)
        if result.rowcount != 1:
            raise TransactionStateError(
                f"no state row for transactional id {transactional_id!r}: "
                "call lock() in the same transaction before write()"
            )
        logger.debug("wrote state %r for transactional id %r", state, transactional_id)

    def write_and_commit(self, conn: Connection, transactional_id: str, state: str) -> None:
        """Store ``state`` and commit the caller's transaction: the recipe's decision.

        On psycopg the UPDATE and the COMMIT travel in one round trip (pipeline mode), so
        SQLAlchemy's ``commit`` event fires only after the database committed. Any error leaves
        the outcome to be asked (the COMMIT may have been applied):
        :meth:`CommitInquiry.commit_status`.
        """
        raw = _psycopg_connection(conn)
        if raw is None:
            self.write(conn, transactional_id, state)
            try:
                with bounded_wait(conn, "COMMIT"):
                    conn.commit()
            except sa.exc.SQLAlchemyError as exc:
                self._reraise(conn, exc)
            return
        _check("transactional_id", transactional_id, allow_empty=False)
        _check("state", state, allow_empty=True)
        _require_transaction(conn, "write_and_commit")
        try:
            with (bounded_wait(conn, "COMMIT"),
                  _as_sqlalchemy_errors(conn, raw, self._pg_write_sql + "; COMMIT")):
                with raw.pipeline():  # one Sync for both (raw.commit() would add its own)
                    cursor = raw.execute(self._pg_write_sql,
                                         (state, datetime.now(UTC), transactional_id))
                    raw.execute("COMMIT")
                written = cursor.rowcount
        except sa.exc.SQLAlchemyError as exc:
            self._reraise(conn, exc)
        conn.commit()  # SQLAlchemy's bookkeeping; the driver has nothing left to commit
        if written != 1:
            raise TransactionStateError(
                f"the state row of transactional id {transactional_id!r} was gone at commit "
                "(deleted inside the transaction?): the database committed without the decision"
            )
        logger.debug("wrote state %r for transactional id %r and committed", state,
                     transactional_id)

    def _lock_pipelined(self, conn: Connection, raw: Any, transactional_id: str,
                        timeout_s: float | None) -> Any:
        """:meth:`lock_row` on psycopg (``raw`` under ``conn``): BEGIN, the lock timeout and the
        upsert in one round trip; returns the upsert's row."""
        from psycopg.pq import TransactionStatus

        with _as_sqlalchemy_errors(conn, raw, self._pg_lock_sql):
            with raw.pipeline():
                if raw.autocommit and raw.info.transaction_status == TransactionStatus.IDLE:
                    # A writer connection (see writer_connection): the BEGIN travels with the lock
                    # instead of making its own round trip.
                    raw.execute(_begin_statement(raw))
                for bound in _wait_bounds(conn, timeout_s, statements=True):
                    raw.execute(bound)
                cursor = raw.execute(self._pg_lock_sql, (transactional_id, datetime.now(UTC)))
                if timeout_s is not None:
                    for reset in _RESET_TIMEOUTS_SQL:
                        raw.execute(reset)
            row = cursor.fetchone()
        assert row is not None  # the upsert always returns its row
        return row

    def generation_on(self, conn: Connection, transactional_id: str) -> tuple[int | None, int]:
        """PostgreSQL and MariaDB, on ``conn`` outside a transaction: the id's fencing
        generation (None without a row, not waiting for its lock) and the server session running
        ``conn`` (``pg_backend_pid()``, ``CONNECTION_ID()``), in one round trip.

        A writer holding its id's lease on ``conn`` asks this after each Kafka commit: the same
        session and generation mean nobody can have taken the lease or claimed the id since.
        """
        _check("transactional_id", transactional_id, allow_empty=False)
        raw = _psycopg_connection(conn)
        if raw is not None and raw.autocommit:  # a writer connection: no transaction to end
            try:
                with (bounded_wait(conn, "the lease check"),
                      _as_sqlalchemy_errors(conn, raw, self._pg_generation_sql)):
                    found = raw.execute(self._pg_generation_sql, (transactional_id,)).fetchone()
            except sa.exc.SQLAlchemyError as exc:
                self._reraise(conn, exc)
            assert found is not None
            return (None if found[1] is None else int(found[1])), int(found[0])
        t = self.table
        generation = (sa.select(t.c.fencing_generation)
                      .where(t.c.transactional_id == transactional_id).scalar_subquery())
        try:
            try:
                session: Any = sa.literal_column(backend_for(conn).session_id_sql)
                with bounded_wait(conn, "the lease check"):
                    found = conn.execute(sa.select(session, generation)).one()
            finally:
                conn.rollback()  # ends SQLAlchemy's implicit transaction (none on a writer's)
        except sa.exc.SQLAlchemyError as exc:
            self._reraise(conn, exc)
        return (None if found[1] is None else int(found[1])), int(found[0])

    # -- own short transactions ----------------------------------------------------------------

    def read(self, transactional_id: str) -> StateRow | None:
        """The stored row of ``transactional_id``, or None. Does not wait for writers' locks."""
        _check("transactional_id", transactional_id, allow_empty=False)
        rows = self.read_all([transactional_id])
        return rows[0] if rows else None

    def read_all(self, transactional_ids: Sequence[str] | None = None) -> list[StateRow]:
        """All rows (or those of ``transactional_ids``), ordered by transactional id."""
        t = self.table
        query = sa.select(*self._columns)
        if transactional_ids is not None:
            ids = list(transactional_ids)
            if not ids:
                return []
            for tid in ids:
                _check("transactional_id", tid, allow_empty=False)
            query = query.where(t.c.transactional_id.in_(ids))
        query = query.order_by(t.c.transactional_id)
        with transaction(self.engine, read_only=True) as conn:
            try:
                rows = conn.execute(query).all()
            except sa.exc.SQLAlchemyError as exc:
                self._reraise(conn, exc)
        return [_state_row(r) for r in rows]

    def claim(self, transactional_ids: Sequence[str], *,
              connection: Connection | None = None,
              timeout_s: float | None = None) -> dict[str, int]:
        """Raise the fencing generation of each id (creating missing rows) and commit.

        Call this before ending or fencing any Kafka transaction of these ids, then act only in a
        later transaction that holds the row lock and still sees the generation returned here.
        A writer whose records left before its lock was granted then sees a generation other
        than its own whenever someone may have acted on its transaction meanwhile.
        ``connection``: an open connection to use (outside a transaction) instead of the pool's.
        ``timeout_s`` bounds the wait for a holder of a row lock on PostgreSQL (SQLite's busy
        timeout bounds it there): :class:`~dualwrite.errors.LockTimeoutError` after that.
        """
        ids = sorted(set(transactional_ids))  # one lock order for every locker: no deadlocks
        for tid in ids:
            _check("transactional_id", tid, allow_empty=False)
        if not ids:
            return {}
        t = self.table
        now = datetime.now(UTC)
        rows = [{"transactional_id": tid, "prepared_txn_state": "", "updated_at": now,
                 "fencing_generation": 1} for tid in ids]
        with transaction(self.engine, connection=connection) as conn:
            # One statement; its rows are upserted (and locked) in the order given.
            stmt = backend_for(conn).upsert(
                t, rows, t.c.transactional_id,
                {"fencing_generation": t.c.fencing_generation + 1},
            ).returning(t.c.transactional_id, t.c.fencing_generation)
            try:
                timeout_s = _wait_bound(timeout_s)
                for bound in _wait_bounds(conn, timeout_s, statements=True):
                    conn.exec_driver_sql(bound)
                with backend_for(conn).session_lock_wait(conn, timeout_s):
                    claimed = {r[0]: int(r[1]) for r in conn.execute(stmt)}
            except sa.exc.SQLAlchemyError as exc:
                self._reraise(conn, exc)
        logger.debug("claimed %s", claimed)
        return claimed

    def compare_and_set(self, transactional_id: str, expected: str, new: str) -> bool:
        """Set the state to ``new`` only if it is still ``expected``; True if it was set.

        Runs in its own transaction and waits for a writer holding the row's lock, then compares
        against what that writer committed. A missing row counts as state ``''``.
        """
        _check("transactional_id", transactional_id, allow_empty=False)
        _check("expected", expected, allow_empty=True)
        _check("new", new, allow_empty=True)
        t = self.table
        stmt = (
            sa.update(t)
            .where(t.c.transactional_id == transactional_id, t.c.prepared_txn_state == expected)
        )
        with transaction(self.engine) as conn:
            stmt = stmt.values(prepared_txn_state=new, updated_at=backend_for(conn).next_version())
            try:
                if expected == "":
                    conn.execute(self._insert_missing(conn, transactional_id))
                swapped = conn.execute(stmt).rowcount == 1
            except sa.exc.SQLAlchemyError as exc:
                self._reraise(conn, exc)
        logger.debug(
            "compare_and_set %r: %r -> %r %s",
            transactional_id,
            expected,
            new,
            "done" if swapped else "skipped (state changed)",
        )
        return swapped

    def delete(self, transactional_id: str) -> bool:
        """Remove the row of ``transactional_id``; True if there was one."""
        _check("transactional_id", transactional_id, allow_empty=False)
        t = self.table
        with transaction(self.engine) as conn:
            try:
                deleted = conn.execute(
                    sa.delete(t).where(t.c.transactional_id == transactional_id)
                ).rowcount
            except sa.exc.SQLAlchemyError as exc:
                self._reraise(conn, exc)
        return deleted == 1

    # -- helpers -------------------------------------------------------------------------------

    def _insert_missing(self, conn: Connection, transactional_id: str) -> Any:
        """``INSERT`` an empty row unless one exists (never blocks on an existing row's lock)."""
        values = {
            "transactional_id": transactional_id,
            "prepared_txn_state": "",
            "updated_at": datetime.now(UTC),
        }
        return backend_for(conn).insert_missing(self.table, values)

    def _reraise(self, conn: Connection, exc: sa.exc.SQLAlchemyError) -> NoReturn:
        """Raise the :func:`~dualwrite.database.database_error` of ``exc`` (chained)."""
        raise database_error(exc, conn.engine.url, table=self.table.name) from exc

