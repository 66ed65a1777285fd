"""One deadline shared by every wait of a public call, so that ``timeout_s`` bounds their sum.

A public call (``DualWriter.transaction()``, :func:`dualwrite.recover`, :func:`dualwrite.status`)
opens a :func:`deadline_scope`; each wait beneath it — librdkafka's init/flush/commit/abort, the
control plane's requests and retries, a database connect, lock or COMMIT — asks
:meth:`Deadline.wait_s` how long it may still wait instead of using a ``timeout_s`` of its own.
The scope lives in a context variable: library signatures stay as they are, and a wait outside
any scope keeps its own timeout. Threads a call starts run under a copy of its context
(:func:`contextvars.copy_context`) to share its deadline.

Past the deadline a wait still gets :data:`MIN_WAIT_S`, so that the cleanup after a failure
(an abort, the question after an unanswered COMMIT) is tried and fails fast rather than not at
all: a call returns within ``timeout_s + MARGIN_S`` (docs/operating.md, "Timeouts and what
they trade").
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["MARGIN_S", "MIN_WAIT_S", "Deadline", "bounded", "current_deadline", "deadline_scope",
           "wait_s"]

#: What a wait past the deadline still gets (librdkafka and libpq need a positive timeout).
MIN_WAIT_S = 0.2
#: How far past ``timeout_s`` a public call may return: its cleanup after a failure (the
#: question after an unanswered COMMIT, a Kafka abort) and the last wait's overshoot.
MARGIN_S = 3.0

_CURRENT: ContextVar[Deadline | None] = ContextVar("dualwrite_deadline", default=None)


@dataclass(frozen=True)
class Deadline:
    """A point in monotonic time and the budget it was made from (for messages)."""

    at: float
    budget_s: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds, seconds)

    def left(self) -> float:
        """Seconds until the deadline (negative once past it)."""
        return self.at - time.monotonic()

    @property
    def expired(self) -> bool:
        return self.left() <= 0

    def wait_s(self, own_s: float | None = None) -> float:
        """How long a wait may last: the time left (at least :data:`MIN_WAIT_S`), capped by the
        wait's own timeout ``own_s`` if it has one."""
        left = max(MIN_WAIT_S, self.left())
        return left if own_s is None else max(MIN_WAIT_S, min(own_s, left))

    def sooner(self, seconds: float) -> Deadline:
        """This deadline, or ``seconds`` from now if that comes first."""
        other = Deadline.after(seconds)
        return other if other.at < self.at else self


def current_deadline() -> Deadline | None:
    """The deadline of the innermost :func:`deadline_scope`, or None."""
    return _CURRENT.get()


def bounded(own_s: float) -> Deadline:
    """The current deadline if it comes before ``own_s`` from now, else ``own_s`` from now."""
    current = _CURRENT.get()
    return Deadline.after(own_s) if current is None else current.sooner(own_s)


def wait_s(own_s: float) -> float:
    """How long a wait with its own timeout ``own_s`` may last under the current deadline."""
    current = _CURRENT.get()
    return own_s if current is None else current.wait_s(own_s)


@contextmanager
def deadline_scope(deadline: Deadline | float, *, past_outer: bool = False
                   ) -> Iterator[Deadline]:
    """Run the block under ``deadline`` (or one that many seconds from now); an enclosing
    scope's deadline still applies if it comes first, unless ``past_outer`` (a cleanup that
    the margin covers, such as the question after an unanswered COMMIT)."""
    mine = deadline if isinstance(deadline, Deadline) else Deadline.after(deadline)
    outer = _CURRENT.get()
    if outer is not None and outer.at < mine.at and not past_outer:
        mine = outer
    token = _CURRENT.set(mine)
    try:
        yield mine
    finally:
        _CURRENT.reset(token)
