"""Alarms: callbacks fired at a time, by one daemon thread for the whole process.

:func:`~dualwrite.database.engine.bounded_wait` arms one around every wait for the database
and disarms it when the wait ends, which it nearly always does first. A ``threading.Timer``
there started an operating-system thread per wait (three per transaction); an alarm costs a
heap push under a lock.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable

__all__ = ["Alarm", "arm"]

log = logging.getLogger("dualwrite.database")


class Alarm:
    """One armed callback; :meth:`disarm` before it fires and it never does."""

    __slots__ = ("at", "disarmed", "fn")

    def __init__(self, at: float, fn: Callable[[], object]) -> None:
        self.at = at
        self.fn = fn
        self.disarmed = False

    def disarm(self) -> None:
        """Idempotent; a callback already running goes on (it must tolerate that)."""
        if not self.disarmed:
            self.disarmed = True
            _CLOCK.disarmed()


class _AlarmClock:
    """The heap of alarms and the thread that fires them; disarmed alarms are dropped lazily,
    and all at once when they are most of the heap."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # the thread does not survive a fork

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, Alarm]] = []
        self._order = itertools.count()
        self._disarmed = 0
        self._thread: threading.Thread | None = None

    def arm(self, delay_s: float, fn: Callable[[], object]) -> Alarm:
        alarm = Alarm(time.monotonic() + delay_s, fn)
        with self._lock:
            first = not self._heap or alarm.at < self._heap[0][0]
            heapq.heappush(self._heap, (alarm.at, next(self._order), alarm))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="dualwrite-alarms")
                self._thread.start()
            elif first:
                self._wake.notify()
        return alarm

    def disarmed(self) -> None:
        with self._lock:
            self._disarmed += 1
            if self._disarmed > 64 and self._disarmed * 2 > len(self._heap):
                self._heap = [e for e in self._heap if not e[2].disarmed]
                heapq.heapify(self._heap)
                self._disarmed = 0

    def _run(self) -> None:
        while True:
            with self._lock:
                due = self._due()
            for alarm in due:
                if not alarm.disarmed:
                    try:
                        alarm.fn()
                    except Exception:  # one alarm's failure must not stop the others
                        log.exception("an alarm's callback failed")

    def _due(self) -> list[Alarm]:
        """Under the lock: wait until an alarm is due; the due ones, taken off the heap."""
        while True:
            now = time.monotonic()
            due: list[Alarm] = []
            while self._heap and (self._heap[0][0] <= now or self._heap[0][2].disarmed):
                alarm = heapq.heappop(self._heap)[2]
                if alarm.disarmed:
                    self._disarmed = max(0, self._disarmed - 1)
                else:
                    due.append(alarm)
            if due:
                return due
            self._wake.wait(self._heap[0][0] - now if self._heap else None)


_CLOCK = _AlarmClock()


def arm(delay_s: float, fn: Callable[[], object]) -> Alarm:
    """Call ``fn()`` in the alarms' thread in ``delay_s`` seconds, unless disarmed first."""
    return _CLOCK.arm(delay_s, fn)
