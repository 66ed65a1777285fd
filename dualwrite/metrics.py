"""Prometheus metrics: one home for every name, label and bucket dualwrite records.

``prometheus_client`` is an optional extra (``pip install dualwrite[metrics]``); without it every
function here does nothing and costs one check. The metrics live in prometheus_client's default
registry, so an application's own ``/metrics`` shows them; ``dualwrite recover --watch
--metrics-port`` serves them itself and ``dualwrite status --prometheus`` prints them once.

Labels are bounded and never carry a secret: a role, an outcome, a phase, a pool's id prefix, a
consumer's group/topic/partition; never a transactional id, a URL or a message.

Only families with samples are exposed: a labelled family appears with its first series, and the
unlabelled ones (the status gauges, the recovery daemon's pass duration and last-success time) are
made when first set, so a scrape never shows a value nobody measured (an alert on ``time() -
dualwrite_recovery_last_success_timestamp_seconds`` must not see a 0 before the first success).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, Protocol, TypeVar, cast

from dualwrite.errors import (
    ConfigurationError,
    HeuristicCommitError,
    HeuristicOutcomeError,
    OutcomeUnreadableError,
    RecoverableError,
)

try:
    import prometheus_client
    from prometheus_client.registry import Collector
except ImportError:  # the optional extra is not installed: nothing is recorded
    prometheus_client = None  # type: ignore[assignment]
    Collector = object  # type: ignore[assignment,misc]

__all__ = [
    "CONTENT_TYPE",
    "ENABLED",
    "PhaseClock",
    "PoolUsage",
    "Role",
    "consumer_fenced_batch",
    "exposition",
    "forget_consumer_lag",
    "heuristic_outcome",
    "observe_consumer_lag",
    "observe_group_size",
    "outcome_of",
    "records_batches",
    "recovery_pass",
    "serve",
    "status_observed",
    "transaction_ended",
]

ENABLED = prometheus_client is not None
"""Whether metrics are recorded (``prometheus_client`` is installed)."""

CONTENT_TYPE: str = prometheus_client.CONTENT_TYPE_LATEST if prometheus_client is not None \
    else "text/plain; version=0.0.4; charset=utf-8"
"""The media type of :func:`exposition`'s text (for an application's own ``/metrics``)."""

Role = Literal["writer", "pool", "sink", "consumer"]
ROLES: tuple[str, ...] = ("writer", "pool", "sink", "consumer")
Phase = Literal["begin", "prepare", "decide", "kafka_commit", "verify", "complete", "sweep"]

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_GROUP_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
_PREFIX = "dualwrite_"


class _Metrics:
    """The metric objects, made once (only when prometheus_client is installed)."""

    def __init__(self) -> None:
        p = prometheus_client
        assert p is not None
        self.transactions = p.Counter(
            "dualwrite_transactions", "Dual-write transactions ended, by outcome (committed, "
            "aborted, unknown: left to recovery, heuristic) and role (writer, pool, sink, "
            "consumer).", ["role", "outcome"])
        self.phases = p.Histogram(
            "dualwrite_phase_seconds", "Time spent in each phase of a transaction (begin, "
            "prepare, decide = the database COMMIT, kafka_commit; a sink's verify, complete, "
            "sweep).", ["role", "phase"], buckets=_SECONDS)
        self.heuristic = p.Counter(
            "dualwrite_heuristic_outcomes", "Heuristic outcomes met (Kafka and the database "
            "disagree about a decided transaction), by role and kind.", ["role", "kind"])
        self.group_size = p.Histogram(
            "dualwrite_pool_group_size", "Requests per group-commit transaction of a "
            "DualWriterPool.", ["pool"], buckets=_GROUP_SIZES)
        self.pool_in_use = p.Gauge(
            "dualwrite_pool_writers_in_use", "Writers of a DualWriterPool running a "
            "transaction now.", ["pool"])
        self.pool_size = p.Gauge(
            "dualwrite_pool_writers", "Writers (transactional ids) of a DualWriterPool.",
            ["pool"])
        self.pool_saturation = p.Gauge(
            "dualwrite_pool_saturation", "Writers in use / writers of a DualWriterPool "
            "(0..1).", ["pool"])
        self.consumer_lag = p.Gauge(
            "dualwrite_consumer_lag", "Records of a partition not yet processed by the "
            "exactly-once consumer (high watermark - decided position).",
            ["group", "topic", "partition"])
        self.fenced_batches = p.Counter(
            "dualwrite_consumer_fenced_batches", "Batches of the exactly-once consumer refused "
            "because a rebalance moved one of their partitions away (the new owner decides "
            "them).", ["group"])
        self.passes = p.Counter(
            "dualwrite_recovery_passes", "Passes of `dualwrite recover --watch`, by result "
            "(ok; error: a side unreachable or ids unresolved).", ["result"])
        self.recovered = p.Counter(
            "dualwrite_recovered_transactions", "Transactions recovery finished, by outcome "
            "(committed, aborted, already-committed, heuristic-acknowledged).", ["outcome"])
        self._made: dict[str, Any] = {}

    def _once(self, name: str, make: Callable[[], _T]) -> _T:
        with _lock:
            if name not in self._made:
                self._made[name] = make()
            return cast(_T, self._made[name])

    def gauge(self, name: str) -> prometheus_client.Gauge:
        """The unlabelled gauge ``name`` (of ``_GAUGES``), made (and exposed) on first use."""
        p = prometheus_client
        assert p is not None
        return self._once(name, lambda: p.Gauge(name, _GAUGES[name]))

    def pass_seconds(self) -> prometheus_client.Histogram:
        p = prometheus_client
        assert p is not None
        return self._once("dualwrite_recovery_pass_seconds", lambda: p.Histogram(
            "dualwrite_recovery_pass_seconds", "Duration of one recovery pass (recover and "
            "status).", buckets=_SECONDS))


_T = TypeVar("_T")
_IN_DOUBT = "dualwrite_in_doubt"
_HEURISTIC_PENDING = "dualwrite_heuristic_unacknowledged"
_OPEN_MAX = "dualwrite_active_transaction_open_time_max_seconds"
_LAST_SUCCESS = "dualwrite_recovery_last_success_timestamp_seconds"
_GAUGES = {
    _IN_DOUBT: "Transactional ids and batch sinks in doubt at the last status check (a "
               "decision still to be carried out).",
    _HEURISTIC_PENDING: "Transactional ids and batch sinks with a heuristic outcome not yet "
                        "acknowledged, at the last status check.",
    _OPEN_MAX: "Age of the longest-open Kafka transaction of the ids dualwrite knows and the "
               "hanging ones (KIP-939's ActiveTransactionOpenTimeMaxMs), at the last status "
               "check.",
    _LAST_SUCCESS: "Unix time of the last recovery pass that succeeded (absent until one "
                   "has).",
}


_M = _Metrics() if prometheus_client is not None else None
_lock = threading.Lock()


def outcome_of(exc: BaseException | None) -> str:
    """The ``outcome`` label of a transaction that ended with ``exc`` (None: committed)."""
    if exc is None:
        return "committed"
    if isinstance(exc, HeuristicOutcomeError):
        return "heuristic"
    if isinstance(exc, RecoverableError):  # OutcomeUnknownError and the like: recovery decides
        return "unknown"
    return "aborted"


def _heuristic_kind(exc: HeuristicOutcomeError) -> str:
    if isinstance(exc, HeuristicCommitError):
        return "commit"
    if isinstance(exc, OutcomeUnreadableError):
        return "unreadable"
    return "abort"


def transaction_ended(role: str, exc: BaseException | None) -> None:
    """Count one transaction of ``role`` that ended with ``exc`` (None: committed); a
    heuristic outcome is counted in ``dualwrite_heuristic_outcomes_total`` too."""
    if _M is None:
        return
    _M.transactions.labels(role, outcome_of(exc)).inc()
    if isinstance(exc, HeuristicOutcomeError):
        heuristic_outcome(role, exc)


def heuristic_outcome(role: str, exc: HeuristicOutcomeError) -> None:
    """Count a heuristic outcome met (handed to a hook, or raised)."""
    if _M is not None:
        _M.heuristic.labels(role, _heuristic_kind(exc)).inc()


class PhaseClock:
    """Times the phases of one transaction: :meth:`lap` records the time since the last lap
    (or the start, or :meth:`restart`) as that phase."""

    def __init__(self, role: str) -> None:
        self._role = role
        self._last = time.perf_counter()

    def restart(self) -> None:
        """Start the next phase now (the time in between, e.g. the application's block, is not
        a phase of dualwrite's)."""
        self._last = time.perf_counter()

    def lap(self, phase: Phase) -> None:
        now = time.perf_counter()
        if _M is not None:
            series = _PHASE_SERIES.get((self._role, phase))
            if series is None:  # labels() takes a lock and builds its key: once per series
                series = _PHASE_SERIES[(self._role, phase)] = _M.phases.labels(self._role, phase)
            series.observe(now - self._last)
        self._last = now


_PHASE_SERIES: dict[tuple[str, str], Any] = {}
"""The phase histogram's series by (role, phase); never removed, so safe to keep."""


class PoolUsage:
    """A :class:`~dualwrite.writer.DualWriterPool`'s writers in use, size and saturation."""

    def __init__(self, pool: str, size: int) -> None:
        self._pool = pool
        self._size = size
        self._in_use = 0
        self._lock = threading.Lock()
        if _M is not None:
            _M.pool_size.labels(pool).set(size)
            self._publish()

    def _publish(self) -> None:
        if _M is not None:
            _M.pool_in_use.labels(self._pool).set(self._in_use)
            _M.pool_saturation.labels(self._pool).set(self._in_use / max(1, self._size))

    def taken(self) -> None:
        """A writer started a transaction (or was checked out)."""
        with self._lock:
            self._in_use += 1
            self._publish()

    def returned(self) -> None:
        """That writer is free again."""
        with self._lock:
            self._in_use = max(0, self._in_use - 1)
            self._publish()

    def close(self) -> None:
        """The pool is closed: its series are removed."""
        if _M is None:
            return
        for gauge in (_M.pool_in_use, _M.pool_size, _M.pool_saturation):
            with contextlib.suppress(KeyError):  # another pool of this prefix removed it
                gauge.remove(self._pool)


def observe_group_size(pool: str, requests: int) -> None:
    """One group-commit transaction of ``pool`` served ``requests`` requests."""
    if _M is not None:
        _M.group_size.labels(pool).observe(requests)


def observe_consumer_lag(group: str, topic: str, partition: int, lag: int) -> None:
    """The exactly-once consumer's lag on one assigned partition (records not yet decided)."""
    if _M is not None:
        _M.consumer_lag.labels(group, topic, str(partition)).set(max(0, lag))


def forget_consumer_lag(group: str, topic: str, partition: int) -> None:
    """The partition was revoked: its lag series is removed."""
    if _M is None:
        return
    with contextlib.suppress(KeyError):
        _M.consumer_lag.remove(group, topic, str(partition))


def consumer_fenced_batch(group: str) -> None:
    """The exactly-once consumer of ``group`` dropped a batch a rebalance fenced."""
    if _M is not None:
        _M.fenced_batches.labels(group).inc()


class _Timings(Protocol):
    verify_s: float
    decide_s: float
    commit_s: float
    complete_s: float
    sweep_s: float


_F = TypeVar("_F", bound=Callable[..., Any])


def records_batches(finish: _F) -> _F:
    """Decorates a batch sink's ``finish``: counts each batch as a ``role="sink"``
    transaction and records its phases from the returned timings (None, a replay skipped, is
    not counted)."""

    @functools.wraps(finish)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            timings: _Timings | None = finish(*args, **kwargs)
        except BaseException as exc:
            transaction_ended("sink", exc)
            raise
        if timings is not None and _M is not None:
            for phase, seconds in (("verify", timings.verify_s), ("decide", timings.decide_s),
                                   ("kafka_commit", timings.commit_s),
                                   ("complete", timings.complete_s),
                                   ("sweep", timings.sweep_s)):
                _M.phases.labels("sink", phase).observe(seconds)
            transaction_ended("sink", None)
        return timings

    return wrapper  # type: ignore[return-value]


def recovery_pass(ok: bool, seconds: float, finished: Iterable[str] = (),
                  heuristic: Iterable[str] = ()) -> None:
    """One pass of the recovery daemon: its result, duration, the outcomes it carried out
    (``Outcome`` values of what it finished) and the kinds (abort, unreadable) of the heuristic
    outcomes it met for the first time (``role="recovery"``)."""
    if _M is None:
        return
    _M.passes.labels("ok" if ok else "error").inc()
    _M.pass_seconds().observe(seconds)
    if ok:
        _M.gauge(_LAST_SUCCESS).set(time.time())
    for outcome in finished:
        _M.recovered.labels(outcome).inc()
    for kind in heuristic:
        _M.heuristic.labels("recovery", kind).inc()


def status_observed(in_doubt: int, heuristic: int, open_max_s: float) -> None:
    """What a status check found: ids and sinks in doubt, heuristic outcomes not acknowledged,
    and the longest-open transaction's age."""
    if _M is None:
        return
    _M.gauge(_IN_DOUBT).set(in_doubt)
    _M.gauge(_HEURISTIC_PENDING).set(heuristic)
    _M.gauge(_OPEN_MAX).set(open_max_s)


def _require() -> None:
    if prometheus_client is None:
        raise ConfigurationError("metrics need prometheus_client: pip install 'dualwrite[metrics]'")


class _Shown(Collector):
    """The default registry's families that have samples; only dualwrite's with ``own``."""

    def __init__(self, own: bool) -> None:
        self._own = own

    def collect(self) -> Iterator[Any]:
        assert prometheus_client is not None
        for family in prometheus_client.REGISTRY.collect():
            if family.samples and (not self._own or family.name.startswith(_PREFIX)):
                yield family

    def restricted_registry(self, names: Iterable[str]) -> Any:
        """``/metrics?name[]=...`` (prometheus_client's HTTP server asks for it)."""
        assert prometheus_client is not None
        return prometheus_client.REGISTRY.restricted_registry(names)


def exposition(*, everything: bool = False) -> str:
    """dualwrite's metrics in the Prometheus text format, only families with samples;
    ``everything``: every family of the default registry with samples (the process's, the
    application's own). :class:`ConfigurationError` without prometheus_client. Serve it with
    :data:`CONTENT_TYPE`."""
    _require()
    return prometheus_client.generate_latest(_Shown(own=not everything)).decode()


def serve(port: int, host: str = "127.0.0.1") -> Callable[[], None]:
    """Serve ``/metrics`` (the default registry's families with samples: dualwrite's and the
    process's metrics) on ``host:port`` in a daemon thread; returns a function that stops it."""
    _require()
    try:
        server, thread = prometheus_client.start_http_server(port, addr=host,
                                                             registry=_Shown(own=False))
    except OSError as exc:
        raise ConfigurationError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") \
            from None

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop
