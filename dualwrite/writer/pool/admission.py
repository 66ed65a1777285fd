"""Which requests are in the pool, and whether it is closed: what :meth:`DualWriterPool.close`
waits for, shared by the pool and its commit policy under one lock."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from dualwrite.errors import FatalError


class Admission:
    """The count of running requests and the pool's closed flag, under ``lock``; ``changed`` is
    notified when either changes (or a writer comes free)."""

    def __init__(self, id_prefix: str) -> None:
        self.id_prefix = id_prefix
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.busy = 0
        self.closed = False

    def refuse_if_closed(self) -> None:
        """Under ``lock``: FatalError once the pool is closed."""
        if self.closed:
            raise FatalError(f"writer pool {self.id_prefix} is closed")

    @contextmanager
    def admitted(self) -> Iterator[None]:
        """Counts a request in (refused once closed): :meth:`DualWriterPool.close` waits for it."""
        with self.lock:
            self.refuse_if_closed()
            self.busy += 1
        try:
            yield
        finally:
            with self.lock:
                self.busy -= 1
                self.changed.notify_all()

    def close(self, deadline: float) -> int | None:
        """Close (no request is admitted any more) and wait until ``deadline`` for the running
        ones; how many still run, or None if it was closed already."""
        with self.lock:
            if self.closed:
                return None
            self.closed = True
            while self.busy and time.monotonic() < deadline:
                self.changed.wait(deadline - time.monotonic())
            return self.busy
