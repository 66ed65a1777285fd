"""DualWriterPool: many requests at once over a bounded set of transactional ids.

A service serves tens of requests at once; one :class:`DualWriter` serves one at a time, and one
transactional id's back-to-back transactions are bounded by the broker (FACTS.md: about 29 ms).
The pool owns ``size`` writers, one per transactional id ``{id_prefix}-{n}``, and hands one to each
request; with ``group_commit`` the requests that arrive while the writers are busy share the next
transaction of a free writer: one prepare, one state row, one COMMIT and one EndTxn serve the
group, each request's rows in a savepoint of their own and its records produced only after its
block succeeded.

Ids per process (docs/design.md, "The writer pool"): a pool takes the lowest numbers ``n`` whose
*pool slot* is free — a session-level PostgreSQL advisory lock (an SQLite ``flock`` beside the
database file) held for the pool's life by a connection of its own, released by the server or
kernel when the process dies. Several processes with one prefix therefore never run the same id,
and the ids of all processes stay in ``{prefix}-0 .. {prefix}-{total size - 1}``: a restarted
process takes the numbers its predecessor left. At start the pool finishes what the prefix's other
free ids left in doubt (a pool that shrank, a process that died and was not replaced) with one
empty transaction each, and its own ids with their first (warm-up) transaction; ``dualwrite
recover`` finds them all too (every id that ever ran has a state row).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import queue
import re
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from dualwrite import metrics
from dualwrite.database import (
    advisory_keys,
    create_engine,
    database_error,
    is_mysql,
    lock_folder,
    try_file_lock,
    unreachable_error,
)
from dualwrite.errors import (
    DatabaseUnreachableError,
    DualWriteError,
    FatalError,
    LockTimeoutError,
    RetriableError,
    TransactionConflictError,
    TransactionStateError,
)
from dualwrite.participant.prepared_state import PreparedTxnState
from dualwrite.participant.producer import Headers
from dualwrite.writer.dual_writer import (
    DualWriter,
    DualWriteTransaction,
    HeuristicHook,
    PhaseHooks,
    transaction_context,
)
from dualwrite.writer.handle import GuardedConnection
from dualwrite.writer.state_store import StateStore

if TYPE_CHECKING:  # importing it at run time needs greenlet, which dualwrite does not
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = [
    "AsyncConnection",
    "AsyncDualWriterPool",
    "AsyncTransaction",
    "DualWriterPool",
    "GroupedTransaction",
    "breaks_writer",
    "sync_engine_for",
]

log = logging.getLogger(__name__)

_SLOT_NAMESPACE = b"dualwrite-pool-slot"
_Record = tuple[str, bytes | str | None, bytes | str | None, int | None, Headers | None]

# Errors after which a writer stays usable: nothing of its session or connection is in question.
_WRITER_SURVIVES = (LockTimeoutError, TransactionConflictError)


def breaks_writer(exc: BaseException) -> bool:
    """Whether a writer that raised ``exc`` from its transaction must be replaced.

    An application's own exception (its ``IntegrityError``, a ``ValueError``) was rolled back on
    both sides and leaves the writer as it was. Every dualwrite error but a lock timeout or a
    conflict may leave the writer's session fenced, its connection gone or a heuristic outcome
    pending: the pool closes that writer and makes a new one for the id, whose first transaction
    claims the id and finishes what is in doubt. A ``BaseException`` that is not an ``Exception``
    (an interrupt) may have stopped the writer anywhere: replaced too.
    """
    if isinstance(exc, DualWriteError):
        return not isinstance(exc, _WRITER_SURVIVES)
    return not isinstance(exc, Exception)


def _slot_lock_name(transactional_id: str) -> str:
    """MariaDB: the user-lock name of a pool slot (at most 64 characters)."""
    return "dualwrite-pool-" + hashlib.sha256(
        _SLOT_NAMESPACE + b"\0" + transactional_id.encode()).hexdigest()[:40]


class _Slots:
    """This process's hold on pool slots: which ids of a prefix are its own (module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        # MariaDB's session user locks (GET_LOCK) serve as PostgreSQL's advisory locks do.
        self._mysql = is_mysql(engine)
        self._dialect = "postgresql" if self._mysql else engine.dialect.name
        self._dir = lock_folder(engine, ".dualwrite-pool")
        self._conn: Connection | None = None
        self._fds: dict[str, int] = {}
        self.held: set[str] = set()

    @property
    def exclusive(self) -> bool:
        """Whether slots exclude other processes (not for an in-memory SQLite database)."""
        return self._dialect == "postgresql" or self._dir is not None

    def take(self, ids: list[str]) -> set[str]:
        """Take the free ones of ``ids``, without waiting; the ones taken."""
        if not self.exclusive:
            got = set(ids)
        elif self._dialect == "postgresql":
            got = self._take_pg(ids)
        else:
            assert self._dir is not None
            got = set()
            for tid in ids:
                fd = try_file_lock(self._dir, tid)
                if fd is not None:
                    self._fds[tid] = fd
                    got.add(tid)
        self.held |= got
        return got

    def _take_pg(self, ids: list[str]) -> set[str]:
        if self._conn is None:
            try:
                self._conn = self._engine.connect()
            except sa.exc.SQLAlchemyError as exc:
                raise unreachable_error(self._engine.url, exc) from exc
        if self._mysql:
            columns = ", ".join(f"GET_LOCK('{_slot_lock_name(tid)}', 0) = 1" for tid in ids)
        else:
            keys = [advisory_keys(_SLOT_NAMESPACE, tid) for tid in ids]
            columns = ", ".join(f"pg_try_advisory_lock({k1}, {k2})" for k1, k2 in keys)
        try:
            got = self._conn.exec_driver_sql(f"SELECT {columns}").one()
            self._conn.commit()  # session-level locks outlive the transaction
        except sa.exc.SQLAlchemyError as exc:
            self._lose_connection()
            raise database_error(exc, self._engine.url) from exc
        return {tid for tid, ok in zip(ids, got, strict=True) if ok}

    def give_back(self, tid: str) -> None:
        """Release one slot (an id the pool only borrowed to finish it)."""
        self.held.discard(tid)
        fd = self._fds.pop(tid, None)
        if fd is not None:
            os.close(fd)
        elif self._conn is not None:
            k1, k2 = advisory_keys(_SLOT_NAMESPACE, tid)
            unlock = (f"SELECT RELEASE_LOCK('{_slot_lock_name(tid)}')" if self._mysql
                      else f"SELECT pg_advisory_unlock({k1}, {k2})")
            try:
                self._conn.exec_driver_sql(unlock)
                self._conn.commit()
            except sa.exc.SQLAlchemyError:
                self._lose_connection()

    def still_held(self) -> bool:
        """Whether the slots are still this process's: on PostgreSQL, whether the session
        holding them is alive (a server restart ends it, and the locks with it)."""
        if self._dialect != "postgresql" or not self.held:
            return True
        if self._conn is None:
            return False
        try:
            self._conn.exec_driver_sql("SELECT 1").one()
            self._conn.commit()
        except sa.exc.SQLAlchemyError:
            self._lose_connection()
            return False
        return True

    def _lose_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                conn.invalidate()
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                conn.close()

    def release_all(self) -> None:
        self.held.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.exec_driver_sql("SELECT RELEASE_ALL_LOCKS()" if self._mysql
                                     else "SELECT pg_advisory_unlock_all()")
                conn.commit()
                conn.close()
            except sa.exc.SQLAlchemyError:
                self._lose_connection()
                with contextlib.suppress(sa.exc.SQLAlchemyError):
                    conn.invalidate()


class _Slot:
    """One transactional id of the pool and its current writer (None until made, or after the
    last one broke)."""

    def __init__(self, tid: str) -> None:
        self.tid = tid
        self.writer: DualWriter | None = None
        self.ended = 0.0
        """When its last transaction ended (``time.monotonic()``)."""
        self.lost = False
        """The slot lock was lost (its session ended) and could not be taken again: the id may
        now be another process's, so this pool stops using it."""


class _RecordBuffer:
    """A request's records, kept until its block has ended without an exception."""

    def __init__(self) -> None:
        self._records: list[_Record] = []

    def produce(self, topic: str, value: bytes | str | None = None,
                key: bytes | str | None = None, *, partition: int | None = None,
                headers: Headers | None = None) -> None:
        """Add a record to this request; it becomes visible iff the request's rows commit."""
        self._records.append((topic, value, key, partition, headers))

    def records(self) -> tuple[_Record, ...]:
        """The records produced so far, in order."""
        return tuple(self._records)


class GroupedTransaction(_RecordBuffer):
    """The handle of one request of a group commit: the same calls as
    :class:`~dualwrite.writer.DualWriteTransaction` (``connection``, ``produce``, ``records``,
    ``state``).

    ``connection`` is the group's database connection, inside a savepoint of this request's own
    (valid only inside the block); records are kept here and produced into the group's Kafka
    transaction once the block has ended without an exception, so a request that fails sends
    nothing.
    """

    def __init__(self, connection: Connection) -> None:
        super().__init__()
        self._connection = connection
        self.state: PreparedTxnState | None = None
        """The group's prepared state, once it committed."""

    @property
    def connection(self) -> Connection:
        """The SQLAlchemy connection of the group's database transaction (this request's
        savepoint); write your rows with it."""
        return self._connection


class _Request:
    """One request waiting for, running in, or waiting on the outcome of a group."""

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self.lock = threading.Lock()
        self.turn = threading.Event()
        self.work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        """What the writer's thread runs for the request's block (the async pool's statements);
        None: the block has ended."""
        self.done = threading.Event()
        self.on_change = on_change
        """Called (in the writer's thread) after ``turn`` or ``done`` is set."""
        self.handle: GroupedTransaction | DualWriteTransaction | None = None
        self.body_error: BaseException | None = None
        self.own_error: BaseException | None = None
        """Why the request failed alone although its block ended normally (its group went
        on): a refused statement it caught, a failed one it went on after, a refused record."""
        self.error: BaseException | None = None
        self.abandoned = False
        self.taken = False

    def signal(self, event: threading.Event) -> None:
        event.set()
        if self.on_change is not None:
            self.on_change()

    def take(self) -> bool:
        """The driver takes the request into its group; False if its caller gave up waiting."""
        with self.lock:
            if self.abandoned:
                return False
            self.taken = True
            return True

    def abandon(self) -> bool:
        """The caller gives up waiting for its turn; False if a group took it already."""
        with self.lock:
            if self.taken:
                return False
            self.abandoned = True
            return True


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


class DualWriterPool:
    """A thread-safe pool of :class:`DualWriter` over ids ``{id_prefix}-{n}`` (module docstring).

    ``with pool.transaction() as tx:`` runs one request atomically, with the calls of a
    ``DualWriter`` transaction (``tx.connection``, ``tx.produce``). Without ``group_commit`` each
    request runs its own transaction on a writer of its own, waiting up to ``acquire_timeout_s``
    for one to be free (then :class:`~dualwrite.errors.RetriableError`). With ``group_commit``
    (default; see bench/README.md for the measurements) each of the ``size`` writers has a
    thread that takes the waiting requests as one group: the request's block still runs in the
    caller's thread (its context variables, its exceptions), on the group's connection — the
    first request of a group on the writer's own handle, the others inside a savepoint each — one
    request after the other; it returns once the group committed on both sides.
    At most ``collectors`` writers (default ``size // 4``) take requests at a time while the
    others commit, so that groups grow with the load.
    A request whose block raises is rolled back alone (its savepoint; its records never leave)
    and gets its exception; a failure of the group's prepare or commit reaches each of its
    requests as the same typed error. ``max_group_size`` bounds a group (and the time its first
    request waits).

    A writer that raised a dualwrite error (fenced, heuristic outcome, database or broker gone;
    :func:`breaks_writer`) is closed and replaced by a new one for the same id before the next
    request. :meth:`close` waits for the running transactions, closes every writer (clearing
    their state rows) and releases the ids.

    ``DualWriter`` keywords (``timeout_s``, ``on_heuristic_abort``, ``verify``, ``hooks``) apply
    to every writer. Kafka: ``kafka_config`` without ``transactional.id``. ``max_ids`` bounds the
    numbers a pool may take; ``warm_up`` runs each writer's first transaction at start;
    ``rest_s`` is the least time between one writer's transactions (:meth:`_rest`).
    """

    def __init__(self, engine: Engine | str, kafka_config: Mapping[str, Any], *,
                 id_prefix: str = "dualwrite", size: int = 16, group_commit: bool = True,
                 max_group_size: int = 32, acquire_timeout_s: float = 30.0,
                 timeout_s: float = 30.0, on_heuristic_abort: HeuristicHook | None = None,
                 verify: Literal["auto", "always"] = "auto", hooks: PhaseHooks | None = None,
                 max_ids: int = 1024, warm_up: bool = True, rest_s: float = 0.01,
                 collectors: int | None = None) -> None:
        if size < 1 or max_group_size < 1:
            raise ValueError("size and max_group_size must be at least 1")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", id_prefix):
            raise ValueError("id_prefix may hold letters, digits, '.', '_' and '-' only")
        if "transactional.id" in kafka_config:
            raise ValueError("the pool names its transactional ids itself (id_prefix)")
        try:
            self._engine = create_engine(engine) if isinstance(engine, str) else engine
        except (sa.exc.ArgumentError, ValueError) as exc:  # the text may show the password
            raise FatalError("DualWriterPool: the database URL (not shown: it may hold a "
                             "password) is not valid, or its driver is not installed "
                             f"({type(exc).__name__})") from None
        self._config = dict(kafka_config)
        self._prefix = id_prefix
        self._group_commit = group_commit
        self._max_group = max_group_size
        self._acquire_timeout_s = acquire_timeout_s
        self._rest_s = rest_s
        self._writer_kw: dict[str, Any] = {
            "timeout_s": timeout_s, "on_heuristic_abort": on_heuristic_abort,
            "verify": verify, "hooks": hooks}
        self._store = StateStore(self._engine)
        self._lock = threading.Lock()
        self._free_changed = threading.Condition(self._lock)
        self._free: deque[_Slot] = deque()
        self._busy = 0
        self._closed = False
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._collecting = threading.BoundedSemaphore(collectors or max(1, size // 4))
        """How many writers may take requests into their groups at once (the others commit)."""
        self._drivers: list[threading.Thread] = []
        self._slots = _Slots(self._engine)
        try:
            ids = self._take_ids(size, max_ids)
            self._all = [_Slot(tid) for tid in ids]
            self._finish_others(max_ids)
            if warm_up:
                self._warm_up()
        except BaseException:
            self._close_writers()
            self._slots.release_all()
            raise
        self._free.extend(self._all)
        self._usage = metrics.PoolUsage(id_prefix, len(self._all))
        if group_commit:
            for slot in self._all:
                t = threading.Thread(target=self._drive, args=(slot,), daemon=True,
                                     name=f"dualwrite-pool-{slot.tid}")
                t.start()
                self._drivers.append(t)
        self._stop_keeper = threading.Event()
        self._keeper = threading.Thread(target=self._keep_slots, daemon=True,
                                        name=f"dualwrite-pool-{id_prefix}-slots")
        self._keeper.start()
        log.info("writer pool %s: %d writers (%s), group commit %s", id_prefix, len(ids),
                 ", ".join(ids), "on" if group_commit else "off")

    @property
    def transactional_ids(self) -> list[str]:
        """The ids this pool runs, in order."""
        return [s.tid for s in self._all]

    @property
    def group_commit(self) -> bool:
        return self._group_commit

    def _tid(self, n: int) -> str:
        return f"{self._prefix}-{n}"

    def _take_ids(self, size: int, max_ids: int) -> list[str]:
        """The lowest ``size`` numbers of the prefix whose slot is free, now this pool's."""
        taken: list[str] = []
        n = 0
        while len(taken) < size and n < max_ids:
            chunk = [self._tid(i) for i in range(n, min(n + size, max_ids))]
            got = self._slots.take(chunk)
            taken += [tid for tid in chunk if tid in got]
            n += len(chunk)
        for extra in taken[size:]:
            self._slots.give_back(extra)
        if len(taken) < size:
            raise FatalError(f"writer pool {self._prefix}: only {len(taken)} of {size} ids are "
                             f"free among {self._prefix}-0..{max_ids - 1} (max_ids); other "
                             "processes hold the rest")
        return taken[:size]

    def _finish_others(self, max_ids: int) -> None:
        """Finish the prefix's ids that no live pool holds and whose rows exist: what a pool
        that shrank, or a process that died and was not replaced, may have left in doubt.

        Each is borrowed (its slot taken, so no other pool starts on it meanwhile), run through
        one empty transaction of a new writer — its claim, lock and settling finish the stored
        state, its new session aborts any other open transaction — closed and given back.
        """
        pattern = re.compile(re.escape(self._prefix) + r"-(\d+)")
        ours = {s.tid for s in self._all}
        rows = [r.transactional_id for r in self._store.read_all()
                if (m := pattern.fullmatch(r.transactional_id)) and int(m.group(1)) < max_ids
                and r.transactional_id not in ours]
        if not rows or not self._slots.exclusive:
            return
        borrowed = sorted(self._slots.take(rows))
        if not borrowed:
            return
        log.info("writer pool %s: finishing %d ids no live pool holds: %s", self._prefix,
                 len(borrowed), ", ".join(borrowed))

        def finish(tid: str) -> None:
            writer = self._new_writer(tid)
            try:
                with writer.transaction():
                    pass
            finally:
                writer.close()

        try:
            with ThreadPoolExecutor(min(8, len(borrowed)),
                                    thread_name_prefix="dualwrite-pool-finish") as ex:
                for f in [ex.submit(finish, tid) for tid in borrowed]:
                    f.result()
        finally:
            for tid in borrowed:
                self._slots.give_back(tid)

    def _warm_up(self) -> None:
        """Run each writer's first transaction (empty) now: it claims the id, finishes what its
        stored state left in doubt and starts the producer session, so that the first requests
        do not pay for it."""
        def warm(slot: _Slot) -> None:
            slot.writer = self._new_writer(slot.tid)
            with slot.writer.transaction():
                pass

        with ThreadPoolExecutor(min(8, len(self._all)),
                                thread_name_prefix="dualwrite-pool-warm") as ex:
            for f in [ex.submit(warm, s) for s in self._all]:
                f.result()

    def _rest(self, slot: _Slot) -> None:
        """Wait until ``rest_s`` after the writer's last transaction ended.

        A transactional id's next AddPartitionsToTxn that reaches the coordinator while it still
        writes the previous transaction's markers is refused (CONCURRENT_TRANSACTIONS); librdkafka
        retries it later and, measured with 2.16.0, often times the retry out and reconnects
        (``REQTMOUT``, then ``FAIL ... disconnect`` on ``TxnCoordinator``): 20 ms to a second
        lost (FACTS.md, "One transactional id back to back"). A short rest costs less; in group
        commit the requests that arrive meanwhile join the writer's next group.
        """
        wait = slot.ended + self._rest_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)

    def _new_writer(self, tid: str) -> DualWriter:
        # The id's slot is this pool's: a writer lease still held is that of a pool whose slot
        # session died, which gives the id up at its next check; take it over.
        kw = {"take_over": True, "metrics_role": "pool", **self._writer_kw}
        return DualWriter(self._engine, self._config, transactional_id=tid, **kw)

    def _writer(self, slot: _Slot) -> DualWriter:
        if slot.writer is None:
            slot.writer = self._new_writer(slot.tid)
        return slot.writer

    def _retire(self, slot: _Slot, exc: BaseException | str) -> None:
        """Close a writer that broke (the slot gets a new one at its next use) or whose id is
        no longer this pool's (its lease goes with its connection)."""
        writer, slot.writer = slot.writer, None
        if isinstance(exc, str):
            log.warning("writer pool: transactional_id=%s closed: %s", slot.tid, exc)
        else:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            log.warning("writer pool: transactional_id=%s replaced after %s", slot.tid, why)
        if writer is not None:
            try:
                writer.close()
            except Exception as failed:  # its session or connection is gone already
                log.info("closing the broken writer of transactional_id=%s: %s", slot.tid,
                         failed)

    # -- one writer per request -------------------------------------------------------------

    def _checkout(self) -> _Slot:
        deadline = time.monotonic() + self._acquire_timeout_s
        with self._lock:
            while True:
                if self._closed:
                    raise FatalError(f"writer pool {self._prefix} is closed")
                while self._free and self._free[0].lost:
                    self._free.popleft()
                if self._free:
                    self._busy += 1
                    self._usage.taken()
                    return self._free.popleft()  # the longest rested: see FACTS.md
                left = deadline - time.monotonic()
                if left <= 0 or not any(not s.lost for s in self._all):
                    raise RetriableError(
                        f"writer pool {self._prefix}: no writer free within "
                        f"{self._acquire_timeout_s:g} s")
                self._free_changed.wait(left)

    def _checkin(self, slot: _Slot) -> None:
        if slot.lost:
            self._retire(slot, "its id was taken by another process")
        self._usage.returned()
        with self._lock:
            self._busy -= 1
            if not slot.lost:
                self._free.append(slot)
            self._free_changed.notify_all()

    @transaction_context("pool.transaction")
    def transaction(self) -> Iterator[DualWriteTransaction | GroupedTransaction]:
        """One request, atomic on both sides (class docstring)."""
        if self._group_commit:
            with self._grouped() as grouped:
                yield grouped
            return
        slot = self._checkout()
        try:
            self._rest(slot)
            writer = self._writer(slot)
            with writer.transaction() as tx:
                yield tx
        except BaseException as exc:
            if breaks_writer(exc):
                self._retire(slot, exc)
            raise
        finally:
            slot.ended = time.monotonic()
            self._checkin(slot)

    # -- group commit ------------------------------------------------------------------------

    @property
    def id_prefix(self) -> str:
        return self._prefix

    @property
    def acquire_timeout_s(self) -> float:
        return self._acquire_timeout_s

    @contextmanager
    def admitted(self) -> Iterator[None]:
        """Counts a request in (refused once closed): :meth:`close` waits for it. For
        :class:`AsyncDualWriterPool`, with :meth:`hand_over`."""
        with self._lock:
            if self._closed:
                raise FatalError(f"writer pool {self._prefix} is closed")
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self._free_changed.notify_all()

    @contextmanager
    def _grouped(self) -> Iterator[GroupedTransaction | DualWriteTransaction]:
        with self.admitted(), self._request() as handle:
            yield handle

    def hand_over(self, req: _Request, executor: ThreadPoolExecutor | None) -> None:
        """Give an admitted request to the writers: to the queue of groups, or without group
        commit to a thread of ``executor`` that runs a transaction of its own for it."""
        if self._group_commit:
            self._requests.put(req)
        else:
            assert executor is not None
            executor.submit(self._run_single, req)

    def _run_single(self, req: _Request) -> None:
        """An async request without group commit, in a thread of the async pool: one writer's
        transaction whose block runs the request's statements (``req.work``) here."""
        if not req.take():
            return
        tx: DualWriteTransaction | GroupedTransaction | None = None
        try:
            with self.transaction() as tx:
                handle = req.handle = GroupedTransaction(tx.connection)
                req.signal(req.turn)
                while (item := req.work.get()) is not None:
                    item()
                if req.body_error is not None:
                    raise req.body_error  # both sides roll back; it reaches the request
                for topic, value, key, partition, headers in handle.records():
                    tx.produce(topic, value, key, partition=partition, headers=headers)
            handle.state = tx.state
        except BaseException as exc:
            if exc is not req.body_error:
                req.error = exc
        finally:
            req.signal(req.turn)
            req.signal(req.done)

    @contextmanager
    def _request(self) -> Iterator[GroupedTransaction | DualWriteTransaction]:
        req = _Request()
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

    def _drive(self, slot: _Slot) -> None:
        """The thread of one writer: take the waiting requests as a group, one transaction."""
        while True:
            self._rest(slot)
            self._collecting.acquire()
            collected = _Once(self._collecting.release)
            try:
                first = self._requests.get()
                if first is _STOP:
                    return
                if slot.lost:  # leave it to a writer that still holds its id
                    self._requests.put(first)
                    self._retire(slot, "its id was taken by another process")
                    return
                if first.take():
                    self._run_group(slot, first, collected)
            finally:
                collected()

    def _run_group(self, slot: _Slot, first: _Request, collected: Callable[[], None]) -> None:
        """One group: the writer's transaction runs ``first`` and the requests that wait or
        arrive meanwhile (up to ``max_group_size``), then ``collected()`` lets another writer
        collect while this one commits."""
        group: list[_Request] = []
        stop = False
        error: BaseException | None = None
        tx: DualWriteTransaction | None = None
        self._usage.taken()
        try:
            writer = self._writer(slot)
            with writer.transaction() as tx:
                group.append(first)
                self._run_first(tx, first)
                conn = tx.lock()  # (the lock, if the first request did not take it)
                nxt: _Request | None = None
                while True:
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
                    self._run_member(conn, tx, nxt, number=len(group),
                                     keep=len(group) <= _KEPT_SAVEPOINTS)
                    nxt = None
                collected()
        except BaseException as exc:
            error = exc
            if breaks_writer(exc):
                self._retire(slot, exc)
        slot.ended = time.monotonic()
        self._usage.returned()
        metrics.observe_group_size(self._prefix, len(group))
        if first not in group:
            group.append(first)  # the transaction failed before its turn
        state = tx.state if tx is not None and error is None else None
        for req in group:
            failed = error if error is not None else req.own_error
            if req.handle is not None:
                req.handle.state = state if failed is None else None
            req.error = failed
            req.signal(req.turn)
            req.signal(req.done)
        if stop:
            self._requests.put(_STOP)

    def _run_first(self, tx: DualWriteTransaction, req: _Request) -> None:
        """The group's first request runs on the writer's own handle, as a lone transaction
        would: its records leave at once (while its rows are written, the lock taken late) and,
        with nothing else in the transaction yet, a failure of its block ends the transaction
        (both sides rolled back), so it needs no savepoint. Requests join after it, unless it
        misused the connection or went on after a failed statement (then the transaction
        fails before anyone joins)."""
        req.handle = tx
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

    def _run_member(self, conn: GuardedConnection, tx: DualWriteTransaction, req: _Request, *,
                    number: int, keep: bool = True) -> None:
        """Run one request's block (in its own thread) inside a savepoint of its own; produce
        its records into the group's transaction if it succeeded, roll it back alone if it
        failed: its exception, a refused statement (the connection's guard), a failed
        statement it went on after, or a record the client would refuse (checked before any
        is sent). ``keep``: leave the savepoint unreleased if it succeeded (see below).

        The savepoint is the writer's own statement, not SQLAlchemy's ``begin_nested()``, so
        that nothing the request does to SQLAlchemy's bookkeeping can stop the writer from
        rolling it back. Only a misuse that cost the whole transaction fails the group."""
        savepoint = f"dualwrite_request_{number}"
        self._own_statement(conn, f"SAVEPOINT {savepoint}")
        req.handle = GroupedTransaction(conn)
        conn.lend_savepoint()
        req.signal(req.turn)
        try:
            while (item := req.work.get()) is not None:
                item()
        finally:
            misuse = conn.end_savepoint_loan()
        if misuse is not None and conn.whole_transaction_lost:
            raise misuse
        body_error = req.body_error
        failure: BaseException | None = body_error or misuse
        if failure is None:
            failure = conn.went_on_after_a_failure()
        records = req.handle.records()
        if failure is None:
            try:
                tx.check(records)
            except DualWriteError as refused:
                failure = refused
        # A savepoint that succeeded is not released: its work commits with the group (the
        # COMMIT ends every savepoint), and a RELEASE would be one more round trip in series
        # per request. The next request's savepoint nests in it, so rolling that one back
        # still undoes that request alone. Past _KEPT_SAVEPOINTS levels they are released
        # again: PostgreSQL caches 64 subtransactions per session.
        if failure is not None:
            self._own_statement(conn, f"ROLLBACK TO SAVEPOINT {savepoint}")
        if failure is not None or not keep:
            self._own_statement(conn, f"RELEASE SAVEPOINT {savepoint}")
        if failure is None:
            for topic, value, key, partition, headers in records:
                tx.produce(topic, value, key, partition=partition, headers=headers)
            return
        if failure is not body_error:
            req.own_error = failure  # the block ended normally: the request fails all the same
            return
        if isinstance(body_error, sa.exc.DBAPIError):
            typed = database_error(body_error, self._engine.url)
            if isinstance(typed, DatabaseUnreachableError):
                raise typed from body_error  # the group's connection is gone: all fail
        if not isinstance(body_error, Exception):
            raise body_error  # an interrupt: stop the group too

    def _own_statement(self, conn: GuardedConnection, statement: str) -> None:
        """One of the writer's own statements on the lent connection (a request's
        savepoint)."""
        try:
            with conn.own_use():
                conn.exec_driver_sql(statement)
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, self._engine.url) from exc

    # -- upkeep and closing -----------------------------------------------------------------

    def _keep_slots(self, interval_s: float = 5.0) -> None:
        """Every few seconds: is the session holding the slots alive? If a server restart ended
        it, take them again; an id another process took meanwhile is given up: its writer is
        closed once idle (two writers of one id would fence each other)."""
        while not self._stop_keeper.wait(interval_s):
            try:
                if self._slots.still_held():
                    continue
                ids = [s.tid for s in self._all if not s.lost]
                got = self._slots.take(ids)
            except DualWriteError as exc:
                log.warning("writer pool %s: cannot check its ids' slots: %s", self._prefix, exc)
                continue
            for slot in self._all:
                if slot.tid in ids and slot.tid not in got:
                    log.error("writer pool %s: transactional_id=%s was taken by another "
                              "process while this pool's slot session was down; giving it up",
                              self._prefix, slot.tid)
                    slot.lost = True
            with self._lock:
                # Group commit: each writer's own thread closes it (``_drive``).
                idle = [] if self._group_commit else [s for s in self._free if s.lost]
                for slot in idle:
                    self._free.remove(slot)
                self._free_changed.notify_all()
            for slot in idle:
                self._retire(slot, "its id was taken by another process")

    def close(self, timeout_s: float | None = None) -> None:
        """Wait (up to ``timeout_s``, default the pool's ``timeout_s``) for running requests
        and the writers' threads, close every writer, release the ids. Idempotent. A close
        that took longer than a second logs what it waited for."""
        started = time.monotonic()
        budget: float = self._writer_kw["timeout_s"] if timeout_s is None else timeout_s
        deadline = started + budget
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._busy and time.monotonic() < deadline:
                self._free_changed.wait(deadline - time.monotonic())
            busy = self._busy
        waited = {"running requests": time.monotonic() - started}
        for _ in self._drivers:
            self._requests.put(_STOP)
        mark = time.monotonic()
        for t in self._drivers:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._drivers if t.is_alive()]
        waited["the writers' threads"] = time.monotonic() - mark
        mark = time.monotonic()
        self._stop_keeper.set()
        self._keeper.join(max(0.0, deadline - time.monotonic()))
        waited["the slot keeper"] = time.monotonic() - mark
        mark = time.monotonic()
        self._close_writers()
        self._slots.release_all()
        self._usage.close()
        waited["closing the writers"] = time.monotonic() - mark
        took = time.monotonic() - started
        if took > 1.0 or busy or stuck:
            log.warning("writer pool %s closed in %.2f s (timeout %g s): waited %s%s%s",
                        self._prefix, took, budget,
                        ", ".join(f"{s:.2f} s for {what}" for what, s in waited.items()),
                        f"; {busy} requests still running" if busy else "",
                        f"; threads still running: {', '.join(stuck)}" if stuck else "")
        else:
            log.info("writer pool %s closed in %.2f s", self._prefix, took)

    def _close_writers(self) -> None:
        for slot in getattr(self, "_all", []):
            writer, slot.writer = slot.writer, None
            if writer is not None:
                try:
                    writer.close()
                except Exception as exc:
                    log.warning("closing the writer of transactional_id=%s: %s", slot.tid, exc)

    def __enter__(self) -> DualWriterPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- asyncio ---------------------------------------------------------------------------------

_T = TypeVar("_T")


def sync_engine_for(engine: AsyncEngine | Engine | str | sa.URL) -> Engine:
    """A dualwrite engine on the database of ``engine``: an async engine's URL with its sync
    driver (``postgresql+psycopg`` serves both; ``sqlite+aiosqlite`` becomes ``sqlite``)."""
    if isinstance(engine, Engine):
        return engine
    url = sa.make_url(engine) if isinstance(engine, str | sa.URL) else engine.url
    if url.drivername in ("sqlite+aiosqlite", "sqlite+pysqlite"):
        url = url.set(drivername="sqlite")
    elif url.drivername in ("postgresql+asyncpg", "postgresql+psycopg_async"):
        url = url.set(drivername="postgresql+psycopg")
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


class AsyncTransaction(_RecordBuffer):
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
    psycopg (or sqlite3) connections on the same database (:func:`sync_engine_for`). Other
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

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.changed = asyncio.Event()
        self.req = _Request(on_change=lambda: _post(loop, self.changed.set))
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
