"""The pool for asyncio: each request's statements run in the thread of the writer holding its
connection, awaited by the request's coroutine (:class:`AsyncDualWriterPool`)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from dualwrite.database import create_engine
from dualwrite.database.backends import MariaDB
from dualwrite.errors import (
    DatabaseUnreachableError,
    FatalError,
    RetriableError,
    TransactionStateError,
)
from dualwrite.participant.prepared_state import PreparedTxnState
from dualwrite.writer.pool.pool import DualWriterPool, PoolTransaction
from dualwrite.writer.pool.requests import Call, RecordBuffer, Request

if TYPE_CHECKING:  # importing it at run time needs greenlet, which dualwrite does not
    from sqlalchemy.ext.asyncio import AsyncEngine

_T = TypeVar("_T")
_P = ParamSpec("_P")


#: Async drivers of MariaDB (and MySQL), whose URLs get PyMySQL under the same dialect name.
_ASYNC_MYSQL_DRIVERS = frozenset({"aiomysql", "asyncmy"})


def sync_engine_for(engine: AsyncEngine | Engine | str | sa.URL) -> Engine:
    """A dualwrite engine on the database of ``engine``: an async engine's URL with its sync
    driver (``postgresql+psycopg`` serves both, ``+asyncpg`` becomes it; ``sqlite+aiosqlite``
    becomes ``sqlite``; ``mysql+aiomysql`` / ``+asyncmy`` become ``mysql+pymysql``, and the
    same for ``mariadb+…``)."""
    if isinstance(engine, Engine):
        return engine
    url = sa.make_url(engine) if isinstance(engine, str | sa.URL) else engine.url
    if url.drivername in ("sqlite+aiosqlite", "sqlite+pysqlite"):
        url = url.set(drivername="sqlite")
    elif url.drivername in ("postgresql+asyncpg", "postgresql+psycopg_async"):
        url = url.set(drivername="postgresql+psycopg")
    elif (url.get_backend_name() in MariaDB.dialects
          and url.get_driver_name() in _ASYNC_MYSQL_DRIVERS):
        url = url.set(drivername=f"{url.get_backend_name()}+pymysql")
    return create_engine(url)


class AsyncConnection:
    """The async face of a request's connection: each call runs the sync SQLAlchemy call in the
    writer's thread (which holds the connection) and awaits its result there, so no database
    wait blocks the event loop. Results come back buffered.

    A call cancelled (``asyncio.wait_for``, ``asyncio.timeout``) before the writer's thread
    started it never runs; one cancelled after it reached the database spoils the request: it
    is rolled back and ends with :class:`~dualwrite.errors.TransactionStateError` (see
    :meth:`AsyncDualWriterPool.transaction`)."""

    def __init__(self, run: Callable[[Callable[[Connection], Any]], Any]) -> None:
        self._run = run

    async def run_sync(self, fn: Callable[..., _T], *args: Any, **kw: Any) -> _T:
        """``fn(sync_connection, *args, **kw)`` in the writer's thread."""
        result: _T = await self._run(lambda conn: fn(conn, *args, **kw))
        return result

    async def execute(self, statement: Any, parameters: Any = None, **kw: Any) -> Any:
        return await self.run_sync(lambda c: _buffered(c.execute(statement, parameters, **kw)))

    async def exec_driver_sql(self, statement: str, parameters: Any = None, **kw: Any) -> Any:
        return await self.run_sync(
            lambda c: _buffered(c.exec_driver_sql(statement, parameters, **kw)))

    async def scalar(self, statement: Any, parameters: Any = None, **kw: Any) -> Any:
        return await self.run_sync(lambda c: c.scalar(statement, parameters, **kw))


def _buffered(result: sa.CursorResult[Any]) -> Any:
    """Rows fetched in the writer's thread (the caller reads them in the event loop's)."""
    return result.freeze()() if result.returns_rows else result


class AsyncTransaction(RecordBuffer):
    """The handle of ``AsyncDualWriterPool.transaction()``: ``await tx.connection.execute(...)``
    and ``tx.produce(...)`` (kept, and produced once the block ended without an exception).

    ``state`` and ``decided`` tell the request's outcome, also to a caller that was cancelled
    while it waited for its group's commit (its block had ended, so its work was part of the
    group already: the group goes on without waiting for it; see
    :meth:`AsyncDualWriterPool.transaction`).
    """

    def __init__(self, run: Callable[[Callable[[Connection], Any]], Any],
                 outcome: Callable[[], tuple[bool, PreparedTxnState | None]] | None = None
                 ) -> None:
        super().__init__()
        self.connection = AsyncConnection(run)
        self._outcome = outcome

    @property
    def decided(self) -> bool:
        """Whether the request's outcome is final: committed (``state`` set), or failed or
        rolled back (``state`` None)."""
        return self._outcome is not None and self._outcome()[0]

    @property
    def state(self) -> PreparedTxnState | None:
        """The prepared state of the transaction once the request's rows and records committed
        with it; None while undecided, or if they did not commit."""
        return None if self._outcome is None else self._outcome()[1]


class AsyncDualWriterPool:
    """:class:`DualWriterPool` for asyncio: ``async with pool.transaction() as tx:``.

    ``engine``: an async SQLAlchemy engine, an engine, or a URL; dualwrite runs its own sync
    psycopg (sqlite3, PyMySQL) connections on the same database (:func:`sync_engine_for`:
    asyncpg, psycopg async, aiosqlite, aiomysql and asyncmy engines are understood). Other
    keywords as for :class:`DualWriterPool` (``group_commit`` the same).

    Threads, not an async Kafka client or async driver: the recipe's waits (the row lock, the
    flush, the two commits, the questions after a failure) are the sync ``DualWriter``'s, proven
    by its crash and fault suites; running them in the writers' threads keeps those guarantees
    word for word, and librdkafka does its I/O in its own threads anyway (confluent-kafka's
    asyncio producer is experimental and has no transactions). Each statement of the block runs
    in the thread that holds the writer's connection; the coroutine awaits it, so no Kafka or
    database wait blocks the event loop. With ``group_commit`` the writers' threads take the
    waiting requests as groups (as in the sync pool); without it each request borrows one of
    ``size`` threads for its transaction.

    The pool starts (claims its ids, finishes what they left in doubt) at ``await
    pool.start()``, ``async with pool``, or the first request; ``await pool.close()``.
    """

    def __init__(self, engine: AsyncEngine | Engine | str, kafka_config: Mapping[str, Any],
                 **kw: Any) -> None:
        self._engine_arg = engine
        self._config = dict(kafka_config)
        self._kw = kw
        self._size = int(kw.get("size", 16))
        self._pool: DualWriterPool | None = None
        self._starting: asyncio.Lock | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def pool(self) -> DualWriterPool:
        """The sync pool underneath (after start)."""
        if self._pool is None:
            raise FatalError("AsyncDualWriterPool is not started")
        return self._pool

    async def start(self) -> None:
        if self._pool is not None:
            return
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._pool is None:
                def make() -> DualWriterPool:
                    return DualWriterPool(sync_engine_for(self._engine_arg), self._config,
                                          **self._kw)
                self._pool = await asyncio.to_thread(make)
                if not self._pool.group_commit:
                    self._executor = ThreadPoolExecutor(
                        self._size, thread_name_prefix="dualwrite-async-pool")

    async def __aenter__(self) -> AsyncDualWriterPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.close)
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncTransaction]:
        """One request, atomic on both sides (see :class:`DualWriterPool`).

        However the request ends, the writer goes on with the rest of its group and keeps no
        lock, Kafka transaction or turn for it. A cancellation (a client disconnect,
        ``asyncio.timeout``, a TaskGroup's shutdown) reaches the caller at once, as its own
        ``CancelledError``, without waiting for the writer:

        - while it waits for its turn: it leaves the queue; a writer that took it already rolls
          it back alone.
        - while its block runs (or another interrupt, ``GeneratorExit`` of an abandoned
          block): the writer rolls back its work alone — its savepoint, or the transaction of
          a group's first request, on both sides — without the caller waiting for it.
        - one of its statements (``asyncio.wait_for(tx.connection.execute(...), t)``): a
          statement the writer had not started never runs, and the block may go on; one that
          had reached the database (running, or ran but its result not delivered) spoils the
          request: every later ``tx.connection`` call raises
          :class:`~dualwrite.errors.TransactionStateError`, and at the block's end the request
          is rolled back and raises ``TransactionStateError``, even if the block caught the
          timeout and went on. Nothing of it commits.
        - while it waits for its group's commit (its block ended): its work is part of the
          group already, which goes on and decides it; ``tx.decided`` and ``tx.state`` (the
          prepared state once committed) tell the outcome to a caller that kept ``tx``.
        """
        await self.start()
        pool = self.pool
        ar = _AsyncRequest(asyncio.get_running_loop())
        req = ar.req

        async def run(fn: Callable[[Connection], Any]) -> Any:
            handle = req.handle
            assert handle is not None
            return await ar.in_writer(lambda: fn(handle.connection))

        tx = AsyncTransaction(run, ar.outcome)
        with pool.admitted():
            pool.hand_over(req, self._executor)
            try:
                await ar.wait_turn(pool)
            except BaseException:  # cancelled, or no writer took it in time
                ar.withdraw("its caller stopped waiting for its turn")
                raise
            handle = req.handle
            if handle is None:  # the transaction failed before this request's turn
                assert req.error is not None
                raise req.error
            try:
                yield tx
            except Exception as exc:
                # A spoiled request's exception is most likely this pool's own refusal (a
                # TransactionStateError, which would cost the writer): the writer is told only
                # to roll the request back.
                ar.end_block(exc if ar.spoiled is None else _RequestWithdrawn(ar.spoiled))
                await ar.until_done()
                if isinstance(req.error, DatabaseUnreachableError) \
                        and req.error.__cause__ is exc:
                    raise req.error from exc  # its own statement lost the database
                raise
            except BaseException:  # cancelled in its block: never the writer's interrupt
                ar.withdraw("its caller was cancelled in its block")
                raise
            if ar.spoiled is not None:
                ar.end_block(_RequestWithdrawn(ar.spoiled))
                await ar.until_done()
                raise TransactionStateError(ar.spoiled)

            def produce_all() -> None:  # the writer's handle may take its lock here
                for topic, value, key, partition, headers in tx.records():
                    handle.produce(topic, value, key, partition=partition, headers=headers)

            try:
                if tx.records():
                    await ar.in_writer(produce_all)
            except Exception as exc:
                ar.end_block(exc)
                await ar.until_done()
                raise
            except BaseException:
                ar.withdraw("its caller was cancelled while its records were handed over")
                raise
            ar.end_block(None)
            await ar.until_done()  # cancelled here: the group decides it (tx.state)
        if req.error is not None:
            raise req.error


    async def run(self, fn: Callable[Concatenate[PoolTransaction, _P], _T], /,
                  *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """One request as a sync callable: ``fn(tx, *args, **kwargs)`` runs in a writer's
        thread (its statements are the sync ``tx.connection``'s, its records ``tx.produce``);
        returns what it returned once the request committed on both sides. The cheapest form
        with group commit: the event loop only awaits the outcome. ``fn`` may run twice
        (:meth:`DualWriterPool.run`: it must have no effect outside ``tx``).

        Cancelled before a writer took it, the request leaves the queue and never runs; after,
        it runs and its group decides it without waiting for the caller."""
        await self.start()
        pool = self.pool
        ar = _AsyncRequest(asyncio.get_running_loop(),
                           call=lambda tx: fn(tx, *args, **kwargs))
        req = ar.req
        with pool.admitted():
            pool.hand_over(req, self._executor)
            try:
                await ar.until_done_or_taken(pool)
                await ar.until_done()
            except BaseException:
                req.abandon()
                raise
        if req.error is not None:
            raise req.error
        return cast(_T, req.result)


class _RequestWithdrawn(Exception):
    """What the writer's thread is handed as a request's ``body_error`` when the request's
    caller withdrew it (cancelled, or a statement of it cancelled after it reached the
    database). An ordinary exception, so that the writer rolls back that request alone (its
    savepoint, or the transaction of a group's first request) and goes on with a writer it
    keeps: a ``CancelledError`` there would stop the whole group and replace the writer
    (:func:`breaks_writer`). The caller raises its own exception, never this one."""


class _Call:
    """One call of an async request's block on its way to the writer's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: Literal["pending", "running", "withdrawn"] = "pending"

    def start(self) -> bool:
        """The writer's thread is about to run it; False if its caller withdrew it first."""
        with self._lock:
            if self._state == "withdrawn":
                return False
            self._state = "running"
            return True

    def withdraw(self) -> bool:
        """Its caller gives up on it; False if it started already (it reached the database)."""
        with self._lock:
            if self._state == "running":
                return False
            self._state = "withdrawn"
            return True


class _AsyncRequest:
    """The event loop's side of one request of :meth:`AsyncDualWriterPool.transaction`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, call: Call | None = None) -> None:
        self.loop = loop
        self.changed = asyncio.Event()
        self.req = Request(on_change=lambda: _post(loop, self.changed.set), call=call)
        self.spoiled: str | None = None
        """Why the request can no longer commit: a statement of it was cancelled after it
        reached the database."""
        self.ended = False
        """The block's end was handed to the writer (``None`` in ``req.work``)."""

    def end_block(self, body_error: BaseException | None) -> None:
        """Hand the block's end to the writer (at once, without an await: a second
        cancellation cannot leave the writer waiting); ``body_error``: it failed, roll it
        back."""
        if not self.ended:
            self.ended = True
            self.req.body_error = body_error
            self.req.work.put(None)

    def withdraw(self, why: str) -> None:
        """The caller gives the request up: out of the queue if no writer took it yet, else
        rolled back alone by the writer. Returns at once."""
        if not self.req.abandon():
            self.end_block(_RequestWithdrawn(why))

    async def wait_turn(self, pool: DualWriterPool) -> None:
        """Until a writer runs the request's block; RetriableError (the request abandoned) if
        none took it within ``acquire_timeout_s``."""
        try:
            async with asyncio.timeout(pool.acquire_timeout_s):
                await _until(self.req.turn, self.changed)
            return
        except TimeoutError:
            if self.req.abandon():
                raise RetriableError(
                    f"writer pool {pool.id_prefix}: no writer took the request within "
                    f"{pool.acquire_timeout_s:g} s") from None
        await _until(self.req.turn, self.changed)  # taken meanwhile: its turn comes

    async def until_done_or_taken(self, pool: DualWriterPool) -> None:
        """Until the request's outcome, or for ``acquire_timeout_s`` if no writer took it by
        then (RetriableError, the request abandoned): one wake-up of the loop per call."""
        try:
            async with asyncio.timeout(pool.acquire_timeout_s):
                await self.until_done()
        except TimeoutError:
            if self.req.abandon():
                raise RetriableError(
                    f"writer pool {pool.id_prefix}: no writer took the request within "
                    f"{pool.acquire_timeout_s:g} s") from None

    async def until_done(self) -> None:
        await _until(self.req.done, self.changed)

    async def in_writer(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` in the writer's thread. Cancelled before the writer started it: it never
        runs; after: the request is spoiled (:meth:`AsyncDualWriterPool.transaction`)."""
        if self.ended:
            raise TransactionStateError("tx.connection refused: the request's block has ended")
        if self.spoiled is not None:
            raise TransactionStateError(f"tx.connection refused: {self.spoiled}")
        loop = self.loop
        future: asyncio.Future[_T] = loop.create_future()
        call = _Call()

        def item() -> None:  # in the writer's thread
            if not call.start():
                return  # withdrawn before it started: it never runs, as its caller saw
            try:
                value = fn()
            except BaseException as exc:
                _post(loop, _settle, future, None, exc)
            else:
                _post(loop, _settle, future, value, None)

        self.req.work.put(item)
        try:
            return await future
        except asyncio.CancelledError:
            if not call.withdraw() and self.spoiled is None:
                self.spoiled = (
                    "a statement of this request was cancelled after it had reached the "
                    "database (it ran, or was running, while its caller saw a cancellation or "
                    "timeout); the request is rolled back: nothing of it commits")
            raise

    def outcome(self) -> tuple[bool, PreparedTxnState | None]:
        """(whether the request's outcome is final, the prepared state if it committed)."""
        req = self.req
        if req.abandoned or req.body_error is not None:
            return True, None  # never ran, or rolled back
        if not req.done.is_set():
            return False, None
        if req.error is not None or req.handle is None:
            return True, None
        return True, req.handle.state


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: Any) -> None:
    """``fn(*args)`` in the event loop's thread, from a writer's; nothing if the loop is closed
    (the request's coroutine is gone: nobody waits for it)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _settle(future: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)


async def _until(event: threading.Event, changed: asyncio.Event) -> None:
    while not event.is_set():
        await changed.wait()
        changed.clear()
