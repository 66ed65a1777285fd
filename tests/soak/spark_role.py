"""The soak's Spark role: ``spark/orders_pipeline.py`` as it ships (its generator source: order ids
``batch * rows .. (batch + 1) * rows - 1``, the same after a restart; validated, enriched, written
by ``ExactlyOnceSink`` to its ``orders_enriched`` table and a topic), with a driver loop of the
soak's: after a dualwrite error the query is started again on the same checkpoint, as an
application's supervisor would, and SIGTERM lets the batch in flight finish, then stops.

Lines for the soak: ``BATCH <id> committed|skipped <records> t=<time>``; ``RESTART <class>
<family> t=<time> [task=<class>]`` after a dualwrite error; ``FOREIGN <class> <family>`` (any
other error, the process then exits 1) or ``GAVE-UP`` after ``--max-restarts``.

    python -m tests.soak.spark_role --db URL -b HOST:PORT --topic T --sink-id S \
        --checkpoint DIR [--rows-per-batch N] [--trigger S] [--kafka-config k=v ...]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from tests.soak.roles import on_sigterm, report_uncaught
from tests.support import script
from tests.support.journal import family

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

pipeline_script = script("spark", "orders_pipeline")
log = logging.getLogger("tests.soak.spark")


class SoakPipeline(pipeline_script.OrdersPipeline):  # type: ignore[misc,name-defined]
    """The pipeline's ``foreachBatch`` function, keeping the error a batch raised (the query's
    own exception only wraps it) and printing a ``BATCH`` line per batch."""

    def __init__(self, sink: Any) -> None:
        super().__init__(sink, max_batches=None, report=lambda line: None)
        self.failures: list[BaseException] = []

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        try:
            super().__call__(df, batch_id)
        except BaseException as exc:
            self.failures.append(exc)
            raise
        if self.batches and self.batches[-1].batch_id == batch_id:
            done = self.batches[-1]
            print(f"BATCH {batch_id} {'skipped' if done.timings is None else 'committed'} "
                  f"{done.records} t={time.time():.3f}", flush=True)

    def hold_new_batches(self) -> None:
        """Batches Spark plans from now on write nothing and wait for the query to stop."""
        self.max_batches = 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("-b", "--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--sink-id", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--rows-per-batch", type=int, default=200)
    ap.add_argument("--trigger", type=float, default=4.0)
    ap.add_argument("--kafka-config", action="append", default=[])
    ap.add_argument("--max-restarts", type=int, default=100_000)
    args = ap.parse_args()
    report_uncaught()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    on_sigterm(stop.set)

    config = pipeline_script.PipelineConfig(
        bootstrap=args.bootstrap, db=args.db, topic=args.topic, sink_id=args.sink_id,
        checkpoint=args.checkpoint, rows_per_batch=args.rows_per_batch,
        partitions=args.partitions, trigger_s=args.trigger, master="local[2,4]",
        kafka_config=dict(item.split("=", 1) for item in args.kafka_config),
        spark_conf={"spark.ui.enabled": "false",
                    # A short-lived driver JVM: C1 only and the serial GC start about twice as
                    # fast.
                    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"})
    from pyspark.errors import StreamingQueryException

    spark = pipeline_script.spark_session(config)
    spark.sparkContext.setLogLevel("ERROR")
    pipeline_script.check_checkpoint(config)
    pipeline_script.ensure_orders_table(config.db, config.table)
    pipeline_script.ensure_topic(config.bootstrap, config.topic, config.partitions,
                                 config.kafka_config)
    orders = pipeline_script.enrich(
        pipeline_script.generated_orders(spark, config.rows_per_batch), config.partitions)
    sink = pipeline_script.make_sink(config)
    restarts = 0
    try:
        while True:
            pipeline = SoakPipeline(sink)
            query = (orders.writeStream.queryName(config.sink_id).foreachBatch(pipeline)
                     .option("checkpointLocation", config.checkpoint)
                     .trigger(processingTime=f"{config.trigger_s:g} seconds").start())
            with contextlib.suppress(StreamingQueryException):  # read below, from failures
                while not stop.is_set() and not query.awaitTermination(0.5):
                    pass
            if stop.is_set():
                pipeline.hold_new_batches()
                # The batch in flight finishes; the next one waits to be stopped.
                deadline = time.monotonic() + 120
                while (query.isActive and not pipeline.held.is_set()
                       and time.monotonic() < deadline):
                    time.sleep(0.2)
                pipeline.release()
                query.stop()
                return 0
            cause: BaseException | None = pipeline.failures[-1] if pipeline.failures else (
                query.exception())
            name = f"{type(cause).__module__}.{type(cause).__qualname__}"
            kind = family(cause) if cause is not None else "foreign"
            if kind == "foreign":
                print(f"FOREIGN {name} {kind}", flush=True)
                return 1
            if restarts >= args.max_restarts:
                print(f"GAVE-UP {name} {kind}", flush=True)
                return 1
            restarts += 1
            # What a failed task raised (BatchTasksFailedError.task_error), by class.
            task = str(getattr(cause, "task_error", "")).split(":", 1)[0]
            print(f"RESTART {name} {kind} t={time.time():.3f}"
                  + (f" task={task}" if task else ""), flush=True)
            log.warning("query failed (%s: %s); starting it again", name, cause)
            time.sleep(1.0)
    finally:
        sink.close()
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
