"""``dualwrite recover --watch``: recovery as a long-lived process, a pass per interval.

Each pass (recover, then status) runs in a thread of its own, so a stop signal need not wait
for it; its result is one timestamped line on stdout and the Prometheus metrics
(:mod:`dualwrite.metrics`). A failed pass is retried with exponential back-off.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

import click

from dualwrite import metrics
from dualwrite.errors import DualWriteError
from dualwrite.participant.outcome import Outcome
from dualwrite.recovery.report import RecoveryReport, StatusReport

__all__ = ["RecoveryDaemon", "RecoveryPass"]

RecoveryPass = Callable[[], tuple[RecoveryReport, StatusReport]]
"""One pass: what recovery did, then what status found."""

_FINISHED = (Outcome.COMMITTED, Outcome.ABORTED, Outcome.ALREADY_COMMITTED, Outcome.ACKNOWLEDGED)
_HEURISTIC_KIND = {Outcome.HEURISTIC_ABORT: "abort", Outcome.OUTCOME_UNREADABLE: "unreadable"}

# How long a stop signal waits for the running pass before abandoning it.
_STOP_GRACE_S = 2.0


class RecoveryDaemon:
    """One pass per interval, a line per pass, metrics; stops on SIGTERM and SIGINT. A failed
    pass (any dualwrite error: a side unreachable, a fatal one) is logged by its type and
    retried after ``interval * 2**(failures - 1)``, at most ``max_backoff_s``."""

    def __init__(self, one_pass: RecoveryPass, interval_s: float, max_backoff_s: float) -> None:
        self._one_pass = one_pass
        self._interval_s = interval_s
        self._max_backoff_s = max_backoff_s
        self._stop = threading.Event()
        self._heuristic_seen: set[tuple[str, str]] = set()

    def run(self) -> None:
        """Run passes until a stop signal (installs handlers for SIGTERM and SIGINT)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self._stop.set())
        failures = 0
        number = 0
        while not self._stop.is_set():
            number += 1
            ok, line = self._pass(number)
            failures = 0 if ok else failures + 1
            delay = self._interval_s if ok else min(
                self._interval_s * 2 ** (failures - 1), self._max_backoff_s)
            _say(line if ok else f"{line}; retrying in {delay:g} s ({failures} in a row)")
            self._stop.wait(delay)
        _say("stopped (signal)")

    def _pass(self, number: int) -> tuple[bool, str]:
        """One pass in a thread of its own, so that a stop signal need not wait for it; whether
        it succeeded, and its log line."""
        started = time.monotonic()
        box: list[tuple[RecoveryReport, StatusReport] | BaseException] = []

        def target() -> None:
            try:
                box.append(self._one_pass())
            except BaseException as exc:
                box.append(exc)

        worker = threading.Thread(target=target, daemon=True, name="dualwrite-recover-pass")
        worker.start()
        while worker.is_alive() and not self._stop.is_set():
            worker.join(0.2)
        worker.join(_STOP_GRACE_S if worker.is_alive() else None)
        if worker.is_alive():
            # Recovery is safe to interrupt anywhere (the next run finishes what this one
            # began); its worker threads are not daemons, so leave without waiting for them.
            _say(f"pass {number}: stopping (signal); abandoned the running pass, the next run "
                 "finishes it")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        elapsed = time.monotonic() - started
        result = box[0]
        if isinstance(result, BaseException):
            what = (f"{type(result).__name__}: {result}" if isinstance(result, DualWriteError)
                    else f"unexpected {type(result).__name__}")
            metrics.recovery_pass(False, elapsed)
            return False, f"pass {number}: error in {elapsed:.2f} s: {what}"
        return self._passed(number, elapsed, *result)

    def _passed(self, number: int, elapsed: float, report: RecoveryReport,
                state: StatusReport) -> tuple[bool, str]:
        """A pass that ran to its end: its metrics, whether it resolved everything, its line."""
        finished = [r.outcome.value for r in report.results if r.outcome in _FINISHED]
        finished += [s.outcome.value for s in report.sinks if s.outcome in _FINISHED]
        new_heuristic = [_HEURISTIC_KIND[r.outcome] for r in report.heuristic
                         if (r.transactional_id, r.state) not in self._heuristic_seen]
        self._heuristic_seen |= {(r.transactional_id, r.state) for r in report.heuristic}
        ok = not (report.failed or report.failed_sinks)
        metrics.recovery_pass(ok, elapsed, finished, new_heuristic)
        in_doubt = len(state.in_doubt) + len(state.sinks_in_doubt)
        heuristic = len(state.heuristic) + len(report.heuristic_sinks)
        metrics.status_observed(in_doubt, heuristic,
                                state.active_transaction_open_time_max_ms / 1000)
        counts = {o: finished.count(o) for o in dict.fromkeys(finished)}
        done = ", ".join(f"{k}={v}" for k, v in counts.items()) or "nothing"
        failed = len(report.failed) + len(report.failed_sinks)
        return ok, (f"pass {number}: {'ok' if ok else 'error'} in {elapsed:.2f} s: finished "
                    f"{done}; in doubt {in_doubt}, heuristic {heuristic}"
                    + (f", unresolved {failed}" if failed else ""))


def _say(line: str) -> None:
    """One line of the daemon's log, timestamped (stdout)."""
    click.echo(f"{datetime.now(UTC).isoformat(timespec='seconds')} {line}")
