"""Ctrl-C during a librdkafka call that runs Python callbacks.

confluent-kafka serves delivery reports (and the error and log callbacks) as Python code inside
``flush()``. A KeyboardInterrupt raised in one of them is recorded, but the next report of the
same batch runs over it and loses it: ``flush()`` then fails with a bare ``SystemError`` and
the process goes on writing (docs/design.md, "Measurements behind the code").
:func:`interrupts_kept` notes the signal while such a call runs, so that the interrupt is raised
again once the call returned.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["interrupts_kept"]


@contextmanager
def interrupts_kept() -> Iterator[None]:
    """Raise KeyboardInterrupt after the block if SIGINT arrived during it, even if the block
    swallowed it. Only in the main thread (where Python runs signal handlers) and only while
    SIGINT has Python's default handler: an application's own handler is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    arrived = False

    def note(signum: int, frame: FrameType | None) -> None:
        nonlocal arrived
        arrived = True
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, note)
    try:
        yield
    except KeyboardInterrupt:
        raise
    except BaseException:
        if arrived:
            raise KeyboardInterrupt from None  # what the block's exception replaced
        raise
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if arrived:
        raise KeyboardInterrupt
