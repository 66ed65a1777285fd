"""Writer leases: who may end a transactional id's Kafka transactions by (producer id, epoch).

librdkafka keeps one (producer id, epoch) for a whole producer session (the TV1 path), so an
EndTxn that another process decided from a snapshot can land on the session's *next* transaction
(the shape of Jepsen's delayed-EndTxn finding, KAFKA-17754). A writer that begins its next
transaction before it takes the state-row lock (the deferred lock, see docs/design.md) therefore
holds a *lease* on its transactional id for as long as its session runs, and nobody else ends a
transaction of that id by (producer id, epoch) while the lease is held: recovery leaves a leased
id to its writer, and a second writer of the id waits for the holder to commit its own
transaction. A writer without the lease takes the row lock before it begins each transaction.

PostgreSQL: a session-level advisory lock, held by the writer's own connection and released by
the server when that session ends (also when the process dies). It needs a server session of
the writer's own: a direct connection, or a pooler in *session* pooling mode. A pooler in
transaction (or statement) pooling mode, such as PgBouncer's ``pool_mode = transaction``, hands
each transaction whatever server session is free, so a lock would stay with a pooled session (a
crashed writer's forever) and another client could find itself holding it.
:meth:`Leases.check_sessions` tells them apart once per engine and refuses such a pooler with a
:class:`FatalError` naming it (:func:`pooler_error`); as that cannot be certain on a busy pooler,
a lease also records its server process, which the writer and recovery compare with the one
that runs their row locks.

MariaDB: a named user lock (``GET_LOCK``), which like PostgreSQL's session advisory lock
belongs to the session that took it and ends with it (also when the process dies); the same
session checks apply, with ``CONNECTION_ID()`` for the server process.

SQLite: an exclusive ``flock`` on a file beside the database file, released by the kernel when
the process dies. An in-memory SQLite database has no leases (one process only): its writers
always lock first.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from dualwrite.database import (
    LEASE_LOCKS,
    SessionLocks,
    database_error,
    mask_url,
    unreachable_error,
)
from dualwrite.errors import FatalError

__all__ = ["HeldLeases", "Lease", "Leases", "pooler_error"]

# Engines whose connections were found to keep their server session (see check_sessions).
_SESSION_CHECKED: weakref.WeakSet[Engine] = weakref.WeakSet()
# Rounds of that check.
_PROBES = 3


def pooler_error(engine: Engine, moved: str) -> FatalError:
    """The refusal of a pooler that moves a client between server sessions; ``moved`` says
    what showed it."""
    return FatalError(
        f"the database {mask_url(engine.url)} is reached through a connection pooler in "
        f"transaction (or statement) pooling mode, such as PgBouncer with pool_mode = "
        f"transaction ({moved}): dualwrite's writer leases are session advisory locks and need "
        "a server session per client connection. Connect dualwrite directly to PostgreSQL, or "
        "through a pooler in session pooling mode (PgBouncer pool_mode = session); see "
        "docs/operating.md, \"Connection poolers\"")


class Lease:
    """One held lease; :meth:`release` gives it back (idempotent).

    On PostgreSQL ``backend_pid`` names the server session that holds it: a holder checks that
    its connection still runs that very session (:meth:`held_by_session`) before relying on it.
    """

    def __init__(self, transactional_id: str, *, conn: Connection | None = None,
                 files: SessionLocks | None = None, backend_pid: int | None = None) -> None:
        self.transactional_id = transactional_id
        self.backend_pid = backend_pid
        """PostgreSQL: the server process (``pg_backend_pid()``) whose session holds the lock;
        a later transaction of the holding connection that runs on another one was moved by a
        transaction pooler (:func:`pooler_error`)."""
        self._conn = conn
        self._files = files
        """SQLite file: the locks holding the lease's file lock."""

    @property
    def ends_with_connection(self) -> bool:
        """The lease is the connection's (PostgreSQL): losing the connection loses the lease."""
        return self._conn is not None

    def held_by_session(self, backend_pid: int) -> bool:
        """Whether the session answering as ``backend_pid`` (``pg_backend_pid()`` asked on the
        holding connection) is the one that took the lease. A server restart, a terminated
        backend or a pooler handing out another server connection each show as another pid
        (or as a failed question): the lease may then have been someone else's meanwhile."""
        return self._conn is not None and self.backend_pid == backend_pid

    def release(self) -> None:
        """Give the lease back. On PostgreSQL that closes the holding connection: the session
        ends and its lock with it, and nothing of an open transaction there is committed."""
        conn, self._conn = self._conn, None
        files, self._files = self._files, None
        if files is not None:
            files.give_back(self.transactional_id)
        if conn is not None:
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                conn.invalidate()


@dataclass(frozen=True)
class HeldLeases:
    """What :meth:`Leases.hold_free` holds: the ids, and on PostgreSQL the connection whose
    session holds them (free for other work outside a transaction while the block runs)."""

    ids: frozenset[str]
    connection: Connection | None
    backend_pid: int | None = None
    """PostgreSQL: the server process whose session holds them (see :attr:`Lease.backend_pid`)."""


class Leases:
    """Takes writer leases on one database (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._locks = SessionLocks(engine, LEASE_LOCKS)

    @property
    def supported(self) -> bool:
        return self._locks.exclusive

    def check_sessions(self) -> None:
        """Refuse (:class:`FatalError`) a pooler that does not keep a client on one server
        session; PostgreSQL and MariaDB only, once per engine (two connections, a few short
        queries).

        A client connection ``a`` asks for its server's pid and ends its transaction; a second
        client ``b`` opens a transaction and asks too, then ``a`` asks again while ``b`` still
        holds its transaction. Directly or under session pooling ``a`` keeps its server session
        (its pid does not change and ``b`` has another). A transaction pooler gives ``a``'s
        idle session to ``b`` (PgBouncer reuses the last released one) or gives ``a`` another;
        :data:`_PROBES` rounds, so that other clients of a busy pooler taking ``a``'s released
        session in between cannot hide it.
        """
        engine = self._engine
        if not self._locks.on_server or engine in _SESSION_CHECKED:
            return
        pid = self._locks.session_id
        moved: str | None = None
        try:
            with engine.connect() as a, engine.connect() as b:
                if a.connection.dbapi_connection is b.connection.dbapi_connection:
                    return  # a pool of one shared connection (StaticPool): nothing to compare
                first = pid(a)
                a.commit()
                for _ in range(_PROBES):
                    other = pid(b)  # b's transaction stays open
                    if other == first:
                        moved = ("another client connection was served by the same server "
                                 f"session (backend {first})")
                        break
                    again = pid(a)
                    a.commit()
                    b.rollback()
                    if again != first:
                        moved = (f"one client connection was served by backend {first}, then "
                                 f"by {again}")
                        break
                a.rollback()
                b.rollback()
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, engine.url) from exc
        if moved is not None:
            raise pooler_error(engine, moved)
        _SESSION_CHECKED.add(engine)

    def verify_session(self, conn: Connection, backend_pid: int | None) -> None:
        """Raise :func:`pooler_error` unless ``conn``'s current transaction runs on the server
        process ``backend_pid`` (the lease holder's; None: nothing to check)."""
        if backend_pid is None:
            return
        try:
            now = self._locks.session_id(conn)
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, self._engine.url) from exc
        if now != backend_pid:
            raise pooler_error(self._engine, f"the connection holding the leases on backend "
                                             f"{backend_pid} ran a later transaction on {now}")

    def try_acquire(self, conn: Connection, transactional_id: str) -> Lease | None:
        """Take ``transactional_id``'s lease without waiting; None if someone else holds it.

        On PostgreSQL the lease belongs to ``conn``'s session (it survives its transactions).
        """
        return self.try_acquire_many(conn, [transactional_id]).get(transactional_id)

    def try_acquire_many(self, conn: Connection, transactional_ids: Iterable[str]
                         ) -> dict[str, Lease]:
        """:meth:`try_acquire` for many ids (one round trip on PostgreSQL); the ones taken."""
        ids = sorted(set(transactional_ids))
        if not ids or not self.supported:
            return {}
        if not self._locks.on_server:
            return self._file_leases(ids)
        self.check_sessions()
        self._refuse_inherited(conn, ids)
        taken = self._locks.take(ids, conn)
        return {tid: Lease(tid, conn=conn, backend_pid=taken.session)
                for tid in ids if tid in taken.names}

    @contextmanager
    def hold_free(self, engine: Engine, transactional_ids: Iterable[str]) -> Iterator[HeldLeases]:
        """Hold, for the block, the leases of the ids nobody holds.

        Where there are no leases every id is held: no writer can then begin a transaction
        before its row lock, so the row lock alone keeps others out. Recovery works this way:
        it leaves an id whose live writer holds the lease to that writer.
        """
        ids = sorted(set(transactional_ids))
        if not self.supported or not ids:
            yield HeldLeases(frozenset(ids), None)
            return
        self.check_sessions()
        if not self._locks.on_server:
            taken = self._file_leases(ids)
            try:
                yield HeldLeases(frozenset(taken), None)
            finally:
                for lease in taken.values():
                    lease.release()
            return
        try:
            conn = engine.connect()
        except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
            raise unreachable_error(engine.url, exc) from exc
        with conn:
            try:
                taken = self.try_acquire_many(conn, ids)
                conn.commit()  # session-level locks outlive the transaction
            except sa.exc.DBAPIError as exc:
                conn.invalidate()
                raise database_error(exc, engine.url) from exc
            try:
                pids = {lease.backend_pid for lease in taken.values()}
                yield HeldLeases(frozenset(taken), conn, pids.pop() if pids else None)
            finally:
                try:
                    self._locks.unlock_all(conn)
                    conn.commit()
                except sa.exc.SQLAlchemyError:
                    conn.invalidate()  # closing the session releases them

    def still_held_by_its_session(self, conn: Connection, lease: Lease) -> bool:
        """Whether ``lease``'s own server session (:attr:`Lease.backend_pid`) still holds it,
        asked on ``conn``. The holding connection answering from another session while this is
        true was moved by a transaction pooler, not cut off: a lost session loses its locks."""
        if lease.backend_pid is None or not self.supported:
            return False
        try:
            holder = self._locks.holder(conn, lease.transactional_id)
            conn.rollback()
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, self._engine.url) from exc
        return holder is not None and holder == lease.backend_pid

    def _refuse_inherited(self, conn: Connection, ids: list[str]) -> None:
        """Raise :func:`pooler_error` if ``conn``'s server session already holds one of these
        leases: the caller has taken none on this connection, so it inherited another client's
        session (a transaction pooler, or session pooling without ``DISCARD ALL`` between
        clients), where taking the lock would "take" a lease its holder still uses."""
        held, session = self._locks.held_here(conn, ids)
        if held:
            backend = self._locks.backend
            raise pooler_error(
                self._engine, f"a client connection that took no writer lease found {held} "
                f"held by its server session ({backend.session_noun} {session}), left by "
                f"another client{backend.session_reset_hint}")

    def _file_leases(self, ids: list[str]) -> dict[str, Lease]:
        """SQLite file: the leases of the ids whose lock files were free."""
        return {tid: Lease(tid, files=self._locks) for tid in self._locks.take(ids).names}
