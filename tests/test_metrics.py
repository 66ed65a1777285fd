"""Prometheus metrics (dualwrite/metrics.py, issue 19 §3) on real Kafka and PostgreSQL.

A writer's and a pool's transactions show up in ``dualwrite_transactions_total`` and the phase
histograms, the pool's groups in ``dualwrite_pool_group_size`` and its writers in use in the
saturation gauges; no label carries a transactional id. ``dualwrite status --prometheus`` prints
the exposition (parsed with prometheus_client's parser) with the in-doubt transaction a
SIGKILLed writer left. Without prometheus_client (its import blocked in a subprocess) the same
calls record nothing and fail nothing, and the CLI's metrics options say what to install.

The alerts examples/README.md documents are evaluated on scrapes of real ``dualwrite recover
--watch --metrics-port`` daemons (healthy, failing every pass) and of ``status --prometheus``:
no family without samples, no last-success time before a pass succeeded.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import dualwrite
from dualwrite import DualWriter, DualWriterPool, OutcomeUnknownError, metrics
from dualwrite.batch import BatchCoordinator
from dualwrite.cli import main
from dualwrite.errors import BatchHeuristicAbortError, HeuristicAbortError, RetriableError
from dualwrite.participant.control_plane import ControlPlane
from dualwrite.writer import PhaseHooks
from tests.support import REPO_ROOT
from tests.support.daemon import (
    SECRET,
    crash_after_db_commit,
    daemon,
    with_password,
)
from tests.support.db import fresh_schema
from tests.support.kafka import closed_port, read_committed, unique
from tests.support.workers import worker_env

pytestmark = pytest.mark.timeout(180)

ROWS = sa.Table("metric_rows", sa.MetaData(), sa.Column("id", sa.String(64), primary_key=True))


@pytest.fixture
def pg(postgres_url: str) -> Iterator[str]:
    """A fresh schema with dualwrite's tables and ROWS."""
    with fresh_schema(postgres_url, "metrics") as url:
        dualwrite.upgrade_database(url)
        engine = dualwrite.create_engine(url)
        ROWS.create(engine)
        engine.dispose()
        yield url


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def label_values() -> set[str]:
    return {v for family in REGISTRY.collect() if family.name.startswith("dualwrite_")
            for sample in family.samples for v in sample.labels.values()}


def test_a_writers_transactions_are_counted_and_timed(pg: str, bootstrap: str,
                                                      topic: str) -> None:
    def txns(outcome: str) -> float:
        return value("dualwrite_transactions_total", role="writer", outcome=outcome)

    def phases(phase: str) -> float:
        return value("dualwrite_phase_seconds_count", role="writer", phase=phase)

    before = {o: txns(o) for o in ("committed", "aborted")}
    before |= {p: phases(p) for p in ("begin", "prepare", "decide", "kafka_commit")}
    tid = unique("metrics-writer")
    with DualWriter(pg, {"bootstrap.servers": bootstrap}, transactional_id=tid) as writer:
        for key in ("a", "b"):
            with writer.transaction() as tx:
                tx.produce(topic, key, key=key)
                tx.connection.execute(ROWS.insert().values(id=key))
        with pytest.raises(ValueError), writer.transaction() as tx:
            tx.produce(topic, "never", key="never")
            raise ValueError("the application's own failure")
    assert sorted(read_committed(bootstrap, topic)) == [b"a", b"b"]
    assert txns("committed") - before["committed"] == 2
    assert txns("aborted") - before["aborted"] == 1
    assert phases("begin") - before["begin"] == 3
    for phase in ("prepare", "decide", "kafka_commit"):
        assert phases(phase) - before[phase] == 2, phase
    assert value("dualwrite_phase_seconds_sum", role="writer", phase="decide") > 0
    assert tid not in label_values()


def test_a_pools_groups_and_saturation(pg: str, bootstrap: str, topic: str) -> None:
    prefix = unique("metrics-pool")
    seen_in_use: list[float] = []
    started = threading.Event()  # after the warm-up

    class Watch(PhaseHooks):
        def prepared(self, state: object) -> None:  # a writer of the pool is running
            if not started.is_set():
                return
            seen_in_use.append(value("dualwrite_pool_writers_in_use", pool=prefix))
            seen_in_use.append(2 * value("dualwrite_pool_saturation", pool=prefix))

    groups_before = value("dualwrite_pool_group_size_count", pool=prefix)
    committed_before = value("dualwrite_transactions_total", role="pool", outcome="committed")
    requests = 16
    with DualWriterPool(pg, {"bootstrap.servers": bootstrap}, id_prefix=prefix, size=2,
                        max_group_size=8, hooks=Watch()) as pool:
        assert value("dualwrite_pool_writers", pool=prefix) == 2
        started.set()
        start = threading.Barrier(requests)

        def request(n: int) -> None:
            start.wait()
            with pool.transaction() as tx:
                tx.connection.execute(ROWS.insert().values(id=f"r{n}"))
                tx.produce(topic, f"r{n}", key=f"r{n}")

        threads = [threading.Thread(target=request, args=(n,)) for n in range(requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        groups = value("dualwrite_pool_group_size_count", pool=prefix) - groups_before
        assert value("dualwrite_pool_group_size_sum", pool=prefix) == requests
        assert 1 <= groups < requests  # some requests shared a transaction
        # The warm-up's two transactions and one per group, all with role="pool".
        assert value("dualwrite_transactions_total", role="pool", outcome="committed") \
            - committed_before == groups + 2
        assert value("dualwrite_pool_writers_in_use", pool=prefix) == 0
        ids = set(pool.transactional_ids)
    print(f"{requests} requests in {groups:.0f} groups; in use while preparing: {seen_in_use}")
    assert seen_in_use and min(seen_in_use) >= 1 and max(seen_in_use) <= 2
    assert len(read_committed(bootstrap, topic)) == requests
    # Closed: its series are gone; no label ever named a transactional id.
    assert REGISTRY.get_sample_value("dualwrite_pool_writers", {"pool": prefix}) is None
    assert not ids & label_values()


def test_status_prometheus_prints_the_exposition(pg: str, bootstrap: str, topic: str) -> None:
    url = with_password(pg)
    engine = dualwrite.create_engine(pg)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE events (id TEXT PRIMARY KEY, txn INT NOT NULL)")
    engine.dispose()
    crash_after_db_commit(url, bootstrap, topic, unique("metrics-crash"), 1)
    result = CliRunner().invoke(main, ["status", "--prometheus", "--db", url, "-b", bootstrap])
    assert result.exit_code == 0, result.output
    assert SECRET not in result.output
    samples = {s.name: s.value for family in text_string_to_metric_families(result.output)
               for s in family.samples}
    assert samples["dualwrite_in_doubt"] == 1
    assert samples["dualwrite_active_transaction_open_time_max_seconds"] > 0
    assert not any(name.startswith(("process_", "python_")) for name in samples)
    assert dualwrite.recover(pg, {"bootstrap.servers": bootstrap}).ok  # (tidy)


def test_a_heuristic_abort_counts_once(pg: str, bootstrap: str, topic: str) -> None:
    """A writer SIGKILLed after its database COMMIT, its Kafka transaction then aborted by
    force (fenced): the next writer of the id raises HeuristicAbortError at each start until it
    is acknowledged; it is counted once."""
    engine = dualwrite.create_engine(pg)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE events (id TEXT PRIMARY KEY, txn INT NOT NULL)")
    engine.dispose()
    tid = unique("metrics-heuristic")
    crash_after_db_commit(pg, bootstrap, topic, tid, 1)
    with ControlPlane({"bootstrap.servers": bootstrap}) as cp:
        cp.fence(tid)  # Kafka aborts what the database decided to commit

    def counted() -> tuple[float, float]:
        return (value("dualwrite_heuristic_outcomes_total", role="writer", kind="abort"),
                value("dualwrite_transactions_total", role="writer", outcome="heuristic"))

    before = counted()
    with DualWriter(pg, {"bootstrap.servers": bootstrap}, transactional_id=tid) as writer:
        for _ in range(2):
            with pytest.raises(HeuristicAbortError), writer.transaction():
                pass
    assert (counted()[0] - before[0], counted()[1] - before[1]) == (1, 1)


@pytest.mark.unit
def test_outcome_labels_and_the_sink_decorator() -> None:
    """Pure logic: which outcome each error means, and that a batch sink's finish counts."""
    assert metrics.outcome_of(None) == "committed"
    assert metrics.outcome_of(ValueError()) == "aborted"
    assert metrics.outcome_of(RetriableError("x")) == "aborted"
    assert metrics.outcome_of(OutcomeUnknownError("x")) == "unknown"
    assert metrics.outcome_of(HeuristicAbortError("t", "s", "d")) == "heuristic"
    assert getattr(BatchCoordinator.finish, "__wrapped__", None) is not None

    class Timings:
        verify_s = decide_s = commit_s = complete_s = sweep_s = 0.01

    @metrics.records_batches
    def finish(result: object) -> object:
        if isinstance(result, BaseException):
            raise result
        return result

    def sink(outcome: str) -> float:
        return value("dualwrite_transactions_total", role="sink", outcome=outcome)

    before = {o: sink(o) for o in ("committed", "heuristic")}
    heuristic_before = value("dualwrite_heuristic_outcomes_total", role="sink", kind="abort")
    finish(Timings())
    finish(None)  # a replay skipped: not a transaction
    with pytest.raises(BatchHeuristicAbortError):
        finish(BatchHeuristicAbortError("s", 1, [HeuristicAbortError("t", "s", "d")]))
    assert sink("committed") - before["committed"] == 1
    assert sink("heuristic") - before["heuristic"] == 1
    assert value("dualwrite_heuristic_outcomes_total", role="sink", kind="abort") \
        - heuristic_before == 1


WITHOUT_PROMETHEUS = """
import sys
sys.modules["prometheus_client"] = None  # `import prometheus_client` raises ImportError
import dualwrite
from dualwrite import metrics
assert not metrics.ENABLED
url, bootstrap, topic, prefix = sys.argv[1:]
with dualwrite.DualWriter(url, {"bootstrap.servers": bootstrap},
                          transactional_id=prefix + "-w") as writer, writer.transaction() as tx:
    tx.produce(topic, "w", key="w")
with dualwrite.DualWriterPool(url, {"bootstrap.servers": bootstrap}, id_prefix=prefix,
                              size=1) as pool, pool.transaction() as tx:
    tx.produce(topic, "p", key="p")
metrics.observe_consumer_lag("group", topic, 0, 5)
metrics.forget_consumer_lag("group", topic, 0)
try:
    metrics.exposition()
except dualwrite.ConfigurationError as exc:
    print("exposition:", exc)
print("done without prometheus_client")
"""

CLI_WITHOUT_PROMETHEUS = ("import sys; sys.modules['prometheus_client'] = None; "
                          "from dualwrite.cli import main; main()")


def test_nothing_recorded_and_nothing_fails_without_prometheus_client(
        pg: str, bootstrap: str, topic: str) -> None:
    run = subprocess.run([sys.executable, "-c", WITHOUT_PROMETHEUS, pg, bootstrap, topic,
                          unique("no-prom")], capture_output=True, text=True, env=worker_env(),
                         cwd=REPO_ROOT, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "exposition: metrics need prometheus_client: pip install 'dualwrite[metrics]'" \
        in run.stdout
    assert "done without prometheus_client" in run.stdout
    assert sorted(read_committed(bootstrap, topic)) == [b"p", b"w"]
    for args in (["status", "--prometheus"], ["recover", "--watch", "1", "--metrics-port", "1"]):
        cli = subprocess.run([sys.executable, "-c", CLI_WITHOUT_PROMETHEUS, *args, "--db", pg,
                              "-b", bootstrap], capture_output=True, text=True, env=worker_env(),
                             timeout=60, check=False)
        assert cli.returncode == 2, (args, cli.stdout, cli.stderr)
        assert "pip install 'dualwrite[metrics]'" in cli.stderr, cli.stderr


Scrape = dict[tuple[str, frozenset[tuple[str, str]]], float]
LAST_SUCCESS = "dualwrite_recovery_last_success_timestamp_seconds"


def parse(text: str) -> Scrape:
    """Every sample of an exposition; asserts that no family is empty."""
    families = list(text_string_to_metric_families(text))
    assert [f.name for f in families if not f.samples] == []
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def series(scrape: Scrape, name: str, **labels: str) -> list[float]:
    return [v for (n, ls), v in scrape.items()
            if n == name and set(labels.items()) <= set(ls)]


def alerts(before: Scrape, now_scrape: Scrape, now: float) -> dict[str, bool]:
    """examples/README.md's alert expressions, evaluated as Prometheus would on two scrapes
    (``before`` the start of the range, ``now_scrape`` its end; a series absent before counts
    from 0). ``no-success`` is the recommended companion of ``stale-success``: passes failed and
    none ever succeeded."""

    def increase(name: str) -> float:
        old = {ls: v for (n, ls), v in before.items() if n == name}
        return max((v - old.get(ls, 0.0) for (n, ls), v in now_scrape.items() if n == name),
                   default=0.0)

    return {
        # increase(dualwrite_heuristic_outcomes_total[1h]) > 0
        "heuristic": increase("dualwrite_heuristic_outcomes_total") > 0,
        # dualwrite_in_doubt > 0
        "in-doubt": any(v > 0 for v in series(now_scrape, "dualwrite_in_doubt")),
        # time() - dualwrite_recovery_last_success_timestamp_seconds > 120
        "stale-success": any(now - v > 120 for v in series(now_scrape, LAST_SUCCESS)),
        # dualwrite_recovery_passes_total{result="error"} > 0
        #   unless on() dualwrite_recovery_last_success_timestamp_seconds
        "no-success": any(v > 0 for v in series(now_scrape, "dualwrite_recovery_passes_total",
                                                  result="error"))
                      and not series(now_scrape, LAST_SUCCESS),
    }


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body: bytes = r.read()
    return body.decode()


def wait_for_passes(port: int, result: str, count: int, timeout_s: float = 60) -> Scrape:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            scrape = parse(scrape_text(port))
            if sum(series(scrape, "dualwrite_recovery_passes_total", result=result)) >= count:
                return scrape
        except OSError:  # not serving yet
            pass
        assert time.monotonic() < deadline, f"no {count} {result} passes in {timeout_s} s"
        time.sleep(0.2)


def test_documented_alerts_on_a_healthy_and_a_failing_daemon(pg: str, bootstrap: str) -> None:
    """Healthy: nothing fires, the last success is recent (and would fire 120 s after the last
    one). Every pass failing (a wrong bootstrap): no last-success time at all, so the documented
    ``time() - …last_success… > 120`` stays silent for ever; ``no-success`` fires."""
    healthy_port, failing_port = closed_port(), closed_port()
    args = ["--watch", "0.5", "--timeout", "3", "--db", pg]
    with daemon([*args, "-b", bootstrap], healthy_port) as healthy, \
            daemon([*args, "-b", f"127.0.0.1:{closed_port()}", "--max-backoff", "1"],
                   failing_port) as failing:
        first = wait_for_passes(healthy_port, "ok", 1)
        last = wait_for_passes(healthy_port, "ok", 3)
        bad_first = wait_for_passes(failing_port, "error", 1)
        bad_last = wait_for_passes(failing_port, "error", 2)
        assert healthy.proc.poll() is None and failing.proc.poll() is None
    now = time.time()
    print("healthy:", sorted(n for n, _ in last), "\nfailing:", sorted(n for n, _ in bad_last))
    assert alerts(first, last, now) == {"heuristic": False, "in-doubt": False,
                                        "stale-success": False, "no-success": False}
    assert now - series(last, LAST_SUCCESS)[0] < 10
    assert alerts(first, last, now + 130)["stale-success"]  # no success for 130 s
    assert not series(bad_last, LAST_SUCCESS)  # never set: not exported (not a 0)
    assert alerts(bad_first, bad_last, now) == {"heuristic": False, "in-doubt": False,
                                                "stale-success": False, "no-success": True}
    # The failing daemon ran no status check: no in-doubt figure (not a 0 either).
    assert not series(bad_last, "dualwrite_in_doubt")


def test_status_prometheus_prints_no_empty_family_and_no_recovery_time(pg: str,
                                                                       bootstrap: str) -> None:
    """A textfile-collector scrape: the status gauges only; no recovery alert can fire."""
    result = CliRunner().invoke(main, ["status", "--prometheus", "--db", pg, "-b", bootstrap])
    assert result.exit_code == 0, result.output
    scrape = parse(result.output)  # (this process's registry may hold other tests' series)
    assert {"dualwrite_in_doubt", "dualwrite_heuristic_unacknowledged",
            "dualwrite_active_transaction_open_time_max_seconds"} <= {n for n, _ in scrape}
    assert "# HELP dualwrite_consumer_lag " not in result.output  # no series: not printed
    if not series(scrape, "dualwrite_recovery_passes_total"):  # no daemon pass in-process
        assert LAST_SUCCESS not in result.output
    assert not any(alerts(scrape, scrape, time.time()).values())
