"""Benchmark: DualWriter against its baseline, in one run, on the same broker and database.

(a) a plain confluent-kafka transaction of N records, (b) a plain database transaction of N rows,
(c) a DualWriter transaction with the same N records and rows, (d) the naive dual write: (b) then
(a) in one timing, as an application doing both would. Median and p99 of each, and the ratios
c / (a + b) and c / d; the cases run in interleaved rounds. Then the time of ``dualwrite.recover``
over many in-doubt transactional ids.

    ./run.sh bench [--iterations 200] [--sizes 1,1000] [--recover-ids 1000] [--db URL]

Starts a local Kafka and PostgreSQL unless ``DUALWRITE_BOOTSTRAP_SERVERS`` / ``--db`` are given.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Producer

import dualwrite as dw
from dualwrite.dev import LocalKafkaCluster, LocalPostgres, create_topic
from dualwrite.writer import StateStore

metadata = sa.MetaData()
rows_table = sa.Table("bench_rows", metadata,
                      sa.Column("id", sa.String(64), primary_key=True),
                      sa.Column("payload", sa.String(256), nullable=False))


def timed(fn: Callable[[], None], iterations: int, pause_s: float, warmup: int = 5
          ) -> list[float]:
    """Latencies of ``fn``; each call starts after an untimed pause.

    Back to back, a transactional id's next transaction can reach the coordinator before the
    previous one's markers are written; librdkafka then retries AddPartitionsToTxn after
    CONCURRENT_TRANSACTIONS, which adds tens of ms to whichever case is quickest to come back.
    The pause measures each case as a request handler would see it, from idle.
    """
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iterations):
        time.sleep(pause_s)
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(x: float) -> str:
    return f"{x * 1000:8.2f}"


def bench_size(engine: sa.Engine, bootstrap: str, topic: str, n: int, iterations: int,
               pause_s: float) -> dict[str, list[float]]:
    payload = "x" * 200
    counter = iter(range(10**9))

    def batch() -> list[dict[str, Any]]:
        base = f"{uuid.uuid4().hex[:8]}-{next(counter)}"
        return [{"id": f"{base}-{i}", "payload": payload} for i in range(n)]

    def insert(conn: sa.Connection, rows: list[dict[str, Any]]) -> None:
        conn.execute(rows_table.insert(), rows)  # executemany (pipelined on psycopg 3)

    producer = Producer({"bootstrap.servers": bootstrap,
                         "transactional.id": f"bench-plain-{uuid.uuid4().hex[:6]}",
                         "linger.ms": 1})
    producer.init_transactions(30)

    def plain_kafka() -> None:
        producer.begin_transaction()
        for r in batch():
            while True:
                try:
                    producer.produce(topic, key=r["id"], value=r["payload"])
                    break
                except BufferError:
                    producer.poll(0.01)
        producer.commit_transaction(30)

    def plain_db() -> None:
        with engine.begin() as conn:
            insert(conn, batch())

    writer = dw.DualWriter(engine, {"bootstrap.servers": bootstrap, "linger.ms": 1},
                           transactional_id=f"bench-dw-{uuid.uuid4().hex[:6]}")

    def dual() -> None:
        rows = batch()
        with writer.transaction() as tx:
            for r in rows:
                tx.produce(topic, key=r["id"], value=r["payload"])
            insert(tx.connection, rows)  # runs while librdkafka sends in the background

    def naive() -> None:
        plain_db()
        plain_kafka()

    # Interleaved rounds, so that load from elsewhere hits every case alike.
    cases = {"kafka": plain_kafka, "db": plain_db, "dualwrite": dual, "naive": naive}
    results: dict[str, list[float]] = {case: [] for case in cases}
    rounds = 4
    for _ in range(rounds):
        for case, fn in cases.items():
            results[case] += timed(fn, max(1, iterations // rounds), pause_s)
    writer.close()
    return results


def bench_recover(engine: sa.Engine, bootstrap: str, topic: str, ids: int) -> float:
    """Leave ``ids`` transactional ids prepared and DB-decided, then time one recover()."""
    store = StateStore(engine)
    prefix = f"bench-rec-{uuid.uuid4().hex[:6]}"
    producers = []
    for i in range(ids):
        tid = f"{prefix}-{i}"
        p = dw.TwoPhaseProducer({"bootstrap.servers": bootstrap, "transactional.id": tid,
                                 "transaction.timeout.ms": 900_000})
        p.init_transactions()
        p.begin_transaction()
        p.produce(topic, key=tid, value=b"in doubt")
        state = p.prepare_transaction()
        with engine.begin() as conn:
            store.lock(conn, tid)
            store.write(conn, tid, str(state))
        producers.append(p)  # keep the session alive: the transaction stays open
        if (i + 1) % 100 == 0:
            print(f"  prepared {i + 1}/{ids}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    report = dw.recover(engine, {"bootstrap.servers": bootstrap},
                        [f"{prefix}-{i}" for i in range(ids)], parallelism=16)
    elapsed = time.perf_counter() - started
    assert report.count(dw.Outcome.COMMITTED) == ids, report.as_dict()["counts"]
    for p in producers:
        p.close()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--sizes", default="1,1000")
    parser.add_argument("--recover-ids", type=int, default=1000)
    parser.add_argument("--db", help="database URL (default: a throwaway local PostgreSQL)")
    parser.add_argument("--pause-ms", type=float, default=10.0,
                        help="untimed pause before each timed transaction (see timed())")
    args = parser.parse_args()

    with ExitStack() as stack:
        bootstrap = os.environ.get("DUALWRITE_BOOTSTRAP_SERVERS")
        if not bootstrap:
            cluster = stack.enter_context(LocalKafkaCluster(brokers=1))
            bootstrap = cluster.bootstrap_servers
        db_url = args.db
        if not db_url:
            pg = stack.enter_context(LocalPostgres())
            db_url = pg.url
        engine = dw.create_engine(db_url)
        dw.upgrade_database(engine)
        metadata.create_all(engine)
        topic = create_topic(bootstrap, f"bench-{uuid.uuid4().hex[:6]}", partitions=3)
        print(f"Kafka {bootstrap}, database {engine.dialect.name}, topic {topic}, "
              f"{args.iterations} iterations per case, {args.pause_ms:g} ms pause before each\n")
        print(f"{'N':>6} {'case':<12} {'median ms':>10} {'p99 ms':>9}")
        for n in (int(s) for s in args.sizes.split(",")):
            r = bench_size(engine, bootstrap, topic, n, args.iterations, args.pause_ms / 1000)
            for case in ("kafka", "db", "dualwrite", "naive"):
                print(f"{n:>6} {case:<12} {ms(statistics.median(r[case])):>10} "
                      f"{ms(p(r[case], 0.99)):>9}")
            med = statistics.median(r["dualwrite"]) / (
                statistics.median(r["kafka"]) + statistics.median(r["db"]))
            p99 = p(r["dualwrite"], 0.99) / (p(r["kafka"], 0.99) + p(r["db"], 0.99))
            print(f"{n:>6} {'c/(a+b)':<12} {med:>10.2f} {p99:>9.2f}")
            med = statistics.median(r["dualwrite"]) / statistics.median(r["naive"])
            p99 = p(r["dualwrite"], 0.99) / p(r["naive"], 0.99)
            print(f"{n:>6} {'c/d':<12} {med:>10.2f} {p99:>9.2f}\n")
        if args.recover_ids:
            elapsed = bench_recover(engine, bootstrap, topic, args.recover_ids)
            print(f"recover() over {args.recover_ids} in-doubt transactional ids: {elapsed:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
