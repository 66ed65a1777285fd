"""What reached an application, journaled: each error's family (what the application should do
about it), its cause chain, and :class:`Journal`, the JSON lines the worker processes of the
fault suites and the soak write."""

from __future__ import annotations

import json
import threading
import time
import traceback
from typing import IO, Any

from dualwrite import errors
from dualwrite.errors import (
    DualWriteError,
    FatalError,
    HeuristicOutcomeError,
    RecoverableError,
    RetriableError,
)
from dualwrite.participant import kafka_errors

FAMILIES = ((RetriableError, "retriable"), (RecoverableError, "recoverable"),
            (HeuristicOutcomeError, "heuristic"), (FatalError, "fatal"),
            (DualWriteError, "dualwrite"))


def family(exc: BaseException) -> str:
    """``retriable``, ``recoverable``, ``heuristic``, ``fatal``, ``dualwrite`` (another
    dualwrite error), or ``foreign``: not a dualwrite error, which must never reach an
    application."""
    return family_of_class(type(exc))


def family_of_class(kind: type[BaseException]) -> str:
    """:func:`family` of an exception class."""
    for base, name in FAMILIES:
        if issubclass(kind, base):
            return name
    return "foreign"


def dualwrite_error_class(name: str) -> type[DualWriteError] | None:
    """The dualwrite error class of that (unqualified) name, from ``dualwrite.errors`` or the
    Kafka error classes; None for any other name."""
    for module in (errors, kafka_errors):
        kind = getattr(module, name, None)
        if isinstance(kind, type) and issubclass(kind, DualWriteError):
            return kind
    return None


def causes(exc: BaseException) -> list[str]:
    """Qualified class names of the exception and what it was chained from."""
    out: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(out) < 8:
        seen.add(id(current))
        out.append(f"{type(current).__module__}.{type(current).__qualname__}")
        current = current.__cause__ or current.__context__
    return out


class Journal:
    """Append-only JSON lines, each flushed to the OS before the call returns."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"e": event, "t": time.time(), **fields})
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def error(self, exc: BaseException, phase: str, **fields: Any) -> str:
        kind = family(exc)
        self.write(
            "error", phase=phase, type=type(exc).__name__, family=kind,
            msg=str(exc)[:600], causes=causes(exc),
            stack="".join(traceback.format_exception(exc))[-6000:], **fields)
        return kind

    def close(self) -> None:
        self._file.close()
