"""The main demo (`./run.sh demo`): a Spark pipeline writes exactly once through a SIGKILL.

1. start a local Kafka (or use $DUALWRITE_BOOTSTRAP_SERVERS) and pick the database: an SQLite
   file (default), a local PostgreSQL (--postgres) or --db URL;
2. run spark/orders_pipeline.py on generated orders and SIGKILL its whole process group (driver,
   JVM, Python workers) midway through the participant commits of one batch: the database has
   decided the batch, Kafka has committed only part of it;
3. restart it on the same checkpoint: the sink commits the rest of the in-doubt batch, Spark's
   replay of that batch is skipped, and more batches follow;
4. compare the `orders` rows with what a read_committed consumer sees (`dualwrite.verify`),
   list open transactions and leftover staged rows, and print the verdict.
"""

from __future__ import annotations

import argparse
import os
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

import dualwrite as dw
from dualwrite.batch import DecisionLog
from dualwrite.database import mask_url

HERE = Path(__file__).resolve().parent
PIPELINE = HERE / "orders_pipeline.py"
STARTED = time.monotonic()
SHORT_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def clock() -> str:
    return f"[{time.monotonic() - STARTED:5.1f}s]"


def step(text: str) -> None:
    print(f"\n== {clock()} {text}", flush=True)


class Pipeline:
    """spark/orders_pipeline.py as a child process in its own process group, stdout echoed."""

    def __init__(self, args: list[str], log_path: Path, faults: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k != "DUALWRITE_SPARK_FAULTS"}
        env["PYTHONUNBUFFERED"] = "1"
        if faults:
            env["DUALWRITE_SPARK_FAULTS"] = faults
        print(f"$ {'DUALWRITE_SPARK_FAULTS=' + faults + ' ' if faults else ''}python "
              f"spark/orders_pipeline.py {shlex.join(args)}", flush=True)
        self.log = log_path.open("ab")
        self.proc = subprocess.Popen([sys.executable, str(PIPELINE), *args], env=env,
                                     cwd=log_path.parent, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._echo, daemon=True).start()

    def _echo(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            print(f"   {clock()} pipeline | {line.rstrip()}", flush=True)
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, prefix: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                return False
            if line.startswith(prefix):
                return True
        return False

    def kill(self) -> None:
        """SIGKILL the whole process group: the driver, its JVM and the Python workers."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9
        finally:
            self.log.close()


def open_transactions(bootstrap: str, sink_id: str) -> list[str]:
    """The sink's transactions still open at the coordinators, as "id (state)"."""
    listed = dw.open_transactions({"bootstrap.servers": bootstrap},
                                  transactional_id_prefix=sink_id)
    return [f"{t.transactional_id} ({t.state})" for t in listed]


def count_rows(engine: sa.Engine, table: str) -> int:
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table(table):
            return 0
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


def main() -> int:
    code, verdict = demo()
    print(verdict, flush=True)  # the last line, after Kafka stopped
    return code


def demo() -> tuple[int, str]:
    parser = argparse.ArgumentParser(description="dualwrite Spark demo: exactly once through a "
                                                 "SIGKILL midway through a batch's commits")
    parser.add_argument("--postgres", action="store_true",
                        help="use a local PostgreSQL server instead of an SQLite file")
    parser.add_argument("--db", help="database URL (default: an SQLite file in a temp dir)")
    parser.add_argument("--rows-per-batch", type=int, default=2000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--crash-batch", type=int, default=2,
                        help="the batch whose participant commits the SIGKILL interrupts")
    parser.add_argument("--batches", type=int, default=5, help="batches in all, both runs")
    parser.add_argument("--crash-point", choices=("committed-one", "decided", "prepared"),
                        default="committed-one",
                        help="where in the crash batch the driver pauses to be killed: after "
                             "a participant committed (default), right after the decision, or "
                             "before it (the batch is then written again)")
    args = parser.parse_args()
    if not 0 <= args.crash_batch < args.batches:
        parser.error("--crash-batch must be below --batches")

    cluster = None
    postgres = None
    bootstrap = os.environ.get("DUALWRITE_BOOTSTRAP_SERVERS")
    workdir = Path(tempfile.mkdtemp(prefix="dualwrite-spark-demo-"))
    phases: list[tuple[str, float]] = []
    try:
        if not bootstrap:
            from dualwrite.dev import LocalKafkaCluster

            step("starting a local Apache Kafka (KRaft, one broker)")
            t = time.monotonic()
            cluster = LocalKafkaCluster(brokers=1)
            cluster.start()
            bootstrap = cluster.bootstrap_servers
            phases.append(("start Kafka", time.monotonic() - t))
            print(f"Kafka at {bootstrap} ({phases[-1][1]:.1f} s)")
        db = args.db
        if db is None and args.postgres:
            from dualwrite.dev import LocalPostgres

            step("starting a local PostgreSQL")
            t = time.monotonic()
            postgres = LocalPostgres()
            postgres.start()
            db = postgres.url
            phases.append(("start PostgreSQL", time.monotonic() - t))
            print(f"PostgreSQL at {db} ({phases[-1][1]:.1f} s)")
        db = db or f"sqlite:///{workdir / 'orders.db'}"
        suffix = uuid.uuid4().hex[:6]
        sink_id, topic = f"orders-demo-{suffix}", f"orders-enriched-{suffix}"
        # A database of our own gets `orders`; a given one a fresh table beside what it holds.
        table = f"orders_{suffix}" if args.db else "orders"
        rows, crash, total = args.rows_per_batch, args.crash_batch, args.batches
        print(f"database: {mask_url(db)}\n"
              f"table: {table}\ntopic: {topic} ({args.partitions} partitions)\nsink: {sink_id}\n"
              f"work dir (checkpoint, pipeline logs): {workdir}")
        common = ["--bootstrap", bootstrap, "--db", db, "--topic", topic, "--table", table,
                  "--sink-id", sink_id,
                  "--checkpoint", str(workdir / "checkpoint"), "--partitions",
                  str(args.partitions), "--rows-per-batch", str(rows), "--trigger", "0.5",
                  "--conf", "spark.ui.enabled=false",
                  # Short-lived driver JVMs: C1 only and the serial GC start faster.
                  "--conf", f"spark.driver.extraJavaOptions={SHORT_JVM}"]
        engine = dw.create_engine(db)

        where = {"committed-one": "is decided and a participant committed",
                 "decided": "is decided, before any participant committed",
                 "prepared": "is prepared, before the decision"}[args.crash_point]
        step(f"run 1: the pipeline writes {rows} orders per batch in {args.partitions} Kafka "
             f"transactions; SIGKILL once batch {crash} {where}")
        t = time.monotonic()
        run1 = Pipeline([*common, "--max-batches", str(total)], workdir / "pipeline-1.log",
                        faults=f"pause:{args.crash_point}:{crash}")
        if not run1.wait_for("DUALWRITE-PAUSED", timeout=300):
            run1.kill()
            return 1, f"failed: the pipeline never paused; see {workdir}/pipeline-1.log"
        run1.kill()
        phases.append((f"run 1 (batches 0..{crash}, killed)", time.monotonic() - t))
        print(f"{clock()} SIGKILL sent to process group {run1.proc.pid} "
              f"(exit {run1.proc.returncode}) after {phases[-1][1]:.1f} s")

        step("state left by the crash")
        record = DecisionLog(engine).read(sink_id)
        in_doubt = open_transactions(bootstrap, sink_id)
        if record is not None:
            print(f"decision log: batch {record.last_batch_id} decided, "
                  f"{'completed' if record.completed else 'NOT completed'}, "
                  f"{len(record.participants)} participants")
        print(f"rows in {table}: {count_rows(engine, table)}")
        print(f"open Kafka transactions of the sink: {len(in_doubt)}"
              + "".join(f"\n  {tid}" for tid in in_doubt))
        if record is not None and record.last_batch_id == crash and not record.completed:
            print(f"batch {crash} is in doubt: the restart commits what is still open, and "
                  "Spark's replay of the batch is skipped")
        else:
            print(f"batch {crash} was not decided: the restart aborts what is open and Spark "
                  "writes the batch again")

        step(f"run 2: restart on the same checkpoint; finish batch {crash} and run to batch "
             f"{total - 1}")
        t = time.monotonic()
        run2 = Pipeline([*common, "--max-batches", str(total)], workdir / "pipeline-2.log")
        code = run2.wait(timeout=300)
        phases.append((f"run 2 (recovery, batches {crash}..{total - 1})", time.monotonic() - t))
        if code != 0:
            return 1, f"failed: the restarted pipeline exited with {code}; see " \
                f"{workdir}/pipeline-2.log"

        step("verifying: database rows vs records a read_committed consumer sees")
        t = time.monotonic()
        # Each record's key is its order id: `dualwrite verify --table T --key order_id`.
        report = dw.verify(engine, {"bootstrap.servers": bootstrap}, table=table,
                           key_column="order_id", topic=topic, timeout_s=60)
        with engine.connect() as conn:
            db_ids = {int(r[0]) for r in conn.execute(sa.text(f"SELECT order_id FROM {table}"))}
        still_open = open_transactions(bootstrap, sink_id)
        staged = count_rows(engine, f"{table}_dw_staging")
        record = DecisionLog(engine).read(sink_id)
        engine.dispose()
        phases.append(("verify", time.monotonic() - t))

        expected = set(range(total * rows))  # the generator's ids of batches 0..total-1
        missing_db, extra = expected - db_ids, len(db_ids - expected)
        decided = record.last_batch_id + 1 if record is not None else 0
        rows_out = [
            ("batches decided (decision log)", decided),
            ("expected order ids (0..N-1)", len(expected)),
            ("rows in the database", report.rows),
            ("records visible to read_committed", report.records),
            ("ids missing from the database", len(missing_db)),
            ("rows without a record (lost)", len(report.lost)),
            ("records without a row (phantoms)", len(report.phantoms)),
            ("ids outside 0..N-1", extra),
            ("duplicates", report.duplicate_records + len(report.duplicate_rows)),
            ("open transactions", len(still_open)),
            ("partitions held by an open transaction", len(report.open_partitions)),
            ("staged rows left", staged),
        ]
        for label, value in rows_out:
            print(f"{label:<40}{value:>8}")
        for tid in still_open:
            print(f"  open: {tid}")
        print("timings: " + ", ".join(f"{name} {secs:.1f} s" for name, secs in phases)
              + f"; total {time.monotonic() - STARTED:.1f} s")
        ok = (report.ok and not missing_db and not still_open and extra == 0 and staged == 0
              and decided == total and bool(db_ids))
        problems = "".join(f" {name}={n}" for name, n in
                           (("missing", len(missing_db)), ("outside", extra),
                            ("open_transactions", len(still_open)), ("staged", staged)) if n)
        if decided != total:
            problems += f" decided_batches={decided}/{total}"
        return (0 if ok else 1), report.summary + problems
    finally:
        if cluster is not None:
            step("stopping Kafka")
            cluster.stop()
        if postgres is not None:
            step("stopping PostgreSQL")
            postgres.stop()


if __name__ == "__main__":
    sys.exit(main())
