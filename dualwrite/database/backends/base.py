"""What differs between the databases dualwrite runs on: one :class:`Backend` per database.

A backend says how its server names a session, which session locks it has and how they are
taken, waited for and given back, and how a lock of a :class:`LockSpace` is named there. A new
database is one more subclass, registered in :mod:`dualwrite.database.backends`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

__all__ = ["Backend", "LockSpace"]


@dataclass(frozen=True)
class LockSpace:
    """One kind of named lock (writer leases, pool slots, sink decisions) and how its names map
    onto each backend's locks. The derived keys, names and folders are what running processes
    lock: changing them lets an old and a new version hold the same lock at once."""

    advisory_namespace: bytes
    """PostgreSQL: the namespace hashed with a name into a two-key advisory lock."""
    user_lock_prefix: str
    """MariaDB: the start of the user-lock name (a hash of the name follows)."""
    user_lock_salt: bytes
    """MariaDB: bytes hashed before the name (empty for most spaces)."""
    folder_suffix: str
    """SQLite: the folder of lock files beside the database file (``<db><suffix>``)."""


class Backend:
    """The database-specific parts dualwrite needs; this base is a database without session
    locks (every lock method is then unused)."""

    name = "database"
    dialects: frozenset[str] = frozenset()
    """SQLAlchemy's dialect names served by this backend."""
    sql_family = ""
    """The SQL dialect its statements are split and classified in
    (:mod:`dualwrite.database.statements`)."""
    single_writer = False
    """Whether one write lock serves the whole database, taken at ``BEGIN IMMEDIATE``."""
    session_locks = False
    """Whether the server has named locks that belong to a session and end with it."""
    transaction_locks = False
    """Whether the server has named locks that end with the transaction (see
    :meth:`transaction_lock_sql`)."""
    session_noun = "session"
    """What the server's session number is called in messages."""
    session_id_sql = ""
    """The SQL expression naming the server session of a connection."""
    copy_from_client = False
    """Whether rows can be streamed in with ``COPY ... FROM STDIN`` (PostgreSQL's)."""
    row_locks = False
    """Whether ``SELECT ... FOR UPDATE`` locks rows (SQLite: one write lock serves instead)."""
    commit_by_row_version = False
    """Whether the outcome of a COMMIT whose answer was lost is read from the session that ran
    it and the state row version it wrote (:meth:`next_version`), the server having no
    transaction status to ask by id (MariaDB)."""
    failed_commit_rolled_back = False
    """Whether a COMMIT that raised is known not to have been applied: SQLite commits
    atomically, and a failed COMMIT leaves the transaction open (busy) or rolls it back."""
    session_reset_hint = ""
    """Appended to the refusal of a session that inherited another client's session locks: how
    a pooler of this database resets sessions between clients."""

    def lock_folder(self, engine: Engine, suffix: str) -> Path | None:
        """The folder of lock files beside the database (files instead of server locks); None
        where locks live in the server, or where there is nothing to lock against."""
        return None

    def lock_timeout_sql(self, timeout_s: float) -> str | None:
        """The statement bounding this transaction's waits for locks; None if there is none."""
        return None

    def insert_missing(self, table: sa.Table, values: Mapping[str, Any]) -> Any:
        """An INSERT of ``values`` that does nothing where the row exists (and never waits for
        an existing row's lock)."""
        raise NotImplementedError

    def upsert(self, table: sa.Table, rows: Sequence[Mapping[str, Any]], key: sa.Column[Any],
               update: Mapping[str, Any]) -> Any:
        """An INSERT of ``rows`` whose conflicts on the unique ``key`` set ``update`` instead
        (one statement, rows upserted in the order given); it can take ``RETURNING``."""
        raise NotImplementedError

    def statement_timeout_sql(self, lock_timeout_s: float) -> str | None:
        """The statement bounding each statement of this transaction a little past
        ``lock_timeout_s``; None if there is none."""
        return None

    def statement_wait_options(self, timeout_s: float | None) -> str:
        """What goes before one statement to bound its waits for row locks by ``timeout_s``,
        where the statement itself can say so (MariaDB's ``SET STATEMENT``); else ``""``."""
        return ""

    @contextmanager
    def session_lock_wait(self, conn: Connection, timeout_s: float | None) -> Iterator[None]:
        """Bound ``conn``'s session's waits for row locks by ``timeout_s`` for the block, where
        only the session's setting can (MariaDB); nothing elsewhere."""
        yield

    def tuple_insert_sql(self, table: str, columns: Sequence[str]) -> str | None:
        """A driver-level INSERT into ``columns`` for an ``executemany`` of plain tuples, where
        that is faster than SQLAlchemy's insert of dictionaries (SQLite); None elsewhere."""
        return None

    def next_version(self) -> Any:
        """The ``updated_at`` a write of a state row stores."""
        return datetime.now(UTC)

    def try_lock_columns(self, space: LockSpace, names: Sequence[str]) -> list[str]:
        """One SELECT column per name, true when its session lock was taken without waiting."""
        raise NotImplementedError

    def lock_sql(self, space: LockSpace, name: str, timeout_s: float) -> str:
        """A SELECT of one column, true when the session lock was taken within ``timeout_s``."""
        raise NotImplementedError

    def unlock_sql(self, space: LockSpace, name: str) -> str:
        """Gives one session lock back."""
        raise NotImplementedError

    def unlock_all_sql(self) -> str:
        """Gives every session lock of the session back."""
        raise NotImplementedError

    def holder_sql(self, space: LockSpace, name: str) -> str:
        """A SELECT of the session number holding the lock (no row, or NULL, when free)."""
        raise NotImplementedError

    def held_here(self, conn: Connection, space: LockSpace, names: Sequence[str]
                  ) -> tuple[int, int]:
        """How many of these locks ``conn``'s session holds, and its session number."""
        raise NotImplementedError

    def transaction_lock_sql(self, space: LockSpace, name: str) -> str:
        """Waits for a lock held until the transaction ends (:attr:`transaction_locks`)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<backend {self.name}>"
