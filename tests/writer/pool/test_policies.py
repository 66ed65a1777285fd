"""The pool's commit policies and its waiting request, without a server: fake writers stand in
for DualWriter (the pool's behaviour on servers is tests/writer/pool/test_pool.py's)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import pytest

from dualwrite import metrics
from dualwrite.errors import FatalError, RetriableError, TransactionConflictError
from dualwrite.writer.pool.admission import Admission
from dualwrite.writer.pool.grouped import GroupCommit
from dualwrite.writer.pool.requests import Request
from dualwrite.writer.pool.single import SingleCommit
from dualwrite.writer.pool.writers import Slot, breaks_writer

pytestmark = pytest.mark.unit


class FakeWriter:
    def __init__(self, tid: str) -> None:
        self.tid = tid
        self.transactions = 0
        self.closed = False

    @contextmanager
    def transaction(self) -> Iterator[str]:
        self.transactions += 1
        yield self.tid

    def close(self) -> None:
        self.closed = True


def slots(n: int) -> list[Slot[FakeWriter]]:
    return [Slot(f"p-{i}", FakeWriter, rest_s=0.0) for i in range(n)]


def single(all_slots: list[Slot[FakeWriter]],
           timeout_s: float = 5.0) -> tuple[SingleCommit, Admission]:
    admission = Admission("p")
    usage = metrics.PoolUsage("p", len(all_slots))
    return SingleCommit(admission, all_slots, usage, acquire_timeout_s=timeout_s), admission


def test_single_commit_hands_out_the_longest_rested_writer() -> None:
    policy, _ = single(slots(2))
    seen: list[object] = []
    for _ in range(3):
        with policy.transaction() as tx:
            seen.append(tx)
    assert seen == ["p-0", "p-1", "p-0"]


def test_single_commit_refuses_once_no_writer_came_free_in_time() -> None:
    policy, admission = single(slots(1), timeout_s=0.05)
    with policy.transaction(), pytest.raises(RetriableError, match=re.escape(
            "writer pool p: no writer free within 0.05 s")), policy.transaction():
        pass
    assert admission.busy == 0


def test_a_writer_is_replaced_after_a_dualwrite_error_only() -> None:
    all_slots = slots(1)
    policy, _ = single(all_slots)
    with pytest.raises(ValueError), policy.transaction():
        raise ValueError("the application's own")
    first = cast(FakeWriter, all_slots[0].writer)
    assert first is not None and not first.closed
    with pytest.raises(FatalError), policy.transaction():
        raise FatalError("fenced")
    assert first.closed and all_slots[0].writer is None
    assert breaks_writer(KeyboardInterrupt()) and not breaks_writer(TransactionConflictError("x"))


def test_a_closed_pool_refuses_requests() -> None:
    policy, admission = single(slots(1))
    assert admission.close(time.monotonic()) == 0
    assert admission.close(time.monotonic()) is None
    with pytest.raises(FatalError, match="writer pool p is closed"), policy.transaction():
        pass


def test_single_commit_gives_up_idle_slots_whose_id_was_lost() -> None:
    all_slots = slots(2)
    policy, _ = single(all_slots)
    all_slots[1].lost = True
    assert policy.idle_lost() == [all_slots[1]]
    with policy.transaction() as tx:
        assert cast(object, tx) == "p-0"


def test_group_commit_without_a_free_writer_gives_the_request_up() -> None:
    all_slots = slots(1)
    policy = GroupCommit(Admission("p"), cast(Any, all_slots), metrics.PoolUsage("p", 1),
                         url=cast(Any, "sqlite://"), max_group_size=4, collectors=1,
                         acquire_timeout_s=0.05)  # not started: no writer takes requests
    with pytest.raises(RetriableError, match=re.escape(
            "writer pool p: no group took the request within 0.05 s")), \
            policy.transaction():
        pass
    assert policy.stop(time.monotonic()) == []


def test_a_request_is_taken_or_abandoned_never_both() -> None:
    changes = []
    req = Request(on_change=lambda: changes.append(1))
    assert req.take() and not req.abandon()
    req.signal(req.turn)
    assert req.turn.is_set() and changes == [1]
    late = Request()
    assert late.abandon() and not late.take()


def test_a_request_is_taken_once_among_racing_writers() -> None:
    req = Request()
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(req.take() and not req.abandon()))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results) and req.taken and not req.abandoned
