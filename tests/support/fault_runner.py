"""The fault runner of ``tests/faults/test_fault_suite.py``: workers, faults, metrics and the
invariant.

Several ``tests/support/workers/fault_worker.py`` processes run DualWriter transactions on a
3-broker cluster and a private PostgreSQL server while :class:`FaultRunner` injects faults one after
another, each at a random moment, and waits after each until the cluster is whole again (every
replica in sync). Given loopback proxies (:class:`tests.support.tcp_proxy.TcpProxy`, one per broker
and one in front of PostgreSQL), the workers reach both only through them, and the runner can also
cut connections, lose an EndTxn response, hold a Produce request, or cut the database's connections.
Afterwards the workers are stopped, ``dualwrite.recover`` runs, and :meth:`FaultRunner.verify`
compares the committed rows with what a read_committed consumer sees and asks the brokers for
transactions left open. Every figure the issue asks for is in :class:`Metrics`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

import dualwrite
from dualwrite.dev import LocalKafkaCluster, read_committed
from dualwrite.participant import ControlPlane, TxnState
from tests.support.db import DatabaseServer, crash_and_restart
from tests.support.tcp_proxy import TcpProxy, contains, kafka_api
from tests.support.workers import FAULT_WORKER, worker_env

log = logging.getLogger("tests.fault_suite")

KINDS = ("coordinator-kill", "leader-kill", "broker-kill", "broker-pause", "rolling-restart",
         "worker-kill", "database-restart", "kafka-cut", "endtxn-lost", "produce-held",
         "database-cut")
BROKER_KINDS = ("coordinator-kill", "leader-kill", "broker-kill", "broker-pause",
                "rolling-restart")
PROXY_KINDS = ("kafka-cut", "endtxn-lost", "produce-held", "database-cut")
"""Faults made by the proxies; they need a runner given them."""
PRODUCE, END_TXN = 0, 26  # Kafka API keys
TXN_LOG = "__transaction_state"
OPEN_STATES = (TxnState.ONGOING, TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT)
# Error families an application may see from these faults (errors.py: "try again").
ALLOWED_FAMILIES = frozenset({"retriable"})


def _commit_lost_with_the_database(error: dict[str, Any], faults: list[Fault],
                                   timeout_s: float) -> bool:
    """An OutcomeUnknownError while PostgreSQL restarted or its connections were cut (within
    the writer's timeout after, even if another fault began since: CI at bd5b9c1 put one on a
    rolling restart begun 0.6 s after a PostgreSQL restart ended): the
    COMMIT's answer was lost with the server, and after a restart its transaction id no longer
    names it (docs/design.md, "The decision must survive a database failover"). The writer
    leaves the Kafka transaction open and its next transaction, or recovery, finishes it from the
    state row; the invariant checks below still hold it to rows == records."""
    return error["type"] == "OutcomeUnknownError" and any(
        f.kind in ("database-restart", "database-cut")
        and f.started - 0.5 <= error["t"] <= f.ended + timeout_s for f in faults)


_BROKER_STOPPING = frozenset({"broker-kill", "coordinator-kill", "leader-kill", "broker-pause",
                              "rolling-restart"})


def coordinator_unanswering(error: dict[str, Any], faults: list[Fault]) -> bool:
    """An OutcomeUnknownError because the coordinator could not be asked for the whole of the
    writer's ``timeout_s``, in a call that overlapped a fault stopping a broker: the answer a
    commit needs was not to be had in time, and the writer says so instead of guessing (found
    by seed 314673822: a broker kill, then the kill of the id's coordinator 11 s later;
    DescribeTransactions answered NOT_COORDINATOR for all 20 s of asking). The transaction stays
    to recovery, and the invariant checks below still hold it to rows == records."""
    if (error["type"] != "OutcomeUnknownError"
            or "the coordinator could not be asked" not in error["msg"]):
        return False
    began = float(error.get("t0", error["t"]))
    return any(f.kind in _BROKER_STOPPING and f.started <= error["t"]
               and max(f.ended, f.started) >= began - 0.5 for f in faults)


def heal_brokers(cluster: LocalKafkaCluster) -> None:
    """Every broker of ``cluster`` running and not paused (after a fault, or a run that failed
    midway)."""
    for node in cluster.nodes:
        cluster.resume_broker(node.index)
        if not cluster.is_running(node.index):
            cluster.restart_broker(node.index)


def proc_sample(pid: int) -> dict[str, int]:
    """RSS (kB), threads and open file descriptors of a live process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    return {"rss_kb": int(fields["VmRSS"].split()[0]), "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


@dataclass
class Fault:
    kind: str
    target: str
    started: float
    ended: float = 0.0
    returns: list[float] = field(default_factory=list)
    """When what the fault took away was back (a broker serving, the database, a worker)."""
    worker: str | None = None
    instance: int = 0


@dataclass
class Metrics:
    seconds: float
    faults: Counter[str]
    committed: int
    errors: Counter[str]
    errors_by_fault: dict[str, Counter[str]]
    errored_but_committed: Counter[str]
    recovery_s: dict[str, float]
    longest_commit_gap_s: float
    anomalies: dict[str, int]
    details: dict[str, list[str]]
    resources: dict[str, dict[str, int]] = field(default_factory=dict)
    timeline: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"fault suite: {self.seconds:.0f} s, {sum(self.faults.values())} faults, "
                 f"{self.committed} transactions committed"]
        lines.append("  faults injected: " + _fmt(self.faults))
        lines.append("  errors reaching the application: " + (_fmt(self.errors) or "none"))
        for kind, errors in sorted(self.errors_by_fault.items()):
            lines.append(f"    during {kind}: {_fmt(errors)}")
        if self.errored_but_committed:
            lines.append("  errors whose transaction did commit: "
                         + _fmt(self.errored_but_committed))
        lines.append("  longest return (broker serving, database up, worker process started)"
                     " -> first commit (s): " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(self.recovery_s.items())))
        lines.append(f"  longest gap between two commits: {self.longest_commit_gap_s:.2f} s")
        lines.append("  anomalies: " + _fmt(Counter(self.anomalies)) + " (must all be 0)")
        lines += [f"    {line}" for line in self.timeline]
        for what, sample in self.resources.items():
            lines.append(f"  long-running worker at {what}: {sample}")
        for what, items in self.details.items():
            for item in items[:12]:
                lines.append(f"  [{what}] {item}")
        return "\n".join(lines)


def _fmt(counts: Counter[str] | dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


@dataclass
class WorkerProcess:
    tid: str
    instance: int
    proc: subprocess.Popen[bytes]
    journal: Path


class FaultRunner:
    """Workers on one topic, faults on the cluster, the database and the workers."""

    def __init__(self, cluster: LocalKafkaCluster, db: DatabaseServer, topic: str,
                 tids: list[str], workdir: Path, *, seed: int, timeout_s: float = 20.0,
                 request_timeout_ms: int = 5000, protected: str | None = None,
                 kafka_proxies: Sequence[TcpProxy] = (), db_proxy: TcpProxy | None = None) -> None:
        self.cluster = cluster
        self.db = db
        self.db_url = db.url
        """The runner's own way to the database (recovery, the invariant): never cut."""
        self.kafka_proxies = list(kafka_proxies)
        """``kafka_proxies[i]`` forwards broker ``i``'s advertised EXTERNAL port to it."""
        self.db_proxy = db_proxy
        self.worker_bootstrap = (",".join(p.address for p in self.kafka_proxies)
                                 or cluster.bootstrap_servers)
        self.worker_db_url = db.url if db_proxy is None else sa.engine.make_url(db.url).set(
            port=db_proxy.port).render_as_string(hide_password=False)
        self.topic = topic
        self.tids = tids
        self.workdir = workdir
        self.rng = random.Random(seed)
        self.timeout_s = timeout_s
        self.request_timeout_ms = request_timeout_ms
        self.protected = protected
        """A worker never killed (its RSS, threads and fds are sampled)."""
        self.workers: dict[str, WorkerProcess] = {}
        self.journals: list[Path] = []
        self.faults: list[Fault] = []
        self.started = time.time()
        self.resources: dict[str, dict[str, int]] = {}
        admin: dict[str, Any] = {"bootstrap.servers": cluster.bootstrap_servers,
                                 "logger": logging.getLogger("tests.fault_suite.admin")}
        self._admin = AdminClient(admin)

    @property
    def kafka(self) -> dict[str, Any]:
        return {"bootstrap.servers": self.cluster.bootstrap_servers}

    # -- workers -------------------------------------------------------------------------------

    def start_workers(self) -> None:
        for tid in self.tids:
            self.spawn(tid, 1)

    def spawn(self, tid: str, instance: int) -> None:
        journal = self.workdir / f"{tid}.{instance}.jsonl"
        out = (self.workdir / f"{tid}.{instance}.log").open("wb")
        cmd = [sys.executable, str(FAULT_WORKER), "--db", self.worker_db_url, "--bootstrap",
               self.worker_bootstrap, "--topic", self.topic, "--tid", tid,
               "--instance", str(instance), "--out", str(journal),
               "--timeout-s", str(self.timeout_s),
               "--request-timeout-ms", str(self.request_timeout_ms)]
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    env=worker_env())
        finally:
            out.close()
        self.workers[tid] = WorkerProcess(tid, instance, proc, journal)
        self.journals.append(journal)

    def stop_workers(self, timeout: float = 60.0) -> None:
        """SIGTERM (the worker ends its transaction and closes its writer), SIGKILL if late."""
        for w in self.workers.values():
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for w in self.workers.values():
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %s ignored SIGTERM; killing it", w.tid)
                w.proc.kill()
                w.proc.wait(10)

    def sample(self, label: str) -> None:
        if self.protected is not None:
            self.resources[label] = proc_sample(self.workers[self.protected].proc.pid)

    def dead_workers(self) -> list[str]:
        return [f"{w.tid}#{w.instance} exit {w.proc.returncode}"
                for w in self.workers.values() if w.proc.poll() is not None]

    # -- the cluster ---------------------------------------------------------------------------

    def index_of(self, node_id: int) -> int:
        return next(n.index for n in self.cluster.nodes if n.node_id == node_id)

    def coordinator_of(self, tid: str) -> int | None:
        with ControlPlane(self.kafka, timeout_s=15) as cp:
            desc = cp.describe_transaction(tid)
        return None if desc is None else desc.coordinator_id

    def leader_of_a_partition(self) -> int:
        parts = self._admin.list_topics(self.topic, timeout=10).topics[self.topic].partitions
        leaders = [p.leader for p in parts.values() if p.leader >= 0]
        return self.rng.choice(leaders)

    def coordinator_index(self, tid: str) -> int:
        """The index of the broker coordinating ``tid``; a random broker while it has none."""
        node = self.coordinator_of(tid)
        if node is None:
            return self.rng.randrange(len(self.cluster.nodes))
        return self.index_of(node)

    def a_coordinator_or_any(self) -> tuple[int, str]:
        """The index of the coordinator of a random worker's id (half the time, or when it has
        none yet: a random broker), and what was picked."""
        if self.rng.random() < 0.5:
            tid = self.rng.choice(self.tids)
            node = self.coordinator_of(tid)
            if node is not None:
                return self.index_of(node), f"coordinator of {tid.rsplit('-', 1)[-1]}: "
        return self.rng.randrange(len(self.cluster.nodes)), ""

    def heal_proxies(self) -> None:
        """Every proxy forwarding again: rules disarmed, nothing refused or held."""
        for proxy in (*self.kafka_proxies, *([self.db_proxy] if self.db_proxy else [])):
            proxy.disarm()
            proxy.refuse(False)
            proxy.release()

    def wait_in_sync(self, timeout: float = 180.0) -> None:
        """Until every partition of the topic and the transaction log has all replicas in sync."""
        deadline = time.monotonic() + timeout
        lagging: list[str] = []
        while time.monotonic() < deadline:
            try:
                topics = self._admin.list_topics(timeout=10).topics
                lagging = [f"{name}-{p.id}" for name in (self.topic, TXN_LOG)
                           for p in topics[name].partitions.values()
                           if p.leader < 0 or len(p.isrs) < len(self.cluster.nodes)]
                if not lagging:
                    return
            except Exception as exc:  # metadata while a broker is joining
                lagging = [repr(exc)]
            time.sleep(0.5)
        raise AssertionError(f"replicas not in sync after {timeout:.0f} s: {lagging[:10]}")

    def bounce(self, fault: Fault, index: int) -> None:
        """SIGKILL broker ``index``, leave it down a moment, start it again."""
        down = self.rng.uniform(0.5, 2.5)
        self.cluster.kill_broker(index)
        time.sleep(down)
        began = time.monotonic()
        self.cluster.restart_broker(index)
        fault.returns.append(time.time())
        fault.target += (f"broker {self.cluster.nodes[index].node_id}, down {down:.1f} s, "
                         f"start {time.monotonic() - began:.1f} s")

    # -- faults --------------------------------------------------------------------------------

    def inject(self, kind: str) -> Fault:
        fault = Fault(kind, "", time.time())
        log.info("fault %d: %s", len(self.faults) + 1, kind)
        if kind == "coordinator-kill":
            tid = self.rng.choice(self.tids)
            fault.target = f"coordinator of {tid.rsplit('-', 1)[-1]}: "
            self.bounce(fault, self.coordinator_index(tid))
        elif kind == "leader-kill":
            fault.target = f"leader of {self.topic.rsplit('-', 1)[-1]}: "
            self.bounce(fault, self.index_of(self.leader_of_a_partition()))
        elif kind == "broker-kill":
            self.bounce(fault, self.rng.randrange(len(self.cluster.nodes)))
        elif kind == "broker-pause":
            if self.rng.random() < 0.5:
                node = self.coordinator_of(self.rng.choice(self.tids))
                index = self.index_of(node) if node is not None else 0
            else:
                index = self.rng.randrange(len(self.cluster.nodes))
            seconds = self.request_timeout_ms / 1000 + self.rng.uniform(2.0, 3.0)
            fault.target = f"broker {self.cluster.nodes[index].node_id} for {seconds:.1f} s"
            self.cluster.pause_broker(index)
            try:
                time.sleep(seconds)
            finally:
                self.cluster.resume_broker(index)
            fault.returns.append(time.time())
        elif kind == "rolling-restart":
            steps = []
            for index in range(len(self.cluster.nodes)):
                began = time.monotonic()
                self.cluster.stop_broker(index)
                stopped = time.monotonic()
                self.cluster.restart_broker(index)
                fault.returns.append(time.time())
                started = time.monotonic()
                self.wait_in_sync()
                steps.append(f"{self.cluster.nodes[index].node_id}: stop {stopped - began:.1f} "
                             f"start {started - stopped:.1f} sync {time.monotonic() - started:.1f}")
            fault.target = "; ".join(steps)
        elif kind == "worker-kill":
            candidates = [t for t in self.tids if t != self.protected]
            tid = self.rng.choice(candidates)
            w = self.workers[tid]
            fault.target = f"worker {tid.rsplit('-', 1)[-1]}#{w.instance}"
            fault.worker = tid
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait(10)
            self.spawn(tid, w.instance + 1)
            fault.instance = w.instance + 1
            fault.returns.append(time.time())
        elif kind == "database-restart":
            fault.target = "immediate"
            crash_and_restart(self.db, self.rng.uniform(0.5, 2.0))
            fault.returns.append(time.time())
        elif kind in PROXY_KINDS:
            self.inject_through_proxy(fault)
        else:
            raise ValueError(kind)
        if kind in BROKER_KINDS and kind != "rolling-restart":
            began = time.monotonic()
            self.wait_in_sync()
            fault.target += f", in sync {time.monotonic() - began:.1f} s"
        fault.ended = time.time()
        self.faults.append(fault)
        log.info("fault %d done in %.1f s: %s %s", len(self.faults), fault.ended - fault.started,
                 kind, fault.target)
        return fault

    def inject_through_proxy(self, fault: Fault) -> None:
        """The faults made by the proxies; ``fault.returns`` is when traffic flowed again."""
        if not self.kafka_proxies or self.db_proxy is None:
            raise ValueError(f"{fault.kind} needs the runner's proxies")
        refusing = self.rng.uniform(0.5, 3.0) if self.rng.random() < 0.5 else 0.0
        if fault.kind == "kafka-cut":
            index, what = self.a_coordinator_or_any()
            proxy = self.kafka_proxies[index]
            cut = self.cut(proxy, refusing)
            fault.target = (f"{what}broker {self.cluster.nodes[index].node_id}, {cut} cut, "
                            f"refused {refusing:.1f} s")
        elif fault.kind == "endtxn-lost":
            tid = self.rng.choice(self.tids)
            index = self.coordinator_index(tid)
            proxy = self.kafka_proxies[index]
            dropped = proxy.drop_next_response(kafka_api(END_TXN)).wait(15)
            proxy.disarm()
            fault.target = (f"coordinator of {tid.rsplit('-', 1)[-1]}: broker "
                            f"{self.cluster.nodes[index].node_id}, "
                            + ("response dropped" if dropped else "no EndTxn in 15 s"))
        elif fault.kind == "produce-held":
            index = self.index_of(self.leader_of_a_partition())
            proxy = self.kafka_proxies[index]
            caught = proxy.hold_next_request(kafka_api(PRODUCE)).wait(15)
            held = self.request_timeout_ms / 1000 + self.rng.uniform(1.0, 3.0) if caught else 0
            time.sleep(held)
            proxy.disarm()
            proxy.release()
            fault.target = (f"leader broker {self.cluster.nodes[index].node_id}, "
                            + (f"held {held:.1f} s" if caught else "no Produce in 15 s"))
        elif fault.kind == "database-cut":
            # Half the time at a COMMIT: forwarded, its answer lost (an unknown outcome).
            at_commit = self.rng.random() < 0.5
            seen = at_commit and self.db_proxy.drop_next_response(contains(b"COMMIT")).wait(15)
            self.db_proxy.disarm()
            cut = self.cut(self.db_proxy, refusing)
            fault.target = (("after a COMMIT, " if seen else "any moment, ")
                            + f"{cut} cut, refused {refusing:.1f} s")
        fault.returns.append(time.time())

    @staticmethod
    def cut(proxy: TcpProxy, refusing: float) -> int:
        """Cut every connection of ``proxy`` (how many); refuse new ones ``refusing`` seconds."""
        proxy.refuse(refusing > 0)
        try:
            cut = proxy.cut()
            time.sleep(refusing)
        finally:
            proxy.refuse(False)
        return cut

    def run(self, schedule: Iterable[str], gap: tuple[float, float] = (0.5, 2.0)) -> None:
        """Inject the faults of ``schedule`` in order, a random gap before each."""
        for kind in schedule:
            time.sleep(self.rng.uniform(*gap))
            dead = self.dead_workers()
            assert not dead, f"workers exited on their own: {dead}"
            self.inject(kind)

    def wait_for_commits(self, since: float, timeout: float = 60.0) -> list[str]:
        """Until every worker committed after ``since``; the ones that did not."""
        deadline = time.monotonic() + timeout
        stalled = list(self.tids)
        while time.monotonic() < deadline:
            done = {e["ids"][0].split(":", 1)[0] for e in self.events() if e["e"] == "commit"
                    and e["t"] > since}
            stalled = [t for t in self.tids if t not in done]
            if not stalled:
                break
            time.sleep(0.5)
        return stalled

    def events(self) -> Iterator[dict[str, Any]]:
        for path in self.journals:
            if not path.exists():
                continue
            for line in path.read_text(encoding="utf-8").splitlines():
                with contextlib.suppress(json.JSONDecodeError):  # a line cut by SIGKILL
                    yield json.loads(line)

    # -- the invariant -------------------------------------------------------------------------

    def verify(self, stalled: list[str]) -> Metrics:
        """Recover, then compare rows with read_committed records; every figure of the run."""
        events = list(self.events())
        commits = sorted((e for e in events if e["e"] == "commit"), key=lambda e: e["t"])
        errors = [e for e in events if e["e"] == "error"]
        anomalies: dict[str, int] = {}
        details: dict[str, list[str]] = {}

        report = dualwrite.recover(self.db_url, self.kafka, self.tids, timeout_s=60)
        anomalies["recovery failed or heuristic"] = len(report.failed) + len(report.heuristic)
        details["recovery"] = [f"{r.transactional_id}: {r.outcome} {r.detail}"
                               for r in (*report.failed, *report.heuristic)]

        with ControlPlane(self.kafka, timeout_s=30) as cp:
            described = cp.describe_transactions(self.tids)
            prefix = self.tids[0].rsplit("-", 1)[0] + "-"  # the run's ids, w0 .. wN
            listed = cp.list_transactions(states=OPEN_STATES, prefix=prefix)
        open_now = sorted({f"{d.transactional_id} {d.state.value}" for d in described.values()
                           if d.state.in_flight}
                          | {f"{t.transactional_id} {t.state.value}" for t in listed})
        anomalies["open transactions"] = len(open_now)
        details["open"] = open_now

        records, unread = read_committed(self.cluster.bootstrap_servers, self.topic,
                                         timeout_s=90)
        anomalies["partitions not readable to the end"] = len(unread)
        keys = [(k or b"").decode() for k, _ in records]
        anomalies["key != value"] = sum(1 for k, v in records if k != v)
        counts = Counter(keys)
        dups = sorted(k for k, c in counts.items() if c > 1)
        anomalies["duplicate records"] = len(dups)
        details["duplicates"] = dups
        engine = dualwrite.create_engine(self.db_url)
        try:
            with engine.connect() as conn:
                query = sa.text("SELECT id FROM fault_rows WHERE worker IN :tids").bindparams(
                    sa.bindparam("tids", expanding=True))
                rows = {r[0] for r in conn.execute(query, {"tids": self.tids})}
        finally:
            engine.dispose()
        in_kafka = set(keys)
        anomalies["rows without records"] = len(rows - in_kafka)
        anomalies["records without rows"] = len(in_kafka - rows)
        details["rows without records"] = sorted(rows - in_kafka)
        details["records without rows"] = sorted(in_kafka - rows)
        acknowledged = {i for e in commits for i in e["ids"]}
        lost = acknowledged - (rows & in_kafka)
        anomalies["lost (committed, then missing)"] = len(lost)
        details["lost"] = sorted(lost)
        missing = (acknowledged | rows) - in_kafka
        if missing:
            details["missing records in the log (read_uncommitted)"] = self.locate(missing)

        foreign = [e for e in errors if e["family"] == "foreign"]
        anomalies["non-dualwrite exceptions"] = len(foreign)
        details["foreign"] = [f"{e['phase']}: {e['type']}: {e['msg'][:200]}\n{e['stack']}"
                              for e in foreign]
        def during(t: float) -> str:
            """The last fault begun before ``t``, if ``t`` is within its end + the timeout."""
            for f in reversed(self.faults):
                if f.started - 0.5 <= t:
                    return f.kind if t <= f.ended + self.timeout_s else "no fault"
            return "no fault"

        unexpected = [e for e in errors if e["family"] != "foreign"
                      and e["family"] not in ALLOWED_FAMILIES
                      and not _commit_lost_with_the_database(e, self.faults, self.timeout_s)
                      and not coordinator_unanswering(e, self.faults)]
        anomalies["non-retriable dualwrite errors"] = len(unexpected)
        details["non-retriable"] = [f"{e['phase']}: {e['type']}: {e['msg'][:300]}\n{e['stack']}"
                                    for e in unexpected]
        anomalies["workers that never committed after the last fault"] = len(stalled)
        details["stalled"] = stalled

        by_fault: dict[str, Counter[str]] = {}
        for e in errors:
            by_fault.setdefault(during(e["t"]), Counter())[e["type"]] += 1
        committed_anyway: Counter[str] = Counter(
            e["type"] for e in errors if e.get("ids") and set(e["ids"]) & rows)

        # A restarted worker is back when its process has started (not when it was spawned).
        starts = {(e["tid"], e["instance"]): e["t"] for e in events if e["e"] == "start"}
        recovery: dict[str, float] = {}
        timeline: list[str] = []
        for f in self.faults:
            took = 0.0
            returns = f.returns
            if f.worker is not None and (f.worker, f.instance) in starts:
                returns = [starts[(f.worker, f.instance)]]
            for back in returns:
                after = [c["t"] for c in commits if c["t"] >= back
                         and (f.worker is None or c["ids"][0].startswith(f.worker + ":"))]
                took = max(took, (after[0] if after else time.time()) - back)
            recovery[f.kind] = max(recovery.get(f.kind, 0.0), took)
            timeline.append(f"{f.started - self.started:6.1f} s {f.kind} ({f.target}): "
                            f"{f.ended - f.started:.1f} s, first commit {took:.2f} s after return")
        times = [self.started] + [c["t"] for c in commits]
        gap = max((b - a for a, b in itertools.pairwise(times)), default=0.0)

        return Metrics(
            seconds=time.time() - self.started,
            faults=Counter(f.kind for f in self.faults),
            committed=len(commits),
            errors=Counter(f"{e['type']} ({e['family']})" for e in errors),
            errors_by_fault=by_fault,
            errored_but_committed=committed_anyway,
            recovery_s=recovery,
            longest_commit_gap_s=gap,
            anomalies=anomalies,
            details={k: v for k, v in details.items() if v},
            resources=self.resources,
            timeline=timeline,
        )

    def locate(self, keys: set[str]) -> list[str]:
        """Where the records of the transactions of ``keys`` are in the log, uncommitted
        reads included: tells an aborted record from one that never arrived."""
        from confluent_kafka import Consumer, TopicPartition

        txns = {k.rsplit(":", 1)[0] for k in keys}
        consumer = Consumer({"bootstrap.servers": self.cluster.bootstrap_servers,
                             "group.id": f"fault-locate-{time.time()}",
                             "isolation.level": "read_uncommitted",
                             "enable.auto.commit": False, "auto.offset.reset": "earliest"})
        found: dict[str, list[str]] = {}
        try:
            parts = consumer.list_topics(self.topic, timeout=10).topics[self.topic].partitions
            consumer.assign([TopicPartition(self.topic, p, 0) for p in parts])
            idle = time.monotonic() + 10
            while time.monotonic() < idle:
                for msg in consumer.consume(10_000, 1.0):
                    if msg.error() is None:
                        idle = time.monotonic() + 5
                        key = (msg.key() or b"").decode()
                        if key.rsplit(":", 1)[0] in txns:
                            found.setdefault(key, []).append(
                                f"p{msg.partition()}@{msg.offset()}")
        finally:
            consumer.close()
        return [f"{k}{' (missing)' if k in keys else ''}: "
                f"{', '.join(found.get(k, [])) or 'not in the log'}"
                for k in sorted(set(found) | keys)]

    def error_samples(self, per_type: int = 1) -> list[str]:
        """One stack per error type seen (for the report of library problems)."""
        seen: Counter[str] = Counter()
        out = []
        for e in self.events():
            if e["e"] == "error" and seen[e["type"]] < per_type:
                seen[e["type"]] += 1
                out.append(f"--- {e['type']} ({e['family']}, {e['phase']}) causes={e['causes']}"
                           f"\n{e['msg'][:400]}\n{e['stack']}")
        return out
