"""Write-once mode of a batch sink: each task's rows in a prepared database transaction.

A task COPYs its partition's rows straight into the target table, in a transaction of its own
that it prepares (``PREPARE TRANSACTION``) beside its Kafka transaction; the decision names both
and the commit phase commits both (``COMMIT PREPARED``). Each row is written once, where the
staging mode writes it twice. PostgreSQL with ``max_prepared_transactions`` > 0 only.

A prepared transaction's global id (gid) names its sink, batch, partition and attempt
(``dw:<sink>:<batch>:<partition>:<attempt key>``), so recovery finds a sink's prepared
transactions in ``pg_prepared_xacts`` without knowing the sink's target; its 64-bit transaction
id, recorded with the decision, says whether a gid that is no longer prepared was committed
(``pg_xact_status``), as the anchor does for a Kafka transaction.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from dualwrite.batch.target import ArrowCopy
from dualwrite.database import as_utc, database_error
from dualwrite.errors import (
    DualWriteError,
    InvalidPreparedStateError,
    PreparedRowsLostError,
    PreparedRowsUnreadableError,
    RetriableError,
)
from dualwrite.participant.outcome import Outcome

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "PreparedDatabaseTxn",
    "PreparedTransactions",
    "PreparedWrite",
    "SinkPrepared",
    "gid_prefix",
]

log = logging.getLogger(__name__)

GID_PREFIX = "dw:"
_GID = re.compile(r"dw:[A-Za-z0-9._~-]+:\d+:\d+:[0-9a-f]{1,64}")
_MAX_GID = 199  # PostgreSQL's GIDSIZE is 200 bytes with the terminator
_UNDEFINED_OBJECT = "42704"  # COMMIT/ROLLBACK PREPARED of a gid that is not prepared
_BUSY = "55000"  # ... of a gid another session is finishing right now


def gid_prefix(sink_id: str, batch_id: int | None = None,
               partition_id: int | None = None) -> str:
    """The gid prefix of a sink (of one batch, of one partition of it).

    A long sink id is shortened and made unique by a digest: a gid has 199 bytes at most.
    """
    name = sink_id
    if len(sink_id) > 100:
        name = f"{sink_id[:80]}~{hashlib.sha256(sink_id.encode()).hexdigest()[:16]}"
    prefix = f"{GID_PREFIX}{name}:"
    if batch_id is not None:
        prefix += f"{batch_id}:"
        if partition_id is not None:
            prefix += f"{partition_id}:"
    return prefix


@dataclass(frozen=True)
class PreparedDatabaseTxn:
    """A task's prepared database transaction: its gid and 64-bit transaction id.

    Immutable, validated on creation; round-trips through ``str`` and :meth:`parse`.
    """

    gid: str
    xid: int

    def __post_init__(self) -> None:
        if not _GID.fullmatch(self.gid) or len(self.gid) > _MAX_GID:
            raise InvalidPreparedStateError(self.gid, "not a dualwrite gid")
        if self.xid <= 0:
            raise InvalidPreparedStateError(str(self.xid), "a transaction id is positive")

    @classmethod
    def for_attempt(cls, sink_id: str, batch_id: int, partition_id: int, attempt_key: str,
                    xid: int) -> PreparedDatabaseTxn:
        return cls(f"{gid_prefix(sink_id, batch_id, partition_id)}{attempt_key}", xid)

    def __str__(self) -> str:
        return f"{self.xid}/{self.gid}"

    @classmethod
    def parse(cls, text: str) -> PreparedDatabaseTxn:
        xid, sep, gid = text.partition("/")
        if not sep or not xid.isdigit():
            raise InvalidPreparedStateError(text, "not <xid>/<gid>")
        return cls(gid, int(xid))


@dataclass(frozen=True)
class SinkPrepared:
    """One prepared transaction of a batch sink, as ``pg_prepared_xacts`` lists it."""

    gid: str
    prepared_at: datetime
    owner: str

    def held_s(self, now: datetime | None = None) -> float:
        """How long it has held its rows' locks."""
        return max(0.0, ((now or datetime.now(UTC)) - self.prepared_at).total_seconds())


class PreparedTransactions:
    """The batch sinks' prepared transactions in one database: find, commit, roll back.

    Every statement runs on a connection of its own in autocommit (``COMMIT PREPARED`` cannot
    run inside a transaction block); failures come out as :mod:`dualwrite.errors` types.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._capacity: int | None = None

    def capacity(self) -> int:
        """How many transactions the server can hold prepared at once (PostgreSQL's
        ``max_prepared_transactions``, asked once); 0 where none can be."""
        if self._capacity is None:
            if self.engine.dialect.name != "postgresql":
                self._capacity = 0
            else:
                with self._autocommit() as conn:
                    limit = conn.exec_driver_sql(
                        "SELECT current_setting('max_prepared_transactions')").scalar_one()
                self._capacity = int(limit)
        return self._capacity

    def available(self) -> bool:
        """Whether the database can prepare transactions at all."""
        return self.capacity() > 0

    def list(self, prefix: str = GID_PREFIX) -> list[SinkPrepared]:
        """This database's prepared transactions whose gid starts with ``prefix``, oldest
        first; none where the database cannot prepare any."""
        if not self.available():
            return []
        with self._autocommit() as conn:
            rows = conn.exec_driver_sql(
                "SELECT gid, prepared, owner FROM pg_prepared_xacts "
                "WHERE database = current_database() AND starts_with(gid, %(p)s) "
                "ORDER BY prepared", {"p": prefix}).all()
        return [SinkPrepared(r.gid, as_utc(r.prepared), r.owner) for r in rows]

    def commit(self, transactional_id: str, txn: PreparedDatabaseTxn) -> Outcome:
        """``COMMIT PREPARED``; a gid no longer prepared is asked about by its transaction id.

        Returns COMMITTED, or ALREADY_COMMITTED. Raises :class:`PreparedRowsLostError` when it
        was rolled back (a decided participant is only ever committed by dualwrite: someone
        else rolled it back), :class:`PreparedRowsUnreadableError` when the database no longer knows
        (the id is older than its commit log), a retriable error when the database is away.
        """
        if self._end(txn.gid, commit=True):
            log.info("transactional_id=%s committed prepared database transaction gid=%s",
                     transactional_id, txn.gid)
            return Outcome.COMMITTED
        with self._autocommit() as conn:
            status = conn.exec_driver_sql("SELECT pg_xact_status(%(x)s::xid8)",
                                          {"x": str(txn.xid)}).scalar_one()
        if status == "committed":
            return Outcome.ALREADY_COMMITTED
        if status == "aborted":
            log.error("transactional_id=%s prepared database transaction gid=%s xid=%d was "
                      "rolled back outside dualwrite after the decision", transactional_id,
                      txn.gid, txn.xid)
            raise PreparedRowsLostError(transactional_id, txn.gid,
                                        f"transaction {txn.xid} is aborted")
        if status == "in progress":  # another session is finishing it right now
            raise RetriableError(f"prepared transaction {txn.gid!r} is being finished by "
                                 "another session; retry")
        raise PreparedRowsUnreadableError(
            transactional_id, txn.gid, f"the database reports transaction {txn.xid} as "
            f"{status or 'unknown'}: it is older than the commit log it keeps")

    def still_prepared(self, txns: Sequence[PreparedDatabaseTxn]) -> set[str]:
        """The gids of ``txns`` still prepared and not being rolled back: listed, and their
        transaction still in progress (a ROLLBACK PREPARED marks it aborted before the gid
        leaves the list)."""
        if not txns:
            return set()
        with self._autocommit() as conn:
            rows = conn.exec_driver_sql(
                "SELECT p.gid FROM pg_prepared_xacts p "
                "JOIN unnest(%(g)s::text[], %(x)s::text[]) AS w(gid, xid) ON p.gid = w.gid "
                "WHERE p.database = current_database() "
                "AND pg_xact_status(w.xid::xid8) = 'in progress'",
                {"g": [t.gid for t in txns], "x": [str(t.xid) for t in txns]}).scalars().all()
        return set(rows)

    def rollback(self, gid: str) -> bool:
        """``ROLLBACK PREPARED``; False if the gid was not prepared (any more)."""
        return self._end(gid, commit=False)

    def _end(self, gid: str, *, commit: bool) -> bool:
        if not _GID.fullmatch(gid):  # inlined below: only ids of our own shape
            raise InvalidPreparedStateError(gid, "not a dualwrite gid")
        verb = "COMMIT PREPARED" if commit else "ROLLBACK PREPARED"
        try:
            with self.engine.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                    f"{verb} '{gid}'")
            return True
        except sa.exc.SQLAlchemyError as exc:
            state = getattr(getattr(exc, "orig", None), "sqlstate", None)
            if state == _UNDEFINED_OBJECT:
                return False
            if state == _BUSY:  # e.g. `dualwrite recover` beside the driver: ask again
                raise RetriableError(f"prepared transaction {gid!r} is being finished by another "
                                     "session; retry") from exc
            raise database_error(exc, self.engine.url) from exc

    @contextmanager
    def _autocommit(self) -> Iterator[Connection]:
        try:
            with self.engine.connect() as conn:
                yield conn.execution_options(isolation_level="AUTOCOMMIT")
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, self.engine.url) from exc

    @contextmanager
    def write(self, target: str, columns: Sequence[str], sink_id: str, batch_id: int,
              partition_id: int, attempt_key: str, *, lock_timeout_s: float
              ) -> Iterator[PreparedWrite]:
        """A task's transaction on the target: COPY its rows, then prepare it (or roll back).

        Leaving the block without :meth:`PreparedWrite.prepare` rolls the transaction back.
        A lock held on a target row (a unique key that a prepared, undecided attempt of the
        same partition holds) is waited for ``lock_timeout_s``, then the task fails typed and
        Spark runs it again, which rolls that attempt back first.
        """
        try:
            raw = self.engine.raw_connection()
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, self.engine.url) from exc
        try:
            conn: Any = raw.driver_connection
            with conn.cursor() as cursor:
                cursor.execute("SELECT set_config('lock_timeout', %s, true), "
                               "pg_current_xact_id()::text",
                               (f"{max(1, int(lock_timeout_s * 1000))}ms",))
                xid = int(cursor.fetchone()[1])
                write = PreparedWrite(conn, cursor, target, columns,
                                      PreparedDatabaseTxn.for_attempt(
                                          sink_id, batch_id, partition_id, attempt_key, xid))
                # psycopg holds the connection's lock for a COPY's whole life: the rollback
                # below would wait forever for a COPY left open.
                try:
                    yield write
                except BaseException as exc:
                    write.cancel_copy(exc)
                    raise
                write.end_copy()
            if not write.prepared:
                conn.rollback()
        except BaseException as exc:
            with suppress(Exception):  # the connection may be what failed
                raw.rollback()
            if isinstance(exc, Exception) and not isinstance(exc, DualWriteError) \
                    and _is_database_error(exc):
                raise database_error(exc, self.engine.url) from exc
            raise
        finally:
            raw.close()


class PreparedWrite:
    """One task's open transaction on the target table (see :meth:`PreparedTransactions.write`)."""

    def __init__(self, conn: Any, cursor: Any, target: str, columns: Sequence[str],
                 txn: PreparedDatabaseTxn) -> None:
        self._conn = conn
        self._copy = ArrowCopy(cursor, target, columns)
        self.txn = txn
        self.prepared = False

    @property
    def rows(self) -> int:
        return self._copy.rows

    def write(self, batch: pa.RecordBatch) -> int:
        """COPY ``batch`` into the target (inside the transaction); returns its row count."""
        return self._copy.write(batch)

    def end_copy(self) -> None:
        """End the COPY (the server checks the rows here); nothing if it ended already."""
        self._copy.__exit__(None, None, None)

    def cancel_copy(self, exc: BaseException) -> None:
        """Abandon the COPY after ``exc`` (psycopg sends CopyFail); the transaction is then
        only good for a rollback."""
        with suppress(Exception):
            self._copy.__exit__(type(exc), exc, exc.__traceback__)

    def prepare(self) -> PreparedDatabaseTxn:
        """End the COPY and ``PREPARE TRANSACTION``: the rows wait, locked, for the decision."""
        from psycopg import sql

        self.end_copy()
        self._conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(self.txn.gid)))
        self.prepared = True
        return self.txn


def _is_database_error(exc: BaseException) -> bool:
    """psycopg's errors (the task talks to the driver connection directly)."""
    return type(exc).__module__.startswith(("psycopg", "sqlalchemy"))
