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
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NoReturn

import sqlalchemy as sa
from sqlalchemy import Connection, Engine
from sqlalchemy.dialects import mysql, postgresql, sqlite

from dualwrite.database import (
    bounded_wait,
    database_error,
    is_mysql,
    transaction,
    uses_begin_immediate,
)
from dualwrite.database.schema import MAX_LENGTH, STATE_TABLE, TRANSACTION_STATE, state_table
from dualwrite.deadline import MIN_WAIT_S, current_deadline, wait_s
from dualwrite.errors import FatalError, TransactionStateError

__all__ = ["MAX_LENGTH", "MYSQL_SERVER_IDENTITY", "SERVER_IDENTITY", "StateRow", "StateStore",
           "writer_connection"]

logger = logging.getLogger(__name__)

_SUPPORTED_DIALECTS = ("postgresql", "sqlite", "mysql", "mariadb")

_IN_RECOVERY = "in recovery"
#: PostgreSQL: which server process, and which history of the data, runs this statement: the
#: WAL timeline (a promotion starts a new one), the postmaster's start time (another server, a
#: promoted standby, a restart after a crash, which replays WAL and may hand out again
#: transaction ids whose WAL was lost) and the shared statistics' reset time, which a crash of
#: one backend (the OOM killer's SIGKILL) changes: the postmaster then reinitializes and replays
#: WAL without restarting, and it is readable by any role, unlike the checkpointer's pid (an
#: administrator's ``pg_stat_reset_shared('bgwriter')`` changes it too, which only makes the
#: state row decide). A transaction id means the same transaction only while this stays the
#: same. A standby in recovery has none (it runs no writes). (The system identifier would add
#: nothing: a standby shares it, another server has another start time; and reading it costs a
#: read of pg_control on every lock.)
SERVER_IDENTITY = (
    f"CASE WHEN pg_is_in_recovery() THEN '{_IN_RECOVERY}' ELSE "
    "substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) || '/' || "
    "pg_postmaster_start_time()::text || '/' || "
    "coalesce(pg_stat_get_bgwriter_stat_reset_time()::text, '') END")


#: MariaDB: which server incarnation runs this statement: host, port and start time (seconds
#: since the epoch, from its uptime: it may read one second apart between two statements). A
#: session id (``CONNECTION_ID()``) names one session on that incarnation only; a restarted
#: server counts them from 1 again.
MYSQL_SERVER_IDENTITY = (
    "CONCAT(@@hostname, ':', @@port, '@', (SELECT UNIX_TIMESTAMP() - VARIABLE_VALUE FROM "
    "information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'UPTIME'))")
#: MariaDB: every write of a state row by dualwrite sets ``updated_at`` to this, so that each
#: committed version of a row has a greater ``updated_at`` than every earlier one (a clock that
#: stands still or steps back cannot repeat one): the row's version, by which the outcome of
#: a COMMIT whose answer was lost is read (:meth:`StateStore.commit_status`).
_MYSQL_NEXT_VERSION = "GREATEST(UTC_TIMESTAMP(6), updated_at + INTERVAL 1 MICROSECOND)"


def _same_history(now: str, then: str | None) -> bool:
    """Whether two :data:`SERVER_IDENTITY` readings of primaries share one WAL timeline: the
    same server, or one restarted after a crash (no promotion in between: that starts a new
    timeline)."""
    if then is None or _IN_RECOVERY in (now, then):
        return False
    return now.partition("/")[0] == then.partition("/")[0]


def _same_mysql_server(now: str, then: str | None) -> bool:
    """Whether two :data:`MYSQL_SERVER_IDENTITY` readings name one server incarnation."""
    if then is None:
        return False
    here, _, started = now.rpartition("@")
    there, _, was = then.rpartition("@")
    try:
        return here == there and abs(float(started) - float(was)) <= 2
    except ValueError:
        return False


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
    outcome can be asked after a failed COMMIT (:meth:`StateStore.commit_status`)."""
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


def _lock_timeout_sql(timeout_s: float) -> str:
    """Bounds this transaction's waits for locks (PostgreSQL's lock_timeout, in ms)."""
    return f"SET LOCAL lock_timeout = {max(1, int(timeout_s * 1000))}"


def _statement_timeout_sql(lock_timeout_s: float) -> str:
    """Bounds each statement of this transaction (PostgreSQL's statement_timeout, in ms), a
    little past ``lock_timeout_s``: a wait for a row lock ends as lock_timeout
    (LockTimeoutError), anything else the server is stuck on as statement_timeout."""
    return f"SET LOCAL statement_timeout = {int(lock_timeout_s * 1000 * 1.1) + 1}"


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


def _mysql_lock_wait_s(timeout_s: float) -> int:
    """MariaDB's innodb_lock_wait_timeout for ``timeout_s``: whole seconds, rounded down so
    that the server answers a held lock before the client's guard gives the connection up
    (bounded_wait), at least 1."""
    return max(1, math.floor(timeout_s))


def _mysql_wait_options(timeout_s: float | None) -> str:
    """MariaDB: ``SET STATEMENT`` options bounding one statement's wait for row locks
    (:func:`_mysql_lock_wait_s`) and its run (max_statement_time, a little longer), or
    ``""``."""
    if timeout_s is None:
        return ""
    lock_s = _mysql_lock_wait_s(timeout_s)
    return (f"SET STATEMENT innodb_lock_wait_timeout={lock_s}, "
            f"max_statement_time={lock_s * 1.1 + 0.5:.3f} FOR ")


@contextmanager
def _mysql_session_lock_wait(conn: Connection, timeout_s: float | None) -> Iterator[None]:
    """MariaDB: the session's innodb_lock_wait_timeout set for the block (whole seconds), then
    restored to the session's own value."""
    if timeout_s is None or not is_mysql(conn):
        yield
        return
    conn.exec_driver_sql("SET @dualwrite_lock_wait = @@SESSION.innodb_lock_wait_timeout, "
                         f"SESSION innodb_lock_wait_timeout = {_mysql_lock_wait_s(timeout_s)}")
    try:
        yield
    finally:
        conn.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = @dualwrite_lock_wait")


def _utc(value: datetime) -> datetime:
    """SQLite returns naive datetimes; dualwrite always stores UTC."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _state_row(row: Any) -> StateRow:
    """A row selected or returned in the order of ``StateStore._columns`` (then, when locked on
    PostgreSQL, the locking transaction's id, its server process and its server's
    :data:`SERVER_IDENTITY`)."""
    xid = int(row[4]) if len(row) > 4 and row[4] is not None else None
    pid = int(row[5]) if len(row) > 5 and row[5] is not None else None
    server = str(row[6]) if len(row) > 6 and row[6] is not None else None
    return StateRow(str(row[0]), str(row[1]), _utc(row[2]), int(row[3]), xid, pid, server)


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
        if engine.dialect.name not in _SUPPORTED_DIALECTS:
            raise FatalError(
                f"dualwrite supports PostgreSQL and SQLite, not {engine.dialect.name!r}"
            )
        if engine.dialect.name == "sqlite" and not uses_begin_immediate(engine):
            logger.warning(
                "SQLite engine not made by dualwrite.database.create_engine: its transactions do "
                "not start with BEGIN IMMEDIATE, so writers may fail with 'database is locked'"
            )
        self.engine = engine
        self.table = TRANSACTION_STATE if table == STATE_TABLE else state_table(table)
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
                if timeout_s is not None:
                    conn.exec_driver_sql(_lock_timeout_sql(timeout_s))
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
                    found = conn.exec_driver_sql(_mysql_wait_options(timeout_s)
                                                 + self._mysql_lock_sql, (tid,)).one()
            else:
                conn.execute(self._insert_missing(conn, tid))
                query = sa.select(*self._columns).where(t.c.transactional_id == tid)
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
        if conn.dialect.name == "postgresql" or is_mysql(conn):
            query = query.with_for_update()  # rows are locked as the sorted scan returns them
        timeout_s = _wait_bound(timeout_s)
        try:
            if timeout_s is not None and ids and conn.dialect.name == "postgresql":
                # A row held by an orphaned idle-in-transaction session: LockTimeoutError
                # within the caller's deadline, not a wait without end.
                conn.exec_driver_sql(_lock_timeout_sql(timeout_s))
            with (bounded_wait(conn, "the lock of state rows"),
                  _mysql_session_lock_wait(conn, timeout_s if ids else None)):
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
            .values(prepared_txn_state=state, updated_at=self._next_version(conn))
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
        the outcome to be asked (the COMMIT may have been applied): :meth:`commit_status`.
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
                if timeout_s is not None:
                    raw.execute(_lock_timeout_sql(timeout_s))
                    raw.execute(_statement_timeout_sql(timeout_s))
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
        t = self.table
        generation = (sa.select(t.c.fencing_generation)
                      .where(t.c.transactional_id == transactional_id).scalar_subquery())
        try:
            try:
                session = (sa.func.connection_id() if is_mysql(conn)
                           else sa.func.pg_backend_pid())
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
            stmt: Any
            if is_mysql(conn):
                stmt = mysql.insert(t).values(rows)
                stmt = stmt.on_duplicate_key_update(
                    fencing_generation=t.c.fencing_generation + 1)
            else:
                insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
                # One statement; its rows are upserted (and locked) in the order given.
                stmt = insert(t).values(rows).on_conflict_do_update(
                    index_elements=[t.c.transactional_id],
                    set_={"fencing_generation": t.c.fencing_generation + 1},
                )
            stmt = stmt.returning(t.c.transactional_id, t.c.fencing_generation)
            try:
                timeout_s = _wait_bound(timeout_s)
                if timeout_s is not None and conn.dialect.name == "postgresql":
                    conn.exec_driver_sql(_lock_timeout_sql(timeout_s))
                    conn.exec_driver_sql(_statement_timeout_sql(timeout_s))
                with _mysql_session_lock_wait(conn, timeout_s):
                    claimed = {r[0]: int(r[1]) for r in conn.execute(stmt)}
            except sa.exc.SQLAlchemyError as exc:
                self._reraise(conn, exc)
        logger.debug("claimed %s", claimed)
        return claimed

    def transaction_status(self, xid: int) -> str | None:
        """PostgreSQL's verdict on the transaction ``xid`` (:attr:`StateRow.locked_by_xid`):
        ``"committed"``, ``"aborted"``, ``"in progress"``, or None once it is too old to know.

        This names one database transaction, unlike the stored state (two transactions can
        store the same string, and recovery may clear it in between).
        """
        try:
            with transaction(self.engine, read_only=True) as conn:
                found = conn.execute(sa.text("SELECT txid_status(:xid)"), {"xid": xid})
                status: str | None = found.scalar_one()
        except sa.exc.SQLAlchemyError as exc:
            if not _in_the_future(exc):
                raise database_error(exc, self.engine.url, table=self.table.name) from exc
            # After a crash (pg_ctl stop -m immediate) the server's next transaction id restarts
            # from its WAL: an id it never logged, as it would have logged the commit, is "in
            # the future". That transaction did not commit.
            return "aborted"
        return status

    def commit_status(self, locked: StateRow, state: str) -> str | None:
        """The outcome of the transaction that locked ``locked`` (:meth:`lock_row`) and wrote
        ``state`` (:meth:`write_and_commit`), after its COMMIT got no answer: ``"committed"``,
        ``"aborted"``, ``"in progress"``, or None when it cannot be known.

        The id is asked first (``txid_status``, as :meth:`transaction_status`), then the row
        read, so that a COMMIT ending in between shows in the row. The server that locked the
        row (:attr:`StateRow.locked_on`) is taken at its word; an id it has not reached yet was
        never handed out there: ``"aborted"``. Another server (a failover to a standby, a crash
        restart, a logical replica) may have given that id to another transaction, or not
        reached it, so its verdict is not taken: the state row decides instead. Its row version
        was written by this transaction (its ``xmin`` is this transaction's id) and holds
        ``state`` only if this transaction committed there. On the same WAL timeline (a crash
        restart, which replays the WAL in full, or a statistics reset) an id still running is
        ``"in progress"`` (wait); once it has ended, and in the row's snapshot too, any other
        version, holding another state, is ``"aborted"`` as long as the fencing generation is
        the locked one (nobody claimed the id, so nobody wrote the row since). Otherwise None
        (after a promotion, or a claim since, it may have committed and been overwritten).
        """
        if is_mysql(self.engine):
            return self._mysql_commit_status(locked, state)
        xid = locked.locked_by_xid
        if xid is None:
            raise ValueError("commit_status needs a row locked on PostgreSQL (lock_row)")
        t = self.table
        status: str | None = None
        future = False
        try:
            with transaction(self.engine, read_only=True) as conn:
                server = conn.exec_driver_sql(f"SELECT {SERVER_IDENTITY}").scalar_one()
                same = server == locked.locked_on
                trusted = same or locked.locked_on is None
                if trusted or server != _IN_RECOVERY:  # a standby may lag: only its row counts
                    try:
                        with conn.begin_nested():  # "in the future" must not end the transaction
                            status = conn.execute(sa.text("SELECT txid_status(:xid)"),
                                                  {"xid": xid}).scalar_one()
                    except sa.exc.SQLAlchemyError as exc:
                        if not _in_the_future(exc):
                            raise
                        future = True
                if trusted and not future:
                    return status
                if same:
                    # The id came from this very server, whose ids only grow: one it has not
                    # reached was never handed out here, so no transaction here had it.
                    return "aborted"
                # Read after the id's answer, with whether the transaction had ended in the
                # snapshot the row is read in (the statement's, or under REPEATABLE READ the
                # transaction's first; txid_status may say "committed" an instant before).
                found: Any = conn.execute(
                    sa.select(t.c.prepared_txn_state, sa.literal_column("xmin::text"),
                              t.c.fencing_generation,
                              sa.func.txid_visible_in_snapshot(
                                  sa.bindparam("xid", xid, type_=sa.BigInteger),
                                  sa.func.txid_current_snapshot()))
                    .where(t.c.transactional_id == locked.transactional_id)).one_or_none()
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, self.engine.url, table=self.table.name) from exc
        # xmin is the 32-bit transaction id; txid_current() adds an epoch above it.
        if found is not None and found[0] == state and int(found[1]) == xid % 2**32:
            return "committed"
        if server == _IN_RECOVERY:
            return None  # a standby may lag: that it lacks the transaction says nothing
        if _same_history(server, locked.locked_on):
            if status == "in progress":
                # The transaction itself, if an administrator's statistics reset changed the
                # identity under it, or one that has its id again after a crash: ask again once
                # it has ended, and the row decides.
                return status
            if (found is not None and int(found[2]) == locked.fencing_generation
                    and found[0] != state):
                if not future and not found[3]:
                    return "in progress"  # running in the row's snapshot: read it again
                # A crash restart: the WAL is replayed in full (an id not reached was never
                # logged), and no one claimed the id since; a row version not written by this
                # transaction is the one it locked, so it did not commit. (This state in
                # another version: a server fed by logical replication shares a timeline
                # number, but not the transaction ids; then the row cannot tell.)
                return "aborted"
        logger.warning("transaction %d of transactional id %r ran on server %s, now %s "
                       "answers: its outcome there is not this transaction's, and the state "
                       "row does not show it", xid, locked.transactional_id,
                       locked.locked_on, server)
        return None

    def _mysql_commit_status(self, locked: StateRow, state: str) -> str | None:
        """:meth:`commit_status` on MariaDB, which has no transaction status to ask: the
        transaction is named by its session and by the row version it wrote.

        1. The session that ran it (:attr:`StateRow.locked_by_pid` on the server incarnation
           :attr:`StateRow.locked_on`) must have ended, so that its transaction is decided: a
           session still listed is killed (``KILL CONNECTION``: a COMMIT it already applied
           stays, anything else is rolled back) and the answer is ``"in progress"`` until it is
           gone. A restarted server ended every session.
        2. Then the row decides. Every dualwrite write raises ``updated_at`` above its previous
           value (:data:`_MYSQL_NEXT_VERSION`), and any other process claims the id (raises its
           fencing generation) before it acts on it: a row whose ``updated_at`` is still the
           locked one was not written by this transaction, which wrote it — ``"aborted"``. A
           later ``updated_at`` with ``state`` and the locked generation was written by this
           transaction — ``"committed"``. Anything else (claimed since, deleted) cannot be
           known: None. On another server (a failover) only ``"committed"`` is taken: a
           replica may lag.
        """
        session = locked.locked_by_pid
        if session is None:
            raise ValueError("commit_status needs a row locked on MariaDB (lock_row)")
        t = self.table
        try:
            with transaction(self.engine) as conn:
                server = str(conn.exec_driver_sql(
                    f"SELECT {MYSQL_SERVER_IDENTITY}").scalar_one())
                same = _same_mysql_server(server, locked.locked_on)
                if same and self._mysql_session_alive(conn, session):
                    return "in progress"
                found = conn.execute(
                    sa.select(t.c.prepared_txn_state, t.c.updated_at, t.c.fencing_generation)
                    .where(t.c.transactional_id == locked.transactional_id)).one_or_none()
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, self.engine.url, table=self.table.name) from exc
        if found is None:
            return None
        written = _utc(found[1]) > locked.updated_at
        if written and found[0] == state and int(found[2]) == locked.fencing_generation:
            return "committed"
        if same and not written:
            return "aborted"
        logger.warning("transactional id %r: the state row no longer shows whether session %d's "
                       "transaction committed (%s)", locked.transactional_id, session,
                       "claimed or rewritten since" if same else f"server {server} answers, "
                       f"the lock was taken on {locked.locked_on}")
        return None

    @staticmethod
    def _mysql_session_alive(conn: Connection, session: int) -> bool:
        """Whether MariaDB still lists ``session``; if so, kill it (its end decides its
        transaction)."""
        alive = conn.exec_driver_sql(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = %s",
            (session,)).scalar_one()
        if not alive:
            return False
        try:
            conn.exec_driver_sql(f"KILL CONNECTION {int(session)}")
        except sa.exc.DBAPIError as exc:
            if getattr(exc.orig, "args", (None,))[0] != 1094:  # unknown thread: ended meanwhile
                raise
        return True

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
            stmt = stmt.values(prepared_txn_state=new, updated_at=self._next_version(conn))
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
        if conn.dialect.name == "postgresql":
            return postgresql.insert(self.table).values(values).on_conflict_do_nothing()
        if is_mysql(conn):
            return mysql.insert(self.table).values(values).prefix_with("IGNORE")
        return sqlite.insert(self.table).values(values).on_conflict_do_nothing()

    @staticmethod
    def _next_version(conn: Connection) -> Any:
        """The ``updated_at`` a write stores: now; on MariaDB also above the row's last one
        (:data:`_MYSQL_NEXT_VERSION`)."""
        if is_mysql(conn):
            return sa.literal_column(_MYSQL_NEXT_VERSION)
        return datetime.now(UTC)

    def _reraise(self, conn: Connection, exc: sa.exc.SQLAlchemyError) -> NoReturn:
        """Raise the :func:`~dualwrite.database.database_error` of ``exc`` (chained)."""
        raise database_error(exc, conn.engine.url, table=self.table.name) from exc


def _in_the_future(exc: sa.exc.SQLAlchemyError) -> bool:
    """PostgreSQL's refusal of ``txid_status`` for an id it has not assigned yet (22023)."""
    orig = getattr(exc, "orig", None)
    return getattr(orig, "sqlstate", None) == "22023" and "in the future" in str(orig)
