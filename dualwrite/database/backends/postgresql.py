"""PostgreSQL: session and transaction-level advisory locks on two-key pairs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection
from sqlalchemy.dialects import postgresql

from dualwrite.database.backends.base import Backend, LockSpace
from dualwrite.database.locks import advisory_keys

__all__ = ["PostgreSQL"]


class PostgreSQL(Backend):
    name = "postgresql"
    dialects = frozenset({"postgresql"})
    sql_family = "postgresql"
    session_locks = True
    transaction_locks = True
    session_noun = "backend"
    session_id_sql = "pg_backend_pid()"
    row_locks = True
    copy_from_client = True
    session_reset_hint = ("; under session pooling, keep PgBouncer's server_reset_query = "
                          "DISCARD ALL")

    @staticmethod
    def keys(space: LockSpace, name: str) -> tuple[int, int]:
        """The two int4 keys of ``name``'s advisory lock."""
        return advisory_keys(space.advisory_namespace, name)

    def lock_timeout_sql(self, timeout_s: float) -> str:
        return f"SET LOCAL lock_timeout = {max(1, int(timeout_s * 1000))}"

    def insert_missing(self, table: sa.Table, values: Mapping[str, Any]) -> Any:
        return postgresql.insert(table).values(values).on_conflict_do_nothing()

    def upsert(self, table: sa.Table, rows: Sequence[Mapping[str, Any]], key: sa.Column[Any],
               update: Mapping[str, Any]) -> Any:
        return postgresql.insert(table).values(list(rows)).on_conflict_do_update(
            index_elements=[key], set_=dict(update))

    def statement_timeout_sql(self, lock_timeout_s: float) -> str:
        """A wait for a row lock ends as lock_timeout (LockTimeoutError), anything else the
        server is stuck on as statement_timeout."""
        return f"SET LOCAL statement_timeout = {int(lock_timeout_s * 1000 * 1.1) + 1}"

    def try_lock_columns(self, space: LockSpace, names: Sequence[str]) -> list[str]:
        return [f"pg_try_advisory_lock({k1}, {k2})"
                for k1, k2 in (self.keys(space, name) for name in names)]

    def lock_sql(self, space: LockSpace, name: str, timeout_s: float) -> str:
        raise NotImplementedError("PostgreSQL waits for session locks under lock_timeout")

    def unlock_sql(self, space: LockSpace, name: str) -> str:
        k1, k2 = self.keys(space, name)
        return f"SELECT pg_advisory_unlock({k1}, {k2})"

    def unlock_all_sql(self) -> str:
        return "SELECT pg_advisory_unlock_all()"

    def holder_sql(self, space: LockSpace, name: str) -> str:
        return f"SELECT pid FROM pg_locks WHERE granted AND {self._locks_named(space, [name])}"

    def held_here(self, conn: Connection, space: LockSpace, names: Sequence[str]
                  ) -> tuple[int, int]:
        found = conn.exec_driver_sql(
            "SELECT count(*), pg_backend_pid() FROM pg_locks WHERE pid = pg_backend_pid() "
            f"AND {self._locks_named(space, names)}").one()
        return int(found[0]), int(found[1])

    def transaction_lock_sql(self, space: LockSpace, name: str) -> str:
        k1, k2 = self.keys(space, name)
        return f"SELECT pg_advisory_xact_lock({k1}, {k2})"

    def _locks_named(self, space: LockSpace, names: Sequence[str]) -> str:
        """The ``pg_locks`` condition naming these two-key advisory locks (``pg_locks`` shows
        each key as an unsigned 32-bit ``oid``)."""
        pairs = ", ".join(f"({k1 & 0xFFFFFFFF}, {k2 & 0xFFFFFFFF})"
                          for k1, k2 in (self.keys(space, name) for name in names))
        return ("locktype = 'advisory' AND objsubid = 2 "
                f"AND (classid::bigint, objid::bigint) IN ({pairs})")
