"""Benchmark: a service's requests (one row + one record each) at 1 to 128 concurrent clients.

In one run, on the same broker and PostgreSQL, per number of client threads:

(a) ``naive``: the naive dual write — the row committed, then the record produced and its delivery
    awaited (one shared producer); not atomic, the figure users compare against;
(b) ``outbox``: the row and an outbox row in one database transaction, no Kafka;
(c) ``pool``: ``DualWriterPool(group_commit=False)``, one Kafka transaction per request;
(d) ``pool-gc``: ``DualWriterPool(group_commit=True)``, requests sharing transactions;
(e) ``async-gc``: ``AsyncDualWriterPool(group_commit=True)``, the clients being asyncio tasks on one
    event loop (in a thread of its own).

Prints transactions/s, p50 and p99 latency and the ratios to (a); then the memory of one pooled
writer (RSS of a warm pool of ``--size`` writers, per writer).

    ./run.sh bench service [--quick] [--seconds 5] [--clients 1,8,32,128] [--size 16]
                           [--cases naive,outbox,pool,pool-gc,async-gc] [--db URL]

Starts a local Kafka and PostgreSQL unless ``DUALWRITE_BOOTSTRAP_SERVERS`` / ``--db`` are given.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack

import sqlalchemy as sa
from confluent_kafka import Producer

import dualwrite as dw
from dualwrite.dev.kafka_cluster import LocalKafkaCluster, create_topic
from dualwrite.dev.postgres_cluster import LocalPostgres

metadata = sa.MetaData()
orders = sa.Table("bench_orders", metadata,
                  sa.Column("id", sa.String(64), primary_key=True),
                  sa.Column("payload", sa.String(256), nullable=False))
outbox = sa.Table("bench_outbox", metadata,
                  sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
                  sa.Column("topic", sa.String(255), nullable=False),
                  sa.Column("key", sa.String(64), nullable=False),
                  sa.Column("payload", sa.String(256), nullable=False))
PAYLOAD = "x" * 200

Request = Callable[[str], None]


def run_clients(request: Request, clients: int, seconds: float) -> tuple[int, list[float], float]:
    """``clients`` threads calling ``request`` for ``seconds``; (count, latencies, elapsed)."""
    stop = threading.Event()
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors: list[BaseException] = []

    def client(i: int) -> None:
        n = 0
        mine = latencies[i]
        try:
            while not stop.is_set():
                started = time.perf_counter()
                request(f"{uuid.uuid4().hex[:12]}-{i}-{n}")
                mine.append(time.perf_counter() - started)
                n += 1
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    flat = sorted(x for lat in latencies for x in lat)
    return len(flat), flat, elapsed


def run_tasks(pool: dw.AsyncDualWriterPool, loop: asyncio.AbstractEventLoop, topic: str,
              clients: int, seconds: float) -> tuple[int, list[float], float]:
    """``clients`` asyncio tasks on ``loop`` running requests for ``seconds``."""
    async def main() -> tuple[int, list[float], float]:
        latencies: list[float] = []
        deadline = time.perf_counter() + seconds

        async def client(i: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                key = f"{uuid.uuid4().hex[:12]}-a{i}-{n}"
                started = time.perf_counter()
                async with pool.transaction() as tx:
                    tx.produce(topic, PAYLOAD, key)
                    await tx.connection.execute(orders.insert(), {"id": key, "payload": PAYLOAD})
                latencies.append(time.perf_counter() - started)
                n += 1

        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        return len(latencies), sorted(latencies), time.perf_counter() - started

    return asyncio.run_coroutine_threadsafe(main(), loop).result()


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", default="1,8,32,128")
    parser.add_argument("--size", type=int, default=16, help="writers per pool")
    parser.add_argument("--cases", default="naive,outbox,pool,pool-gc,async-gc")
    parser.add_argument("--quick", action="store_true", help="2 s per case")
    parser.add_argument("--pause", type=float, default=2.0,
                        help="idle seconds before each case: the broker settles from the last")
    parser.add_argument("--db", help="database URL (default: a throwaway local PostgreSQL)")
    args = parser.parse_args()
    seconds = 2.0 if args.quick else args.seconds
    cases = args.cases.split(",")

    with ExitStack() as stack:
        bootstrap = os.environ.get("DUALWRITE_BOOTSTRAP_SERVERS")
        if not bootstrap:
            bootstrap = stack.enter_context(LocalKafkaCluster(brokers=1)).bootstrap_servers
        db_url = args.db or stack.enter_context(LocalPostgres()).url
        # A service's bounded connection pool, shared by its request threads (cases a and b).
        engine = dw.create_engine(db_url, pool_size=32, max_overflow=0, pool_timeout=60)
        dw.upgrade_database(engine)
        metadata.create_all(engine)
        topic = create_topic(bootstrap, f"bench-svc-{uuid.uuid4().hex[:6]}", partitions=3)
        kafka = {"bootstrap.servers": bootstrap}

        producer = Producer({**kafka, "linger.ms": 0, "enable.idempotence": True})
        polling = threading.Event()

        def poll() -> None:
            while not polling.is_set():
                producer.poll(0.05)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()

        def naive(key: str) -> None:
            with engine.begin() as conn:
                conn.execute(orders.insert(), {"id": key, "payload": PAYLOAD})
            delivered = threading.Event()
            failed: list[object] = []

            def on_delivery(err: object, _msg: object) -> None:
                if err is not None:
                    failed.append(err)
                delivered.set()

            producer.produce(topic, PAYLOAD, key, on_delivery=on_delivery)
            delivered.wait(30)
            if failed or not delivered.is_set():
                raise RuntimeError(f"naive produce failed: {failed}")

        def outboxed(key: str) -> None:
            with engine.begin() as conn:
                conn.execute(orders.insert(), {"id": key, "payload": PAYLOAD})
                conn.execute(outbox.insert(), {"topic": topic, "key": key, "payload": PAYLOAD})

        pools: dict[str, dw.DualWriterPool] = {}
        before = rss_mb()
        for case, gc in (("pool", False), ("pool-gc", True)):
            if case in cases:
                pools[case] = stack.enter_context(dw.DualWriterPool(
                    engine, kafka, id_prefix=f"bench-{case}-{uuid.uuid4().hex[:6]}",
                    size=args.size, group_commit=gc))
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        apool: dw.AsyncDualWriterPool | None = None
        if "async-gc" in cases:
            apool = dw.AsyncDualWriterPool(engine, kafka, size=args.size, group_commit=True,
                                           id_prefix=f"bench-async-{uuid.uuid4().hex[:6]}")
            asyncio.run_coroutine_threadsafe(apool.start(), loop).result()
        writers = args.size * (len(pools) + (apool is not None))
        per_writer = (rss_mb() - before) / max(1, writers)

        def pooled(pool: dw.DualWriterPool) -> Request:
            def request(key: str) -> None:
                with pool.transaction() as tx:
                    tx.produce(topic, PAYLOAD, key)
                    tx.connection.execute(orders.insert(), {"id": key, "payload": PAYLOAD})
            return request

        requests: dict[str, Request] = {"naive": naive, "outbox": outboxed}
        requests.update({case: pooled(pool) for case, pool in pools.items()})
        print(f"Kafka {bootstrap}, PostgreSQL, topic {topic} (3 partitions), {seconds:g} s per "
              f"case, pools of {args.size} writers\n")
        print(f"{'clients':>7} {'case':<8} {'tx/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
              f"{'tx/s vs a':>10} {'p99 vs a':>9}")
        for clients in (int(c) for c in args.clients.split(",")):
            base: tuple[float, float] | None = None
            for case in cases:
                time.sleep(args.pause)
                if case == "async-gc":
                    assert apool is not None
                    count, lat, elapsed = run_tasks(apool, loop, topic, clients, seconds)
                else:
                    count, lat, elapsed = run_clients(requests[case], clients, seconds)
                tps, p99 = count / elapsed, pct(lat, 0.99)
                if case == "naive":
                    base = (tps, p99)
                ratio = (f"{tps / base[0]:>10.2f} {p99 / base[1]:>9.2f}" if base
                         else f"{'':>10} {'':>9}")
                print(f"{clients:>7} {case:<8} {tps:>8.0f} {pct(lat, 0.5) * 1000:>8.1f} "
                      f"{p99 * 1000:>8.1f} {ratio}", flush=True)
            print()
        print(f"memory per pooled writer (RSS of {writers} warm writers / {writers}): "
              f"{per_writer:.1f} MB")
        if apool is not None:
            asyncio.run_coroutine_threadsafe(apool.close(), loop).result()
        polling.set()
        producer.flush(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
