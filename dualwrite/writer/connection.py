"""A writer's own database connection, kept between its transactions: opened, locked on, rolled
back, and let go (with the lease, where the lease is the connection's session)."""

from __future__ import annotations

import contextlib
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection

from dualwrite.database import bounded_wait, database_error
from dualwrite.deadline import current_deadline
from dualwrite.errors import DatabaseUnreachableError, DualWriteError
from dualwrite.writer.handle import GuardedConnection
from dualwrite.writer.lease import pooler_error
from dualwrite.writer.lease_keeper import LeaseKeeper
from dualwrite.writer.settings import WriterSettings, log
from dualwrite.writer.state_store import StateRow, writer_connection

__all__ = ["WriterConnection"]


class WriterConnection:
    """The writer's connection (see :func:`~dualwrite.writer.state_store.writer_connection`)
    and the state row its current transaction locked."""

    def __init__(self, settings: WriterSettings, lease: LeaseKeeper) -> None:
        self._settings = settings
        self._lease = lease
        self.current: GuardedConnection | None = None
        """The open connection, if any."""
        self.locked: StateRow | None = None
        """The row as locked by the database transaction holding the lock; on PostgreSQL its
        transaction id and server name the decision
        (:meth:`~dualwrite.writer.commit_inquiry.CommitInquiry.commit_status`)."""

    def own(self) -> GuardedConnection:
        """The writer's connection (opened if there is none), back in the writer's hands."""
        if self.current is None:
            conn = writer_connection(self._settings.engine, GuardedConnection)
            assert isinstance(conn, GuardedConnection)
            self.current = conn
        self.current.reclaim()
        return self.current

    def begin_and_lock(self) -> tuple[GuardedConnection, StateRow]:
        """Begin on the writer's connection and lock the state row.

        The connection is kept between transactions (no pool checkout, no ping). One that died
        while idle is replaced once: nothing of the transaction has happened yet.
        """
        settings = self._settings
        for attempt in (1, 2):
            conn = self.own()
            try:
                try:
                    conn.begin()
                except sa.exc.SQLAlchemyError as exc:
                    raise database_error(exc, settings.engine.url) from exc
                row = settings.store.lock_row(conn, settings.transactional_id,
                                              timeout_s=settings.timeout_s)
                self.locked = row
                lease = self._lease.lease
                held = lease.backend_pid if lease is not None else None
                if None not in (held, row.locked_by_pid) and held != row.locked_by_pid:
                    # The connection holding the lease is on another server session now: a
                    # transaction pooler the start-up check did not catch (a busy one).
                    raise pooler_error(settings.engine, f"the writer's lease is held by backend "
                                                        f"{held}, its transaction ran on "
                                                        f"{row.locked_by_pid}")
                return conn, row
            except BaseException as exc:
                self.drop()
                lost = isinstance(exc, DatabaseUnreachableError)
                deadline = current_deadline()
                if attempt == 2 or not lost or (deadline is not None and deadline.expired):
                    raise
                log.info("database connection of transactional_id=%s was lost while idle; "
                         "reconnecting", settings.transactional_id)
        raise AssertionError("unreachable")

    def rollback(self, conn: Connection) -> None:
        """Roll back (freeing the row lock); a connection that cannot is dropped instead."""
        try:
            with bounded_wait(conn, "ROLLBACK"):
                conn.rollback()
        except (sa.exc.SQLAlchemyError, DualWriteError):
            self.drop()

    def drop(self) -> None:
        """Let go of the writer's connection; what it held is rolled back, freeing the row lock
        (and, on PostgreSQL, the lease: the next transaction locks first again)."""
        conn, self.current = self.current, None
        raw: Any = None
        if conn is not None:
            conn.reclaim()
            if not conn.closed and not conn.invalidated:
                raw = conn.connection.dbapi_connection
        if self._lease.release_with_connection() and raw is not None:
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
                log.debug("closing the connection of transactional_id=%s: %s",
                          self._settings.transactional_id, exc)

    def discard(self) -> None:
        """Close the writer's connection at the driver, which rolls back what it held: after a
        misuse SQLAlchemy's view of the transaction may not match the database's, so neither
        its rollback nor the pool's reset on return can be trusted to end it."""
        conn = self.current
        if conn is not None:
            conn.reclaim()
            # (PyMySQL raises its own error closing a connection the invalidation closed.)
            driver_error = self._settings.engine.dialect.loaded_dbapi.Error
            with contextlib.suppress(sa.exc.SQLAlchemyError, driver_error):
                raw = conn.connection.dbapi_connection
                conn.invalidate()  # closes a pooled driver connection, only forgets a detached one
                if raw is not None:
                    raw.close()  # the detached one (psycopg's writer connection)
        self.drop()
