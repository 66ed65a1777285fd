"""Group commit: the requests that arrive while the writers are busy share the next transaction
of a free writer, each in a savepoint of its own (the pool's docstring) — except calls
(``pool.run``) in a group of calls only, which run bare and run again should one of them fail."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from dualwrite import metrics
from dualwrite.database import database_error
from dualwrite.errors import DatabaseUnreachableError, DualWriteError, RetriableError
from dualwrite.participant.prepared_state import PreparedTxnState
from dualwrite.writer.dual_writer import DualWriter, DualWriteTransaction
from dualwrite.writer.handle import GuardedConnection
from dualwrite.writer.pool.admission import Admission
from dualwrite.writer.pool.policy import CommitPolicy
from dualwrite.writer.pool.requests import Call, GroupedTransaction, Request
from dualwrite.writer.pool.writers import Slot, breaks_writer

_STOP = object()

_KEPT_SAVEPOINTS = 32
"""How many grouped requests' savepoints a group keeps unreleased at most: PostgreSQL caches 64
subtransactions per session (past that every snapshot of the server gets slower)."""


class _Once:
    """Calls ``fn`` at the first call only."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn: Callable[[], object] | None = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class _CallFailed(Exception):
    """A call run without a savepoint failed: raised out of the group's transaction, which
    rolls it back on both sides, so that the group's other calls run again."""

    def __init__(self, req: Request, error: BaseException) -> None:
        super().__init__("a call of the group failed")
        self.req = req
        self.error = error


class GroupCommit(CommitPolicy):
    """Each writer has a thread that takes the waiting requests as one group (:meth:`_drive`);
    at most ``collectors`` writers take requests at a time while the others commit, so that
    groups grow with the load. A writer whose id was lost is closed by its own thread."""

    grouped = True

    def __init__(self, admission: Admission, slots: list[Slot[DualWriter]],
                 usage: metrics.PoolUsage, *,
                 url: sa.URL, max_group_size: int, collectors: int,
                 acquire_timeout_s: float) -> None:
        self._admission = admission
        self._prefix = admission.id_prefix
        self._all = slots
        self._usage = usage
        self._url = url
        """The database's (for its errors)."""
        self._max_group = max_group_size
        self._acquire_timeout_s = acquire_timeout_s
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._collecting = threading.BoundedSemaphore(collectors)
        """How many writers may take requests into their groups at once (the others commit)."""
        self._drivers: list[threading.Thread] = []

    def start(self) -> None:
        for slot in self._all:
            t = threading.Thread(target=self._drive, args=(slot,), daemon=True,
                                 name=f"dualwrite-pool-{slot.tid}")
            t.start()
            self._drivers.append(t)

    def stop(self, deadline: float) -> list[str]:
        for _ in self._drivers:
            self._requests.put(_STOP)
        for t in self._drivers:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self._drivers if t.is_alive()]

    @contextmanager
    def transaction(self) -> Iterator[GroupedTransaction | DualWriteTransaction]:
        with self._admission.admitted(), self._request() as handle:
            yield handle

    def run(self, call: Call) -> Any:
        with self._admission.admitted():
            req = Request(call=call)
            self._requests.put(req)
            try:
                # One wake-up per request: the outcome, or the timeout for being taken.
                if not req.done.wait(self._acquire_timeout_s) and req.abandon():
                    raise RetriableError(f"writer pool {self._prefix}: no group took the "
                                         f"request within {self._acquire_timeout_s:g} s")
                req.done.wait()
            except BaseException:
                # Interrupted (Ctrl-C): out of the queue if no group took it yet; else its
                # group runs it and decides it without waiting for this thread.
                req.abandon()
                raise
        if req.error is not None:
            raise req.error
        return req.result

    def hand_over(self, req: Request, executor: ThreadPoolExecutor | None) -> None:
        """Into the queue the writers' threads take their groups from."""
        self._requests.put(req)

    @contextmanager
    def _request(self) -> Iterator[GroupedTransaction | DualWriteTransaction]:
        req = Request()
        self._requests.put(req)
        try:
            if not req.turn.wait(self._acquire_timeout_s) and req.abandon():
                raise RetriableError(f"writer pool {self._prefix}: no group took the request "
                                     f"within {self._acquire_timeout_s:g} s")
            req.turn.wait()
        except BaseException as exc:  # interrupted (Ctrl-C) while waiting for its turn
            if not isinstance(exc, RetriableError) and not req.abandon():
                # A group took it: end its block now, as failed, or the group's thread would
                # wait for it forever (and close() for that thread).
                req.body_error = exc
                req.work.put(None)
            raise
        if req.handle is None:  # the group failed before this request's turn
            assert req.error is not None
            raise req.error
        try:
            yield req.handle
        except BaseException as exc:
            req.body_error = exc
            req.work.put(None)
            req.done.wait()
            if req.error is not None and isinstance(req.error, DatabaseUnreachableError) \
                    and req.error.__cause__ is exc:
                raise req.error from exc  # its own statement lost the database
            raise
        req.work.put(None)
        req.done.wait()
        if req.error is not None:
            raise req.error

    def _drive(self, slot: Slot[DualWriter]) -> None:
        """The thread of one writer: take the waiting requests as a group, one transaction."""
        while True:
            slot.rest()
            self._collecting.acquire()
            collected = _Once(self._collecting.release)
            try:
                first = self._requests.get()
                if first is _STOP:
                    return
                if slot.lost:  # leave it to a writer that still holds its id
                    self._requests.put(first)
                    slot.retire("its id was taken by another process")
                    return
                if first.take():
                    self._run_group(slot, first, collected)
            finally:
                collected()

    def _run_group(self, slot: Slot[DualWriter], first: Request,
                   collected: Callable[[], None]) -> None:
        """One group, and its second run should a call run without a savepoint fail
        (:meth:`_run_member`): the others then run again in a new transaction, each inside a
        savepoint this time, so no call runs more than twice."""
        rerun = self._transaction(slot, [first], collected, careful=False)
        if rerun:
            self._transaction(slot, rerun, collected, careful=True)

    def _transaction(self, slot: Slot[DualWriter], taken: list[Request],
                     collected: Callable[[], None], *, careful: bool) -> list[Request]:
        """One transaction of the writer: ``taken`` and, unless ``careful``, the requests that
        wait or arrive meanwhile (up to ``max_group_size``), then ``collected()`` lets another
        writer collect while this one commits. Returns the calls to run again if one of them
        failed where no savepoint could undo it alone (both sides were rolled back)."""
        group: list[Request] = []
        stop = False
        error: BaseException | None = None
        tx: DualWriteTransaction | None = None
        self._usage.taken()
        try:
            writer = slot.current_writer()
            with writer.transaction() as tx:
                if careful:  # calls run before: each in a savepoint now
                    conn = tx.lock()
                    for req in taken:
                        group.append(req)
                        self._run_member(conn, tx, req, number=len(group), bare=False,
                                         keep=len(group) <= _KEPT_SAVEPOINTS)
                else:
                    group.append(taken[0])
                    self._run_first(tx, taken[0])
                    conn = tx.lock()  # (the lock, if the first request did not take it)
                nxt: Request | None = None
                while not careful:
                    while len(group) < self._max_group:
                        try:
                            item = self._requests.get_nowait()
                        except queue.Empty:
                            break
                        if item is _STOP:
                            stop = True
                            break
                        if item.take():
                            nxt = item
                            break
                    if nxt is None:
                        break
                    group.append(nxt)
                    # Calls alone so far: a failure can be undone by running them again.
                    bare = all(r.call is not None for r in group)
                    self._run_member(conn, tx, nxt, number=len(group), bare=bare,
                                     keep=len(group) <= _KEPT_SAVEPOINTS)
                    nxt = None
                collected()
        except _CallFailed as failed:  # both sides rolled back: the others run again
            group.remove(failed.req)
            self._end([failed.req], failed.error, None)
            rerun, group = group, []
        except BaseException as exc:
            error = exc
            if breaks_writer(exc):
                slot.retire(exc)
            rerun = []
        else:
            rerun = []
        slot.ended = time.monotonic()
        self._usage.returned()
        if group:
            metrics.observe_group_size(self._prefix, len(group))
        for req in taken:
            if req not in group and req not in rerun and not req.done.is_set():
                group.append(req)  # the transaction failed before its turn
        state = tx.state if tx is not None and error is None else None
        self._end(group, error, state)
        if stop:
            self._requests.put(_STOP)
        return rerun

    @staticmethod
    def _end(group: list[Request], error: BaseException | None,
             state: PreparedTxnState | None) -> None:
        """Tell each request of a finished transaction its outcome."""
        for req in group:
            failed = error if error is not None else req.own_error
            if req.handle is not None:
                req.handle.state = state if failed is None else None
            req.error = failed
            req.turn.set()  # (a waiter for its turn re-checks it at the done signal)
            req.signal(req.done)

    def _run_first(self, tx: DualWriteTransaction, req: Request) -> None:
        """The group's first request runs on the writer's own handle, as a lone transaction
        would: its records leave at once (while its rows are written, the lock taken late) and,
        with nothing else in the transaction yet, a failure of it ends the transaction (both
        sides rolled back), so it needs no savepoint. Requests join after it, unless it
        misused the connection or went on after a failed statement (then the transaction
        fails before anyone joins)."""
        req.handle = tx
        if req.call is not None:
            req.turn.set()  # started: its caller waits for the outcome only
            req.result = req.call(tx)
        else:
            req.signal(req.turn)
            while (item := req.work.get()) is not None:
                item()
            if req.body_error is not None:
                raise req.body_error
        held, _ = tx.bound()
        if held is not None and held.misused is not None:
            raise held.misused
        failed = held.went_on_after_a_failure() if held is not None else None
        if failed is not None:
            raise failed

    def _run_member(self, conn: GuardedConnection, tx: DualWriteTransaction, req: Request, *,
                    number: int, bare: bool, keep: bool = True) -> None:
        """Run one request inside a savepoint of its own — a block in its caller's thread, a
        call in this one — and produce its records into the group's transaction if it
        succeeded, or roll it back alone if it failed: its exception, a refused statement (the
        connection's guard), a failed statement it went on after, or a record the client would
        refuse (checked before any is sent). ``keep``: leave the savepoint unreleased if it
        succeeded (see below).

        ``bare``: no savepoint (a round trip less per request), for a call in a group of calls
        only: its failure raises :class:`_CallFailed`, which rolls the transaction back on
        both sides, and the group's other calls run again.

        The savepoint is the writer's own statement, not SQLAlchemy's ``begin_nested()``, so
        that nothing the request does to SQLAlchemy's bookkeeping can stop the writer from
        rolling it back. Only a misuse that cost the whole transaction fails the group."""
        savepoint = f"dualwrite_request_{number}"
        if not bare:
            self._own_statement(conn, f"SAVEPOINT {savepoint}")
        handle = req.handle = GroupedTransaction(conn)
        conn.lend_savepoint()
        if req.call is not None:
            req.turn.set()  # started: its caller waits for the outcome only
        else:
            req.signal(req.turn)
        try:
            if req.call is not None:
                try:
                    req.result = req.call(handle)
                except BaseException as exc:
                    req.body_error = exc
            else:
                while (item := req.work.get()) is not None:
                    item()
        finally:
            misuse = conn.end_savepoint_loan()
        if misuse is not None and conn.whole_transaction_lost:
            if bare:  # the writer drops the connection; the others run again
                raise _CallFailed(req, misuse)
            raise misuse
        body_error = req.body_error
        failure: BaseException | None = body_error or misuse
        if failure is None:
            failure = conn.went_on_after_a_failure()
        records = handle.records()
        if failure is None:
            try:
                tx.check(records)
            except DualWriteError as refused:
                failure = refused
        if failure is not None and (lost := self._group_lost(body_error)) is not None:
            raise lost
        if failure is not None and bare:
            raise _CallFailed(req, failure)
        # A savepoint that succeeded is not released: its work commits with the group (the
        # COMMIT ends every savepoint), and a RELEASE would be one more round trip in series
        # per request. The next request's savepoint nests in it, so rolling that one back
        # still undoes that request alone. Past _KEPT_SAVEPOINTS levels they are released
        # again: PostgreSQL caches 64 subtransactions per session.
        if failure is not None:
            self._own_statement(conn, f"ROLLBACK TO SAVEPOINT {savepoint}")
        if not bare and (failure is not None or not keep):
            self._own_statement(conn, f"RELEASE SAVEPOINT {savepoint}")
        if failure is None:
            for topic, value, key, partition, headers in records:
                tx.produce(topic, value, key, partition=partition, headers=headers)
        elif failure is not body_error or req.call is not None:
            # The request fails alone (its group goes on): a block that ended normally all
            # the same, or a call (whose caller is told by the group).
            req.own_error = failure

    def _group_lost(self, body_error: BaseException | None) -> BaseException | None:
        """The error that fails the whole group, if a request's own exception is one: its
        statement lost the database connection, or an interrupt."""
        if isinstance(body_error, sa.exc.DBAPIError):
            typed = database_error(body_error, self._url)
            if isinstance(typed, DatabaseUnreachableError):
                typed.__cause__ = body_error
                return typed
        if body_error is not None and not isinstance(body_error, Exception):
            return body_error
        return None

    def _own_statement(self, conn: GuardedConnection, statement: str) -> None:
        """One of the writer's own statements on the lent connection (a request's
        savepoint)."""
        try:
            with conn.own_use():
                conn.exec_driver_sql(statement)
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, self._url) from exc
