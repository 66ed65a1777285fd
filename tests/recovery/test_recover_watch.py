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

import signal
import time
from collections.abc import Iterator

import pytest

import dualwrite
from dualwrite.dev import LocalKafkaCluster, LocalPostgres
from tests.support.daemon import (
    SECRET,
    crash_after_db_commit,
    daemon,
    free_port,
    paused,
    with_password,
)
from tests.support.db import fresh_schema, pg_ctl, private_postgres
from tests.support.kafka import closed_port, read_committed, unique
from tests.support.settings import KAFKA_VERSION

pytestmark = pytest.mark.timeout(300)

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
    with daemon(args, free_port()) as d:
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
