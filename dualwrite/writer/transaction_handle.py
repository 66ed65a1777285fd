"""The handle a transaction's block gets (``with writer.transaction() as tx:``): its database
connection and ``produce``, and the context manager that opens it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from sqlalchemy import Connection

from dualwrite.errors import TransactionStateError
from dualwrite.participant.prepared_state import PreparedTxnState
from dualwrite.participant.producer import Headers, TwoPhaseProducer
from dualwrite.writer.handle import GuardedConnection

__all__ = ["DualWriteTransaction", "LateLock", "Record", "TransactionContext",
           "transaction_context"]

Record = tuple[str, bytes | str | None, bytes | str | None, int | None, Headers | None]
"""One produced record: (topic, value, key, partition, headers)."""

LateLock = Callable[[TwoPhaseProducer, Sequence[Record]],
                    tuple[GuardedConnection, TwoPhaseProducer]]
"""Takes a transaction's deferred state-row lock, given its producer and the records it sent
before; returns the connection and producer the transaction goes on with (both new if it had to
start over). Raises, with nothing of the transaction left open under a new producer, if it
cannot."""


_T = TypeVar("_T")
_P = ParamSpec("_P")


class _NotATransactionError(TransactionStateError, AttributeError):
    """A transaction's call made on ``transaction()``'s context manager (``with`` forgotten);
    an AttributeError too, so that ``hasattr`` and ``getattr(x, name, default)`` still work."""


class TransactionContext(contextlib.AbstractContextManager[_T]):
    """What ``transaction()`` returns: a context manager whose ``with`` opens the transaction.
    A transaction's call made on it instead (``w.transaction().produce(...)``) raises
    :class:`~dualwrite.errors.TransactionStateError` saying to use ``with``."""

    def __init__(self, inner: contextlib.AbstractContextManager[_T], what: str) -> None:
        self._inner = inner
        self._what = what

    def __enter__(self) -> _T:
        return self._inner.__enter__()

    def __exit__(self, *exc: Any) -> bool | None:
        return self._inner.__exit__(*exc)

    if not TYPE_CHECKING:  # at run time only: type checkers still flag the misuse
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            raise _NotATransactionError(
                f"{self._what}() returns a context manager, not the transaction: write "
                f"`with {self._what}() as tx:` and call tx.{name} inside the block")


def transaction_context(what: str) -> Callable[[Callable[_P, Iterator[_T]]],
                                              Callable[_P, TransactionContext[_T]]]:
    """``@contextmanager`` for ``transaction()`` methods: returns a :class:`TransactionContext`
    (named ``what`` in its misuse message)."""
    def decorate(fn: Callable[_P, Iterator[_T]]) -> Callable[_P, TransactionContext[_T]]:
        managed = contextmanager(fn)

        @functools.wraps(fn)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> TransactionContext[_T]:
            return TransactionContext(managed(*args, **kwargs), what)
        return wrapper
    return decorate



class DualWriteTransaction:
    """Handle for the body of ``DualWriter.transaction()``: a DB connection and ``produce``.

    Once a writer's session is established it begins with no connection and a ``late_lock``
    (:data:`LateLock`), taken at the block's first record or first use of :attr:`connection`.
    The connection is lent to the block (:class:`~dualwrite.writer.handle.GuardedConnection`):
    ending its transaction there is refused and abandons the transaction; after the block the
    handle refuses everything.
    """

    def __init__(self, connection: GuardedConnection | None, producer: TwoPhaseProducer,
                 late_lock: LateLock | None = None) -> None:
        self._connection = connection
        self._producer = producer
        self._late_lock = late_lock
        self._records: list[Record] = []
        """Every record of the transaction, sent again should it start over in a new session."""
        self._ended = False
        self._misuse: TransactionStateError | None = None
        self.state: PreparedTxnState | None = None
        """The prepared state, set once the block has prepared (for logging and tests)."""
        if connection is not None:
            connection.lend()

    @property
    def connection(self) -> Connection:
        """The SQLAlchemy connection of the database transaction; write your rows with it.

        The first use may take the state-row lock (unless a record was produced first, which
        takes it instead, while the record travels). It refuses ``commit()``, ``rollback()``,
        ``begin()``, ``close()`` and the like (:class:`TransactionStateError`): the writer
        ends the transaction; savepoints (``begin_nested()``) are fine.
        """
        self._refuse_if_ended("connection")
        self._take_late_lock()
        assert self._connection is not None
        return self._connection

    def produce(self, topic: str, value: bytes | str | None = None,
                key: bytes | str | None = None, *, partition: int | None = None,
                headers: Headers | None = None) -> None:
        """Send a record in this transaction; it becomes visible iff the rows commit."""
        self._refuse_if_ended("produce()")
        if self._connection is not None and self._connection.misused is not None:
            raise TransactionStateError(
                "tx.produce() refused: this transaction's connection was misused; the "
                "transaction is abandoned: leave the block (nothing of it commits)")
        self._producer.produce(topic, value, key, partition=partition, headers=headers)
        self._records.append((topic, value, key, partition, headers))
        if self._late_lock is not None:
            # The first record is on its way (AddPartitionsToTxn first): lock now.
            self._take_late_lock()

    def records(self) -> tuple[Record, ...]:
        """The records produced so far, in order."""
        return tuple(self._records)

    def check(self, records: Sequence[Record]) -> None:
        """Raise what :meth:`produce` would raise for the first of ``records`` that the client
        refuses by itself, sending none of them (a group's request, before its records join)."""
        for topic, value, key, partition, _ in records:
            self._producer.check_record(topic, value, key, partition=partition)

    def bound(self) -> tuple[GuardedConnection | None, TwoPhaseProducer]:
        """The connection (None until the deferred lock is taken) and the producer the
        transaction uses now, without taking the lock: what the DualWriter ends it with."""
        return self._connection, self._producer

    def end(self) -> None:
        """The block is over: the handle refuses from now on, and the writer takes its
        connection back (see :attr:`misuse`)."""
        if not self._ended:
            self._ended = True
            if self._connection is not None:
                self._misuse = self._connection.take_back()

    @property
    def misuse(self) -> TransactionStateError | None:
        """What the block was refused, if it misused the connection (after :meth:`end`)."""
        return self._misuse

    def lock(self) -> GuardedConnection:
        """The connection, taking the deferred lock if the block did not (for the writer)."""
        self._take_late_lock()
        assert self._connection is not None
        return self._connection

    def _refuse_if_ended(self, what: str) -> None:
        if self._ended:
            raise TransactionStateError(
                f"tx.{what} refused: the dual-write transaction's block has ended; use the "
                "handle of the next `with writer.transaction() as tx:`")

    def _take_late_lock(self) -> None:
        late_lock, self._late_lock = self._late_lock, None
        if late_lock is not None:
            self._connection, self._producer = late_lock(self._producer, self.records())
            if not self._ended:
                self._connection.lend()
