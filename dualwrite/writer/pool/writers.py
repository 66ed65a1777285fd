"""One transactional id of the pool and its current writer: made on first use, rested between
transactions, replaced after it broke."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Generic, Protocol, TypeVar

from dualwrite.errors import DualWriteError, LockTimeoutError, TransactionConflictError

log = logging.getLogger("dualwrite.writer.pool")

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


class PooledWriter(Protocol):
    """What a pool asks of a writer: one transaction at a time, and closing."""

    def transaction(self) -> AbstractContextManager[Any]: ...

    def close(self) -> None: ...


W = TypeVar("W", bound=PooledWriter)


class Slot(Generic[W]):
    """One transactional id of the pool and its current writer (None until made, or after the
    last one broke)."""

    def __init__(self, tid: str, new_writer: Callable[[str], W], rest_s: float) -> None:
        self.tid = tid
        self.writer: W | None = None
        self.ended = 0.0
        """When its last transaction ended (``time.monotonic()``)."""
        self.lost = False
        """The slot lock was lost (its session ended) and could not be taken again: the id may
        now be another process's, so this pool stops using it."""
        self._new_writer = new_writer
        self._rest_s = rest_s

    def current_writer(self) -> W:
        """The id's writer, made now if it has none."""
        if self.writer is None:
            self.writer = self._new_writer(self.tid)
        return self.writer

    def rest(self) -> None:
        """Wait until ``rest_s`` after the writer's last transaction ended.

        A transactional id's next AddPartitionsToTxn that reaches the coordinator while it still
        writes the previous transaction's markers is refused (CONCURRENT_TRANSACTIONS); librdkafka
        retries it later and may time the retry out and reconnect (``REQTMOUT``, then ``FAIL ...
        disconnect`` on ``TxnCoordinator``), which costs more than a short rest (docs/design.md,
        "Measurements behind the code"). In group commit the requests that arrive meanwhile join
        the writer's next group.
        """
        wait = self.ended + self._rest_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)

    def retire(self, exc: BaseException | str) -> None:
        """Close a writer that broke (the slot gets a new one at its next use) or whose id is
        no longer this pool's (its lease goes with its connection)."""
        writer, self.writer = self.writer, None
        if isinstance(exc, str):
            log.warning("writer pool: transactional_id=%s closed: %s", self.tid, exc)
        else:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            log.warning("writer pool: transactional_id=%s replaced after %s", self.tid, why)
        if writer is not None:
            try:
                writer.close()
            except Exception as failed:  # its session or connection is gone already
                log.info("closing the broken writer of transactional_id=%s: %s", self.tid,
                         failed)
