"""The process's alarm clock (bounded_wait's watchdog): fires on time, never after disarm,
in time order whatever the order armed, and survives a failing callback."""

from __future__ import annotations

import threading
import time

import pytest

from dualwrite.database import alarms

pytestmark = pytest.mark.unit


def test_fires_on_time_and_not_when_disarmed() -> None:
    fired: list[tuple[str, float]] = []
    started = time.monotonic()
    done = threading.Event()

    def note(name: str) -> None:
        fired.append((name, time.monotonic() - started))
        if name == "last":
            done.set()

    late = alarms.arm(0.30, lambda: note("late"))
    alarms.arm(0.40, lambda: note("last"))
    alarms.arm(0.05, lambda: 1 / 0)  # a failing callback stops nothing
    alarms.arm(0.10, lambda: note("early"))  # armed after a later one: still first
    gone = [alarms.arm(0.2, lambda: note("disarmed")) for _ in range(200)]
    for alarm in gone:
        alarm.disarm()
    late.disarm()
    assert done.wait(5)
    assert [name for name, _ in fired] == ["early", "last"]
    assert 0.09 <= fired[0][1] < 0.35 and 0.39 <= fired[1][1] < 1.5
