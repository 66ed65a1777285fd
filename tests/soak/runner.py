"""The soak's run: servers, proxies, the four roles under a supervisor, the fault lanes, the end.

:func:`run_soak` is the whole of it; ``python -m tests.soak`` and ``tests/soak/test_soak.py``
call it. The servers are the fault suite's (a 3-broker cluster, topic and transaction log RF 3,
min ISR 2; a PostgreSQL or MariaDB server committing durably), reached by the roles only through
:class:`~tests.support.tcp_proxy.TcpProxy` instances, so :class:`~tests.support.fault_runner.
FaultRunner` injects the broker, proxy and database-restart faults; the soak adds its own
(delays, terminated sessions, role kills).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

import dualwrite
from dualwrite.batch.naming import transactional_id
from dualwrite.dev import LocalKafkaCluster, LocalMariaDB, read_committed
from tests.soak.consumer_role import PAYMENTS
from tests.soak.report import SoakSummary, write_report
from tests.soak.roles import KILLED_LINE, READY_LINE
from tests.soak.schedule import LANES, plan
from tests.soak.service_role import ID_PREFIX
from tests.soak.verify import Expected, run_cli, verify
from tests.support.daemon import free_port
from tests.support.db import DatabaseServer, ensure_running, private_postgres, terminate_sessions
from tests.support.fault_runner import Fault, FaultRunner, heal_brokers
from tests.support.journal import Journal
from tests.support.settings import KAFKA_VERSION
from tests.support.tcp_proxy import TcpProxy
from tests.support.workers import worker_env

log = logging.getLogger("tests.soak")

RUNNER_KINDS = frozenset({"coordinator-kill", "leader-kill", "broker-kill", "broker-pause",
                          "rolling-restart", "kafka-cut", "endtxn-lost", "produce-held",
                          "database-cut", "database-restart"})
"""Kinds :class:`FaultRunner` injects; the rest are the soak's."""
SPARK_KINDS = frozenset({"spark-kill", "spark-commit-kill"})
REQUEST_TIMEOUT_MS = 5000
SPARK_PARTITIONS = 4


@dataclass
class SoakConfig:
    out: Path
    minutes: float = 3.0
    faults: int | None = None
    """Stop injecting after this many faults (else after ``minutes``)."""
    seed: int = field(default_factory=lambda: random.randrange(2**31))
    clients: int = 4
    pool_size: int = 4
    spark: bool = True
    spark_rows_per_batch: int = 200
    spark_trigger_s: float = 4.0
    kafka_version: str = KAFKA_VERSION
    database: str = "postgresql"
    """``postgresql`` or ``mariadb``."""


class Role:
    """One role's process, started again whenever it exits, as an init system would; each
    start (an incarnation) logs to a file of its own."""

    def __init__(self, name: str, command: Callable[[], list[str]], out: Path,
                 journal: Journal) -> None:
        self.name = name
        self.command = command
        self.out = out
        self.journal = journal
        self.incarnation = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.env_once: dict[str, str] = {}
        """Environment for the next start only."""
        self.kill_at: str | None = None
        """A line that, once in the current incarnation's log, gets it SIGKILLed."""
        self.armed = 0
        """The incarnation a kill-after-commit fault armed (0: none)."""
        self.restarts = 0
        self.stopping = False
        self._lock = threading.RLock()
        self._thread = threading.Thread(target=self._supervise, name=f"soak-{name}",
                                        daemon=True)

    def log_path(self, incarnation: int) -> Path:
        return self.out / f"{self.name}.{incarnation}.log"

    def start(self) -> None:
        with self._lock:
            self.incarnation += 1
            env = {**worker_env(), "SPARK_LOCAL_IP": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"),
                   **self.env_once}
            self.env_once = {}
            with self.log_path(self.incarnation).open("wb") as out:
                self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                             env=env, start_new_session=True)
        if not self._thread.is_alive():
            self._thread.start()

    def _supervise(self) -> None:
        while True:
            time.sleep(0.3)
            with self._lock:
                proc = self.proc
                if self.stopping or proc is None:
                    return
                code = proc.poll()
                if code is None:
                    if self.kill_at and self.kill_at in self.current_log():
                        self.kill_at = None
                        self._kill(proc)
                    continue
                self.journal.write("restart", role=self.name, reason=f"exit {code}",
                                   incarnation=self.incarnation)
                self.restarts += 1
            time.sleep(1.0)
            with self._lock:
                if not self.stopping:
                    self.start()

    def log_text(self, incarnation: int) -> str:
        path = self.log_path(incarnation)
        return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""

    def current_log(self) -> str:
        return self.log_text(self.incarnation)

    def logs(self) -> str:
        return "".join(self.log_text(i) for i in range(1, self.incarnation + 1))

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def kill(self, *, next_env: dict[str, str] | None = None, kill_at: str | None = None
             ) -> int:
        """SIGKILL the current incarnation (its whole process group); its number. The next
        incarnation gets ``next_env`` and is SIGKILLed once its log shows ``kill_at``."""
        with self._lock:
            assert self.proc is not None
            if next_env is not None:
                self.env_once = next_env
                self.kill_at = kill_at
            self._kill(self.proc)
            return self.incarnation

    def disarm(self) -> None:
        """No kill-after-commit left pending: the next start plain, an armed incarnation
        killed (the supervisor starts it again)."""
        with self._lock:
            self.kill_at = None
            self.env_once = {}
            armed, self.armed = self.armed, 0
            if armed and armed == self.incarnation and self.proc is not None \
                    and self.proc.poll() is None:
                self._kill(self.proc)

    def signal(self, sig: signal.Signals) -> int:
        with self._lock:
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            return self.incarnation

    def exited_since(self, incarnation: int) -> bool:
        with self._lock:
            return self.incarnation > incarnation or (
                self.proc is not None and self.proc.poll() is not None)

    def stop(self, timeout: float = 90.0, *, asked: bool = False) -> int | None:
        """SIGTERM, no restart; SIGKILL if still running after ``timeout``. Its exit code.
        ``asked``: the role was asked to stop another way; SIGTERM only after ``timeout``."""
        with self._lock:
            self.stopping = True
            proc = self.proc
        if proc is None:
            return None
        if asked:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM for %.0f s; killing it", self.name, timeout)
                self._kill(proc)
        # Spark's Python workers and JVM live in the role's process group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.returncode


@dataclass
class LaneFault:
    lane: str
    fault: Fault
    failed: bool = False
    """The fault could not be made (its target says why)."""


class Soak:
    """One run: the servers are given; :meth:`run` does the rest."""

    def __init__(self, config: SoakConfig, cluster: LocalKafkaCluster, db: DatabaseServer,
                 kafka_proxies: list[TcpProxy], db_proxy: TcpProxy) -> None:
        self.config = config
        self.cluster = cluster
        self.db = db
        self.out = config.out
        self.journal = Journal(str(self.out / "events.jsonl"))
        self.orders_topic = cluster.create_topic("soak-orders", partitions=6)
        self.paid_topic = cluster.create_topic("soak-paid", partitions=3)
        self.spark_topic = cluster.create_topic("soak-spark", partitions=SPARK_PARTITIONS)
        self.group = "soak-payments"
        self.sink_id = "soak-spark"
        tids = [f"{ID_PREFIX}-{i}" for i in range(config.pool_size)]
        tids.append(f"dualwrite-consumer-{self.group}-0")
        if config.spark:
            tids += [transactional_id(self.sink_id, b, p, 0) for b in (0, 1)
                     for p in range(SPARK_PARTITIONS)]
        self.runner = FaultRunner(cluster, db, self.orders_topic, tids, self.out,
                                  seed=config.seed, request_timeout_ms=REQUEST_TIMEOUT_MS,
                                  kafka_proxies=kafka_proxies, db_proxy=db_proxy)
        self.rng = random.Random(config.seed)
        self.faults: list[LaneFault] = []
        self._faults_lock = threading.Lock()
        self.stop_faults = threading.Event()
        self.service_port = free_port()
        self.metrics_port = free_port()
        self.scrapes: list[dict[str, Any]] = []
        self.roles = self._roles()
        self.started = time.time()

    # -- the roles -----------------------------------------------------------------------------

    def _roles(self) -> dict[str, Role]:
        py = sys.executable
        bootstrap, db = self.runner.worker_bootstrap, self.runner.worker_db_url
        roles = {
            "service": Role("service", lambda: [
                py, "-m", "tests.soak.service_role", "--db", db, "-b", bootstrap, "--topic",
                self.orders_topic, "--port", str(self.service_port),
                "--size", str(self.config.pool_size)], self.out, self.journal),
            "load": Role("load", lambda: [
                py, "-m", "tests.soak.load_role", "--url",
                f"http://127.0.0.1:{self.service_port}", "--clients", str(self.config.clients),
                "--journal", str(self.out / "load.jsonl")], self.out, self.journal),
            "consumer": Role("consumer", lambda: [
                py, "-m", "tests.soak.consumer_role", "--db", db, "-b", bootstrap,
                "--input", self.orders_topic, "--output", self.paid_topic, "--group",
                self.group, "--journal", str(self.out / "consumer.jsonl")],
                self.out, self.journal),
            "daemon": Role("daemon", lambda: [
                py, "-m", "dualwrite.cli", "-v", "recover", "--db", db, "-b", bootstrap,
                "--watch", "5", "--max-backoff", "10", "--metrics-port",
                str(self.metrics_port)], self.out, self.journal),
        }
        if self.config.spark:
            timeout = str(REQUEST_TIMEOUT_MS)
            roles["spark"] = Role("spark", lambda: [
                py, "-m", "tests.soak.spark_role", "--db", db, "-b", bootstrap, "--topic",
                self.spark_topic, "--sink-id", self.sink_id, "--checkpoint",
                str(self.out / "spark-checkpoint"), "--partitions", str(SPARK_PARTITIONS),
                "--rows-per-batch", str(self.config.spark_rows_per_batch),
                "--trigger", str(self.config.spark_trigger_s),
                "--kafka-config", f"request.timeout.ms={timeout}",
                "--kafka-config", f"socket.timeout.ms={timeout}"], self.out, self.journal)
        return roles

    def prepare_database(self) -> None:
        dualwrite.upgrade_database(self.db.url)
        engine = dualwrite.create_engine(self.db.url)
        try:
            PAYMENTS.metadata.create_all(engine)
            with engine.begin() as conn:
                conn.exec_driver_sql(
                    "CREATE TABLE events (event_id BIGINT PRIMARY KEY, payload TEXT)")
        finally:
            engine.dispose()

    def scrape_daemon(self, stop: threading.Event) -> None:
        """The daemon's pass counters every few seconds (they restart with its process)."""
        while not stop.wait(3.0):
            role = self.roles["daemon"]
            try:
                url = f"http://127.0.0.1:{self.metrics_port}/metrics"
                with urllib.request.urlopen(url, timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                continue
            passes = {s.labels.get("result", ""): int(s.value)
                      for f in text_string_to_metric_families(text)
                      if f.name == "dualwrite_recovery_passes" for s in f.samples
                      if s.name.endswith("_total")}
            scrape = {"t": time.time(), "incarnation": role.incarnation,
                      "ok": passes.get("ok", 0), "error": passes.get("error", 0)}
            self.scrapes.append(scrape)
            self.journal.write("scrape", **{k: v for k, v in scrape.items() if k != "t"})

    # -- progress ------------------------------------------------------------------------------

    def progress(self, since: float) -> dict[str, bool]:
        """Which roles completed something after ``since``."""
        done = {"service": any(e["t"] > since for e in journal_lines(self.out / "load.jsonl")
                               if e["e"] == "ack"),
                "consumer": any(e["t"] > since and e.get("n", 0) > 0
                                for e in journal_lines(self.out / "consumer.jsonl")
                                if e["e"] == "done"),
                "daemon": self.daemon_passed_since(since)}
        if "spark" in self.roles:
            done["spark"] = any(t > since
                                for t, _, _ in spark_batches(self.roles["spark"].logs()))
        return done

    def daemon_passed_since(self, since: float) -> bool:
        """Whether a daemon process completed a successful pass after ``since``."""
        before: dict[int, int] = {}
        for s in self.scrapes:
            if s["t"] <= since:
                before[s["incarnation"]] = s["ok"]
            elif s["ok"] > before.get(s["incarnation"], 0):
                return True
        return False

    def wait_for_progress(self, since: float, timeout: float) -> list[str]:
        """Until every role completed something after ``since``; the ones that did not."""
        deadline = time.monotonic() + timeout
        stalled: list[str] = []
        while time.monotonic() < deadline:
            stalled = [r for r, ok in self.progress(since).items() if not ok]
            if not stalled:
                return []
            time.sleep(1.0)
        return stalled

    # -- faults --------------------------------------------------------------------------------

    def lane(self, name: str) -> None:
        without = frozenset() if self.config.spark else SPARK_KINDS
        for planned in plan(self.config.seed, name, without=without):
            if self.stop_faults.wait(planned.gap_s):
                return
            with self._faults_lock:
                if self.config.faults is not None and len(self.faults) >= self.config.faults:
                    self.stop_faults.set()
                    return
                fault = Fault(planned.kind, "", time.time())
                made = LaneFault(name, fault)
                self.faults.append(made)
            try:
                self.inject(fault)
            except Exception as exc:  # a fault that could not be made is reported, not fatal
                log.exception("fault %s failed", planned.kind)
                made.failed = True
                fault.target += f" (could not inject: {type(exc).__name__}: {exc})"
            fault.ended = time.time()

    def inject(self, fault: Fault) -> None:
        kind = fault.kind
        if kind in RUNNER_KINDS:
            made = self.runner.inject(kind)
            fault.started, fault.target, fault.returns = made.started, made.target, made.returns
        elif kind in ("kafka-delay", "database-delay"):
            if kind == "kafka-delay":
                index, what = self.runner.a_coordinator_or_any()
                proxy = self.runner.kafka_proxies[index]
                what += f"broker {self.cluster.nodes[index].node_id}"
            else:
                assert self.runner.db_proxy is not None
                proxy, what = self.runner.db_proxy, "database"
            held = self.rng.uniform(1.0, 4.0)
            proxy.blackhole("both", existing_only=True)
            try:
                time.sleep(held)
            finally:
                proxy.release()
            fault.target = f"{what}: every connection held {held:.1f} s"
        elif kind == "database-sessions":
            fault.target = f"{terminate_sessions(self.db)} sessions terminated"
        elif kind.endswith("-commit-kill"):
            self.kill_after_commit(fault, kind.removesuffix("-commit-kill"))
        elif kind.endswith("-kill"):
            role = self.roles[kind.removesuffix("-kill")]
            fault.target = f"{role.name} #{role.kill()}"
        else:
            raise ValueError(kind)
        fault.returns.append(time.time())

    def kill_after_commit(self, fault: Fault, name: str, wait_s: float = 45.0) -> None:
        """SIGKILL ``name`` right after its next database COMMIT. The service and the consumer
        arm their hook on SIGUSR1; Spark's driver is started again with a pause at the next
        batches' decision (``DUALWRITE_SPARK_FAULTS``) and killed once it prints that it
        paused."""
        role = self.roles[name]
        if name == "spark":
            last = max((b for _, b, _ in spark_batches(role.logs())), default=-1)
            marker = "DUALWRITE-PAUSED decided"
            incarnation = role.kill(next_env={"DUALWRITE_SPARK_FAULTS": ";".join(
                f"pause:decided:{b}" for b in range(last + 1, last + 6))}, kill_at=marker) + 1
        else:
            # SIGUSR1 before the role installed its hook would kill it plainly.
            ready = time.monotonic() + 30
            while READY_LINE not in role.current_log() and time.monotonic() < ready:
                time.sleep(0.2)
            incarnation = role.signal(signal.SIGUSR1)
            marker = KILLED_LINE
        role.armed = incarnation
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not self.stop_faults.is_set():
            if role.incarnation > incarnation or (role.incarnation == incarnation
                                                  and role.exited_since(incarnation)):
                break
            time.sleep(0.2)
        text = role.log_path(incarnation).read_text(encoding="utf-8", errors="replace") \
            if role.log_path(incarnation).exists() else ""
        hit = marker in text
        fault.target = (f"{name} #{incarnation} " + ("killed after a database COMMIT" if hit
                        else "no database COMMIT before the next step (left armed)"))

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> SoakSummary:
        self.prepare_database()
        self.runner.heal_proxies()
        stop_scraping = threading.Event()
        threads = [threading.Thread(target=self.scrape_daemon, args=(stop_scraping,),
                                    daemon=True)]
        for t in threads:
            t.start()
        for role in self.roles.values():
            role.start()
        figures: dict[str, str] = {}
        began = time.time()
        # Spark's first batch too: a driver SIGKILLed while it writes its first offsets entry
        # leaves a temporary file in offsets/ that Spark 4 refuses at every later start
        # (STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY; spark/README.md).
        cold = self.wait_for_progress(0.0, timeout=300)
        if cold:
            raise RuntimeError(f"roles never completed anything before any fault: {cold}; "
                               f"logs in {self.out}")
        figures["warm-up"] = f"{time.time() - began:.0f} s (every role completed something)"
        faults_began = time.time()
        lanes = [threading.Thread(target=self.lane, args=(name,), name=f"lane-{name}",
                                  daemon=True) for name in LANES]
        for t in lanes:
            t.start()
        self.stop_faults.wait(self.config.minutes * 60)
        self.stop_faults.set()
        for t in lanes:
            t.join(300)
        figures["faults"] = f"{time.time() - faults_began:.0f} s"
        self.heal()
        healed = time.time()
        stalled = self.wait_for_progress(healed, timeout=180)
        figures["back after the last fault"] = (
            f"{time.time() - healed:.0f} s (every role completed something)" if not stalled
            else f"not within 180 s: {stalled}")
        expected = self.wind_down(healed)
        stop_scraping.set()
        figures["wind-down"] = f"{time.time() - healed:.0f} s"
        summary = verify(self, expected, stalled)
        summary.figures.update(figures)
        return summary

    def heal(self) -> None:
        """Every proxy forwarding, every broker up and in sync, the database up, no role left
        armed to die at its next COMMIT."""
        self.runner.heal_proxies()
        heal_brokers(self.cluster)
        ensure_running(self.db)
        for role in self.roles.values():
            role.disarm()
        self.runner.wait_in_sync()

    def wind_down(self, healed: float) -> Expected:
        """Stop the load, Spark (its batch in flight finishes) and the service; wait until the
        daemon finished what they left in doubt and the consumer read every order event; stop
        the consumer and the daemon."""
        exits: dict[str, int | None] = {"load": self.roles["load"].stop()}
        if self.config.spark:
            exits["spark"] = self.roles["spark"].stop(timeout=180)
        exits["service"] = self.roles["service"].stop()
        began = time.monotonic()
        in_doubt = self.wait_nothing_in_doubt()
        settled = time.monotonic() - began
        consumer_behind = self.wait_consumer_caught_up()
        for name in ("consumer", "daemon"):
            exits[name] = self.roles[name].stop()
        return Expected(exits=exits, healed=healed,
                        in_doubt=in_doubt, settled_s=settled, consumer_behind=consumer_behind)

    def wait_nothing_in_doubt(self, timeout: float = 120.0) -> list[str]:
        """Until ``dualwrite status`` finds nothing in doubt (the daemon's work once the
        roles stopped), or ``timeout``: what it still found."""
        deadline = time.monotonic() + timeout
        found: list[str] = []
        while time.monotonic() < deadline:
            status = run_cli("status", "--db", self.db.url, "-b",
                             self.cluster.bootstrap_servers)
            if status.returncode == 0:
                return []
            found = [line for line in status.stdout.splitlines() if "in-doubt" in line] or [
                f"exit {status.returncode}: {(status.stdout + status.stderr)[-500:]}"]
            time.sleep(3.0)
        return found

    def wait_consumer_caught_up(self, timeout: float = 180.0) -> int:
        """Until the consumer's payments match every order event a read_committed consumer
        sees, or ``timeout``: how many it is behind."""
        deadline = time.monotonic() + timeout
        engine = dualwrite.create_engine(self.db.url)
        behind = -1
        try:
            while time.monotonic() < deadline:
                records, _ = read_committed(self.cluster.bootstrap_servers, self.orders_topic,
                                            timeout_s=60)
                with engine.connect() as conn:
                    paid = conn.execute(sa.select(sa.func.count()).select_from(PAYMENTS)
                                        ).scalar_one()
                behind = len(records) - paid
                if behind <= 0:
                    return behind
                time.sleep(2.0)
        finally:
            engine.dispose()
        return behind

    def stop_all(self) -> None:
        for role in self.roles.values():
            with contextlib.suppress(Exception):
                role.stop(timeout=20)


def journal_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by SIGKILL
            out.append(json.loads(line))
    return out


_BATCH = re.compile(r"^BATCH (\d+) committed (\d+) t=([\d.]+)", re.M)
_RESTART = re.compile(r"^RESTART (\S+) (\S+) t=([\d.]+)(?: task=(\S+))?$", re.M)


def spark_batches(text: str) -> list[tuple[float, int, int]]:
    """``(time, batch id, records)`` of every batch the Spark role committed."""
    return [(float(m.group(3)), int(m.group(1)), int(m.group(2)))
            for m in _BATCH.finditer(text)]


def spark_restarts(text: str) -> list[tuple[float, str, str, str | None]]:
    """``(time, error class, its family, the class a failed task raised or None)`` of every
    restart of the Spark role's query after an error."""
    return [(float(m.group(3)), m.group(1).rsplit(".", 1)[-1], m.group(2), m.group(4))
            for m in _RESTART.finditer(text)]


@contextlib.contextmanager
def servers(kafka_version: str, database: str) -> Iterator[tuple[
        LocalKafkaCluster, DatabaseServer, list[TcpProxy], TcpProxy]]:
    """The fault suite's servers (``database``: ``postgresql`` or ``mariadb``, each committing
    durably), and a proxy in front of each."""
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(LocalKafkaCluster(
            brokers=3, kafka_version=kafka_version, backend="jars", heap="512m",
            startup_timeout=300, proxied=True))
        kafka_proxies = [stack.enter_context(TcpProxy(external, port=advertised,
                                                      kafka_framing=True))
                         for external, advertised in zip(cluster.external_ports,
                                                         cluster.proxy_ports, strict=True)]
        db: DatabaseServer
        if database == "mariadb":
            db = stack.enter_context(LocalMariaDB(settings={
                "innodb-flush-log-at-trx-commit": "1", "max-connections": "400"}))
        else:
            db = stack.enter_context(private_postgres(synchronous_commit="on"))
        port = sa.engine.make_url(db.url).port
        assert port is not None
        db_proxy = stack.enter_context(TcpProxy(port))
        yield cluster, db, kafka_proxies, db_proxy


def run_soak(config: SoakConfig) -> SoakSummary:
    """The whole soak; its report is written to ``config.out``."""
    config.out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    with servers(config.kafka_version, config.database) as (cluster, db, kafka_proxies,
                                                            db_proxy):
        started = time.time() - began
        soak = Soak(config, cluster, db, kafka_proxies, db_proxy)
        try:
            summary = soak.run()
        finally:
            soak.stop_all()
            soak.stop_faults.set()
            soak.runner.heal_proxies()
            heal_brokers(cluster)
    summary.seconds = time.time() - began
    summary.figures = {"servers started": f"{started:.0f} s", **summary.figures,
                       "Kafka": config.kafka_version, "database": config.database}
    events = journal_events(soak)
    with (config.out / "timeline.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    write_report(config.out, summary, events)
    # Not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs, counting them.
    fields = {f.name: getattr(summary, f.name) for f in dataclasses.fields(summary)}
    (config.out / "summary.json").write_text(json.dumps({**fields, "ok": summary.ok},
                                                        indent=1), encoding="utf-8")
    return summary


def journal_events(soak: Soak) -> list[dict[str, Any]]:
    """Every event of the run in the report's shape, from the roles' journals and logs."""
    events: list[dict[str, Any]] = []
    for lf in soak.faults:
        f = lf.fault
        events.append({"e": "fault", "kind": f.kind, "lane": lf.lane, "start": f.started,
                       "end": f.ended or f.started, "target": f.target})
    acks: Counter[int] = Counter()
    for e in journal_lines(soak.out / "load.jsonl"):
        if e["e"] == "ack":
            acks[int(e["t"])] += 1
        elif e["e"] == "error":
            events.append({"e": "error", "role": "service", "t": e["t"], "type": e["type"],
                           "family": e["family"]})
    events += [{"e": "done", "role": "service", "t": float(t), "n": n} for t, n in acks.items()]
    for e in journal_lines(soak.out / "consumer.jsonl"):
        if e["e"] == "done":
            events.append({"e": "done", "role": "consumer", "t": e["t"], "n": e["n"]})
        elif e["e"] == "error":
            events.append({"e": "error", "role": "consumer", "t": e["t"], "type": e["type"],
                           "family": e["family"]})
    if "spark" in soak.roles:
        text = soak.roles["spark"].logs()
        events += [{"e": "done", "role": "spark", "t": t, "n": n}
                   for t, _, n in spark_batches(text)]
        events += [{"e": "error", "role": "spark", "t": t, "type": kind, "family": family}
                   for t, kind, family, _ in spark_restarts(text)]
    events += [{"e": "scrape", **s} for s in soak.scrapes]
    events += [e for e in journal_lines(soak.out / "events.jsonl") if e["e"] == "restart"]
    return sorted(events, key=lambda e: float(e.get("t", e.get("start", 0.0))))
