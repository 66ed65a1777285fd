"""The soak's exactly-once consumer: each order event of the service's topic becomes one
``soak_payments`` row and one record on the output topic (key and value: the order id), per
batch one ``ExactlyOnceConsumer`` decision.

    python -m tests.soak.consumer_role --db URL -b HOST:PORT --input T --output T2 \
        --group G --journal FILE

It runs until SIGTERM. Like an application following the README it keeps going after an error:
the error is journaled (class and family; ``foreign`` if not dualwrite's) and a new consumer
takes the group's place. Every batch Kafka committed is journaled as ``done`` with its size.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Sequence

import sqlalchemy as sa

import dualwrite as dw
from tests.soak.roles import KillAfterDatabaseCommit, on_sigterm, report_uncaught, role_logging
from tests.support.journal import Journal

PAYMENTS = sa.Table("soak_payments", sa.MetaData(),
                    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
                    sa.Column("order_id", sa.String(64), nullable=False),
                    sa.Column("amount_cents", sa.BigInteger, nullable=False),
                    sa.Column("source", sa.String(64), nullable=False))
"""No unique order id on purpose: the verifier counts duplicates instead of a constraint
refusing them."""


class Batches:
    """The size of the batch being decided, journaled once Kafka committed it."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.pending = 0

    def handle(self, messages: Sequence[dw.ConsumedMessage], tx: dw.DualWriteTransaction,
               output: str) -> None:
        rows = []
        for m in messages:
            order = json.loads(m.value or b"{}")
            rows.append({"order_id": order["order_id"], "amount_cents": order["amount_cents"],
                         "source": f"{m.partition}@{m.offset}"})
            tx.produce(output, order["order_id"], order["order_id"])
        if rows:
            tx.connection.execute(PAYMENTS.insert(), rows)
        self.pending = len(messages)

    def committed(self) -> None:
        self.journal.write("done", n=self.pending)
        self.pending = 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("-b", "--bootstrap", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--journal", required=True)
    args = ap.parse_args()
    report_uncaught()
    role_logging()
    journal = Journal(args.journal)
    batches = Batches(journal)
    hooks = KillAfterDatabaseCommit(batches.committed)
    stopping = threading.Event()
    current: list[dw.ExactlyOnceConsumer] = []

    def stop() -> None:
        stopping.set()
        for consumer in current:
            consumer.stop()

    on_sigterm(stop)
    engine = dw.create_engine(args.db, connect_args={"connect_timeout": 3})
    journal.write("start")
    while not stopping.is_set():
        try:
            with dw.ExactlyOnceConsumer(
                    engine, {"bootstrap.servers": args.bootstrap,
                             "request.timeout.ms": 5000, "socket.timeout.ms": 5000},
                    group_id=args.group, topics=[args.input], max_batch=200, max_batch_s=0.2,
                    timeout_s=20, hooks=hooks,
                    consumer_config={"session.timeout.ms": 6000}) as consumer:
                current[:] = [consumer]
                if stopping.is_set():
                    break
                consumer.run(lambda ms, tx: batches.handle(ms, tx, args.output))
        except Exception as exc:
            journal.error(exc, "run")
            time.sleep(1.0)
        finally:
            current.clear()
    journal.write("stop")
    engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
