"""What the soak's role processes share: a hook that SIGKILLs the process right after its next
database COMMIT once SIGUSR1 armed it, and SIGTERM as a request to stop."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType

from dualwrite.participant import PreparedTxnState
from dualwrite.writer import PhaseHooks

KILLED_LINE = "SOAK-KILLED after-database-commit"
READY_LINE = "SOAK-READY"
"""Printed once the role's SIGUSR1 handler is installed (SIGUSR1 before it would kill)."""
UNCAUGHT = "SOAK-UNCAUGHT"


class KillAfterDatabaseCommit(PhaseHooks):
    """Armed by SIGUSR1: at the next database COMMIT (a transaction decided, its Kafka
    transaction not committed yet) print :data:`KILLED_LINE` and SIGKILL this process; every
    Kafka commit calls ``on_kafka_committed``."""

    def __init__(self, on_kafka_committed: Callable[[], None] | None = None) -> None:
        self.armed = threading.Event()
        self._on_kafka_committed = on_kafka_committed
        signal.signal(signal.SIGUSR1, self._arm)
        print(READY_LINE, flush=True)

    def _arm(self, signum: int, frame: FrameType | None) -> None:
        self.armed.set()

    def database_committed(self, state: PreparedTxnState) -> None:
        if self.armed.is_set():
            print(KILLED_LINE, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def kafka_committed(self, state: PreparedTxnState) -> None:
        if self._on_kafka_committed is not None:
            self._on_kafka_committed()


def report_uncaught() -> None:
    """An exception no code of the role caught (main thread or any other) prints
    ``SOAK-UNCAUGHT <module.class> <family>`` before Python's own report: the verdict counts
    those that are not dualwrite's."""
    from tests.support.journal import family

    def line(exc: BaseException) -> None:
        print(f"{UNCAUGHT} {type(exc).__module__}.{type(exc).__qualname__} {family(exc)}",
              flush=True)

    default_hook = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        line(exc)
        default_hook(kind, exc, tb)

    default_thread_hook = threading.excepthook

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None:
            line(args.exc_value)
        default_thread_hook(args)

    sys.excepthook = hook
    threading.excepthook = thread_hook


def role_logging() -> None:
    """Timestamped log lines, dualwrite's lifecycle lines (INFO: transactional id, producer id,
    epoch) among them: what a failed verdict is read against."""
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("dualwrite").setLevel(logging.INFO)


def on_sigterm(stop: Callable[[], None]) -> None:
    """Call ``stop`` on SIGTERM (the supervisor's request to stop)."""
    def handler(signum: int, frame: FrameType | None) -> None:
        stop()
    signal.signal(signal.SIGTERM, handler)
