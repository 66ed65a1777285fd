"""Benchmark: the exactly-once consumer against a plain at-least-once consumer, same run.

Both read the same ``--messages`` input records (3 partitions, read_committed) in batches of
``--batch`` and, per input, write one row and produce one record:

(a) ``at-least-once``: confluent-kafka consumer; per batch the rows in one database transaction,
    then the records with an idempotent producer (flushed), then the group offsets committed
    (synchronously). A crash between those steps repeats the batch's rows or records;
(b) ``exactly-once``: ``dualwrite.ExactlyOnceConsumer`` with ``max_batch=--batch``: per batch one
    decision of rows, records and input positions.

Prints messages/s of each (from the first batch handed over to the last one done, so the group
join is not counted) and (b)/(a), per round (the two alternate who goes first) and the median.

    ./run.sh bench consumer [--messages 20000] [--batch 500] [--rounds 3] [--db URL]

Starts a local Kafka and PostgreSQL unless ``DUALWRITE_BOOTSTRAP_SERVERS`` / ``--db`` are given.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack

import sqlalchemy as sa
from confluent_kafka import Consumer, Producer

import dualwrite as dw
from dualwrite.dev.kafka_cluster import LocalKafkaCluster, create_topic
from dualwrite.dev.postgres_cluster import LocalPostgres

metadata = sa.MetaData()
effects = sa.Table("bench_consumer_effects", metadata,
                   sa.Column("id", sa.String(64), nullable=False),
                   sa.Column("payload", sa.String(256), nullable=False))


def feed(bootstrap: str, topic: str, n: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    for i in range(n):
        producer.produce(topic, key=f"k{i}", value=f"payment-{i:08d}-" + "x" * 40)
        if i % 10_000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0


def at_least_once(engine: sa.Engine, bootstrap: str, topic: str, output: str, n: int,
                  batch: int) -> float:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"alo-{uuid.uuid4().hex[:6]}",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "auto.offset.reset": "earliest"})
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                         "linger.ms": 0})
    consumer.subscribe([topic])
    done, start = 0, 0.0
    try:
        while done < n:
            msgs = [m for m in consumer.consume(batch, 0.2) if m.error() is None]
            if not msgs:
                continue
            if not start:
                start = time.perf_counter()
            values = [(m.value() or b"").decode() for m in msgs]
            with engine.begin() as conn:
                conn.execute(effects.insert(), [{"id": v[:16], "payload": v} for v in values])
            for v in values:
                producer.produce(output, value=v, key=v[:16])
            assert producer.flush(30) == 0
            consumer.commit(asynchronous=False)
            done += len(msgs)
        return done / (time.perf_counter() - start)
    finally:
        consumer.close()


def exactly_once(engine: sa.Engine, bootstrap: str, topic: str, output: str, n: int,
                 batch: int) -> float:
    start = 0.0

    def handler(messages: Sequence[dw.ConsumedMessage], tx: dw.DualWriteTransaction) -> None:
        nonlocal start
        if not start:
            start = time.perf_counter()
        values = [(m.value or b"").decode() for m in messages]
        for v in values:
            tx.produce(output, value=v, key=v[:16])
        tx.connection.execute(effects.insert(), [{"id": v[:16], "payload": v} for v in values])

    with dw.ExactlyOnceConsumer(engine, {"bootstrap.servers": bootstrap},
                                group_id=f"eo-{uuid.uuid4().hex[:6]}", topics=[topic],
                                max_batch=batch, max_batch_s=0.1) as consumer:
        done = consumer.run(handler, stop_after=n)
    return done / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--db", help="database URL (default: a throwaway local PostgreSQL)")
    args = parser.parse_args()
    with ExitStack() as stack:
        bootstrap = os.environ.get("DUALWRITE_BOOTSTRAP_SERVERS")
        if not bootstrap:
            bootstrap = stack.enter_context(LocalKafkaCluster(brokers=1)).bootstrap_servers
        db_url = args.db or stack.enter_context(LocalPostgres()).url
        dw.upgrade_database(db_url)
        engine = dw.create_engine(db_url)
        metadata.create_all(engine)
        run = uuid.uuid4().hex[:6]
        topic = create_topic(bootstrap, f"bench-consumer-in-{run}", partitions=3)
        feed(bootstrap, topic, args.messages)
        print(f"{args.messages} input records on 3 partitions, batches of {args.batch}")
        cases = [("at-least-once", at_least_once), ("exactly-once", exactly_once)]
        ratios = []
        for r in range(args.rounds):
            rates = {}
            for name, case in cases if r % 2 == 0 else cases[::-1]:  # alternate who goes first
                output = create_topic(bootstrap, f"bench-consumer-{name}-{run}-{r}",
                                      partitions=3)
                rates[name] = case(engine, bootstrap, topic, output, args.messages, args.batch)
            ratios.append(rates["exactly-once"] / rates["at-least-once"])
            print(f"round {r + 1}: " + ", ".join(f"{name} {rate:.0f} messages/s"
                                                 for name, rate in rates.items())
                  + f"; ratio {ratios[-1]:.2f}")
        print(f"SUMMARY: exactly-once / at-least-once = {statistics.median(ratios):.2f}x "
              f"(median of {args.rounds} rounds; {args.messages} messages, batch {args.batch})")
        metadata.drop_all(engine)
        engine.dispose()


if __name__ == "__main__":
    main()
