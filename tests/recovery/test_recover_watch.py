"""``dualwrite recover --watch``: the recovery daemon across a broker restart and a PostgreSQL
restart (issue 19 §4).

The daemon runs as a process of its own against a private broker and a private PostgreSQL server
(both are restarted here), with a database URL that carries a password. While the daemon is
paused (SIGSTOP) a writer is SIGKILLed after its database COMMIT, leaving its Kafka transaction
in doubt, and then a server goes down; the daemon's passes fail with the typed error (logged,
counted in ``dualwrite_recovery_passes_total{result="error"}``), and once the server is back a
pass succeeds and commits the in-doubt transaction. Every scrape of ``/metrics`` is parsed with
prometheus_client's parser. SIGTERM (SIGINT too, in the middle of a pass) exits 0 promptly; no
line and no metric shows the password.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import IO

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

import dualwrite
from dualwrite.dev import LocalKafkaCluster, LocalPostgres
from tests.conftest import KAFKA_VERSION
from tests.support.db import fresh_schema, pg_ctl, private_postgres
from tests.support.kafka import closed_port, read_committed, unique
from tests.support.workers import CRASH_WORKER, worker_env

pytestmark = pytest.mark.timeout(300)

SECRET = "s3cret-Pa55word"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def with_password(url: str) -> str:
    """``url`` with a password (the private server trusts 127.0.0.1: it is never checked)."""
    return sa.make_url(url).set(password=SECRET).render_as_string(hide_password=False)


class Daemon:
    """A `dualwrite recover --watch` process, its output lines and its /metrics."""

    def __init__(self, args: list[str], port: int | None = None) -> None:
        self.port = port
        cmd = [sys.executable, "-m", "dualwrite.cli", "recover", *args]
        if port is not None:
            cmd += ["--metrics-port", str(port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=worker_env())
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))
        self._queue.put("")

    def output(self) -> str:
        return "\n".join(self.lines)

    def scrape(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Every sample of /metrics, parsed with prometheus_client's parser."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert SECRET not in text
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def value(self, name: str, **labels: str) -> float:
        try:
            return self.scrape().get((name, frozenset(labels.items())), 0.0)
        except OSError:  # not serving yet
            return 0.0

    def wait_for(self, what: str, condition: Callable[[], bool], timeout_s: float = 90) -> float:
        deadline = time.monotonic() + timeout_s
        started = time.monotonic()
        while not condition():
            assert self.proc.poll() is None, f"the daemon exited:\n{self.output()}"
            assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s:\n" \
                                                f"{self.output()[-4000:]}"
            time.sleep(0.3)
        return time.monotonic() - started

    def stop(self, sig: signal.Signals) -> tuple[int, float]:
        started = time.monotonic()
        self.proc.send_signal(sig)
        code = self.proc.wait(30)
        return code, time.monotonic() - started

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextlib.contextmanager
def daemon(args: list[str], port: int | None = None) -> Iterator[Daemon]:
    d = Daemon(args, port)
    try:
        yield d
    finally:
        d.kill()
        print(d.output())


@contextlib.contextmanager
def paused(d: Daemon) -> Iterator[None]:
    d.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        d.proc.send_signal(signal.SIGCONT)


def crash_after_db_commit(url: str, bootstrap: str, topic: str, tid: str, txn: int) -> None:
    """A writer that dies (SIGKILL) between its database COMMIT and its Kafka commit of its
    transaction ``txn`` (rows and records ``t<txn>-0``, ``t<txn>-1``)."""
    proc = subprocess.Popen([sys.executable, str(CRASH_WORKER), "--db", url,
                             "--bootstrap", bootstrap, "--topic", topic, "--tid", tid,
                             "--rows", "2", "--first-txn", str(txn),
                             "--crash-point", "after-db-commit"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=worker_env())
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()
        assert line.strip() == "AT after-db-commit", (line, proc.stderr and proc.stderr.read())
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalKafkaCluster]:
    """A broker of this module's own: it is killed and restarted."""
    with LocalKafkaCluster(brokers=1, kafka_version=KAFKA_VERSION, backend="jars") as c:
        yield c


@pytest.fixture
def private_pg() -> Iterator[LocalPostgres]:
    """A PostgreSQL server of this test's own (it is stopped and started). Commits are
    synchronous: an immediate shutdown must not lose the writer's decision."""
    with private_postgres(synchronous_commit="on") as pg:
        yield pg


def test_daemon_survives_a_broker_and_a_database_restart(
        cluster: LocalKafkaCluster, private_pg: LocalPostgres) -> None:
    url = with_password(private_pg.url)
    dualwrite.upgrade_database(url)
    engine = dualwrite.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE events (id TEXT PRIMARY KEY, txn INT NOT NULL)")
    engine.dispose()
    bootstrap = cluster.bootstrap_servers
    topic = cluster.create_topic(unique("watch"), 1)
    args = ["--watch", "1", "--max-backoff", "2", "--timeout", "5", "--db", url,
            "-b", bootstrap]
    with daemon(args, _free_port()) as d:
        d.wait_for("a first pass", lambda: d.value("dualwrite_recovery_passes_total",
                                                   result="ok") >= 1)

        # 1. A writer left in doubt, then the broker killed; the daemon meets it gone.
        with paused(d):
            crash_after_db_commit(url, bootstrap, topic, "watch-a", 1)
            cluster.kill_broker(0)
        d.wait_for("a failed pass (broker)", lambda: d.value(
            "dualwrite_recovery_passes_total", result="error") >= 1)
        assert d.proc.poll() is None
        cluster.restart_broker(0)
        cluster.wait_until_ready(60.0)
        d.wait_for("the in-doubt transaction committed", lambda: d.value(
            "dualwrite_recovered_transactions_total", outcome="committed") >= 1)
        assert read_committed(bootstrap, topic) == [b"t1-0", b"t1-1"]
        errors_after_broker = d.value("dualwrite_recovery_passes_total", result="error")

        # 2. Another writer left in doubt, then PostgreSQL stopped (immediate) and started.
        with paused(d):
            crash_after_db_commit(url, bootstrap, topic, "watch-b", 2)
            pg_ctl(private_pg, "stop", "-m", "immediate", "-w")
        d.wait_for("a failed pass (database)", lambda: d.value(
            "dualwrite_recovery_passes_total", result="error") > errors_after_broker)
        assert private_pg.data_dir is not None
        restarted = time.time()
        pg_ctl(private_pg, "start", "-w", "-l", str(private_pg.data_dir / "postgres.log"))
        d.wait_for("the second in-doubt transaction committed", lambda: d.value(
            "dualwrite_recovered_transactions_total", outcome="committed") >= 2)
        d.wait_for("a successful pass after the restart", lambda: d.value(
            "dualwrite_recovery_last_success_timestamp_seconds") > restarted)
        assert read_committed(bootstrap, topic) == [b"t1-0", b"t1-1", b"t2-0", b"t2-1"]
        assert d.value("dualwrite_in_doubt") == 0
        assert d.value("dualwrite_recovery_pass_seconds_count") >= 4

        code, took = d.stop(signal.SIGTERM)
    print(f"SIGTERM: exit {code} in {took:.2f} s")
    assert code == 0 and took < 10
    out = d.output()
    assert SECRET not in out
    assert "BrokerUnreachableError" in out and "DatabaseUnreachableError" in out, out
    assert out.count("finished committed=1") == 2, out
    assert "retrying in" in out and out.rstrip().endswith("stopped (signal)")


def test_a_stop_signal_abandons_a_pass_that_waits(postgres_url: str) -> None:
    """SIGINT while a pass waits for an unreachable broker (timeout 30 s): exit 0 at once."""
    with fresh_schema(postgres_url, "watch") as url:
        dualwrite.upgrade_database(url)
        args = ["--watch", "60", "--timeout", "30", "--db", url,
                "-b", f"127.0.0.1:{closed_port()}"]
        with daemon(args) as d:
            d.wait_for("the start line", lambda: any("recovery daemon" in ln for ln in d.lines))
            time.sleep(1.5)  # inside the first pass's status, waiting for the broker
            code, took = d.stop(signal.SIGINT)
        print(f"SIGINT mid-pass: exit {code} in {took:.2f} s")
        assert code == 0 and took < 5, d.output()
        assert "abandoned the running pass" in d.output()
