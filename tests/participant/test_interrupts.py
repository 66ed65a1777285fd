"""interrupts_kept: a SIGINT a block swallowed is raised again after it (no broker needed)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from dualwrite.participant.interrupts import interrupts_kept

pytestmark = pytest.mark.unit


def handlers_run_here() -> None:
    """A Python call: CPython runs pending signal handlers as a function starts."""


def swallow_sigint_then(exc: BaseException | None) -> None:
    """What confluent-kafka's flush() did: the interrupt is lost, a SystemError (or nothing)
    comes out instead."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        handlers_run_here()
    except KeyboardInterrupt:
        pass
    if exc is not None:
        raise exc


@pytest.mark.parametrize("then", [None, SystemError("returned NULL without setting an exception")])
def test_a_swallowed_interrupt_is_raised_again(then: BaseException | None) -> None:
    with pytest.raises(KeyboardInterrupt), interrupts_kept():
        swallow_sigint_then(then)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_a_signal_the_block_is_untouched() -> None:
    with pytest.raises(SystemError), interrupts_kept():
        raise SystemError("a real one")
    with interrupts_kept():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_applications_own_handler_is_left_alone() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with interrupts_kept():
            os.kill(os.getpid(), signal.SIGINT)
        assert seen == [signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_outside_the_main_thread_nothing_changes() -> None:
    handlers: list[object] = []

    def run() -> None:
        with interrupts_kept():
            handlers.append(signal.getsignal(signal.SIGINT))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert handlers == [signal.default_int_handler]
