"""Benchmark: the batch sink's commit phase at 8 and 32 participants, without Spark.

Per batch, ``N`` participants are prepared the way the Spark sink's tasks leave them (a
``TwoPhaseProducer`` on the pooled transactional id writes one record to its partition, prepares
and is closed; untimed, on a thread pool), then :meth:`BatchCoordinator.finish` verifies,
decides (one PostgreSQL transaction), commits every participant and marks the batch completed.
Its :class:`BatchTimings` are recorded. Two commit paths are interleaved batch by batch, so load
from other processes hits them alike:

- ``threads``: the commit before the fan-out change: one ``ControlPlane.end_transaction`` call
  per participant, from a pool of 16 threads (the first alone, as the sink does);
- ``pipelined``: the sink's commit: every EndTxn sent at once (``ControlPlane.end_transactions``:
  one FindCoordinator, pipelined on one connection per coordinator).

One warm-up batch per path and size is excluded. At the end a read_committed consumer checks
that every committed record is there exactly once.

    ./run.sh bench commit [--participants 8,32] [--batches 15] [--paths threads,pipelined]
                          [--db-url URL] [--json]

Starts a local Kafka and PostgreSQL unless ``DUALWRITE_BOOTSTRAP_SERVERS`` / ``--db-url`` (or
``DUALWRITE_DATABASE_URL``) are given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import dualwrite as dw
from dualwrite.batch.coordinator import BatchCoordinator, BatchTimings
from dualwrite.batch.decision_log import Participant
from dualwrite.batch.naming import transactional_id
from dualwrite.participant import ControlPlane

PATHS = ("threads", "pipelined")
PHASES = ("commit_phase_s", "commit_s", "decide_s", "complete_s", "verify_s")


def log(msg: str) -> None:
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"[{time.strftime('%H:%M:%S')} load {load}] {msg}", file=sys.stderr, flush=True)


class ThreadedCommit(BatchCoordinator):
    """The commit phase as it was: one EndTxn call per participant from 16 threads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._threads = ThreadPoolExecutor(16, thread_name_prefix="bench-threaded-commit")

    def commit(self, batch_id: int, participants: Sequence[Participant]) -> int:
        cp = self.control_plane

        def one(p: Participant) -> None:
            cp.end_transaction(p.transactional_id, p.state.producer_id, p.state.epoch,
                               commit=True)

        if participants:
            one(participants[0])
            list(self._threads.map(one, participants[1:]))
        return len(participants)

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        super().close()


def prepare(pool: ThreadPoolExecutor, kafka_config: Mapping[str, Any], cp: ControlPlane,
            sink_id: str, topic: str, batch: int, n: int) -> list[Participant]:
    """``n`` prepared participants of ``batch``, one per partition, as the sink's tasks leave
    them (the producer closed, its transaction open for the driver)."""

    def task(partition: int) -> Participant:
        tid = transactional_id(sink_id, batch, partition, 0)
        producer = dw.TwoPhaseProducer({**kafka_config, "transactional.id": tid, "linger.ms": 0},
                                       control_plane=cp)
        try:
            producer.init_transactions()
            producer.begin_transaction()
            value = f"{sink_id}-{batch}-{partition}".encode()
            producer.produce(topic, value, key=value, partition=partition)
            state = producer.prepare_transaction()
        finally:
            producer.close()
        return Participant(partition, tid, state, 1)

    return list(pool.map(task, range(n)))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--participants", default="8,32",
                        help="participants per batch, comma-separated (default 8,32)")
    parser.add_argument("--batches", type=int, default=15, help="measured batches per case")
    parser.add_argument("--paths", default=",".join(PATHS), help="threads,pipelined")
    parser.add_argument("--db-url", default=os.environ.get("DUALWRITE_DATABASE_URL"),
                        help="SQLAlchemy URL (default: a throwaway local PostgreSQL)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    sizes = [int(n) for n in args.participants.split(",")]
    paths = [p for p in args.paths.split(",") if p]
    if not set(paths) <= set(PATHS) or not paths:
        parser.error(f"--paths: choose from {','.join(PATHS)}")

    from dualwrite.dev import LocalKafkaCluster, LocalPostgres, create_topic, read_committed

    results: dict[str, dict[str, list[float]]] = {}
    with ExitStack() as stack:
        bootstrap = os.environ.get("DUALWRITE_BOOTSTRAP_SERVERS")
        if not bootstrap:
            log("starting a local Kafka broker")
            bootstrap = stack.enter_context(LocalKafkaCluster(brokers=1)).bootstrap_servers
        db_url = args.db_url
        if not db_url:
            log("starting a local PostgreSQL")
            db_url = stack.enter_context(LocalPostgres()).url
        engine = dw.create_engine(db_url)
        dw.upgrade_database(engine)
        run = uuid.uuid4().hex[:6]
        kafka_config = {"bootstrap.servers": bootstrap}
        topic = create_topic(bootstrap, f"bench-commit-{run}", partitions=max(sizes))
        cp = stack.enter_context(ControlPlane(kafka_config))
        pool = stack.enter_context(ThreadPoolExecutor(8, thread_name_prefix="bench-task"))
        coordinators: dict[tuple[str, int], BatchCoordinator] = {}
        for n in sizes:
            for path in paths:
                kind = ThreadedCommit if path == "threads" else BatchCoordinator
                coordinators[path, n] = stack.enter_context(
                    kind(f"bench-commit-{run}-{path}-{n}", engine, kafka_config))
        expected = 0
        log(f"participants {sizes}, paths {paths}, {args.batches} batches + 1 warm-up each")
        for batch in range(args.batches + 1):
            for n in sizes:
                for path in paths:
                    coord = coordinators[path, n]
                    parts = prepare(pool, kafka_config, cp, coord.sink_id, topic, batch, n)
                    timings = coord.finish(batch, parts)
                    assert isinstance(timings, BatchTimings)
                    expected += n
                    if batch == 0:
                        continue
                    case = results.setdefault(f"{path}@{n}", {k: [] for k in PHASES})
                    for phase in PHASES:
                        case[phase].append(getattr(timings, phase))
            if batch % 5 == 0:
                log(f"batch {batch} done")
        records, unfinished = read_committed(bootstrap, topic, timeout_s=60)
        values = [v for _, v in records]
        ok = len(values) == expected and len(set(values)) == expected and not unfinished

    summary = {name: {phase: {"p50": statistics.median(v), "p95": percentile(v, 0.95)}
                      for phase, v in phases.items()} for name, phases in results.items()}
    if args.json:
        print(json.dumps({"summary": summary, "verified": ok, "records": len(values)}, indent=2))
    else:
        print(f"{'case':<14} {'commit phase p50/p95':>21} {'EndTxn':>9} {'decide':>9} "
              f"{'complete':>9} {'verify':>9}   (ms; p50 unless said)")
        for name, s in summary.items():
            def ms(phase: str, q: str = "p50", s: dict[str, dict[str, float]] = s) -> str:
                return f"{s[phase][q] * 1e3:.1f}"
            both = f"{ms('commit_phase_s')} / {ms('commit_phase_s', 'p95')}"
            print(f"{name:<14} {both:>21} {ms('commit_s'):>9} {ms('decide_s'):>9} "
                  f"{ms('complete_s'):>9} {ms('verify_s'):>9}")
    print(f"SUMMARY: {len(values)} of {expected} records committed once, "
          f"{'verified OK' if ok else 'VERIFICATION FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
