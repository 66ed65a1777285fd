"""Reading a topic the way the exactly-once checks need: read_committed, to the end."""

from __future__ import annotations

import logging
import time
import uuid

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

__all__ = ["read_committed"]


def read_committed(bootstrap: str, topic: str, *, timeout_s: float = 60.0
                   ) -> tuple[list[tuple[bytes | None, bytes | None]], list[int]]:
    """Every (key, value) a read_committed consumer sees in ``topic`` now, and the partitions
    it could not read to the end within ``timeout_s`` (an open transaction holds their last
    stable offset back). librdkafka reports the end of a partition at its last stable offset."""
    consumer = Consumer({"bootstrap.servers": bootstrap,
                         "group.id": f"dualwrite-verify-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "enable.partition.eof": True, "auto.offset.reset": "earliest",
                         "logger": logging.getLogger("dualwrite.librdkafka.dev")})
    try:
        meta = consumer.list_topics(topic, timeout=10).topics[topic]
        consumer.assign([TopicPartition(topic, p, 0) for p in meta.partitions])
        pending = set(meta.partitions)
        records: list[tuple[bytes | None, bytes | None]] = []
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            for msg in consumer.consume(10_000, 0.5):
                err = msg.error()
                if err is None:
                    records.append((msg.key(), msg.value()))
                    pending.add(msg.partition() or 0)  # more may follow an end we saw
                elif err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(msg.partition() or 0)
                else:
                    raise KafkaException(err)
        return records, sorted(pending)
    finally:
        consumer.close()
