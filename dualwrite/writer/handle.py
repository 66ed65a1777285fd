"""The writer's database connection, and the guard that keeps a block from ending its transaction.

``tx.connection`` is the writer's own connection, lent to the block. The block may run any
statement and use savepoints, but the database transaction is the writer's to end: its COMMIT is
the decision, made only after the records are prepared. A ``commit()`` inside the block would
commit rows before the decision; a ``rollback()`` would drop rows whose records still commit.
So, while lent, every way to end or replace the transaction is refused with
:class:`~dualwrite.errors.TransactionStateError` *before* it reaches the database, and the
refusal marks the loan misused: nothing more runs on it, and the writer abandons the whole
transaction (rows and records) when the block ends, even if the application caught the error.
After the block the connection refuses everything until the writer takes it back.

It is a subclass of SQLAlchemy's :class:`~sqlalchemy.engine.Connection` (one object, not a
proxy) so that it is accepted wherever a Connection is (``Session(bind=tx.connection)``,
``pandas.read_sql``) and shares its transaction bookkeeping with the writer. Its public methods
that end a transaction are overridden (refused before SQLAlchemy changes any state); the paths
that bypass them (a ``Transaction`` object's ``commit()``/``rollback()``, which a ``Session``
uses, and raw ``COMMIT``/``ROLLBACK``/``BEGIN`` statements) are caught by SQLAlchemy's
``commit``/``rollback``/``before_cursor_execute`` events, before the driver is called.
"""

from __future__ import annotations

import enum
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine import CursorResult, NestedTransaction, RootTransaction, TwoPhaseTransaction

from dualwrite.errors import TransactionStateError

__all__ = ["GuardedConnection"]

# Raw statements that end, begin or prepare a transaction (``ROLLBACK TO [SAVEPOINT]`` is a
# savepoint's, and allowed).
_TRANSACTION_CONTROL = re.compile(
    r"\s*(?:COMMIT|END|ABORT|BEGIN|START\s+TRANSACTION|PREPARE\s+TRANSACTION"
    r"|ROLLBACK(?!\s+(?:(?:TRANSACTION|WORK)\s+)?TO\b))\b", re.IGNORECASE)


class _Mode(enum.Enum):
    OWNED = "owned"
    """The writer's: anything goes (its lock, state row, COMMIT, rollback)."""
    LENT = "lent"
    """The block's (``tx.connection``): statements and savepoints only."""
    RETURNED = "returned"
    """The block ended: nothing, until the writer takes it back."""


class GuardedConnection(Connection):
    """A Connection that the writer lends to a block (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self._mode = _Mode.OWNED
        self._misuse: TransactionStateError | None = None
        self._own_threads: set[int] = set()
        """Threads running the writer's own statements (:meth:`own_use`), whatever the mode."""
        event.listen(self, "commit", self._on_end)
        event.listen(self, "rollback", self._on_end)
        event.listen(self, "before_execute", self._on_statement)
        event.listen(self, "before_cursor_execute", self._on_execute)

    # -- the writer's side ---------------------------------------------------------------------

    @property
    def misused(self) -> TransactionStateError | None:
        """The refusal, once the block misused the connection it was lent."""
        return self._misuse

    def lend(self) -> None:
        """Hand the connection to the block."""
        self._mode = _Mode.LENT
        self._misuse = None

    def take_back(self) -> TransactionStateError | None:
        """The block ended: the writer's again; the refusal if the block misused it (then its
        transaction must be abandoned, and the connection with it: SQLAlchemy's bookkeeping may
        no longer match the database's)."""
        self._mode = _Mode.OWNED
        misuse, self._misuse = self._misuse, None
        return misuse

    def retire(self) -> None:
        """The transaction is over: refuse a reference the application kept from the block."""
        self._mode = _Mode.RETURNED

    def reclaim(self) -> None:
        """The writer uses the connection again (its next transaction, or closing it)."""
        self._mode = _Mode.OWNED

    @contextmanager
    def own_use(self) -> Iterator[None]:
        """The writer's own statements between transactions (its lease check, which runs on
        its helper thread while the block's thread may retire the connection)."""
        me = threading.get_ident()
        self._own_threads.add(me)
        try:
            yield
        finally:
            self._own_threads.discard(me)

    # -- the guard -------------------------------------------------------------------------------

    def _refuse(self, what: str) -> TransactionStateError:
        if self._mode is _Mode.RETURNED:
            return TransactionStateError(
                f"tx.connection.{what} refused: the dual-write transaction's block has ended; "
                "use the connection of the next `with writer.transaction() as tx:`")
        if self._misuse is not None:
            return TransactionStateError(
                f"tx.connection.{what} refused: this transaction's connection was misused "
                f"({self._misuse.args[0].split(' refused', 1)[0]}); the transaction is "
                "abandoned: leave the block (nothing of it commits)")
        self._misuse = TransactionStateError(
            f"tx.connection.{what} refused: the writer ends the dual-write transaction (leave "
            "the block normally to commit, raise out of it to roll back; use begin_nested() "
            "for a savepoint); the transaction is abandoned: nothing of it commits")
        return self._misuse

    def _guard(self, what: str, *, ends: bool) -> None:
        """Refuse ``what`` if the block may not do it now; ``ends``: it ends or replaces the
        transaction."""
        if self._mode is _Mode.OWNED or threading.get_ident() in self._own_threads:
            return
        if self._mode is _Mode.RETURNED or self._misuse is not None or ends:
            raise self._refuse(what)

    def begin(self) -> RootTransaction:
        self._guard("begin()", ends=True)
        return super().begin()

    def begin_nested(self) -> NestedTransaction:
        self._guard("begin_nested()", ends=False)
        return super().begin_nested()

    def begin_twophase(self, xid: Any | None = None) -> TwoPhaseTransaction:
        self._guard("begin_twophase()", ends=True)
        return super().begin_twophase(xid)

    def commit(self) -> None:
        self._guard("commit()", ends=True)
        super().commit()

    def rollback(self) -> None:
        self._guard("rollback()", ends=True)
        super().rollback()

    def close(self) -> None:
        self._guard("close()", ends=True)
        super().close()

    def invalidate(self, exception: BaseException | None = None) -> None:
        # SQLAlchemy itself invalidates a connection whose driver reported a disconnect: the
        # transaction is lost already, and the writer reports that (DatabaseUnreachableError).
        if not isinstance(exception, self.dialect.loaded_dbapi.Error):
            self._guard("invalidate()", ends=True)
        super().invalidate(exception)

    def exec_driver_sql(self, statement: str, parameters: Any | None = None,
                        execution_options: Any | None = None) -> CursorResult[Any]:
        # Checked before SQLAlchemy's own checks (before_execute does not see this method).
        self._guard("exec_driver_sql()", ends=False)
        return super().exec_driver_sql(statement, parameters, execution_options)

    def detach(self) -> None:
        self._guard("detach()", ends=True)
        super().detach()

    # -- the event listeners (the paths that bypass the methods above) ---------------------------

    def _on_end(self, conn: Connection) -> None:
        """A Transaction object (or a Session) ending the lent connection's transaction."""
        self._guard("get_transaction() commit or rollback", ends=True)

    def _on_statement(self, conn: Connection, *_: Any) -> None:
        """``execute()``, before SQLAlchemy's own checks: refused once misused or returned."""
        self._guard("execute()", ends=False)

    def _on_execute(self, conn: Connection, cursor: Any, statement: str, *_: Any) -> None:
        """A statement, before the driver sees it: refused once misused or returned, and
        refused if it is a raw transaction-control statement."""
        ends = _TRANSACTION_CONTROL.match(statement) is not None
        self._guard(f"execute({statement.strip()[:30]!r})" if ends else "execute()", ends=ends)
