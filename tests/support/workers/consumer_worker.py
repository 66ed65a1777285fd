"""Exactly-once consumer worker for tests/consumer/test_consumer.py (a separate process, SIGKILLed).

    python tests/support/workers/consumer_worker.py --db URL --bootstrap HOST:PORT --group G \
        --input IN \
        --output OUT [--kill-phase rows|prepared|database_committed --kill-at-batch N] \
        [--idle-s S] [--max-batch N] [--slow-s S]

Per input message it inserts ``effects(input_id)`` and produces the value to OUT (key = value =
the input's value). With ``--kill-phase`` it SIGKILLs itself in batch N at that phase: after the
handler's rows (``rows``), after the Kafka prepare (``prepared``), after the database COMMIT and
before Kafka's (``database_committed``), through the writer's PhaseHooks. Prints ``DECIDED n``
after each batch and exits 0 after ``--idle-s`` without input.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Sequence

import sqlalchemy as sa

from dualwrite import ConsumedMessage, DualWriteTransaction, ExactlyOnceConsumer, create_engine
from dualwrite.participant import PreparedTxnState
from dualwrite.writer import PhaseHooks

EFFECTS = sa.table("effects", sa.column("input_id", sa.String), sa.column("worker", sa.Integer))


def die() -> None:
    print("KILLED", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class Killer(PhaseHooks):
    def __init__(self, phase: str, at_batch: int) -> None:
        self.phase, self.at_batch, self.batch = phase, at_batch, 0

    def due(self, phase: str) -> bool:
        return self.phase == phase and self.batch == self.at_batch

    def prepared(self, state: PreparedTxnState) -> None:
        if self.due("prepared"):
            die()

    def database_committed(self, state: PreparedTxnState) -> None:
        if self.due("database_committed"):
            die()


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--db", "--bootstrap", "--group", "--input", "--output"):
        ap.add_argument(name, required=True)
    ap.add_argument("--kill-phase", default="")
    ap.add_argument("--kill-at-batch", type=int, default=1)
    ap.add_argument("--idle-s", type=float, default=4.0)
    ap.add_argument("--max-batch", type=int, default=20)
    ap.add_argument("--slow-s", type=float, default=0.0)
    args = ap.parse_args()
    killer = Killer(args.kill_phase, args.kill_at_batch)
    engine = create_engine(args.db)

    def handler(messages: Sequence[ConsumedMessage], tx: DualWriteTransaction) -> None:
        killer.batch += 1
        for m in messages:
            value = (m.value or b"").decode()
            tx.connection.execute(sa.insert(EFFECTS).values(input_id=value, worker=os.getpid()))
            tx.produce(args.output, value=value, key=value)
        if killer.due("rows"):
            die()
        if args.slow_s:
            time.sleep(args.slow_s)

    consumer = ExactlyOnceConsumer(
        engine, {"bootstrap.servers": args.bootstrap}, group_id=args.group,
        topics=[args.input], max_batch=args.max_batch, max_batch_s=0.1, timeout_s=20,
        consumer_config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500},
        hooks=killer)
    with consumer:
        consumer.start()
        print(f"STARTED {consumer.transactional_id}", flush=True)
        total = 0
        while True:
            n = consumer.run(handler, stop_after=1, idle_s=args.idle_s)
            if n == 0:
                break
            total += n
            print(f"DECIDED {total}", flush=True)


if __name__ == "__main__":
    main()
