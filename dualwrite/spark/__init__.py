"""Exactly-once Spark Structured Streaming sinks for Kafka and SQL (needs ``dualwrite[spark]``).

``df.writeStream.foreachBatch(ExactlyOnceSink(sink_id=..., kafka_config=..., topic=...))`` writes
each micro-batch to a Kafka topic (and optionally a SQL table) exactly once; see spark/README.md.
:mod:`dualwrite.spark.faults` is its fault-injection seam (for the crash tests).
"""

from dualwrite.batch.coordinator import BatchTimings, SinkRecovery
from dualwrite.spark._sink import DEFAULT_DATABASE_URL, ExactlyOnceSink

__all__ = ["DEFAULT_DATABASE_URL", "BatchTimings", "ExactlyOnceSink", "SinkRecovery"]
