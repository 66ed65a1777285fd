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

Two lines of defence. Before a statement runs, its text is read by a lexer
(:mod:`dualwrite.database.statements`: comments, quoting, several statements in one string) and
one that would end, begin or prepare a transaction, or commit implicitly (MariaDB's DDL), is
refused. After every statement the driver's own transaction state
(:mod:`dualwrite.database.driver_state`, no round trip) is the authority: a statement that left
the transaction anyway (a stored procedure that commits) marks the loan misused *and*
:attr:`GuardedConnection.left_transaction`, so that the writer reports what that statement did
(its rows may be committed without their records) instead of taking it for a plain refusal.

A group commit lends the connection to several requests in turn, each inside a savepoint of its
own (:meth:`GuardedConnection.lend_savepoint`): there a raw savepoint statement is refused too, and
SQLAlchemy's savepoints may be released or rolled back only if the request made them, so that
no request can reach another's work. A refusal there fails that request alone
(:meth:`GuardedConnection.end_savepoint_loan`).

It is a subclass of SQLAlchemy's :class:`~sqlalchemy.engine.Connection` (one object, not a
proxy) so that it is accepted wherever a Connection is (``Session(bind=tx.connection)``,
``pandas.read_sql``) and shares its transaction bookkeeping with the writer. Its public methods
that end a transaction are overridden (refused before SQLAlchemy changes any state); the paths
that bypass them (a ``Transaction`` object's ``commit()``/``rollback()``, which a ``Session``
uses, and raw statements) are caught by SQLAlchemy's ``commit``/``rollback``/
``before_cursor_execute`` events, before the driver is called.
"""

from __future__ import annotations

import enum
import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine import CursorResult, NestedTransaction, RootTransaction, TwoPhaseTransaction
from sqlalchemy.sql.elements import (
    ReleaseSavepointClause,
    RollbackToSavepointClause,
    SavepointClause,
)

from dualwrite.database import backend_for
from dualwrite.database.driver_state import DriverTransaction, driver_transaction
from dualwrite.database.statements import Effect, effect_of, split_statements
from dualwrite.errors import TransactionStateError

__all__ = ["GuardedConnection", "statement_effects"]

_SAVEPOINT_CLAUSES = (SavepointClause, RollbackToSavepointClause, ReleaseSavepointClause)


@functools.lru_cache(maxsize=2048)
def statement_effects(sql: str, dialect: str) -> frozenset[Effect]:
    """The effects of the statements in ``sql`` (cached: an application sends the same texts
    again and again)."""
    family = backend_for(dialect).sql_family
    return frozenset(effect_of(s, family) for s in split_statements(sql, family))


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
        self._left_transaction = False
        self._bookkeeping_lost = False
        """A Transaction object's commit or rollback was refused after SQLAlchemy had begun to
        end it: its view of the transaction no longer matches the database's."""
        self._loan_savepoints: set[str] | None = None
        """While lent within a savepoint of the request's own: the savepoints the request made
        (the only ones it may release or roll back to)."""
        self._own_threads: set[int] = set()
        """Threads running the writer's own statements (:meth:`own_use`), whatever the mode."""
        event.listen(self, "commit", self._on_end)
        event.listen(self, "rollback", self._on_end)
        event.listen(self, "before_execute", self._on_statement)
        event.listen(self, "before_cursor_execute", self._on_execute)
        event.listen(self, "after_cursor_execute", self._after_execute)
        event.listen(self, "rollback_savepoint", self._on_savepoint_end)
        event.listen(self, "release_savepoint", self._on_savepoint_end)

    # -- the writer's side ---------------------------------------------------------------------

    @property
    def misused(self) -> TransactionStateError | None:
        """The refusal, once the block misused the connection it was lent."""
        return self._misuse

    @property
    def left_transaction(self) -> bool:
        """Whether a statement of the block ended the database transaction (the driver said
        so after it ran): what it did, commit or rollback, is for the writer to find out."""
        return self._left_transaction

    @property
    def whole_transaction_lost(self) -> bool:
        """Whether the misuse cost the whole transaction, not only the request that did it: a
        statement left it, or SQLAlchemy's bookkeeping of it no longer matches the database."""
        return self._left_transaction or self._bookkeeping_lost

    def lend(self) -> None:
        """Hand the connection to the block."""
        self._mode = _Mode.LENT
        self._misuse = None
        self._left_transaction = self._bookkeeping_lost = False

    def lend_savepoint(self) -> None:
        """Lend the connection, inside a savepoint the writer just began, to one request of a
        group."""
        self._loan_savepoints = set()

    def end_savepoint_loan(self) -> TransactionStateError | None:
        """That request's block ended: the refusal if it misused the connection, cleared so the
        group goes on once the writer rolled the request's savepoint back — unless the misuse
        cost the whole transaction (:attr:`whole_transaction_lost`), which ends the group too."""
        self._loan_savepoints = None
        misuse = self._misuse
        if not self.whole_transaction_lost:
            self._misuse = None
        return misuse

    def take_back(self) -> TransactionStateError | None:
        """The block ended: the writer's again; the refusal if the block misused it (then its
        transaction must be abandoned, and the connection with it: SQLAlchemy's bookkeeping may
        no longer match the database's)."""
        if self._mode is _Mode.LENT:
            self._check_driver()
        self._mode = _Mode.OWNED
        self._loan_savepoints = None
        misuse, self._misuse = self._misuse, None
        return misuse

    def driver_transaction(self, cursor: Any = None) -> DriverTransaction:
        """The driver's view of the transaction (no round trip; see
        :func:`~dualwrite.database.driver_state.driver_transaction` for ``cursor``)."""
        if self.closed or self.invalidated:
            return DriverTransaction.UNKNOWN
        return driver_transaction(self.connection.dbapi_connection, cursor)

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

    def went_on_after_a_failure(self) -> TransactionStateError | None:
        """The error for a block that caught a failed statement and went on, if it did: on
        PostgreSQL the transaction is aborted then, and a COMMIT would roll it back."""
        if self.driver_transaction() is not DriverTransaction.FAILED:
            return None
        return TransactionStateError(
            "a statement of the block failed and the block went on (the database rolls such a "
            "transaction back); nothing of it committed. Use a savepoint (begin_nested()) "
            "around a statement that may fail")

    def _lent_to_the_block(self) -> bool:
        return self._mode is not _Mode.OWNED and threading.get_ident() not in self._own_threads

    def _guard(self, what: str, *, ends: bool) -> None:
        """Refuse ``what`` if the block may not do it now; ``ends``: it ends or replaces the
        transaction."""
        if not self._lent_to_the_block():
            return
        if self._mode is _Mode.RETURNED or self._misuse is not None or ends:
            raise self._refuse(what)

    def _check_driver(self, cursor: Any = None) -> None:
        """After a statement of the block: did it leave the transaction? (The driver knows.)"""
        if self._left_transaction or self.driver_transaction(cursor) is not DriverTransaction.NONE:
            return
        self._left_transaction = True
        self._misuse = TransactionStateError(
            "tx.connection: a statement of the block ended the database transaction (the "
            "driver reports none open after it); the transaction is abandoned: nothing of it "
            "after that statement commits, and what it wrote before may have been committed "
            "without its records")

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
        # SQLAlchemy itself invalidates a connection whose driver reported a disconnect (the
        # transaction is lost already, and the writer reports that: DatabaseUnreachableError),
        # and one whose statement an exit exception interrupted (KeyboardInterrupt, a task's
        # cancellation): that exception goes on, the transaction abandoned.
        if exception is not None and not isinstance(exception, Exception):
            if self._lent_to_the_block() and self._misuse is None:
                self._misuse = TransactionStateError(
                    f"tx.connection: a statement was interrupted ({type(exception).__name__}) "
                    "and its connection invalidated; the transaction is abandoned: nothing of "
                    "it commits")
        elif not isinstance(exception, self.dialect.loaded_dbapi.Error):
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
        """A Transaction object (or a Session) ending the lent connection's transaction: refused
        before the database sees it, but SQLAlchemy deactivates the object all the same."""
        if self._lent_to_the_block():
            self._bookkeeping_lost = True
        self._guard("get_transaction() commit or rollback", ends=True)

    def _on_statement(self, conn: Connection, *_: Any) -> None:
        """``execute()``, before SQLAlchemy's own checks: refused once misused or returned."""
        self._guard("execute()", ends=False)

    def _on_execute(self, conn: Connection, cursor: Any, statement: str, parameters: Any,
                    context: Any, *_: Any) -> None:
        """A statement, before the driver sees it: refused once misused or returned, and
        refused if it would end the transaction (or, in a request's savepoint, name a
        savepoint)."""
        if not self._lent_to_the_block():
            return
        clause = getattr(getattr(context, "compiled", None), "statement", None)
        if isinstance(clause, _SAVEPOINT_CLAUSES):  # begin_nested() and its end
            self._guard("execute()", ends=False)
            if isinstance(clause, SavepointClause) and self._loan_savepoints is not None:
                self._loan_savepoints.add(clause.ident)  # (the savepoint event has no name)
            return
        self._check_driver()  # a failed statement may have left the transaction
        effects = statement_effects(statement, conn.dialect.name)
        ends = Effect.ENDS in effects or (
            Effect.SAVEPOINT in effects and self._loan_savepoints is not None)
        self._guard(f"execute({statement.strip()[:40]!r})" if ends else "execute()", ends=ends)

    def _after_execute(self, conn: Connection, cursor: Any, *_: Any) -> None:
        if self._lent_to_the_block():
            self._check_driver(cursor)

    def _on_savepoint_end(self, conn: Connection, name: str, context: Any) -> None:
        """A savepoint released or rolled back: in a request's savepoint, only its own."""
        loan = self._loan_savepoints
        if loan is not None and name not in loan and self._lent_to_the_block():
            self._guard(f"savepoint {name!r} (another request's)", ends=True)
