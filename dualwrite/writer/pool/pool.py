"""The writers of a bounded set of transactional ids, their start, upkeep and close
(:class:`WriterPool`, whatever the participant), and :class:`DualWriterPool` (Kafka); how
requests share the writers is the commit policy's (:mod:`.single`, :mod:`.grouped`)."""

from __future__ import annotations

import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, Concatenate, Generic, Literal, ParamSpec, Self, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy import Engine

from dualwrite import metrics
from dualwrite.database import create_engine
from dualwrite.errors import DualWriteError, FatalError
from dualwrite.writer.dual_writer import (
    DualWriter,
    DualWriteTransaction,
    HeuristicHook,
    PhaseHooks,
    transaction_context,
)
from dualwrite.writer.pool.admission import Admission
from dualwrite.writer.pool.grouped import GroupCommit
from dualwrite.writer.pool.policy import CommitPolicy
from dualwrite.writer.pool.requests import GroupedTransaction, Request
from dualwrite.writer.pool.single import SingleCommit
from dualwrite.writer.pool.slots import Slots
from dualwrite.writer.pool.writers import Slot, W
from dualwrite.writer.state_store import StateStore

log = logging.getLogger("dualwrite.writer.pool")

_P = ParamSpec("_P")
_T = TypeVar("_T")

PoolTransaction = DualWriteTransaction | GroupedTransaction
"""The handle of one pool request: ``connection`` and ``produce``, whichever kind it is."""


class WriterPool(ABC, Generic[W]):
    """What every pool does whatever its participant: take the ids ``{id_prefix}-{n}`` whose
    slots are free, finish what the prefix's other ids left in doubt, warm the writers up,
    keep the slots, close. A pool names its writers (:meth:`_new_writer`) and how requests
    share them (:meth:`_make_policy`)."""

    def __init__(self, engine: Engine | str, *, id_prefix: str, size: int,
                 acquire_timeout_s: float, timeout_s: float, max_ids: int, warm_up: bool,
                 rest_s: float) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", id_prefix):
            raise ValueError("id_prefix may hold letters, digits, '.', '_' and '-' only")
        try:
            self._engine = create_engine(engine) if isinstance(engine, str) else engine
        except (sa.exc.ArgumentError, ValueError) as exc:  # the text may show the password
            raise FatalError(f"{type(self).__name__}: the database URL (not shown: it may "
                             "hold a password) is not valid, or its driver is not installed "
                             f"({type(exc).__name__})") from None
        self._prefix = id_prefix
        self._acquire_timeout_s = acquire_timeout_s
        self._timeout_s = timeout_s
        self._store = StateStore(self._engine)
        self._admission = Admission(id_prefix)
        self._slots = Slots(self._engine)
        try:
            ids = self._take_ids(size, max_ids)
            self._all: list[Slot[W]] = [Slot(tid, self._new_writer, rest_s) for tid in ids]
            self._finish_others(max_ids)
            if warm_up:
                self._warm_up()
        except BaseException:
            self._close_writers()
            self._slots.release_all()
            raise
        self._usage = metrics.PoolUsage(id_prefix, len(self._all))
        self._policy = self._make_policy()
        self._policy.start()
        self._stop_keeper = threading.Event()
        self._keeper = threading.Thread(target=self._keep_slots, daemon=True,
                                        name=f"dualwrite-pool-{id_prefix}-slots")
        self._keeper.start()
        log.info("writer pool %s: %d writers (%s), group commit %s", id_prefix, len(ids),
                 ", ".join(ids), "on" if self._policy.grouped else "off")

    @abstractmethod
    def _new_writer(self, tid: str) -> W:
        """A new writer for ``tid``, whose slot is this pool's."""

    @abstractmethod
    def _make_policy(self) -> CommitPolicy:
        """How requests share the writers (once they are made)."""

    @property
    def transactional_ids(self) -> list[str]:
        """The ids this pool runs, in order."""
        return [s.tid for s in self._all]

    @property
    def group_commit(self) -> bool:
        return self._policy.grouped

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
        def warm(slot: Slot[W]) -> None:
            with slot.current_writer().transaction():
                pass

        with ThreadPoolExecutor(min(8, len(self._all)),
                                thread_name_prefix="dualwrite-pool-warm") as ex:
            for f in [ex.submit(warm, s) for s in self._all]:
                f.result()

    @property
    def id_prefix(self) -> str:
        return self._prefix

    @property
    def acquire_timeout_s(self) -> float:
        return self._acquire_timeout_s

    def admitted(self) -> AbstractContextManager[None]:
        """Counts a request in (refused once closed): :meth:`close` waits for it. For
        :class:`AsyncDualWriterPool`, with :meth:`hand_over`."""
        return self._admission.admitted()

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
            with self._admission.lock:
                idle = self._policy.idle_lost()
                self._admission.changed.notify_all()
            for slot in idle:
                slot.retire("its id was taken by another process")

    def close(self, timeout_s: float | None = None) -> None:
        """Wait (up to ``timeout_s``, default the pool's ``timeout_s``) for running requests
        and the writers' threads, close every writer, release the ids. Idempotent. A close
        that took longer than a second logs what it waited for."""
        started = time.monotonic()
        budget = self._timeout_s if timeout_s is None else timeout_s
        deadline = started + budget
        busy = self._admission.close(deadline)
        if busy is None:
            return
        waited = {"running requests": time.monotonic() - started}
        mark = time.monotonic()
        stuck = self._policy.stop(deadline)
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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DualWriterPool(WriterPool[DualWriter]):
    """A thread-safe pool of :class:`DualWriter` over ids ``{id_prefix}-{n}`` (package docstring).

    ``with pool.transaction() as tx:`` runs one request atomically, with the calls of a
    ``DualWriter`` transaction (``tx.connection``, ``tx.produce``). Without ``group_commit`` each
    request runs its own transaction on a writer of its own, waiting up to ``acquire_timeout_s``
    for one to be free (then :class:`~dualwrite.errors.RetriableError`). With ``group_commit``
    (default; see bench/README.md for the measurements) each of the ``size`` writers has a
    thread that takes the waiting requests as one group: the request's block still runs in the
    caller's thread (its context variables, its exceptions), on the group's connection — the
    first request of a group on the writer's own handle, the others inside a savepoint each — one
    request after the other; it returns once the group committed on both sides.
    At most ``collectors`` writers (default 1) take requests at a time while the others
    commit, so that a group holds what arrived while the last one ran: groups grow with the
    load. Collecting is Python work under the GIL, so a second collector mostly competes with
    the first for the same core (docs/design.md).
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
    ``rest_s`` is the least time between one writer's transactions (:meth:`Slot.rest`).
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
        if "transactional.id" in kafka_config:
            raise ValueError("the pool names its transactional ids itself (id_prefix)")
        self._config = dict(kafka_config)
        self._writer_kw: dict[str, Any] = {
            "timeout_s": timeout_s, "on_heuristic_abort": on_heuristic_abort,
            "verify": verify, "hooks": hooks}
        self._group_commit = group_commit
        self._max_group_size = max_group_size
        self._collectors = collectors or 1
        super().__init__(engine, id_prefix=id_prefix, size=size,
                         acquire_timeout_s=acquire_timeout_s, timeout_s=timeout_s,
                         max_ids=max_ids, warm_up=warm_up, rest_s=rest_s)

    def _make_policy(self) -> CommitPolicy:
        if self._group_commit:
            return GroupCommit(self._admission, self._all, self._usage, url=self._engine.url,
                               max_group_size=self._max_group_size,
                               collectors=self._collectors,
                               acquire_timeout_s=self._acquire_timeout_s)
        return SingleCommit(self._admission, self._all, self._usage,
                            acquire_timeout_s=self._acquire_timeout_s)

    def _new_writer(self, tid: str) -> DualWriter:
        # The id's slot is this pool's: a writer lease still held is that of a pool whose slot
        # session died, which gives the id up at its next check; take it over.
        kw = {"take_over": True, "metrics_role": "pool", **self._writer_kw}
        return DualWriter(self._engine, self._config, transactional_id=tid, **kw)

    @transaction_context("pool.transaction")
    def transaction(self) -> Iterator[DualWriteTransaction | GroupedTransaction]:
        """One request, atomic on both sides (class docstring)."""
        with self._policy.transaction() as tx:
            yield tx

    def run(self, fn: Callable[Concatenate[PoolTransaction, _P], _T], /,
            *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """One request as a callable: ``fn(tx, *args, **kwargs)`` in a writer's thread, with
        the calls of :meth:`transaction`'s handle; returns what ``fn`` returned once the
        request committed on both sides, or raises what it raised (nothing of it committed).

        Cheaper than :meth:`transaction` with group commit: a request costs its own statements
        and no savepoint, and its thread only waits. The price: ``fn`` may run twice. When a
        call of a group fails, the group's transaction is rolled back on both sides and its
        other calls run again, each inside a savepoint then (so a call runs at most twice, and
        only its last run commits). So ``fn`` must have no effect outside ``tx`` (no other
        connection, no remote call, no mutation of shared state it cannot repeat), and it runs
        in another thread (no context variables of the caller). Interrupted (Ctrl-C) after a
        group took it, the request is decided by its group without the caller."""
        return cast(_T, self._policy.run(lambda tx: fn(tx, *args, **kwargs)))

    def hand_over(self, req: Request, executor: ThreadPoolExecutor | None) -> None:
        """Give an admitted request to the writers: to the queue of groups, or without group
        commit to a thread of ``executor`` that runs a transaction of its own for it."""
        self._policy.hand_over(req, executor)
