"""MariaDB (and MySQL): user locks (``GET_LOCK``), which belong to the session that took them."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection
from sqlalchemy.dialects import mysql

from dualwrite.database.backends.base import Backend, LockSpace

__all__ = ["MariaDB"]

#: Every write of a state row by dualwrite sets ``updated_at`` to this, so that each committed
#: version of a row has a greater ``updated_at`` than every earlier one (a clock that stands
#: still or steps back cannot repeat one): the row's version, by which the outcome of a COMMIT
#: whose answer was lost is read.
_NEXT_VERSION = "GREATEST(UTC_TIMESTAMP(6), updated_at + INTERVAL 1 MICROSECOND)"


class MariaDB(Backend):
    name = "mariadb"
    dialects = frozenset({"mysql", "mariadb"})
    sql_family = "mysql"
    session_locks = True
    session_noun = "connection"
    session_id_sql = "CONNECTION_ID()"
    row_locks = True
    commit_by_row_version = True

    @staticmethod
    def lock_name(space: LockSpace, name: str) -> str:
        """The user-lock name of ``name`` (at most 64 characters)."""
        digest = hashlib.sha256(space.user_lock_salt + name.encode()).hexdigest()
        return space.user_lock_prefix + digest[:40]

    @staticmethod
    def lock_wait_s(timeout_s: float) -> int:
        """innodb_lock_wait_timeout for ``timeout_s``: whole seconds, rounded down so that the
        server answers a held lock before the client's guard gives the connection up
        (``bounded_wait``), at least 1."""
        return max(1, math.floor(timeout_s))

    def statement_wait_options(self, timeout_s: float | None) -> str:
        """``SET STATEMENT`` options bounding one statement's wait for row locks
        (:meth:`lock_wait_s`) and its run (max_statement_time, a little longer), or ``""``."""
        if timeout_s is None:
            return ""
        lock_s = self.lock_wait_s(timeout_s)
        return (f"SET STATEMENT innodb_lock_wait_timeout={lock_s}, "
                f"max_statement_time={lock_s * 1.1 + 0.5:.3f} FOR ")

    @contextmanager
    def session_lock_wait(self, conn: Connection, timeout_s: float | None) -> Iterator[None]:
        """The session's innodb_lock_wait_timeout set for the block (whole seconds), then
        restored to the session's own value."""
        if timeout_s is None:
            yield
            return
        conn.exec_driver_sql("SET @dualwrite_lock_wait = @@SESSION.innodb_lock_wait_timeout, "
                             "SESSION innodb_lock_wait_timeout = "
                             f"{self.lock_wait_s(timeout_s)}")
        try:
            yield
        finally:
            conn.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = @dualwrite_lock_wait")

    def next_version(self) -> Any:
        return sa.literal_column(_NEXT_VERSION)

    def insert_missing(self, table: sa.Table, values: Mapping[str, Any]) -> Any:
        return mysql.insert(table).values(values).prefix_with("IGNORE")

    def upsert(self, table: sa.Table, rows: Sequence[Mapping[str, Any]], key: sa.Column[Any],
               update: Mapping[str, Any]) -> Any:
        return mysql.insert(table).values(list(rows)).on_duplicate_key_update(dict(update))

    def try_lock_columns(self, space: LockSpace, names: Sequence[str]) -> list[str]:
        return [f"GET_LOCK('{self.lock_name(space, name)}', 0) = 1" for name in names]

    def lock_sql(self, space: LockSpace, name: str, timeout_s: float) -> str:
        return f"SELECT GET_LOCK('{self.lock_name(space, name)}', {max(0.0, timeout_s):.3f}) = 1"

    def unlock_sql(self, space: LockSpace, name: str) -> str:
        return f"SELECT RELEASE_LOCK('{self.lock_name(space, name)}')"

    def unlock_all_sql(self) -> str:
        return "SELECT RELEASE_ALL_LOCKS()"

    def holder_sql(self, space: LockSpace, name: str) -> str:
        return f"SELECT IS_USED_LOCK('{self.lock_name(space, name)}')"

    def held_here(self, conn: Connection, space: LockSpace, names: Sequence[str]
                  ) -> tuple[int, int]:
        columns = ", ".join(f"IS_USED_LOCK('{self.lock_name(space, name)}') = CONNECTION_ID()"
                            for name in names)
        *mine, session = conn.exec_driver_sql(f"SELECT {columns}, CONNECTION_ID()").one()
        return sum(1 for m in mine if m), int(session)
