"""A request waiting for, running in, or waiting on the outcome of a writer's transaction, and
the handles its block writes through."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection

from dualwrite.participant.prepared_state import PreparedTxnState
from dualwrite.participant.producer import Headers
from dualwrite.writer.dual_writer import DualWriteTransaction

Record = tuple[str, bytes | str | None, bytes | str | None, int | None, Headers | None]
"""One record of a request: topic, value, key, partition, headers."""


class RecordBuffer:
    """A request's records, kept until its block has ended without an exception."""

    def __init__(self) -> None:
        self._records: list[Record] = []

    def produce(self, topic: str, value: bytes | str | None = None,
                key: bytes | str | None = None, *, partition: int | None = None,
                headers: Headers | None = None) -> None:
        """Add a record to this request; it becomes visible iff the request's rows commit."""
        self._records.append((topic, value, key, partition, headers))

    def records(self) -> tuple[Record, ...]:
        """The records produced so far, in order."""
        return tuple(self._records)


class GroupedTransaction(RecordBuffer):
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


Call = Callable[[GroupedTransaction | DualWriteTransaction], Any]
"""A request of ``pool.run(fn, ...)``: its whole work as one callable, which the writer's
thread runs (again, should another request of its group fail before the group commits)."""


class Request:
    """One request waiting for, running in, or waiting on the outcome of a group: a block
    (``with pool.transaction()``: its statements run in the caller's thread, or reach the
    writer's through ``work``) or a :data:`Call`."""

    def __init__(self, on_change: Callable[[], None] | None = None, *,
                 call: Call | None = None) -> None:
        self.call = call
        self.result: Any = None
        """What ``call`` returned (its last run, if it ran again)."""
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
