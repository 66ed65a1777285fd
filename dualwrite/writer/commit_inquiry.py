"""What became of a database transaction whose COMMIT got no answer.

A writer that lost the answer to its COMMIT asks the database what happened
(:meth:`CommitInquiry.commit_status`). The answer is a :class:`CommitStatus`, or None when it
cannot be known. Each backend's inquiry is split in two: the reads (the server's identity, what
it says of the transaction, the state row's version) and a pure function of what was read
(:func:`postgresql_verdict`, :func:`mysql_verdict`), which the unit tests drive without a server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from dualwrite.database import as_utc, backend_for, database_error, transaction

if TYPE_CHECKING:
    from dualwrite.writer.state_store import StateRow

__all__ = ["IN_RECOVERY", "MYSQL_SERVER_IDENTITY", "SERVER_IDENTITY", "CommitInquiry",
           "CommitStatus", "MysqlRow", "PostgresqlAnswer", "PostgresqlRow", "asks_id",
           "id_decides", "mysql_verdict", "postgresql_verdict", "same_history",
           "same_mysql_server"]

logger = logging.getLogger(__name__)


class CommitStatus(StrEnum):
    """The outcome of one database transaction; its values are PostgreSQL's ``txid_status``."""

    COMMITTED = "committed"
    ABORTED = "aborted"
    IN_PROGRESS = "in progress"


IN_RECOVERY = "in recovery"
"""What :data:`SERVER_IDENTITY` reads on a standby."""
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
    f"CASE WHEN pg_is_in_recovery() THEN '{IN_RECOVERY}' ELSE "
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


def same_history(now: str, then: str | None) -> bool:
    """Whether two :data:`SERVER_IDENTITY` readings of primaries share one WAL timeline: the
    same server, or one restarted after a crash (no promotion in between: that starts a new
    timeline)."""
    if then is None or IN_RECOVERY in (now, then):
        return False
    return now.partition("/")[0] == then.partition("/")[0]


def same_mysql_server(now: str, then: str | None) -> bool:
    """Whether two :data:`MYSQL_SERVER_IDENTITY` readings name one server incarnation."""
    if then is None:
        return False
    here, _, started = now.rpartition("@")
    there, _, was = then.rpartition("@")
    try:
        return here == there and abs(float(started) - float(was)) <= 2
    except ValueError:
        return False


# -- the pure decisions ------------------------------------------------------------------------


@dataclass(frozen=True)
class PostgresqlAnswer:
    """What a PostgreSQL server said when asked about a transaction id."""

    server: str
    """Its :data:`SERVER_IDENTITY` now."""
    status: CommitStatus | None = None
    """``txid_status``: None if not asked, or the id is too old to know."""
    future: bool = False
    """Whether it refused the id as one it has not handed out yet ("in the future")."""


@dataclass(frozen=True)
class PostgresqlRow:
    """The state row's current version, read after the id was asked."""

    state: str
    xmin: int
    """The 32-bit id of the transaction that wrote this version."""
    fencing_generation: int
    ended: bool
    """Whether the asked transaction had ended in the snapshot the row was read in."""


@dataclass(frozen=True)
class MysqlRow:
    """The state row's current version on MariaDB."""

    state: str
    updated_at: datetime
    fencing_generation: int


def asks_id(locked: StateRow, server: str) -> bool:
    """Whether the server now answering is asked about the id at all: a standby may lag, so
    only its row counts, unless it is the server that ran the transaction."""
    return _trusted(locked, server) or server != IN_RECOVERY


def id_decides(locked: StateRow, answer: PostgresqlAnswer) -> bool:
    """Whether the server's answer alone decides, so the row is not read."""
    return answer.server == locked.locked_on or (_trusted(locked, answer.server)
                                                 and not answer.future)


def _trusted(locked: StateRow, server: str) -> bool:
    return server == locked.locked_on or locked.locked_on is None


def postgresql_verdict(locked: StateRow, state: str, answer: PostgresqlAnswer,
                       row: PostgresqlRow | None) -> CommitStatus | None:
    """The outcome of the transaction that locked ``locked`` and wrote ``state``.

    The server that locked the row (:attr:`StateRow.locked_on`) is taken at its word; an id it
    has not reached yet was never handed out there: aborted. Another server (a failover to a
    standby, a crash restart, a logical replica) may have given that id to another
    transaction, or not reached it, so its verdict is not taken: the state row decides instead.
    Its row version was written by this transaction (its ``xmin`` is this transaction's id) and
    holds ``state`` only if this transaction committed there. On the same WAL timeline (a crash
    restart, which replays the WAL in full, or a statistics reset) an id still running is in
    progress (wait); once it has ended, and in the row's snapshot too, any other version,
    holding another state, is aborted as long as the fencing generation is the locked one
    (nobody claimed the id, so nobody wrote the row since). Otherwise None (after a promotion,
    or a claim since, it may have committed and been overwritten). ``row`` is None when the
    row is missing or, if :func:`id_decides`, not read.
    """
    xid = locked.locked_by_xid
    if xid is None:
        raise ValueError("commit_status needs a row locked on PostgreSQL (lock_row)")
    if _trusted(locked, answer.server) and not answer.future:
        return answer.status
    if answer.server == locked.locked_on:
        # The id came from this very server, whose ids only grow: one it has not reached was
        # never handed out here, so no transaction here had it.
        return CommitStatus.ABORTED
    # xmin is the 32-bit transaction id; txid_current() adds an epoch above it.
    if row is not None and row.state == state and row.xmin == xid % 2**32:
        return CommitStatus.COMMITTED
    if answer.server == IN_RECOVERY:
        return None  # a standby may lag: that it lacks the transaction says nothing
    if same_history(answer.server, locked.locked_on):
        if answer.status is CommitStatus.IN_PROGRESS:
            # The transaction itself, if an administrator's statistics reset changed the
            # identity under it, or one that has its id again after a crash: ask again once it
            # has ended, and the row decides.
            return CommitStatus.IN_PROGRESS
        if (row is not None and row.fencing_generation == locked.fencing_generation
                and row.state != state):
            if not answer.future and not row.ended:
                return CommitStatus.IN_PROGRESS  # running in the row's snapshot: read it again
            # A crash restart: the WAL is replayed in full (an id not reached was never
            # logged), and no one claimed the id since; a row version not written by this
            # transaction is the one it locked, so it did not commit. (This state in another
            # version: a server fed by logical replication shares a timeline number, but not
            # the transaction ids; then the row cannot tell.)
            return CommitStatus.ABORTED
    return None


def mysql_verdict(locked: StateRow, state: str, server: str, session_alive: bool,
                  row: MysqlRow | None) -> CommitStatus | None:
    """The outcome on MariaDB of the transaction that locked ``locked`` and wrote ``state``.

    ``session_alive``: whether the locking session is still listed (then killed) on the server
    that ran it. Every dualwrite write raises ``updated_at`` above its previous value, and any
    other process claims the id (raises its fencing generation) before it acts on it: a row
    whose ``updated_at`` is still the locked one was not written by this transaction, which
    wrote it — aborted. A later ``updated_at`` with ``state`` and the locked generation was
    written by this transaction — committed. Anything else (claimed since, deleted) cannot be
    known: None. On another server (a failover) only committed is taken: a replica may lag.
    """
    same = same_mysql_server(server, locked.locked_on)
    if same and session_alive:
        return CommitStatus.IN_PROGRESS
    if row is None:
        return None
    written = row.updated_at > locked.updated_at
    if written and row.state == state and row.fencing_generation == locked.fencing_generation:
        return CommitStatus.COMMITTED
    if same and not written:
        return CommitStatus.ABORTED
    return None


# -- asking the database -----------------------------------------------------------------------


class CommitInquiry:
    """Asks the database of a state table what became of a transaction that locked a row."""

    def __init__(self, engine: Engine, table: sa.Table) -> None:
        self.engine = engine
        self.table = table

    def transaction_status(self, xid: int) -> CommitStatus | None:
        """PostgreSQL's verdict on the transaction ``xid`` (:attr:`StateRow.locked_by_xid`), or
        None once it is too old to know.

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
            return CommitStatus.ABORTED
        return None if status is None else CommitStatus(status)

    def commit_status(self, locked: StateRow, state: str) -> CommitStatus | None:
        """The outcome of the transaction that locked ``locked`` (:meth:`StateStore.lock_row`)
        and wrote ``state`` (:meth:`StateStore.write_and_commit`), after its COMMIT got no
        answer, or None when it cannot be known (:func:`postgresql_verdict`,
        :func:`mysql_verdict`).

        On PostgreSQL the id is asked first (``txid_status``, as :meth:`transaction_status`),
        then the row read, so that a COMMIT ending in between shows in the row.
        """
        if backend_for(self.engine).commit_by_row_version:
            return self._mysql_commit_status(locked, state)
        xid = locked.locked_by_xid
        if xid is None:
            raise ValueError("commit_status needs a row locked on PostgreSQL (lock_row)")
        t = self.table
        row: PostgresqlRow | None = None
        try:
            with transaction(self.engine, read_only=True) as conn:
                answer = PostgresqlAnswer(
                    str(conn.exec_driver_sql(f"SELECT {SERVER_IDENTITY}").scalar_one()))
                if asks_id(locked, answer.server):
                    answer = _ask_txid_status(conn, xid, answer.server)
                if id_decides(locked, answer):
                    return postgresql_verdict(locked, state, answer, None)
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
                if found is not None:
                    row = PostgresqlRow(str(found[0]), int(found[1]), int(found[2]),
                                        bool(found[3]))
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, self.engine.url, table=self.table.name) from exc
        verdict = postgresql_verdict(locked, state, answer, row)
        if verdict is None and answer.server != IN_RECOVERY:
            logger.warning("transaction %d of transactional id %r ran on server %s, now %s "
                           "answers: its outcome there is not this transaction's, and the state "
                           "row does not show it", xid, locked.transactional_id,
                           locked.locked_on, answer.server)
        return verdict

    def _mysql_commit_status(self, locked: StateRow, state: str) -> CommitStatus | None:
        """:meth:`commit_status` on MariaDB, which has no transaction status to ask: the
        transaction is named by its session and by the row version it wrote.

        The session that ran it (:attr:`StateRow.locked_by_pid` on the server incarnation
        :attr:`StateRow.locked_on`) must have ended, so that its transaction is decided: a
        session still listed is killed (``KILL CONNECTION``: a COMMIT it already applied stays,
        anything else is rolled back) and the answer is in progress until it is gone. A
        restarted server ended every session. Then the row decides (:func:`mysql_verdict`).
        """
        session = locked.locked_by_pid
        if session is None:
            raise ValueError("commit_status needs a row locked on MariaDB (lock_row)")
        t = self.table
        row: MysqlRow | None = None
        try:
            with transaction(self.engine) as conn:
                server = str(conn.exec_driver_sql(
                    f"SELECT {MYSQL_SERVER_IDENTITY}").scalar_one())
                same = same_mysql_server(server, locked.locked_on)
                if same and _mysql_session_alive(conn, session):
                    return mysql_verdict(locked, state, server, True, None)
                found = conn.execute(
                    sa.select(t.c.prepared_txn_state, t.c.updated_at, t.c.fencing_generation)
                    .where(t.c.transactional_id == locked.transactional_id)).one_or_none()
                if found is not None:
                    row = MysqlRow(str(found[0]), as_utc(found[1]), int(found[2]))
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, self.engine.url, table=self.table.name) from exc
        verdict = mysql_verdict(locked, state, server, False, row)
        if verdict is None and row is not None:
            logger.warning("transactional id %r: the state row no longer shows whether session "
                           "%d's transaction committed (%s)", locked.transactional_id, session,
                           "claimed or rewritten since" if same else f"server {server} answers, "
                           f"the lock was taken on {locked.locked_on}")
        return verdict


def _ask_txid_status(conn: Connection, xid: int, server: str) -> PostgresqlAnswer:
    """``txid_status(xid)`` inside ``conn``'s transaction, which an id "in the future" must not
    end."""
    try:
        with conn.begin_nested():
            status = conn.execute(sa.text("SELECT txid_status(:xid)"), {"xid": xid}).scalar_one()
    except sa.exc.SQLAlchemyError as exc:
        if not _in_the_future(exc):
            raise
        return PostgresqlAnswer(server, None, future=True)
    return PostgresqlAnswer(server, None if status is None else CommitStatus(status))


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


def _in_the_future(exc: sa.exc.SQLAlchemyError) -> bool:
    """PostgreSQL's refusal of ``txid_status`` for an id it has not assigned yet (22023)."""
    orig = getattr(exc, "orig", None)
    return getattr(orig, "sqlstate", None) == "22023" and "in the future" in str(orig)
