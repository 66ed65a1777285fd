"""The soak's verdict, after the roles stopped: ``dualwrite recover`` (the CLI), then every table
against its topic as Kafka's own Java console consumer reads it (read_committed), and Kafka's
``kafka-transactions.sh`` (its ``TransactionsCommand``) for transactions left open or hanging.

The invariant, each part an anomaly count that must be 0:

- service: every order row has exactly one event and every event a row; every order the load
  saw acknowledged (``201``) has both;
- consumer: every order event was consumed exactly once (one ``soak_payments`` row), and every
  payment row has exactly one ``paid`` record and every record a row;
- Spark: every order of every batch the sink decided (the generator's ids ``0 .. (last batch +
  1) * rows - 1``) is exactly once in the table and exactly once in its topic, nothing else is;
  every batch the pipeline reported committed was decided; no prepared database transaction
  left;
- nothing open or hanging in Kafka; ``dualwrite recover`` and ``dualwrite status`` clean;
- only dualwrite's errors reached an application (anything else: ``foreign``), and every role
  completed work again after the last fault.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import dualwrite
from dualwrite.batch.decision_log import DecisionLog
from tests.soak.kafka_tools import console_consume, find_hanging, list_transactions
from tests.soak.report import SoakSummary
from tests.soak.roles import UNCAUGHT
from tests.soak.schedule import LANES
from tests.support.journal import dualwrite_error_class
from tests.support.workers import worker_env

if TYPE_CHECKING:
    from tests.soak.runner import Soak

OPEN_STATES = frozenset({"Ongoing", "PrepareCommit", "PrepareAbort", "PrepareEpochFence"})
_UNCAUGHT = re.compile(rf"^{UNCAUGHT} (\S+) (\S+)$", re.M)
SPARK_TABLE = "orders_enriched"
"""The orders pipeline's table (spark/orders_pipeline.py)."""
GRACE_S = 30.0
"""After the faults healed, how long a request may still go unanswered (a client's wait)."""


@dataclass
class Expected:
    exits: dict[str, int | None]
    """Each role's exit code when stopped (SIGTERM)."""
    healed: float
    """When the faults were over and everything was up again."""
    in_doubt: list[str]
    """What ``dualwrite status`` still found in doubt when the wait for the daemon ended."""
    settled_s: float
    """How long the daemon took to finish what the stopped roles left in doubt."""
    consumer_behind: int
    """Order events the consumer had not decided when it was stopped."""


class Tally:
    """Anomalies (counts that must be 0) and what they were, by name."""

    def __init__(self) -> None:
        self.anomalies: dict[str, int] = {}
        self.details: dict[str, list[str]] = {}

    def check(self, name: str, items: Iterable[object]) -> None:
        found = sorted(str(i) for i in items)
        self.anomalies[name] = len(found)
        if found:
            self.details[name] = found[:50]


def duplicated(values: Iterable[str]) -> list[str]:
    return [f"{v} x{n}" for v, n in Counter(values).items() if n > 1]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dualwrite.cli", *args], capture_output=True,
                          text=True, timeout=600, env=worker_env())


def verify(soak: Soak, expected: Expected, stalled: list[str]) -> SoakSummary:
    """Recover, read everything back, count anomalies; the run's summary."""
    from tests.soak.runner import journal_lines, spark_batches

    config = soak.config
    bootstrap = soak.cluster.bootstrap_servers
    version = config.kafka_version
    tally = Tally()
    figures: dict[str, str] = {}

    tally.check("in doubt after the roles stopped, not finished by the daemon in 120 s",
                expected.in_doubt)
    figures["daemon after the roles stopped"] = f"nothing in doubt after {expected.settled_s:.0f} s"
    tally.check("order events the consumer had not read when stopped",
                [f"{expected.consumer_behind} behind"] if expected.consumer_behind > 0 else [])
    recover = run_cli("recover", "--db", soak.db.url, "-b", bootstrap, "--json")
    figures["dualwrite recover"] = f"exit {recover.returncode}"
    tally.check("dualwrite recover exit code not 0", [f"exit {recover.returncode}: "
                f"{(recover.stdout + recover.stderr)[-2000:]}"] if recover.returncode else [])
    status = run_cli("status", "--db", soak.db.url, "-b", bootstrap, "--json")
    tally.check("dualwrite status after recover not clean", [
        f"exit {status.returncode}: {status.stdout[-2000:]}"] if status.returncode else [])

    engine = dualwrite.create_engine(soak.db.url)
    try:
        with engine.connect() as conn:
            rows = [r[0] for r in conn.exec_driver_sql("SELECT order_id FROM http_orders")]
            payment_amounts = [(r[0], r[1]) for r in conn.exec_driver_sql(
                "SELECT order_id, amount_cents FROM soak_payments")]
            payments = [o for o, _ in payment_amounts]
            spark_rows = [str(r[0]) for r in conn.exec_driver_sql(
                f"SELECT order_id FROM {SPARK_TABLE}")] if config.spark else []
            prepared = [str(r[-1]) for r in conn.exec_driver_sql(
                "SELECT gid FROM pg_prepared_xacts" if conn.dialect.name == "postgresql"
                else "XA RECOVER")]
        decided = DecisionLog(engine).read(soak.sink_id) if config.spark else None
    finally:
        engine.dispose()

    # Kafka's tools, each a JVM of its own, at once (a transaction still open would be
    # an anomaly of its own; find-hanging's 0 minutes: however young).
    with ThreadPoolExecutor(6) as pool:
        read = {topic: pool.submit(console_consume, bootstrap, topic, kafka_version=version,
                                   idle_timeout_s=3.0)
                for topic in (soak.orders_topic, soak.paid_topic, soak.spark_topic)
                if topic != soak.spark_topic or config.spark}
        listing = pool.submit(list_transactions, bootstrap, kafka_version=version)
        hanging_lines = pool.submit(find_hanging, bootstrap,
                                    [n.node_id for n in soak.cluster.nodes],
                                    kafka_version=version, max_transaction_timeout_min=0)
    orders = read[soak.orders_topic].result()
    paid = read[soak.paid_topic].result()
    events = [json.loads(r.value)["order_id"] for r in orders]
    tally.check("order events whose key is not their order id",
                [f"{r.key} {r.value}" for r in orders
                 if r.key != json.loads(r.value)["order_id"]])
    tally.check("order events duplicated", duplicated(events))
    tally.check("order rows without an event", set(rows) - set(events))
    tally.check("order events without a row", set(events) - set(rows))
    load = journal_lines(soak.out / "load.jsonl")
    acked = {e["id"] for e in load if e["e"] == "ack"}
    tally.check("acknowledged orders lost", acked - (set(rows) & set(events)))
    # RetriableError: nothing was decided, so a client may send the order again.
    retried = {e["id"] for e in load if e["e"] == "error" and e["family"] == "retriable"}
    tally.check("orders answered retriable that committed", retried & (set(rows) | set(events)))
    tally.check("requests unanswered after the faults healed", [
        f"{e['id']} at +{e['t'] - expected.healed:.0f} s ({e.get('why')})" for e in load
        if e["e"] == "unavailable" and e["t"] > expected.healed + GRACE_S])

    tally.check("order events not consumed", set(events) - set(payments))
    tally.check("order events consumed more than once", duplicated(payments))
    tally.check("payments of no order event", set(payments) - set(events))
    amounts = {json.loads(r.value)["order_id"]: json.loads(r.value)["amount_cents"]
               for r in orders}
    tally.check("payments whose amount is not their order's", [
        f"{o}: {a} != {amounts.get(o)}" for o, a in payment_amounts if amounts.get(o) != a])
    tally.check("paid records whose key is not their value",
                [f"{r.key} {r.value}" for r in paid if r.key != r.value])
    paid_ids = [r.value for r in paid]
    tally.check("paid records duplicated", duplicated(paid_ids))
    tally.check("payments without a paid record", set(payments) - set(paid_ids))
    tally.check("paid records without a payment", set(paid_ids) - set(payments))

    transactions = {"service": len(acked), "consumer": len(payments)}
    if config.spark:
        spark = read[soak.spark_topic].result()
        spark_ids = [str(json.loads(r.value)["order_id"]) for r in spark]
        tally.check("spark records whose key is not their order id",
                    [f"{r.key} {r.value}" for r in spark
                     if r.key != str(json.loads(r.value)["order_id"])])
        batches = 0 if decided is None else decided.last_batch_id + 1
        generated = {str(i) for i in range(batches * config.spark_rows_per_batch)}
        tally.check("spark orders of decided batches lost", generated - set(spark_ids))
        tally.check("spark records duplicated", duplicated(spark_ids))
        tally.check("spark records of no decided batch", set(spark_ids) - generated)
        tally.check("spark rows != records", set(spark_rows) ^ set(spark_ids))
        tally.check("spark rows duplicated", duplicated(spark_rows))
        reported = spark_batches(soak.roles["spark"].logs())
        tally.check("spark batches reported committed but not decided",
                    {b for _, b, _ in reported if b >= batches})
        transactions["spark"] = len(reported)
        figures["spark"] = (f"{batches} batches decided ({len(generated)} orders), "
                            f"{len(spark_ids)} records, {len(spark_rows)} rows")
    tally.check("prepared database transactions left", prepared)

    listed = listing.result()
    tally.check("open transactions (kafka-transactions.sh list)",
                [f"{t.transactional_id} {t.state}" for t in listed if t.state in OPEN_STATES])
    tally.check("hanging transactions (kafka-transactions.sh find-hanging)",
                hanging_lines.result())
    figures["Kafka's tools"] = (f"console consumer read {len(orders)} order events, "
                                f"{len(paid)} paid records; {len(listed)} transactional ids "
                                "listed")

    errors, foreign = role_errors(soak)
    tally.check("errors that are not dualwrite's (foreign) or a refused request", foreign)
    tally.check("role processes that exited unexplained (not SIGKILLed by a fault)",
                unexplained_exits(soak))
    tally.check("service shutdowns that failed", [
        f"service #{i}" for i in range(1, soak.roles["service"].incarnation + 1)
        if "Application shutdown failed" in soak.roles["service"].log_text(i)])
    made = Counter(f.lane for f in soak.faults if not f.failed)
    tally.check("lanes that made no fault", set(LANES) - set(made))
    figures["faults that could not be made"] = str(sum(1 for f in soak.faults if f.failed))
    tally.check("roles that completed nothing after the last fault", stalled)
    # uvicorn raises SIGTERM again once it shut down cleanly (the pool closed).
    clean = {"service": (0, -signal.SIGTERM)}
    bad_exits = [f"{name} exit {code}" for name, code in expected.exits.items()
                 if code is not None and code not in clean.get(name, (0,))]
    tally.check("roles that did not stop cleanly on SIGTERM", bad_exits)
    passes = daemon_passes(soak.scrapes)
    tally.check("recovery daemon without a successful pass", [] if passes["ok"] else ["0 ok"])
    transactions["daemon"] = passes["ok"]

    return SoakSummary(
        seed=config.seed, seconds=0.0, minutes_planned=config.minutes,
        faults=Counter(f.fault.kind for f in soak.faults), transactions=transactions,
        errors=errors, restarts={name: role.restarts for name, role in soak.roles.items()},
        daemon_passes=passes, anomalies=tally.anomalies, details=tally.details,
        figures=figures)


def role_errors(soak: Soak) -> tuple[dict[str, Counter[str]], list[str]]:
    """Errors that reached each role's application code, by class and family; and those that
    must not have (not dualwrite's, or a request the service refused as bad)."""
    from tests.soak.runner import journal_lines, spark_restarts

    errors: dict[str, Counter[str]] = {}
    foreign: list[str] = []
    for role, path in (("service", "load.jsonl"), ("consumer", "consumer.jsonl")):
        for e in journal_lines(soak.out / path):
            if e["e"] != "error":
                continue
            errors.setdefault(role, Counter())[f"{e['type']} ({e['family']})"] += 1
            if e["family"] in ("foreign", "client"):
                foreign.append(f"{role}: {e['type']}: {str(e.get('msg', ''))[:300]}")
    if "spark" in soak.roles:
        text = soak.roles["spark"].logs()
        restarts = spark_restarts(text)
        for _, kind, family, _ in restarts:
            errors.setdefault("spark", Counter())[f"{kind} ({family})"] += 1
        for m in _UNCAUGHT.finditer(text):  # the start failed; the supervisor started it again
            errors.setdefault("spark", Counter())[
                f"{m.group(1).rsplit('.', 1)[-1]} ({m.group(2)}, at start)"] += 1
        foreign += [f"spark: {m.group(0)}" for m in re.finditer(r"^(FOREIGN|GAVE-UP) .*$",
                                                                   text, re.M)]
        # A task's own error, reported inside BatchTasksFailedError: dualwrite's, or foreign.
        foreign += [f"spark: a task raised {task}" for _, _, _, task in restarts
                    if task is not None and dualwrite_error_class(task) is None]
    for name in ("service", "consumer", "load", "spark"):
        if name not in soak.roles:
            continue
        foreign += [f"{name}: uncaught {m.group(1)}" for m in
                    _UNCAUGHT.finditer(soak.roles[name].logs()) if m.group(2) == "foreign"]
    return errors, foreign


def unexplained_exits(soak: Soak) -> list[str]:
    """Role processes that ended but were not SIGKILLed by a fault: a service that failed to
    start (its uvicorn's exit 3, the error typed: ``SOAK-UNCAUGHT`` lines are checked), a Spark
    driver whose start failed on a dualwrite error, and one that gave up (``FOREIGN``/
    ``GAVE-UP``, counted apart) excepted."""
    from tests.soak.runner import journal_lines

    found = []
    for e in journal_lines(soak.out / "events.jsonl"):
        if e["e"] != "restart" or e["reason"] == "exit -9":
            continue
        text = soak.roles[e["role"]].log_text(e["incarnation"])
        if e["role"] == "service" and "Application startup failed" in text:
            continue
        if e["role"] == "spark" and re.search(r"^(FOREIGN|GAVE-UP) ", text, re.M):
            continue
        # The pipeline's start (its table, its topic, the sink) failed on a typed error.
        if e["role"] == "spark" and any(m.group(2) != "foreign"
                                        for m in _UNCAUGHT.finditer(text)):
            continue
        found.append(f"{e['role']} #{e['incarnation']}: {e['reason']}")
    return found


def daemon_passes(scrapes: list[dict[str, object]]) -> dict[str, int]:
    """Passes of every daemon process: each incarnation's last scrape, summed."""
    last: dict[object, dict[str, object]] = {}
    for s in scrapes:
        last[s["incarnation"]] = s
    return {k: sum(int(str(s[k])) for s in last.values()) for k in ("ok", "error")}
