"""Benchmark: dualwrite's Spark sink against Spark's built-in Kafka sink, in one run.

Same broker, database, session and data: each batch is ``spark.range`` slice of ``--partitions``
partitions with ``key`` = the id as a string and ``value`` = the id left-padded to
``--value-bytes``. Per batch, in this order:

1. ``baseline``: Spark's built-in Kafka sink (``df.write.format("kafka")``, at-least-once);
2. ``naive+sql``: what a Spark user writes today for Kafka and a table in one ``foreachBatch``,
   not atomic: the built-in Kafka sink, then Spark's JDBC writer (``df.write.jdbc``, append,
   ``reWriteBatchedInserts=true``) into a table of the same shape (PostgreSQL only);
3. ``naive+copy``: the same, with a table written the fast way: the built-in Kafka sink, then
   one ``COPY`` per task into the table (the sink's own COPY code), not atomic (PostgreSQL only);
4. ``floor``: no sink, only what any Python sink pays: the rows cross to PySpark's Python workers
   through ``mapInArrow`` and become Python bytes (``to_pylist``), as the sink's tasks do;
4a. ``copy``: no Kafka at all: the rows cross to Python and each task COPYs them into a table of
   the same shape, committed (PostgreSQL only). ``copy`` minus ``floor`` is what the database
   costs to take each row once on this machine, whatever the protocol around it; the report's
   ``bound`` line adds it to the ``kafka`` case's time: the best rate any atomic sink that writes
   each row once to the topic and the table could reach here;
5. ``kafka``: ``ExactlyOnceSink`` writing the topic only;
6. ``kafka+sql``: ``ExactlyOnceSink`` writing the topic and a SQL table in its default mode:
   write-once on PostgreSQL (each task COPYs into the table in a transaction it prepares),
   staging on SQLite (executemany);
7. ``kafka+staged``: the same, forced to stage (COPY into a staging table, moved into the table
   after the commit: each row written twice).

The sink is called as ``sink(df, batch_id)``, exactly what ``foreachBatch`` does with each
micro-batch, so neither side pays a streaming trigger or checkpoint and the baseline is the same
``DataFrame.write`` that the built-in streaming Kafka sink runs per micro-batch. The cases
are interleaved batch by batch so that load from other processes hits them alike. One warm-up
batch per case is excluded. Then ``--tiny-batches`` batches of ``--partitions`` records (one per
partition) isolate the sink's fixed per-batch cost. At the end, a read_committed consumer checks
that every dualwrite topic holds each record exactly once (and the table every row).

    ./run.sh bench spark [--quick] [--records 1000000] [--batches 5] [--partitions 8]
                         [--value-bytes 200] [--db postgres|sqlite] [--json]

Starts a local Kafka and PostgreSQL unless ``DUALWRITE_BOOTSTRAP_SERVERS`` / ``--db-url`` (or
``DUALWRITE_DATABASE_URL``) are given. The Kafka connector jars are resolved once with Maven from
``bench/spark-kafka.pom.xml`` and cached under ``.dualwrite/spark-kafka-jars``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
POM = Path(__file__).resolve().parent / "spark-kafka.pom.xml"
CASES = ("baseline", "naive+sql", "naive+copy", "floor", "copy", "kafka", "kafka+sql",
         "kafka+staged")
SINK_CASES = ("kafka", "kafka+sql", "kafka+staged")
NAIVE_SQL_CASES = ("naive+sql", "naive+copy")  # PostgreSQL only
COPY_CASES = ("naive+copy", "copy")  # PostgreSQL only: a COPY per task, each into a table


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {load()}] {msg}", file=sys.stderr, flush=True)


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


# -- setup ---------------------------------------------------------------------------------------

def spark_kafka_jars() -> list[str]:
    """The connector jars, resolved by Maven once and cached by the pom's hash."""
    home = Path(os.environ.get("DUALWRITE_HOME") or REPO / ".dualwrite")
    digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:12]
    out = home / "spark-kafka-jars" / digest
    jars = sorted(out.glob("*.jar")) if out.is_dir() else []
    if not jars:
        mvn = shutil.which("mvn")
        if mvn is None:
            raise SystemExit("mvn not found: install Maven to fetch Spark's Kafka connector")
        log(f"resolving Spark's Kafka connector with Maven into {out}")
        tmp = out.with_name(f"{digest}.{os.getpid()}.tmp")
        subprocess.run([mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
                        f"-DoutputDirectory={tmp}"], check=True, stdout=sys.stderr)
        tmp.replace(out)
        jars = sorted(out.glob("*.jar"))
    return [str(j) for j in jars]


def spark_session(master: str, partitions: int, jars: list[str]) -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable  # workers must import dualwrite
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(master).appName("dualwrite bench_spark")
             .config("spark.jars", ",".join(jars))
             .config("spark.pyspark.python", sys.executable)
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", str(partitions))
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def batch_df(spark: Any, start: int, count: int, partitions: int, value_bytes: int) -> Any:
    from pyspark.sql import functions as F

    ids = F.col("id").cast("string")
    return spark.range(start, start + count, 1, partitions).select(
        F.col("id"), ids.alias("key"), F.lpad(ids, value_bytes, "0").alias("value"))


def create_table(engine: Any, name: str, value_bytes: int) -> None:
    import sqlalchemy as sa

    meta = sa.MetaData()
    sa.Table(name, meta, sa.Column("id", sa.BigInteger, primary_key=True),
             sa.Column("value", sa.String(max(value_bytes, 32)), nullable=False))
    meta.create_all(engine)


def floor_task(batches: Any) -> Any:
    """The Python side of a mapInArrow sink without the sink: Arrow rows to Python bytes."""
    import pyarrow as pa

    rows = 0
    for batch in batches:
        for name in ("key", "value"):
            _ = [v.encode() for v in batch.column(name).to_pylist()]
        rows += batch.num_rows
    yield pa.RecordBatch.from_pydict({"rows": pa.array([rows], pa.int64())})


def copy_task(libpq_url: str, table: str, batches: Any) -> Any:
    """``naive+copy``'s task: its partition's rows into ``table`` with one COPY, committed."""
    import psycopg
    import pyarrow as pa

    from dualwrite.batch.target import ArrowCopy

    with psycopg.connect(libpq_url) as conn:
        with conn.cursor() as cursor, ArrowCopy(cursor, table, ("id", "value")) as copy:
            for batch in batches:
                copy.write(batch)
        rows = copy.rows
    yield pa.RecordBatch.from_pydict({"rows": pa.array([rows], pa.int64())})


# -- measurement ---------------------------------------------------------------------------------

@dataclass
class Batch:
    case: str
    batch_id: int
    records: int
    wall_s: float
    timings: Any = None  # BatchTimings for the dualwrite cases

    @property
    def rate(self) -> float:
        return self.records / self.wall_s

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"case": self.case, "batch_id": self.batch_id,
                               "records": self.records, "wall_s": round(self.wall_s, 4),
                               "records_per_s": round(self.rate)}
        t = self.timings
        if t is not None:
            out.update(tasks_s=round(self.wall_s - driver_s(t), 4),
                       verify_s=round(t.verify_s, 4), decide_s=round(t.decide_s, 4),
                       commit_s=round(t.commit_s, 4), complete_s=round(t.complete_s, 4),
                       sweep_s=round(t.sweep_s, 4), commit_phase_s=round(t.commit_phase_s, 4))
        return out


@dataclass
class Results:
    batches: list[Batch] = field(default_factory=list)

    def of(self, case: str) -> list[Batch]:
        return [b for b in self.batches if b.case == case]


def driver_s(t: Any) -> float:
    return float(t.verify_s + t.commit_phase_s + t.sweep_s)


def overall_rate(batches: list[Batch]) -> float:
    return sum(b.records for b in batches) / sum(b.wall_s for b in batches)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Runner:
    """Writes one batch with each case and records what it took."""

    def __init__(self, spark: Any, args: argparse.Namespace, bootstrap: str,
                 sinks: dict[str, Any], topics: dict[str, str],
                 jdbc: tuple[str, str, dict[str, str]] | None = None,
                 copy_into: tuple[str, dict[str, str]] | None = None) -> None:
        self.spark, self.args, self.bootstrap = spark, args, bootstrap
        self.sinks, self.topics, self.jdbc = sinks, topics, jdbc
        self.copy_into = copy_into  # (libpq URL, {case: table}) of the COPY cases
        self._seen: dict[str, Any] = {}
        for case, sink in sinks.items():
            sink.on_batch = self._recorder(case)

    def _recorder(self, case: str) -> Callable[[int, Any, int], None]:
        def on_batch(batch_id: int, timings: Any, records: int) -> None:
            self._seen[case] = (timings, records)
        return on_batch

    def write(self, case: str, batch_id: int, start: int, count: int) -> Batch:
        df = batch_df(self.spark, start, count, self.args.partitions, self.args.value_bytes)
        started = time.perf_counter()
        timings = None
        if case == "baseline":
            (df.select("key", "value").write.format("kafka")
             .option("kafka.bootstrap.servers", self.bootstrap)
             .option("topic", self.topics[case]).save())
        elif case == "naive+sql":
            # foreachBatch as a Spark user writes it: both writers on the same DataFrame, one
            # after the other, nothing atomic (no persist: spark.range recomputes for less).
            assert self.jdbc is not None
            (df.select("key", "value").write.format("kafka")
             .option("kafka.bootstrap.servers", self.bootstrap)
             .option("topic", self.topics[case]).save())
            url, table, props = self.jdbc
            df.select("id", "value").write.jdbc(url, table, mode="append", properties=props)
        elif case == "naive+copy":
            (df.select("key", "value").write.format("kafka")
             .option("kafka.bootstrap.servers", self.bootstrap)
             .option("topic", self.topics[case]).save())
            self._copy(case, df, count)
        elif case == "copy":
            self._copy(case, df, count)
        elif case == "floor":
            rows = sum(r.rows for r in df.select("key", "value").mapInArrow(
                floor_task, "rows long").collect())
            assert rows == count, (rows, count)
        else:
            self._seen.pop(case, None)
            self.sinks[case](df, batch_id)
            timings, records = self._seen[case]
            assert timings is not None and records == count, (case, batch_id, records, count)
        return Batch(case, batch_id, count, time.perf_counter() - started, timings)

    def _copy(self, case: str, df: Any, count: int) -> None:
        """Each task COPYs its rows into ``case``'s table, committed."""
        assert self.copy_into is not None
        libpq_url, copy_tables = self.copy_into
        rows = sum(r.rows for r in df.select("id", "value").mapInArrow(
            functools.partial(copy_task, libpq_url, copy_tables[case]), "rows long").collect())
        assert rows == count, (rows, count)


# -- verification --------------------------------------------------------------------------------

def count_committed(bootstrap: str, topic: str, partitions: int) -> tuple[int, int, list[int]]:
    """(records, distinct keys, records per partition) a read_committed consumer sees."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "enable.partition.eof": True, "auto.offset.reset": "earliest"})
    try:
        # The last stable offset of a read_committed ListOffsets: where consumption can stop.
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1]
                for p in range(partitions)}
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        per_partition = [0] * partitions
        keys: set[bytes] = set()
        eof: set[int] = set()
        deadline = time.monotonic() + 300
        while len(eof) < partitions and time.monotonic() < deadline:
            for msg in consumer.consume(10_000, timeout=1.0):
                err, partition = msg.error(), int(msg.partition() or 0)
                if err is not None:
                    if (err.code() == err._PARTITION_EOF
                            and int(msg.offset() or 0) >= ends[partition]):
                        eof.add(partition)
                    continue
                per_partition[partition] += 1
                keys.add(bytes(msg.key() or b""))
        if len(eof) < partitions:
            raise RuntimeError(f"{topic}: did not reach the end of every partition")
        return sum(per_partition), len(keys), per_partition
    finally:
        consumer.close()


# -- reporting -----------------------------------------------------------------------------------

def jdbc_target(db_url: str) -> tuple[str, dict[str, str]]:
    """Spark's JDBC URL and connection properties for a SQLAlchemy PostgreSQL URL."""
    import sqlalchemy as sa

    url = sa.make_url(db_url)
    props = {"driver": "org.postgresql.Driver", "user": url.username or "",
             "password": url.password or "", "batchsize": "10000",
             "reWriteBatchedInserts": "true"}
    options = url.query.get("options")
    for option in (options,) if isinstance(options, str) else options or ():
        if option.startswith("-csearch_path="):  # a schema of its own (the README test's)
            props["currentSchema"] = option.removeprefix("-csearch_path=")
    return f"jdbc:postgresql://{url.host or 'localhost'}:{url.port or 5432}/{url.database}", props


def ms(x: float) -> str:
    return f"{x * 1000:.0f}"


def summarize(results: Results, tiny: Results) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = overall_rate(results.of("baseline"))
    naive = overall_rate(results.of("naive+sql")) if results.of("naive+sql") else None
    copy = overall_rate(results.of("naive+copy")) if results.of("naive+copy") else None
    for case in CASES:
        bs = results.of(case)
        if not bs:
            continue
        rates = [b.rate for b in bs]
        entry: dict[str, Any] = {
            "records": sum(b.records for b in bs), "overall_records_per_s": round(overall_rate(bs)),
            "median_batch_records_per_s": round(statistics.median(rates)),
            "min_batch_records_per_s": round(min(rates)),
            "ratio_to_baseline": round(overall_rate(bs) / base, 3)}
        if naive is not None:
            entry["ratio_to_naive_sql"] = round(overall_rate(bs) / naive, 3)
        if copy is not None:
            entry["ratio_to_naive_copy"] = round(overall_rate(bs) / copy, 3)
        if case in SINK_CASES:
            entry.update(phase_stats(bs))
        out[case] = entry
    if all(results.of(c) for c in ("kafka", "floor", "copy")):
        # Seconds per record add up: the kafka case's, plus what the database's COPY cost
        # above the floor (the same rows crossing to Python are already in kafka's time).
        per_record = (1 / overall_rate(results.of("kafka")) + 1 / overall_rate(results.of("copy"))
                      - 1 / overall_rate(results.of("floor")))
        out["bound"] = {"records_per_s": round(1 / per_record),
                        "ratio_to_baseline": round(1 / per_record / base, 3)}
    for case in CASES:
        bs = tiny.of(case)
        if bs:
            walls = [b.wall_s for b in bs]
            entry = {"batches": len(bs), "median_wall_s": round(statistics.median(walls), 4),
                     "p95_wall_s": round(pct(walls, .95), 4)}
            if case in SINK_CASES:
                entry.update(phase_stats(bs))
            out[f"tiny {case}"] = entry
    return out


def phase_stats(bs: list[Batch]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("commit_phase_s", "decide_s", "commit_s", "complete_s", "verify_s", "sweep_s"):
        values = [float(getattr(b.timings, name)) for b in bs]
        out[name] = {"median": round(statistics.median(values), 4),
                     "p95": round(pct(values, 0.95), 4)}
    tasks = [b.wall_s - driver_s(b.timings) for b in bs]
    out["tasks_s"] = {"median": round(statistics.median(tasks), 4),
                      "p95": round(pct(tasks, 0.95), 4)}
    return out


def print_report(info: dict[str, Any], results: Results, tiny: Results,
                 summary: dict[str, Any], verified: dict[str, Any]) -> None:
    print(f"Spark {info['spark']} {info['master']}, Kafka {info['bootstrap']}, database "
          f"{info['db']}; {info['records']} records x {info['value_bytes']} B in "
          f"{info['batches']} batches of {info['batch_size']} (+1 warm-up batch of "
          f"{info['warmup']} per case), {info['partitions']} partitions; "
          f"{os.cpu_count()} cores; load average at start {info['load_start']}\n")
    print("per batch (ms; tasks = everything before the driver's verify)")
    print(f"{'case':<12} {'batch':>5} {'records/s':>10} {'wall':>7} {'tasks':>7} {'verify':>7} "
          f"{'decide':>7} {'commit':>7} {'complete':>8} {'sweep':>6}")
    for b in results.batches:
        t = b.timings
        cols = ("" if t is None else
                f"{ms(b.wall_s - driver_s(t)):>7} {ms(t.verify_s):>7} {ms(t.decide_s):>7} "
                f"{ms(t.commit_s):>7} {ms(t.complete_s):>8} {ms(t.sweep_s):>6}")
        print(f"{b.case:<12} {b.batch_id:>5} {b.rate:>10.0f} {ms(b.wall_s):>7} {cols}")
    print(f"\n{'case':<12} {'records/s':>10} {'median batch':>13} {'vs baseline':>12} "
          f"{'vs naive+sql':>13} {'vs naive+copy':>14}")
    for case in CASES:
        s = summary.get(case)
        if s:
            naive, copy = s.get("ratio_to_naive_sql"), s.get("ratio_to_naive_copy")
            print(f"{case:<12} {s['overall_records_per_s']:>10} "
                  f"{s['median_batch_records_per_s']:>13} {s['ratio_to_baseline']:>12.3f} "
                  f"{'' if naive is None else f'{naive:.3f}':>13} "
                  f"{'' if copy is None else f'{copy:.3f}':>14}")
    bound = summary.get("bound")
    if bound:
        print(f"{'bound':<12} {bound['records_per_s']:>10} {'':>13} "
              f"{bound['ratio_to_baseline']:>12.3f}   (kafka + (copy - floor): the best an "
              "atomic sink writing each row once to both could do here)")
    print(f"\nfixed per-batch cost, {info['partitions']} partitions (ms, median / p95)")
    print(f"{'case':<16} {'commit_phase':>13} {'decide':>11} {'commit':>11} {'complete':>11} "
          f"{'verify':>11} {'sweep':>11} {'tasks':>11} {'wall':>11}")
    def mp(d: dict[str, float]) -> str:
        return f"{ms(d['median'])} / {ms(d['p95'])}"

    for label, res in (("", results), ("tiny ", tiny)):
        for case in SINK_CASES:
            s = summary.get(label + case)
            if s is None:
                continue
            wall = [b.wall_s for b in res.of(case)]
            print(f"{label + case:<16} {mp(s['commit_phase_s']):>13} {mp(s['decide_s']):>11} "
                  f"{mp(s['commit_s']):>11} {mp(s['complete_s']):>11} {mp(s['verify_s']):>11} "
                  f"{mp(s['sweep_s']):>11} {mp(s['tasks_s']):>11} "
                  f"{ms(statistics.median(wall))} / {ms(pct(wall, .95))}")
    for case in ("baseline", "floor"):
        tb = tiny.of(case)
        if tb:
            w = [b.wall_s for b in tb]
            print(f"{'tiny ' + case:<16} {'':>13} {'':>11} {'':>11} {'':>11} {'':>11} {'':>11} "
                  f"{'':>11} {ms(statistics.median(w))} / {ms(pct(w, .95))}")
    print("\nverification (read_committed consumer)")
    for name, v in verified.items():
        print(f"  {name:<22} {v['detail']}")
    print(f"\nload average at end {info['load_end']}")


# -- main ----------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, help="measured records (default 1,000,000)")
    parser.add_argument("--batches", type=int, help="measured batches (default 5)")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--topic-partitions", type=int, help="default: --partitions")
    parser.add_argument("--value-bytes", type=int, default=200)
    parser.add_argument("--warmup-records", type=int,
                        help="records in each case's excluded warm-up batch (default: a batch)")
    parser.add_argument("--tiny-batches", type=int,
                        help="batches of --partitions records each, to isolate the fixed cost "
                             "(default 20)")
    parser.add_argument("--db", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--db-url", default=os.environ.get("DUALWRITE_DATABASE_URL"),
                        help="database URL (default: a throwaway local PostgreSQL, or an SQLite "
                             "file with --db sqlite)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help="comma-separated subset of " + ",".join(CASES))
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--quick", action="store_true",
                        help="smoke size: 40,000 records in 4 batches, 6 tiny batches "
                             "(explicit options win)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    sizes = (40_000, 4, 6) if args.quick else (1_000_000, 5, 20)
    for name, default in zip(("records", "batches", "tiny_batches"), sizes, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown or not cases:
        parser.error(f"unknown cases {sorted(unknown)}")
    if args.db == "sqlite" or (args.db_url or "").startswith("sqlite"):
        cases = [c for c in cases if c not in (*NAIVE_SQL_CASES, *COPY_CASES)]  # PostgreSQL
    args.topic_partitions = args.topic_partitions or args.partitions
    batch_size = args.records // args.batches
    warmup = args.warmup_records or batch_size
    load_start = load()

    import sqlalchemy as sa

    import dualwrite as dw
    from dualwrite.dev import LocalKafkaCluster, create_topic
    from dualwrite.spark import ExactlyOnceSink

    with ExitStack() as stack:
        jars = spark_kafka_jars()
        bootstrap = os.environ.get("DUALWRITE_BOOTSTRAP_SERVERS")
        if not bootstrap:
            log("starting a local Kafka broker")
            bootstrap = stack.enter_context(LocalKafkaCluster(brokers=1)).bootstrap_servers
        db_url = args.db_url
        if not db_url and args.db == "sqlite":
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-spark-"))
            db_url = f"sqlite:///{tmp}/bench.db"
        elif not db_url:
            from dualwrite.dev import LocalPostgres
            log("starting a local PostgreSQL")
            db_url = stack.enter_context(LocalPostgres()).url
        engine = dw.create_engine(db_url)
        dw.upgrade_database(engine)
        run = uuid.uuid4().hex[:6]
        kafka_config = {"bootstrap.servers": bootstrap}
        topics = {case: create_topic(bootstrap, f"bench-spark-{run}-{name}",
                                     partitions=args.topic_partitions)
                  for case, name in (("baseline", "base"), ("naive+sql", "naive"),
                                     ("naive+copy", "ncopy"), ("kafka", "dw"),
                                     ("kafka+sql", "dwsql"), ("kafka+staged", "dwstg"),
                                     ("tiny", "tiny"), ("tiny+sql", "tinysql"),
                                     ("tiny+staged", "tinystg"))}
        tables = {case: f"bench_spark_{name}_{run}" for case, name in (
            ("kafka+sql", "dwsql"), ("kafka+staged", "dwstg"), ("naive+sql", "naive"),
            ("naive+copy", "ncopy"), ("copy", "copy"), ("tiny+sql", "tinysql"),
            ("tiny+staged", "tinystg"))}
        for name in tables.values():
            create_table(engine, name, args.value_bytes)

        def sink(name: str, topic: str, target: str | None, participants: int | None = None,
                 sql_mode: Any = "auto") -> ExactlyOnceSink:
            return ExactlyOnceSink(sink_id=f"bench-{name}-{run}", kafka_config=kafka_config,
                                   topic=topic, database_url=db_url, key_column="key",
                                   value_column="value", target_table=target,
                                   table_columns=["id", "value"] if target else None,
                                   max_participants=participants, sql_mode=sql_mode)

        # The throughput cases run with the sink's default (one participant per core); the
        # fixed-cost cases keep one participant per partition (--partitions of them).
        sinks = {"kafka": sink("dw", topics["kafka"], None),
                 "kafka+sql": sink("dwsql", topics["kafka+sql"], tables["kafka+sql"]),
                 "kafka+staged": sink("dwstg", topics["kafka+staged"], tables["kafka+staged"],
                                      sql_mode="staging")}
        tiny_sinks = {"kafka": sink("tiny", topics["tiny"], None, args.partitions),
                      "kafka+sql": sink("tinysql", topics["tiny+sql"], tables["tiny+sql"],
                                        args.partitions),
                      "kafka+staged": sink("tinystg", topics["tiny+staged"],
                                           tables["tiny+staged"], args.partitions, "staging")}
        log("starting Spark")
        spark = spark_session(args.master, args.partitions, jars)
        stack.callback(spark.stop)
        for each in (*sinks.values(), *tiny_sinks.values()):
            stack.callback(each.close)
        info = {"spark": spark.version, "master": args.master, "bootstrap": bootstrap,
                "db": engine.dialect.name, "records": args.records, "batches": args.batches,
                "batch_size": batch_size, "warmup": warmup, "partitions": args.partitions,
                "value_bytes": args.value_bytes, "load_start": load_start}

        jdbc = None
        if "naive+sql" in cases:
            jdbc_url, jdbc_props = jdbc_target(db_url)
            jdbc = (jdbc_url, tables["naive+sql"], jdbc_props)
        copy_into = None
        if any(c in cases for c in COPY_CASES):
            libpq = sa.make_url(db_url).set(drivername="postgresql")
            copy_into = (libpq.render_as_string(hide_password=False),
                         {c: tables[c] for c in COPY_CASES})
        runner = Runner(spark, args, bootstrap, {c: s for c, s in sinks.items() if c in cases},
                        topics, jdbc, copy_into)
        results = Results()
        expected = {c: 0 for c in cases}
        # Batch 0 is the warm-up (ids after the measured range); batches 1..N are measured.
        plan = [(0, args.records, warmup)] + [(k + 1, k * batch_size, batch_size)
                                                for k in range(args.batches)]
        for batch_id, start, count in plan:
            for case in cases:
                b = runner.write(case, batch_id, start, count)
                expected[case] += count
                log(f"{case:<9} batch {batch_id}: {count} records in {b.wall_s:.2f} s "
                    f"({b.rate:,.0f}/s)")
                if batch_id > 0:
                    results.batches.append(b)

        tiny = Results()
        tiny_runner = Runner(spark, args, bootstrap,
                             {c: s for c, s in tiny_sinks.items() if c in cases},
                             {**topics, "kafka": topics["tiny"], "kafka+sql": topics["tiny+sql"],
                              "kafka+staged": topics["tiny+staged"]})
        tiny_base = 10**12
        for batch_id in range(args.tiny_batches + 1):
            for case in cases:
                if case in (*NAIVE_SQL_CASES, *COPY_CASES):
                    continue
                b = tiny_runner.write(case, batch_id, tiny_base + batch_id * args.partitions,
                                      args.partitions)
                if case == "baseline":  # its tiny batches share the baseline topic
                    expected["baseline"] += args.partitions
                if batch_id > 0:
                    tiny.batches.append(b)
        log("tiny batches done")

        verified: dict[str, Any] = {}
        ok = True
        checks = [(c, topics[c], expected[c]) for c in cases if c in SINK_CASES]
        tiny_topic = {"kafka": "tiny", "kafka+sql": "tiny+sql", "kafka+staged": "tiny+staged"}
        checks += [(f"tiny {c}", topics[tiny_topic[c]], (args.tiny_batches + 1) * args.partitions)
                   for c in cases if c in SINK_CASES]
        for case in ("baseline", *NAIVE_SQL_CASES):
            if case in cases:
                checks.append((case, topics[case], expected[case]))
        for name, topic, want in checks:
            total, distinct, per_partition = count_committed(bootstrap, topic,
                                                             args.topic_partitions)
            if name in ("baseline", *NAIVE_SQL_CASES):  # at-least-once: duplicates allowed
                good = distinct == want and total >= want
            else:
                good = total == want and distinct == want
            ok &= good
            verified[name] = {"expected": want, "records": total, "distinct_keys": distinct,
                              "per_partition": per_partition, "ok": good,
                              "detail": f"{'OK ' if good else 'BAD'} {total} records, {distinct} "
                                        f"distinct keys, expected {want}; per partition "
                                        f"{per_partition}"}
        counted = []
        for case in ("kafka+sql", "kafka+staged"):
            if case in cases:
                tiny_case = case.replace("kafka", "tiny")
                counted += [(f"{case} table", tables[case], expected[case]),
                            (f"tiny {case} table", tables[tiny_case],
                             (args.tiny_batches + 1) * args.partitions)]
        for case in (*NAIVE_SQL_CASES, "copy"):
            if case in cases:  # at-least-once: a retried task writes its rows again
                counted.append((f"{case} table", tables[case], expected[case]))
        if counted:
            for name, tbl, want in counted:
                with engine.connect() as conn:
                    rows = conn.execute(sa.text(f"SELECT count(*) FROM {tbl}")).scalar_one()
                good = rows == want
                ok &= good
                verified[name] = {"expected": want, "rows": rows, "ok": good,
                                  "detail": f"{'OK ' if good else 'BAD'} {rows} rows, "
                                            f"expected {want}"}
        info["load_end"] = load()
        summary = summarize(results, tiny)
        if args.json:
            print(json.dumps({"info": info, "summary": summary, "verified": verified,
                              "batches": [b.as_dict() for b in results.batches],
                              "tiny_batches": [b.as_dict() for b in tiny.batches]}, indent=2))
        else:
            print_report(info, results, tiny, summary, verified)
        parts = []
        for case in CASES:
            s = summary.get(case)
            if s:
                naive, copy = s.get("ratio_to_naive_sql"), s.get("ratio_to_naive_copy")
                parts.append(f"{case} {s['overall_records_per_s']:,}/s"
                             + ("" if case == "baseline" else f" ({s['ratio_to_baseline']:.2f}x")
                             + ("" if case == "baseline" or naive is None
                                else f", {naive:.2f}x naive+sql")
                             + ("" if case == "baseline" or copy is None
                                else f", {copy:.2f}x naive+copy")
                             + ("" if case == "baseline" else ")"))
        if "bound" in summary:
            parts.append(f"bound {summary['bound']['records_per_s']:,}/s "
                         f"({summary['bound']['ratio_to_baseline']:.2f}x)")
        for case in SINK_CASES:
            s = summary.get(f"tiny {case}")
            if s:
                parts.append(f"commit phase {case} p50 {ms(s['commit_phase_s']['median'])} ms "
                             f"p95 {ms(s['commit_phase_s']['p95'])} ms")
        line = (f"SUMMARY: {'; '.join(parts)}; verified {'OK' if ok else 'FAILED'}; "
                f"load {info['load_start']} -> {info['load_end']}")
        print(line, file=sys.stderr if args.json else sys.stdout)
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
