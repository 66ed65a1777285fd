"""The worker scripts the tests run as separate processes (so they can be SIGKILLed), and the
environment they run in: the repository on ``PYTHONPATH``, output unbuffered."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from tests.support import REPO_ROOT

HERE = Path(__file__).resolve().parent

CONSUMER_WORKER = HERE / "consumer_worker.py"
CRASH_WORKER = HERE / "crash_worker.py"
FAULT_WORKER = HERE / "fault_worker.py"
POOL_WORKER = HERE / "pool_worker.py"
SPARK_WORKER = HERE / "spark_worker.py"
STATUS_WORKER = HERE / "status_worker.py"


def worker_env() -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


_SAY = threading.Lock()


def say(*words: object) -> None:
    """Print one line whole, even from several threads at once (``print`` writes its words
    and the newline in separate calls, which other threads' lines can split)."""
    line = " ".join(str(w) for w in words) + "\n"
    with _SAY:
        sys.stdout.write(line)
        sys.stdout.flush()
