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
the server when that session ends (also when the process dies). SQLite: an exclusive ``flock`` on
a file beside the database file, released by the kernel when the process dies. An in-memory
SQLite database has no leases (one process only): its writers always lock first.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from dualwrite.database import (
    advisory_keys,
    database_error,
    lock_folder,
    try_file_lock,
    unreachable_error,
)
from dualwrite.errors import FatalError

__all__ = ["HeldLeases", "Lease", "Leases"]


class Lease:
    """One held lease; :meth:`release` gives it back (idempotent).

    On PostgreSQL ``backend_pid`` names the server session that holds it: a holder checks that
    its connection still runs that very session (:meth:`held_by_session`) before relying on it.
    """

    def __init__(self, transactional_id: str, *, conn: Connection | None = None,
                 fd: int | None = None, backend_pid: int | None = None) -> None:
        self.transactional_id = transactional_id
        self._conn = conn
        self._fd = fd
        self.backend_pid = backend_pid

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
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock
        if conn is not None:
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                conn.invalidate()


@dataclass(frozen=True)
class HeldLeases:
    """What :meth:`Leases.hold_free` holds: the ids, and on PostgreSQL the connection whose
    session holds them (free for other work outside a transaction while the block runs)."""

    ids: frozenset[str]
    connection: Connection | None


class Leases:
    """Takes writer leases on one database (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self._dialect = engine.dialect.name
        self._dir = lock_folder(engine, ".dualwrite-leases")

    @property
    def supported(self) -> bool:
        return self._dialect == "postgresql" or self._dir is not None

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
        if self._dialect == "postgresql":
            keys = {tid: advisory_keys(b"dualwrite-lease", tid) for tid in ids}
            columns = ", ".join(f"pg_try_advisory_lock({k1}, {k2})" for k1, k2 in keys.values())
            backend_pid, *got = conn.exec_driver_sql(f"SELECT pg_backend_pid(), {columns}").one()
            return {tid: Lease(tid, conn=conn, backend_pid=int(backend_pid))
                    for tid, ok in zip(ids, got, strict=True) if ok}
        return self._try_files(ids)

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
        if self._dialect != "postgresql":
            taken = self._try_files(ids)
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
                held = frozenset(self.try_acquire_many(conn, ids))
                conn.commit()  # session-level locks outlive the transaction
            except sa.exc.DBAPIError as exc:
                conn.invalidate()
                raise database_error(exc, engine.url) from exc
            try:
                yield HeldLeases(held, conn)
            finally:
                try:
                    conn.exec_driver_sql("SELECT pg_advisory_unlock_all()")
                    conn.commit()
                except sa.exc.SQLAlchemyError:
                    conn.invalidate()  # closing the session releases them

    def _try_files(self, ids: list[str]) -> dict[str, Lease]:
        assert self._dir is not None
        taken: dict[str, Lease] = {}
        try:
            for tid in ids:
                fd = try_file_lock(self._dir, tid)
                if fd is not None:
                    taken[tid] = Lease(tid, fd=fd)
        except FatalError:
            for lease in taken.values():
                lease.release()
            raise
        return taken
