"""Single commit: each request runs a transaction of its own on a writer it has to itself."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from dualwrite import metrics
from dualwrite.errors import RetriableError
from dualwrite.writer.dual_writer import DualWriteTransaction
from dualwrite.writer.pool.admission import Admission
from dualwrite.writer.pool.policy import CommitPolicy
from dualwrite.writer.pool.requests import Call, GroupedTransaction, Request
from dualwrite.writer.pool.writers import Slot, breaks_writer


class SingleCommit(CommitPolicy):
    """A request checks out a free writer (waiting up to ``acquire_timeout_s``, then
    RetriableError), runs its transaction and checks the writer in again."""

    grouped = False

    def __init__(self, admission: Admission, slots: list[Slot[Any]], usage: metrics.PoolUsage, *,
                 acquire_timeout_s: float) -> None:
        self._admission = admission
        self._all = slots
        self._free: deque[Slot[Any]] = deque(slots)
        self._usage = usage
        self._acquire_timeout_s = acquire_timeout_s

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        slot = self._checkout()
        try:
            slot.rest()
            writer = slot.current_writer()
            with writer.transaction() as tx:
                yield tx
        except BaseException as exc:
            if breaks_writer(exc):
                slot.retire(exc)
            raise
        finally:
            slot.ended = time.monotonic()
            self._checkin(slot)

    def run(self, call: Call) -> Any:
        with self.transaction() as tx:
            return call(tx)

    def hand_over(self, req: Request, executor: ThreadPoolExecutor | None) -> None:
        """Run the request's transaction in a thread of ``executor`` (the async pool's)."""
        assert executor is not None
        executor.submit(self._run, req)

    def idle_lost(self) -> list[Slot[Any]]:
        idle = [s for s in self._free if s.lost]
        for slot in idle:
            self._free.remove(slot)
        return idle

    def _run(self, req: Request) -> None:
        """An async request, in a thread of the async pool: one writer's transaction whose
        block runs the request's statements (``req.work``) here."""
        if not req.take():
            return
        tx: DualWriteTransaction | None = None
        try:
            with self.transaction() as tx:
                if req.call is not None:
                    req.handle = tx
                    req.signal(req.turn)
                    req.result = req.call(tx)
                    return
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

    def _checkout(self) -> Slot[Any]:
        admission = self._admission
        deadline = time.monotonic() + self._acquire_timeout_s
        with admission.lock:
            while True:
                admission.refuse_if_closed()
                while self._free and self._free[0].lost:
                    self._free.popleft()
                if self._free:
                    admission.busy += 1
                    self._usage.taken()
                    return self._free.popleft()  # the longest rested (Slot.rest)
                left = deadline - time.monotonic()
                if left <= 0 or not any(not s.lost for s in self._all):
                    raise RetriableError(
                        f"writer pool {admission.id_prefix}: no writer free within "
                        f"{self._acquire_timeout_s:g} s")
                admission.changed.wait(left)

    def _checkin(self, slot: Slot[Any]) -> None:
        if slot.lost:
            slot.retire("its id was taken by another process")
        self._usage.returned()
        with self._admission.lock:
            self._admission.busy -= 1
            if not slot.lost:
                self._free.append(slot)
            self._admission.changed.notify_all()
