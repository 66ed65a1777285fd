"""How the pool runs its requests: the interface of its two commit policies, single commit
(:mod:`.single`: one writer's transaction per request) and group commit (:mod:`.grouped`: the
waiting requests share a writer's next transaction)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, ClassVar

from dualwrite.writer.pool.requests import Call, Request
from dualwrite.writer.pool.writers import Slot


class CommitPolicy(ABC):
    """What a :class:`~dualwrite.writer.pool.pool.WriterPool` asks of a commit policy: run a
    request of a thread (:meth:`transaction`) and take one of the async pool
    (:meth:`hand_over`); the lifecycle hooks do nothing unless a policy needs them."""

    grouped: ClassVar[bool]
    """Whether requests share transactions (the pool's ``group_commit``)."""

    @abstractmethod
    def transaction(self) -> AbstractContextManager[Any]:
        """One request of the calling thread, atomic on both sides: the handle its block
        writes through (the writer's own, or a group member's)."""

    @abstractmethod
    def run(self, call: Call) -> Any:
        """One request of the calling thread as a callable: ``call(tx)`` in a writer's
        transaction; what it returned, once committed on both sides."""

    @abstractmethod
    def hand_over(self, req: Request, executor: ThreadPoolExecutor | None) -> None:
        """Give an admitted request of the async pool to the writers; its statements reach the
        writer's thread through ``req.work``."""

    def start(self) -> None:
        """Start what the policy runs in the background (once the pool's writers are ready)."""
        return None

    def stop(self, deadline: float) -> list[str]:
        """Stop it, waiting until ``deadline``; the names of threads still running."""
        return []

    def idle_lost(self) -> list[Slot[Any]]:
        """Under the pool's lock: the idle slots whose id was lost, now out of use, for the
        pool to close."""
        return []
