"""Benchmark: a service's requests (one row + one record each) at 1 to 128 concurrent clients.

In one run, on the same broker and PostgreSQL, per number of client threads:

(a) ``naive``: the naive dual write — the row committed, then the record produced and its delivery
    awaited (one shared producer); not atomic, the figure users compare against;
(b) ``outbox``: the row and an outbox row in one database transaction, no Kafka;
(c) ``pool``: ``DualWriterPool(group_commit=False)``, one Kafka transaction per request;
(d) ``pool-gc``: ``DualWriterPool(group_commit=True)``, requests sharing transactions;
(e) ``async-gc``: ``AsyncDualWriterPool(group_commit=True)``, the clients being asyncio tasks on one
    event loop (in a thread of its own);
(f) ``pool-run``: ``pool.run(fn, key)`` on (d)'s pool, ``fn`` running in a writer's thread;
(g) ``async-run``: ``await apool.run(fn, key)`` on (e)'s pool, the same ``fn``.

Prints transactions/s, p50 and p99 latency, the process's CPU per request and the ratios to (a);
then the memory of one pooled writer (RSS of a warm pool of ``--size`` writers, per writer).
``--durable`` runs every case again on a second throwaway PostgreSQL that flushes each commit
(fsync, synchronous_commit and full_page_writes on) and prints its own table. ``--profile`` adds,
for (a) and the grouped cases, the CPU per request by component (yappi over a second run).

    ./run.sh bench service [--quick] [--seconds 5] [--clients 1,8,32,128] [--size 16]
                           [--cases naive,outbox,pool,pool-gc,async-gc,pool-run,async-run]
                           [--db URL] [--durable] [--profile]

Starts a local Kafka and PostgreSQL unless ``DUALWRITE_BOOTSTRAP_SERVERS`` / ``--db`` are given.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import site
import sys
import sysconfig
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

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
CASES = ("naive", "outbox", "pool", "pool-gc", "async-gc", "pool-run", "async-run")
PROFILED = ("naive", "pool-gc", "async-gc", "pool-run", "async-run")
ASYNC_CASES = ("async-gc", "async-run")
RUN_CASES = ("pool-run", "async-run")

Request = Callable[[str], None]
AsyncRequest = Callable[[str], Awaitable[None]]
Tx = dw.DualWriteTransaction | dw.GroupedTransaction


# -- CPU accounting ---------------------------------------------------------------------------

# Components of the profile, in print order: (column, module prefixes).
COMPONENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sqla", ("sqlalchemy",)),
    ("psycopg", ("psycopg", "psycopg_binary", "psycopg_c", "psycopg_pool")),
    ("kafka", ("confluent_kafka",)),
    ("w.pool", ("dualwrite.writer.pool",)),
    ("writer", ("dualwrite.writer",)),
    ("partic", ("dualwrite.participant",)),
    ("database", ("dualwrite.database",)),
    ("thr/q", ("threading", "queue", "_thread", "_queue", "concurrent")),
    ("asyncio", ("asyncio", "_asyncio")),
    ("other", ("",)),
)
# librdkafka's own threads (named ``rdk:...``): native CPU a Python profiler does not see.
RDK = "rdk-thr"


def component_of(module: str) -> str:
    for name, prefixes in COMPONENTS:
        if any(module == p or module.startswith(p + ".") or not p for p in prefixes):
            return name
    return "other"


class ModuleNames:
    """A source file's dotted module name, from the import roots of this interpreter."""

    def __init__(self) -> None:
        roots = [Path(dw.__file__).resolve().parent.parent, *map(Path, site.getsitepackages()),
                 Path(sysconfig.get_paths()["stdlib"])]
        self.roots = sorted({r.resolve() for r in roots}, key=lambda r: -len(str(r)))
        self.cache: dict[str, str] = {}

    def __call__(self, path: str) -> str:
        name = self.cache.get(path)
        if name is None:
            name = path
            resolved = Path(path).resolve()
            for root in self.roots:
                if resolved.is_relative_to(root):
                    name = ".".join(resolved.relative_to(root).with_suffix("").parts)
                    break
            self.cache[path] = name
        return name


def builtin_component(full_name: str) -> str | None:
    """The component of a C function yappi reports under ``builtins``, if its name tells."""
    for marker, name in (("cimpl.", "kafka"), ("psycopg", "psycopg"), ("_thread.", "thr/q"),
                         ("_queue.", "thr/q"), ("_asyncio.", "asyncio")):
        if marker in full_name:
            return name
    return None


def rdk_cpu() -> dict[int, float]:
    """CPU seconds so far of each librdkafka thread of this process, by thread id: the
    scheduler's run time in ns (``schedstat``), as ``stat``'s clock ticks round a thread's few
    milliseconds to nothing."""
    out: dict[int, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().startswith("rdk:"):
                out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return out


@dataclass
class CaseResult:
    count: int
    latencies: list[float]
    elapsed: float
    cpu: float
    rdk: float = 0.0
    profile: dict[str, float] = field(default_factory=dict)
    """Python threads' CPU seconds by component (yappi, exclusive time), of a profiled run."""
    profiled_cpu: float = 0.0
    profiled_count: int = 0


@contextmanager
def measured(result: list[float]) -> Iterator[None]:
    """Process CPU seconds and librdkafka threads' CPU seconds of the block into ``result``."""
    cpu0, rdk0 = time.process_time(), rdk_cpu()
    yield
    cpu1, rdk1 = time.process_time(), rdk_cpu()
    result[:] = [cpu1 - cpu0, sum(v - rdk0.get(tid, 0.0) for tid, v in rdk1.items())]


def yappi_profile(modules: ModuleNames) -> dict[str, float]:
    """The stopped yappi's CPU seconds by component: each function's exclusive time, C functions
    that name no component counted with their Python caller."""
    import yappi

    by: dict[str, float] = {}
    for stat in yappi.get_func_stats():
        if stat.builtin:
            name = builtin_component(stat.full_name)
            if name is not None:
                by[name] = by.get(name, 0.0) + stat.tsub
            continue
        name = component_of(modules(stat.module))
        by[name] = by.get(name, 0.0) + stat.tsub
        for child in stat.children:
            if child.builtin and builtin_component(child.full_name) is None:
                by[name] = by.get(name, 0.0) + child.tsub
    return by


# -- clients ----------------------------------------------------------------------------------

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


def run_tasks(request: AsyncRequest, loop: asyncio.AbstractEventLoop, clients: int,
              seconds: float) -> tuple[int, list[float], float]:
    """``clients`` asyncio tasks on ``loop`` awaiting ``request`` for ``seconds``."""
    async def main() -> tuple[int, list[float], float]:
        latencies: list[float] = []
        deadline = time.perf_counter() + seconds

        async def client(i: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                await request(f"{uuid.uuid4().hex[:12]}-a{i}-{n}")
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


def durability(engine: sa.Engine) -> str:
    """The server's settings that decide whether a commit waits for its flush to disk."""
    with engine.connect() as conn:
        return ", ".join(f"{name}={conn.exec_driver_sql(f'SHOW {name}').scalar()}"
                         for name in ("fsync", "synchronous_commit", "full_page_writes",
                                      "max_connections"))


# -- one database -----------------------------------------------------------------------------

def bench_database(title: str, db_url: str, kafka: dict[str, str], topic: str,
                   args: argparse.Namespace, cases: list[str], seconds: float,
                   memory: bool) -> None:
    """Every case at every number of clients on the database at ``db_url``: one table; with
    ``memory``, the RSS per warm writer (the first database's only: a later one reuses what the
    allocator freed)."""
    with ExitStack() as stack:
        # A service's bounded connection pool, shared by its request threads (cases a and b).
        engine = dw.create_engine(db_url, pool_size=32, max_overflow=0, pool_timeout=60)
        stack.callback(engine.dispose)
        dw.upgrade_database(engine)
        metadata.create_all(engine)
        print(f"== {title}: {durability(engine)}\n")

        producer = Producer({**kafka, "linger.ms": 0, "enable.idempotence": True})
        polling = threading.Event()

        def poll() -> None:
            while not polling.is_set():
                producer.poll(0.05)

        threading.Thread(target=poll, daemon=True).start()
        stack.callback(producer.flush, 10)
        stack.callback(polling.set)

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

        def work(tx: Tx, key: str) -> None:
            tx.produce(topic, PAYLOAD, key)
            tx.connection.execute(orders.insert(), {"id": key, "payload": PAYLOAD})

        pools: dict[str, dw.DualWriterPool] = {}
        before = rss_mb()
        for case, gc, users in (("pool", False, ("pool",)),
                                ("pool-gc", True, ("pool-gc", "pool-run"))):
            if any(c in cases for c in users):
                pools[case] = stack.enter_context(dw.DualWriterPool(
                    engine, kafka, id_prefix=f"bench-{case}-{uuid.uuid4().hex[:6]}",
                    size=args.size, group_commit=gc))
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        stack.callback(loop.call_soon_threadsafe, loop.stop)
        apool: dw.AsyncDualWriterPool | None = None
        if any(c in cases for c in ASYNC_CASES):
            apool = dw.AsyncDualWriterPool(engine, kafka, size=args.size, group_commit=True,
                                           id_prefix=f"bench-async-{uuid.uuid4().hex[:6]}")
            asyncio.run_coroutine_threadsafe(apool.start(), loop).result()
            closing = apool.close
            stack.callback(lambda: asyncio.run_coroutine_threadsafe(closing(), loop).result())
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
        if "pool-run" in cases:
            runner = pools["pool-gc"]
            requests["pool-run"] = lambda key: runner.run(work, key)
        async_requests: dict[str, AsyncRequest] = {}
        if apool is not None:
            apool_ = apool

            async def async_gc(key: str) -> None:
                async with apool_.transaction() as tx:
                    tx.produce(topic, PAYLOAD, key)
                    await tx.connection.execute(orders.insert(), {"id": key, "payload": PAYLOAD})

            async def async_run(key: str) -> None:
                await apool_.run(work, key)

            async_requests = {"async-gc": async_gc, "async-run": async_run}

        def run_case(case: str, clients: int) -> tuple[int, list[float], float]:
            if case in async_requests:
                return run_tasks(async_requests[case], loop, clients, seconds)
            return run_clients(requests[case], clients, seconds)

        modules = ModuleNames()
        results: dict[tuple[int, str], CaseResult] = {}
        print(f"{'clients':>7} {'case':<9} {'tx/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
              f"{'cpu ms/req':>10} {'tx/s vs a':>10} {'p99 vs a':>9}")
        for clients in (int(c) for c in args.clients.split(",")):
            base: tuple[float, float] | None = None
            for case in cases:
                time.sleep(args.pause)
                cpu: list[float] = []
                with measured(cpu):
                    count, lat, elapsed = run_case(case, clients)
                res = results[clients, case] = CaseResult(count, lat, elapsed, cpu[0], cpu[1])
                tps, p99 = count / elapsed, pct(lat, 0.99)
                if case == "naive":
                    base = (tps, p99)
                ratio = (f"{tps / base[0]:>10.2f} {p99 / base[1]:>9.2f}" if base
                         else f"{'':>10} {'':>9}")
                print(f"{clients:>7} {case:<9} {tps:>8.0f} {pct(lat, 0.5) * 1000:>8.1f} "
                      f"{p99 * 1000:>8.1f} {res.cpu / max(1, count) * 1000:>10.2f} {ratio}",
                      flush=True)
                if args.profile and case in PROFILED:
                    import yappi

                    time.sleep(args.pause)
                    yappi.clear_stats()
                    yappi.set_clock_type("cpu")
                    prof: list[float] = []
                    with measured(prof):
                        yappi.start(builtins=True, profile_threads=True)
                        try:
                            res.profiled_count = run_case(case, clients)[0]
                        finally:
                            yappi.stop()
                    res.profiled_cpu = prof[0]
                    res.profile = yappi_profile(modules)
                    yappi.clear_stats()
            print()
        if memory:
            print(f"memory per pooled writer (RSS of {writers} warm writers / {writers}): "
                  f"{per_writer:.1f} MB\n")
        if args.profile:
            print_profile(results)


def print_profile(results: dict[tuple[int, str], CaseResult]) -> None:
    """CPU ms per request by component: the Python threads' share of each component in the
    profiled run, applied to the unprofiled run's Python-thread CPU, plus librdkafka's threads."""
    names = [name for name, _ in COMPONENTS] + [RDK]
    print("CPU ms per request by component (yappi shares of a second, profiled run, scaled to "
          "the unprofiled run;\nrdk-thr: librdkafka's native threads, unprofiled run; "
          "prof x: the profiled run's CPU per request / the unprofiled run's)")
    print(f"{'clients':>7} {'case':<9} {'cpu ms':>7} {'prof x':>6} "
          + " ".join(f"{n:>8}" for n in names))
    for (clients, case), res in results.items():
        if not res.profile or not res.count:
            continue
        per_req = res.cpu / res.count * 1000
        python = (res.cpu - res.rdk) / res.count * 1000
        total = sum(res.profile.values()) or 1.0
        cells = [python * res.profile.get(n, 0.0) / total for n, _ in COMPONENTS]
        cells.append(res.rdk / res.count * 1000)
        overhead = res.profiled_cpu / max(1, res.profiled_count) * 1000 / per_req
        print(f"{clients:>7} {case:<9} {per_req:>7.2f} {overhead:>6.1f} "
              + " ".join(f"{c:>8.3f}" for c in cells))
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, help="per case (default 5, 2 with --quick)")
    parser.add_argument("--clients", default="1,8,32,128")
    parser.add_argument("--size", type=int, default=16, help="writers per pool")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--quick", action="store_true",
                        help="2 s per case (an explicit --seconds wins)")
    parser.add_argument("--pause", type=float, default=2.0,
                        help="idle seconds before each case: the broker settles from the last")
    parser.add_argument("--db", help="database URL (default: a throwaway local PostgreSQL)")
    parser.add_argument("--durable", action="store_true",
                        help="also run every case on a throwaway PostgreSQL with fsync, "
                             "synchronous_commit and full_page_writes on")
    parser.add_argument("--profile", action="store_true",
                        help="CPU per request by component for naive and the grouped cases "
                             "(a second, profiled run of each; needs yappi)")
    args = parser.parse_args()
    seconds = args.seconds if args.seconds is not None else 2.0 if args.quick else 5.0
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}: choose from {','.join(CASES)}")
    missing = [c for c in RUN_CASES if c in cases
               and not hasattr(dw.AsyncDualWriterPool if c in ASYNC_CASES
                               else dw.DualWriterPool, "run")]
    if missing:
        print(f"skipping {', '.join(missing)}: this dualwrite's pools have no run()\n")
        cases = [c for c in cases if c not in missing]
    if args.profile:
        try:
            import yappi  # noqa: F401
        except ImportError:
            parser.error("--profile needs yappi: pip install yappi (in dualwrite[dev])")

    with ExitStack() as stack:
        bootstrap = os.environ.get("DUALWRITE_BOOTSTRAP_SERVERS")
        if not bootstrap:
            bootstrap = stack.enter_context(LocalKafkaCluster(brokers=1)).bootstrap_servers
        # Three warm pools take about 30 connections per 16 writers, (a) and (b) 32 more.
        room = {"max_connections": "400"}
        databases = [("PostgreSQL of --db" if args.db else "throwaway PostgreSQL",
                      args.db or stack.enter_context(LocalPostgres(settings=room)).url)]
        if args.durable:
            databases.append(("durable throwaway PostgreSQL", stack.enter_context(
                LocalPostgres(settings=room, durable=True)).url))
        topic = create_topic(bootstrap, f"bench-svc-{uuid.uuid4().hex[:6]}", partitions=3)
        print(f"Kafka {bootstrap}, topic {topic} (3 partitions), {seconds:g} s per case, pools "
              f"of {args.size} writers\n")
        for i, (title, url) in enumerate(databases):
            bench_database(title, url, {"bootstrap.servers": bootstrap}, topic, args, cases,
                           seconds, memory=i == 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
