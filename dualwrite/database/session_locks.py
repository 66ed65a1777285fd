"""Named locks held for as long as a server session lives: one home for writer leases, pool slots
and the batch sinks' decision lock.

PostgreSQL: session advisory locks; MariaDB: user locks (``GET_LOCK``). Both belong to the server
session that took them and end with it, also when the process dies. SQLite: an exclusive
``flock`` on a file beside the database file, which the kernel drops when the process dies; an
in-memory SQLite database has one process only, so nothing to lock against. The SQL of each
backend lives in :mod:`dualwrite.database.backends`; the names each kind of lock uses are its
:class:`LockSpace` below.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from dualwrite.database.backends import Backend, LockSpace, backend_for
from dualwrite.database.engine import database_error, unreachable_error
from dualwrite.database.locks import try_file_lock
from dualwrite.errors import FatalError

__all__ = ["LEASE_LOCKS", "POOL_SLOT_LOCKS", "SINK_LOCKS", "SessionLocks", "Taken"]

LEASE_LOCKS = LockSpace(b"dualwrite-lease", "dualwrite-lease-", b"", ".dualwrite-leases")
"""Writer leases (:mod:`dualwrite.writer.lease`)."""
POOL_SLOT_LOCKS = LockSpace(b"dualwrite-pool-slot", "dualwrite-pool-",
                            b"dualwrite-pool-slot\0", ".dualwrite-pool")
"""Pool slots (:mod:`dualwrite.writer.pool`)."""
SINK_LOCKS = LockSpace(b"dualwrite-sink", "dualwrite-sink-", b"", ".dualwrite-sinks")
"""The batch sinks' decision lock (:mod:`dualwrite.batch.decision_log`)."""


@dataclass(frozen=True)
class Taken:
    """The names one :meth:`SessionLocks.take` got, and the server session holding them (None
    for files, or where nothing is locked)."""

    names: frozenset[str]
    session: int | None = None


class SessionLocks:
    """The locks of one :class:`LockSpace` on one database.

    Server locks are taken on a connection the caller gives (its session holds them; the caller
    ends the transaction) or, without one, on a connection of this object's own, opened on first
    use and kept until :meth:`release_all`. File locks are this object's until given back.
    """

    def __init__(self, engine: Engine, space: LockSpace) -> None:
        self.engine = engine
        self.space = space
        self.backend: Backend = backend_for(engine)
        self.folder: Path | None = self.backend.lock_folder(engine, space.folder_suffix)
        """SQLite file: where the lock files live."""
        self._conn: Connection | None = None
        self._fds: dict[str, int] = {}

    @property
    def on_server(self) -> bool:
        """Whether the locks live in the server (and belong to a session)."""
        return self.backend.session_locks

    @property
    def exclusive(self) -> bool:
        """Whether the locks exclude other processes (not on an in-memory SQLite database)."""
        return self.on_server or self.folder is not None

    # -- taking and giving back ------------------------------------------------------------

    def take(self, names: Sequence[str], conn: Connection | None = None) -> Taken:
        """Take the free ones of ``names`` without waiting (one round trip on a server); where
        nothing excludes other processes, every name."""
        if not names:
            return Taken(frozenset())
        if self.folder is not None:
            return Taken(frozenset(self._take_files(names)))
        if not self.on_server:
            return Taken(frozenset(names))
        if conn is not None:
            return self._take_on(conn, names)
        own = self._own_connection()
        try:
            taken = self._take_on(own, names)
            own.commit()  # session locks outlive the transaction
        except sa.exc.SQLAlchemyError as exc:
            self._lose_connection()
            raise database_error(exc, self.engine.url) from exc
        return taken

    def wait(self, conn: Connection, name: str, timeout_s: float) -> bool:
        """Take ``name``'s server lock on ``conn``'s session, waiting up to ``timeout_s``;
        whether it was taken (the caller ends the transaction: the lock outlives it)."""
        return bool(conn.exec_driver_sql(
            self.backend.lock_sql(self.space, name, timeout_s)).scalar())

    def wait_file(self, name: str, timeout_s: float) -> bool:
        """Take ``name``'s file lock, waiting up to ``timeout_s``; whether it was taken."""
        assert self.folder is not None
        deadline = time.monotonic() + timeout_s
        while not self._take_files([name]):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def lock_for_transaction(self, conn: Connection, name: str, timeout_s: float) -> None:
        """Wait for ``name``'s lock held until ``conn``'s transaction ends
        (:attr:`Backend.transaction_locks`), for at most ``timeout_s`` (then the server's lock
        timeout error)."""
        bound = self.backend.lock_timeout_sql(timeout_s)
        if bound is not None:
            conn.exec_driver_sql(bound)
        conn.exec_driver_sql(self.backend.transaction_lock_sql(self.space, name))

    def give_back(self, name: str, conn: Connection | None = None) -> None:
        """Release one lock: its file's, or its server lock on ``conn`` (else on the own
        connection, whose failure only loses that connection and so the locks)."""
        fd = self._fds.pop(name, None)
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock
            return
        if not self.on_server:
            return
        if conn is not None:
            conn.exec_driver_sql(self.backend.unlock_sql(self.space, name))
            return
        if self._conn is not None:
            try:
                self._conn.exec_driver_sql(self.backend.unlock_sql(self.space, name))
                self._conn.commit()
            except sa.exc.SQLAlchemyError:
                self._lose_connection()

    def unlock_all(self, conn: Connection) -> None:
        """Release every server lock of ``conn``'s session."""
        conn.exec_driver_sql(self.backend.unlock_all_sql())

    def release_all(self) -> None:
        """Release this object's file locks and the own connection's locks, and close it."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                self.unlock_all(conn)
                conn.commit()
                conn.close()
            except sa.exc.SQLAlchemyError:
                with contextlib.suppress(sa.exc.SQLAlchemyError):
                    conn.invalidate()
                with contextlib.suppress(sa.exc.SQLAlchemyError):
                    conn.close()

    # -- asking ----------------------------------------------------------------------------

    def still_held(self) -> bool:
        """Whether the own connection's session, which holds its server locks, is alive (a
        server restart ends it, and the locks with it); True where locks are not a session's."""
        if not self.on_server:
            return True
        if self._conn is None:
            return False
        try:
            self._conn.exec_driver_sql("SELECT 1").one()
            self._conn.commit()
        except sa.exc.SQLAlchemyError:
            self._lose_connection()
            return False
        return True

    def session_id(self, conn: Connection) -> int:
        """The number of ``conn``'s server session (``pg_backend_pid()``,
        ``CONNECTION_ID()``)."""
        return int(conn.exec_driver_sql(f"SELECT {self.backend.session_id_sql}").scalar_one())

    def holder(self, conn: Connection, name: str) -> int | None:
        """The server session holding ``name``'s lock, asked on ``conn``; None if free."""
        found = conn.exec_driver_sql(self.backend.holder_sql(self.space, name)).scalar()
        return None if found is None else int(found)

    def held_here(self, conn: Connection, names: Sequence[str]) -> tuple[int, int]:
        """How many of ``names``' locks ``conn``'s session holds, and its session number."""
        return self.backend.held_here(conn, self.space, names)

    # -- internals -------------------------------------------------------------------------

    def _take_on(self, conn: Connection, names: Sequence[str]) -> Taken:
        columns = ", ".join(self.backend.try_lock_columns(self.space, names))
        *got, session = conn.exec_driver_sql(
            f"SELECT {columns}, {self.backend.session_id_sql}").one()
        return Taken(frozenset(n for n, ok in zip(names, got, strict=True) if ok), int(session))

    def _take_files(self, names: Iterable[str]) -> list[str]:
        assert self.folder is not None
        taken: list[str] = []
        try:
            for name in names:
                fd = try_file_lock(self.folder, name)
                if fd is not None:
                    self._fds[name] = fd
                    taken.append(name)
        except FatalError:
            for name in taken:
                self.give_back(name)
            raise
        return taken

    def _own_connection(self) -> Connection:
        if self._conn is None:
            try:
                self._conn = self.engine.connect()
            except sa.exc.SQLAlchemyError as exc:
                raise unreachable_error(self.engine.url, exc) from exc
        return self._conn

    def _lose_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                conn.invalidate()
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                conn.close()
