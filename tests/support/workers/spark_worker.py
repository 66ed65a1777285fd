"""A Spark Structured Streaming query through ExactlyOnceSink, run as a process the tests kill.

The source is a directory of JSON files, one file per micro-batch (``maxFilesPerTrigger=1``), so the
set of events is known and a replayed batch re-reads the same file. The query runs with
``availableNow`` and exits 0 once every file is processed. Faults come from
``DUALWRITE_SPARK_FAULTS`` (see dualwrite/spark/faults.py).

With ``--follow STOP_FILE`` the query runs until that file exists instead, picking up files as
they arrive, then writes what is left and exits 0. There, when the query fails with a dualwrite
error, it is started again as an application would (same sink, same checkpoint) and the line
``RESTART <error type> <family>`` printed; any other error ends the process with
``FOREIGN <type>`` (only typed errors may reach the application).

    python spark_worker.py --bootstrap B --db URL --topic T --sink-id S --source DIR \
        --checkpoint DIR [--partitions N] [--kafka-only] [--master local[2]] [--conf k=v ...] \
        [--kafka-config k=v ...] [--follow STOP_FILE]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from tests.support.journal import family


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--sink-id", required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--kafka-only", action="store_true")
    parser.add_argument("--sql-mode", default="auto")
    parser.add_argument("--master", default="local[2,4]")
    parser.add_argument("--txn-timeout-ms", type=int)
    parser.add_argument("--conf", action="append", default=[])
    parser.add_argument("--kafka-config", action="append", default=[])
    parser.add_argument("--follow", metavar="STOP_FILE")
    parser.add_argument("--max-restarts", type=int, default=20)
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("py4j", "kafka", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ["PYSPARK_PYTHON"] = sys.executable

    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from dualwrite.spark import ExactlyOnceSink

    builder = (SparkSession.builder.master(args.master).appName(args.sink_id)
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", str(args.partitions))
               .config("spark.pyspark.python", sys.executable)
               # A short-lived driver JVM: C1 only and the serial GC start about twice as fast.
               .config("spark.driver.extraJavaOptions",
                       "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"))
    faults = os.environ.get("DUALWRITE_SPARK_FAULTS")
    if faults:  # executors of a standalone cluster do not inherit the driver's environment
        builder = builder.config("spark.executorEnv.DUALWRITE_SPARK_FAULTS", faults)
    for item in args.conf:
        key, _, value = item.partition("=")
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")

    kafka_config: dict[str, object] = {"bootstrap.servers": args.bootstrap}
    if args.txn_timeout_ms:
        kafka_config["transaction.timeout.ms"] = args.txn_timeout_ms
    for item in args.kafka_config:
        key, _, value = item.partition("=")
        kafka_config[key] = int(value) if value.isdigit() else value
    sink = ExactlyOnceSink(
        sink_id=args.sink_id, kafka_config=kafka_config, topic=args.topic,
        database_url=args.db, key_column="key",
        target_table=None if args.kafka_only else "events",
        table_columns=None if args.kafka_only else ["event_id", "payload"],
        # One participant per partition, so that --partitions changes the participants.
        max_participants=args.partitions, sql_mode=args.sql_mode)

    def report(batch_id: int, timings: object, records: int) -> None:
        print(f"BATCH {batch_id} {'skipped' if timings is None else 'committed'} {records} "
              f"t={time.time():.3f}", flush=True)

    sink.on_batch = report
    events = (spark.readStream.schema("event_id BIGINT, payload STRING")
              .option("maxFilesPerTrigger", 1).json(args.source))
    shaped = (events.withColumn("key", F.col("event_id").cast("string"))
              .repartition(args.partitions))
    if args.follow:
        failures: list[BaseException] = []

        def write(df: Any, batch_id: int) -> None:
            try:
                sink(df, batch_id)
            except BaseException as exc:
                failures.append(exc)  # what the query's exception wraps, for the report
                raise

        def start() -> Any:
            failures.clear()
            return (shaped.writeStream.foreachBatch(write)
                    .option("checkpointLocation", args.checkpoint).start())

        follow(start, failures, args.follow, args.max_restarts)
    else:
        query = (shaped.writeStream.foreachBatch(sink)
                 .option("checkpointLocation", args.checkpoint)
                 .trigger(availableNow=True).start())
        query.awaitTermination()
    print(f"RECOVERY {sink.recovery}", flush=True)
    print(f"MODE {sink.mode}", flush=True)
    sink.close()
    spark.stop()
    print("DONE", flush=True)
    return 0


def follow(start: Callable[[], Any], failures: list[BaseException], stop_file: str,
           max_restarts: int) -> None:
    """Run the query until ``stop_file`` exists and all available files are written; start it
    again after a dualwrite error, as an application's supervisor would."""
    from pyspark.errors import StreamingQueryException

    restarts = 0
    while True:
        query = start()
        try:
            while not os.path.exists(stop_file):
                if query.awaitTermination(0.5):
                    raise RuntimeError("the query stopped by itself")
            query.processAllAvailable()
            query.stop()
            return
        except StreamingQueryException as exc:
            cause: BaseException = failures[-1] if failures else exc
            kind = family(cause)
            name = f"{type(cause).__module__}.{type(cause).__qualname__}"
            if kind == "foreign" or restarts >= max_restarts:
                print(f"FOREIGN {name} {kind}" if kind == "foreign" else
                      f"GAVE-UP {name} {kind}", flush=True)
                raise
            restarts += 1
            # What a failed task raised (BatchTasksFailedError.task_error), by class.
            task = str(getattr(cause, "task_error", "")).split(":", 1)[0]
            print(f"RESTART {name} {kind} t={time.time():.3f}"
                  + (f" task={task}" if task else ""), flush=True)
            logging.getLogger("spark_worker").warning("query failed (%s: %s); restarting",
                                                      name, cause)
            time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
