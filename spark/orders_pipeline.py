"""The orders pipeline: order events -> validate and enrich -> `orders` table + `orders-enriched`.

Every micro-batch reaches the SQL table and the Kafka topic exactly once, through
``dualwrite.spark.ExactlyOnceSink`` (``--kafka-only``: the topic alone; the database then holds
only the sink's decision log). Sources:

- ``generator`` (default): Spark's ``rate-micro-batch`` source, ``--rows-per-batch`` rows per batch.
  Order ids are the source's ``value`` (0, 1, 2, ... across batches, replayed identically after a
  restart), and every other field is derived from the id, so a run is reproducible.
- ``kafka``: JSON order events from ``--source-topic`` (Spark's Kafka source: the
  ``spark-sql-kafka`` package is fetched from Maven Central, see ``--kafka-package``; under
  spark-submit, pass ``--packages``).

    python spark/orders_pipeline.py --bootstrap 127.0.0.1:9092 --max-batches 10
    spark-submit --master local[4] spark/orders_pipeline.py --bootstrap 127.0.0.1:9092

``build_query()`` starts the same query for tests and other drivers; see spark/README.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

    from dualwrite.batch import BatchTimings
    from dualwrite.spark import ExactlyOnceSink

DEFAULT_DB = "sqlite:///dualwrite-demo.db"
# Spark's Kafka source, in the version of the installed pyspark.
KAFKA_PACKAGE = "org.apache.spark:spark-sql-kafka-0-10_2.13:{version}"
# 2026-01-01T00:00:00Z: generated orders carry reproducible timestamps (one second per batch).
GENERATOR_EPOCH_MS = 1_767_225_600_000

# Fixed conversion rates to EUR, in per-mille, and the currencies an order may use.
EUR_PER_MILLE = {"EUR": 1000, "USD": 920, "GBP": 1170, "CHF": 1050}
REGIONS = ("eu-west", "eu-central", "us-east", "us-west", "apac")
# The `orders` table (and the fields of every `orders-enriched` record), in order.
ORDER_COLUMNS = ("order_id", "customer_id", "amount_cents", "currency", "amount_eur_cents",
                 "tier", "region", "created_at")
EVENT_SCHEMA = ("order_id BIGINT, customer_id BIGINT, amount_cents BIGINT, currency STRING, "
                "region STRING, created_at TIMESTAMP")


@dataclass
class PipelineConfig:
    """The pipeline's options (the command line maps onto these one to one)."""

    bootstrap: str
    db: str = DEFAULT_DB
    topic: str = "orders-enriched"
    table: str = "orders_enriched"  # not `orders`: the README's own table has other columns
    sink_id: str = "orders-pipeline"
    checkpoint: str = "checkpoints/orders-pipeline"
    kafka_only: bool = False
    source: str = "generator"
    source_topic: str | None = None
    kafka_package: str | None = None
    """Maven coordinates of Spark's Kafka source (default: ``KAFKA_PACKAGE``, pyspark's version)."""
    rows_per_batch: int = 1000
    partitions: int = 4
    trigger_s: float = 1.0
    max_batches: int | None = None
    """Stop once batches 0..N-1 are written (counted from the checkpoint's start, all runs)."""
    master: str | None = None
    spark_conf: dict[str, str] = field(default_factory=dict)
    """Extra Spark settings (``--conf key=value``)."""
    kafka_config: dict[str, str] = field(default_factory=dict)
    """Extra settings of the sink's Kafka clients (``--kafka-config key=value``): security,
    timeouts; ``bootstrap.servers`` is ``bootstrap``."""


# -- the transformation ------------------------------------------------------------------------

def generated_orders(spark: SparkSession, rows_per_batch: int) -> DataFrame:
    """Order events from the ``rate-micro-batch`` source; every field derives from the id."""
    from pyspark.sql import functions as F

    rate = (spark.readStream.format("rate-micro-batch")
            .option("rowsPerBatch", rows_per_batch)
            .option("startTimestamp", GENERATOR_EPOCH_MS)
            .option("advanceMillisPerBatch", 1000)
            .load())
    order_id = F.col("value")
    customer_id = order_id * 7919 % 5000 + 1
    currencies = F.array(*(F.lit(c) for c in EUR_PER_MILLE))
    regions = F.array(*(F.lit(r) for r in REGIONS))
    return rate.select(
        order_id.alias("order_id"),
        customer_id.alias("customer_id"),
        (order_id * 104729 % 49_900 + 100).alias("amount_cents"),
        F.element_at(currencies, (order_id % len(EUR_PER_MILLE) + 1).cast("int"))
        .alias("currency"),
        F.element_at(regions, (customer_id % len(REGIONS) + 1).cast("int")).alias("region"),
        F.col("timestamp").alias("created_at"),
    )


def kafka_orders(spark: SparkSession, bootstrap: str, topic: str) -> DataFrame:
    """Order events as JSON (``EVENT_SCHEMA``) from a Kafka topic; unparsable ones are dropped."""
    from pyspark.sql import functions as F

    raw = (spark.readStream.format("kafka")
           .option("kafka.bootstrap.servers", bootstrap)
           .option("subscribe", topic)
           .option("startingOffsets", "earliest")
           .option("kafka.isolation.level", "read_committed")
           .load())
    parsed = raw.select(F.from_json(F.col("value").cast("string"), EVENT_SCHEMA).alias("e"))
    return parsed.select("e.*")


def _eur_cents(currency: Column, cents: Column) -> Column:
    from pyspark.sql import functions as F

    rate = F.lit(None).cast("long")
    for code, per_mille in EUR_PER_MILLE.items():
        rate = F.when(currency == code, F.lit(per_mille)).otherwise(rate)
    return F.round(cents * rate / 1000).cast("long")


def enrich(events: DataFrame, partitions: int) -> DataFrame:
    """Validate (ids, a positive amount, a known currency), enrich, shape for the sink.

    Adds ``amount_eur_cents``, ``tier`` and region ``unknown`` for a missing or overlong one
    (a value the table refuses would fail the batch forever); the result has the ``orders``
    columns plus ``key`` (the order id) and ``value`` (the enriched order as JSON).
    """
    from pyspark.sql import functions as F

    valid = events.where(
        F.col("order_id").isNotNull() & (F.col("order_id") >= 0)
        & F.col("customer_id").isNotNull()
        & (F.col("amount_cents") > 0)
        & F.col("currency").isin(*EUR_PER_MILLE)
        & F.col("created_at").isNotNull())
    eur = _eur_cents(F.col("currency"), F.col("amount_cents"))
    enriched = valid.select(
        F.col("order_id").cast("long").alias("order_id"),
        F.col("customer_id").cast("long").alias("customer_id"),
        F.col("amount_cents").cast("long").alias("amount_cents"),
        F.col("currency"),
        eur.alias("amount_eur_cents"),
        F.when(eur >= 20_000, "large").when(eur >= 5_000, "medium").otherwise("small")
        .alias("tier"),
        F.coalesce(F.when(F.length("region") <= 16, F.col("region")), F.lit("unknown"))
        .alias("region"),
        F.col("created_at"),
    )
    return (enriched
            .withColumn("key", F.col("order_id").cast("string"))
            .withColumn("value", F.to_json(F.struct(*(F.col(c) for c in ORDER_COLUMNS))))
            .repartition(partitions, "order_id"))


# -- the database and the topic ----------------------------------------------------------------

def orders_table(metadata: Any, name: str = "orders_enriched") -> Any:
    import sqlalchemy as sa

    return sa.Table(
        name, metadata,
        sa.Column("order_id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("customer_id", sa.BigInteger, nullable=False),
        sa.Column("amount_cents", sa.BigInteger, nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column("amount_eur_cents", sa.BigInteger, nullable=False),
        sa.Column("tier", sa.String(8), nullable=False),
        sa.Column("region", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def ensure_orders_table(db_url: str, name: str = "orders_enriched") -> None:
    """Create the orders table unless it exists (a database out of reach:
    ``DatabaseUnreachableError``, as from the sink)."""
    import sqlalchemy as sa

    import dualwrite as dw
    from dualwrite.database import transaction

    engine = dw.create_engine(db_url)
    try:
        with transaction(engine) as conn:
            orders_table(sa.MetaData(), name).create(conn, checkfirst=True)
    finally:
        engine.dispose()


def ensure_topic(bootstrap: str, topic: str, partitions: int,
                 kafka_config: Mapping[str, str] | None = None, timeout_s: float = 15.0) -> None:
    """Create ``topic`` (``partitions`` partitions, the broker's replication) unless it exists.
    ``kafka_config``: the sink's client settings (security). No broker answering:
    ``BrokerUnreachableError``, as from the sink."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    import dualwrite as dw

    # librdkafka's own lines through `logging` (quiet), as dualwrite's clients do.
    conf: dict[str, Any] = {**(kafka_config or {}), "bootstrap.servers": bootstrap,
                            "logger": logging.getLogger("dualwrite.librdkafka")}
    admin = AdminClient(conf)
    try:
        if topic in admin.list_topics(timeout=timeout_s).topics:
            return
    except KafkaException as exc:
        raise dw.BrokerUnreachableError(f"cannot list the topics at {bootstrap}: "
                                        f"{exc.args[0]}") from exc
    future = admin.create_topics([NewTopic(topic, partitions)], request_timeout=timeout_s)[topic]
    try:
        future.result()
    except KafkaException as exc:
        error = exc.args[0]
        if error.code() == KafkaError.TOPIC_ALREADY_EXISTS:  # created concurrently
            return
        kind = dw.BrokerUnreachableError if error.retriable() else dw.ConfigurationError
        raise kind(f"cannot create topic {topic}: {error}") from exc


def check_checkpoint(config: PipelineConfig) -> None:
    """Refuse a fresh checkpoint when the database already holds decisions of this sink.

    Spark would number batches from 0 again, and the sink would skip them as replays of batches
    it decided before: nothing would be written.
    """
    if "://" in config.checkpoint and not config.checkpoint.startswith("file:"):
        return  # not a local directory; not checked
    commits = Path(config.checkpoint.removeprefix("file:")) / "commits"
    if commits.is_dir() and any(commits.iterdir()):
        return
    import dualwrite as dw
    from dualwrite.batch import DecisionLog
    from dualwrite.database import mask_url

    engine = dw.create_engine(config.db)
    try:
        log = DecisionLog(engine)
        record = log.read(config.sink_id) if log.has_tables() else None
    finally:
        engine.dispose()
    if record is not None:
        raise SystemExit(
            f"sink {config.sink_id!r} decided batches up to {record.last_batch_id} in "
            f"{mask_url(config.db)}, but the checkpoint {config.checkpoint} is new: its batches "
            "would be skipped as replays. Use the old checkpoint, another --sink-id, or drop the "
            "sink's record (dualwrite.batch.decision_log.DecisionLog(engine).forget(sink_id)).")


# -- the query ---------------------------------------------------------------------------------

class BatchLimitReachedError(RuntimeError):
    """Raised in the batch after ``max_batches`` so that Spark does not mark it committed."""


@dataclass
class BatchReport:
    batch_id: int
    records: int
    timings: BatchTimings | None
    seconds: float


class OrdersPipeline:
    """The ``foreachBatch`` function: the sink, progress reports, and ``max_batches``."""

    def __init__(self, sink: ExactlyOnceSink, max_batches: int | None,
                 report: Callable[[str], None] = print) -> None:
        self.sink = sink
        self.max_batches = max_batches
        self.report = report
        self.batches: list[BatchReport] = []
        self.held = threading.Event()
        """Set when Spark started a batch past the limit (held until the query stops)."""
        self._last_done = threading.Event()
        self._release = threading.Event()
        self._last: tuple[int, BatchTimings | None, int] | None = None
        self._recovery_reported = False
        sink.on_batch = self._on_batch

    def _on_batch(self, batch_id: int, timings: BatchTimings | None, records: int) -> None:
        self._last = (batch_id, timings, records)

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        if self.max_batches is not None and batch_id >= self.max_batches:
            # Spark planned a batch past the limit: write nothing and hold it until the query is
            # stopped, then fail it, so that Spark does not mark it done; a later run writes it.
            self.held.set()
            self._release.wait()
            raise BatchLimitReachedError(f"batch {batch_id} is past --max-batches "
                                         f"{self.max_batches}")
        started = time.perf_counter()
        self._last = None
        self.sink(df, batch_id)
        seconds = time.perf_counter() - started
        self._report_recovery()
        _, timings, records = self._last or (batch_id, None, 0)
        self.batches.append(BatchReport(batch_id, records, timings, seconds))
        if timings is None:
            self.report(f"batch {batch_id}: decided by an earlier run, skipped "
                        f"({seconds * 1e3:.0f} ms)")
        else:
            self.report(
                f"batch {batch_id}: {records} records, commit phase "
                f"{timings.commit_phase_s * 1e3:.0f} ms (decide {timings.decide_s * 1e3:.0f}, "
                f"commit {(timings.commit_s + timings.complete_s) * 1e3:.0f}), batch "
                f"{seconds * 1e3:.0f} ms")
        if self.max_batches is not None and batch_id >= self.max_batches - 1:
            self._last_done.set()

    def finished(self, query: StreamingQuery) -> bool:
        """True once batch ``max_batches - 1`` is in Spark's commit log, or a later one is held."""
        if self.held.is_set():
            return True
        if not self._last_done.is_set():
            return False
        # Progress is posted after the commit log is written: stopping earlier would make the
        # next run replay (and skip) the last batch.
        progress = query.lastProgress
        return (progress is not None and self.max_batches is not None
                and progress.batchId >= self.max_batches - 1)

    def _report_recovery(self) -> None:
        recovery = self.sink.recovery
        if self._recovery_reported or recovery is None:
            return
        self._recovery_reported = True
        done = []
        if recovery.completed_batch is not None:
            done.append(f"completed in-doubt batch {recovery.completed_batch} "
                        f"({recovery.committed} participant commits)")
        if recovery.aborted:
            done.append(f"aborted {len(recovery.aborted)} lingering transactions")
        if recovery.purged_rows:
            done.append(f"dropped {recovery.purged_rows} staged rows")
        self.report("recovery: " + ("; ".join(done) if done else "nothing to do"))

    def release(self) -> None:
        """Let a batch held past the limit fail (call while stopping the query)."""
        self._release.set()


def make_sink(config: PipelineConfig) -> ExactlyOnceSink:
    from dualwrite.spark import ExactlyOnceSink

    return ExactlyOnceSink(
        sink_id=config.sink_id,
        kafka_config={**config.kafka_config, "bootstrap.servers": config.bootstrap},
        topic=config.topic, database_url=config.db, key_column="key", value_column="value",
        target_table=None if config.kafka_only else config.table,
        table_columns=None if config.kafka_only else list(ORDER_COLUMNS))


def build_query(spark: SparkSession, config: PipelineConfig,
                report: Callable[[str], None] = print) -> tuple[StreamingQuery, OrdersPipeline]:
    """Create the table and topic if missing, then start the streaming query."""
    check_checkpoint(config)
    if not config.kafka_only:
        ensure_orders_table(config.db, config.table)
    ensure_topic(config.bootstrap, config.topic, config.partitions, config.kafka_config)
    if config.source == "kafka":
        if not config.source_topic:
            raise SystemExit("--source kafka needs --source-topic")
        events = kafka_orders(spark, config.bootstrap, config.source_topic)
    else:
        events = generated_orders(spark, config.rows_per_batch)
    pipeline = OrdersPipeline(make_sink(config), config.max_batches, report)
    query = (enrich(events, config.partitions).writeStream
             .queryName(config.sink_id)
             .foreachBatch(pipeline)
             .option("checkpointLocation", config.checkpoint)
             .trigger(processingTime=f"{config.trigger_s:g} seconds")
             .start())
    return query, pipeline


def stop_query(query: StreamingQuery, pipeline: OrdersPipeline) -> None:
    """Stop the query (a batch held past the limit is released and fails), close the sink."""
    stopper = threading.Thread(target=query.stop, name="stop-query", daemon=True)
    stopper.start()
    time.sleep(0.2)
    pipeline.release()
    stopper.join()
    pipeline.sink.close()


def run_until_done(query: StreamingQuery, pipeline: OrdersPipeline,
                   stop: threading.Event | None = None, timeout_s: float | None = None) -> bool:
    """Wait for ``max_batches``, a failure, ``stop`` or the timeout; then stop the query.

    Returns True when the query ended without an error of its own.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while (query.isActive and not pipeline.finished(query)
               and not (stop is not None and stop.is_set())
               and (deadline is None or time.monotonic() < deadline)):
            pipeline.held.wait(0.2)
    finally:
        stop_query(query, pipeline)
    error = query.exception()
    return error is None or BatchLimitReachedError.__name__ in str(error)


def spark_session(config: PipelineConfig) -> SparkSession:
    """A session for this pipeline; master and interpreter only when spark-submit set none."""
    from pyspark.sql import SparkSession

    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ  # started by spark-submit
    builder = SparkSession.builder.appName(f"dualwrite {config.sink_id}")
    if config.master:
        builder = builder.master(config.master)
    elif not under_submit:
        builder = builder.master("local[2]")
    if not under_submit:
        # Local Python workers must import dualwrite: run them on this interpreter.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        builder = (builder.config("spark.pyspark.python", sys.executable)
                   .config("spark.ui.showConsoleProgress", "false"))
        if config.source == "kafka" and not {"spark.jars", "spark.jars.packages"} & set(
                config.spark_conf):
            import pyspark

            package = config.kafka_package or KAFKA_PACKAGE.format(version=pyspark.__version__)
            builder = builder.config("spark.jars.packages", package)
    builder = (builder.config("spark.sql.shuffle.partitions", str(config.partitions))
               .config("spark.sql.session.timeZone", "UTC"))
    for key, value in config.spark_conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def run(config: PipelineConfig) -> int:
    from dualwrite.database import mask_url

    spark = spark_session(config)
    target = "Kafka only" if config.kafka_only else f"table {config.table} + Kafka"
    source = (f"Kafka topic {config.source_topic}" if config.source == "kafka"
              else f"generator, {config.rows_per_batch} orders per batch")
    print(f"orders pipeline: {source} -> {target} (topic {config.topic}, sink {config.sink_id}, "
          f"db {mask_url(config.db)}, master {spark.sparkContext.master}, "
          f"{config.partitions} partitions)", flush=True)
    query, pipeline = build_query(spark, config, lambda line: print(line, flush=True))
    stop_requested = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop_requested.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ok = run_until_done(query, pipeline, stop_requested)
    error = query.exception()
    spark.stop()
    if not ok:
        print(f"orders pipeline failed: {error}", file=sys.stderr, flush=True)
        return 1
    written = [b for b in pipeline.batches if b.timings is not None]
    print(f"orders pipeline stopped: {len(written)} batch{'' if len(written) == 1 else 'es'}, "
          f"{sum(b.records for b in written)} records written in this run", flush=True)
    return 0


def parse_args(argv: Sequence[str] | None = None) -> PipelineConfig:
    defaults = PipelineConfig(bootstrap="")
    p = argparse.ArgumentParser(
        description="Order events -> validate/enrich -> `orders` table + `orders-enriched` "
                    "topic, exactly once (dualwrite ExactlyOnceSink).")
    p.add_argument("--bootstrap", "-b", default=os.environ.get("DUALWRITE_BOOTSTRAP_SERVERS"),
                   help="Kafka bootstrap servers (default: $DUALWRITE_BOOTSTRAP_SERVERS)")
    p.add_argument("--db", default=defaults.db,
                   help="database URL: decision log and the orders table (default: %(default)s)")
    p.add_argument("--topic", default=defaults.topic, help="output topic (default: %(default)s)")
    p.add_argument("--table", default=defaults.table,
                   help="target table, created if missing (default: %(default)s)")
    p.add_argument("--sink-id", default=defaults.sink_id,
                   help="sink id: decision-log key and transactional-id prefix "
                        "(default: %(default)s)")
    p.add_argument("--checkpoint", default=defaults.checkpoint,
                   help="Spark checkpoint directory (default: %(default)s)")
    p.add_argument("--kafka-only", action="store_true",
                   help="write the topic only (the database keeps just the decision log)")
    p.add_argument("--source", choices=("generator", "kafka"), default=defaults.source)
    p.add_argument("--source-topic", help="input topic of JSON order events (--source kafka)")
    p.add_argument("--kafka-package", metavar="GROUP:ARTIFACT:VERSION",
                   help="Spark's Kafka source package when run with python (default: "
                        "spark-sql-kafka-0-10_2.13 of the installed pyspark's version; none "
                        "if --conf gives spark.jars or spark.jars.packages)")
    p.add_argument("--rows-per-batch", type=int, default=defaults.rows_per_batch,
                   help="generated orders per batch (default: %(default)s)")
    p.add_argument("--partitions", type=int, default=defaults.partitions,
                   help="partitions per batch = Kafka transactions per batch; also the output "
                        "topic's partitions when it is created (default: %(default)s)")
    p.add_argument("--trigger", type=float, default=defaults.trigger_s, metavar="SECONDS",
                   help="processing-time trigger interval (default: %(default)s)")
    p.add_argument("--max-batches", type=int, metavar="N",
                   help="stop once batches 0..N-1 are written, counting earlier runs on this "
                        "checkpoint (default: run until interrupted)")
    p.add_argument("--master", help="Spark master (default: local[2]; under spark-submit, "
                                    "whatever spark-submit was given)")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Spark setting (repeatable), e.g. spark.ui.enabled=false")
    p.add_argument("--kafka-config", action="append", default=[], metavar="KEY=VALUE",
                   help="setting of the sink's Kafka clients (repeatable), e.g. "
                        "security.protocol=SASL_SSL")
    p.add_argument("-v", "--verbose", action="store_true", help="dualwrite's INFO logs")
    args = p.parse_args(argv)
    if not args.bootstrap:
        p.error("--bootstrap is required (or set DUALWRITE_BOOTSTRAP_SERVERS)")
    if args.partitions < 1 or args.rows_per_batch < 1:
        p.error("--partitions and --rows-per-batch must be positive")
    if any("=" not in item for item in args.conf):
        p.error("--conf takes KEY=VALUE")
    if any("=" not in item for item in args.kafka_config):
        p.error("--kafka-config takes KEY=VALUE")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("py4j", "kafka", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return PipelineConfig(
        bootstrap=args.bootstrap, db=args.db, topic=args.topic, table=args.table,
        sink_id=args.sink_id,
        checkpoint=args.checkpoint, kafka_only=args.kafka_only, source=args.source,
        source_topic=args.source_topic, kafka_package=args.kafka_package,
        rows_per_batch=args.rows_per_batch,
        partitions=args.partitions, trigger_s=args.trigger, max_batches=args.max_batches,
        master=args.master,
        spark_conf=dict(item.split("=", 1) for item in args.conf),
        kafka_config=dict(item.split("=", 1) for item in args.kafka_config))


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
