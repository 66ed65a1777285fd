"""A payments consumer: each payment in `payments` marks its order paid and emits `order-paid`,
exactly once (dualwrite.ExactlyOnceConsumer).

    python examples/payments_consumer.py --db sqlite:///payments.db -b 127.0.0.1:9092 --feed 200

``--feed N`` first creates N unpaid orders and publishes one payment for each. The consumer then
applies payments in batches: per batch one atomic decision of the `payable_orders` updates, the
`order-paid` records and the input positions. ``--crash-after-db-commit N`` SIGKILLs it in batch N
after the database decided and before Kafka committed; starting it again (or ``dualwrite
recover``) finishes that batch, and it goes on from the decided positions. ``--verify`` checks
that every order was paid once and has one `order-paid` record, and that no transaction is open.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

import dualwrite as dw
from dualwrite import metrics
from dualwrite.participant import PreparedTxnState

metadata = sa.MetaData()
orders = sa.Table(
    "payable_orders", metadata,  # its own table: the README's `orders` has other columns
    sa.Column("order_id", sa.String(64), primary_key=True),
    sa.Column("amount_cents", sa.Integer, nullable=False),
    sa.Column("paid_cents", sa.Integer, nullable=False, server_default="0"),
    sa.Column("payments", sa.Integer, nullable=False, server_default="0"),
)


class CrashAfterDatabaseCommit(dw.PhaseHooks):
    """SIGKILL after the database decided batch ``n`` (Kafka has not committed it yet)."""

    def __init__(self, n: int) -> None:
        self.n, self.batches = n, 0

    def database_committed(self, state: PreparedTxnState) -> None:
        self.batches += 1
        if self.batches == self.n:
            print(f"killed after the database committed batch {self.n}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def quiet_client_config(bootstrap: str) -> dict[str, Any]:
    """librdkafka's own lines through `logging` (quiet by default), as dualwrite's clients."""
    return {"bootstrap.servers": bootstrap, "logger": logging.getLogger("dualwrite.librdkafka")}


def ensure_topics(bootstrap: str, names: Sequence[str]) -> None:
    admin = AdminClient(quiet_client_config(bootstrap))
    existing = admin.list_topics(timeout=10).topics
    missing = [NewTopic(n, 3, 1) for n in names if n not in existing]
    for future in admin.create_topics(missing).values() if missing else ():
        future.result(timeout=30)


def feed(engine: sa.Engine, bootstrap: str, topic: str, n: int) -> None:
    """N unpaid orders in the database, one payment for each in ``topic``."""
    run = uuid.uuid4().hex[:6]
    ids = [(f"order-{run}-{i}", 100 + i) for i in range(n)]
    with engine.begin() as conn:
        conn.execute(orders.insert(), [{"order_id": o, "amount_cents": a} for o, a in ids])
    producer = Producer(quiet_client_config(bootstrap))
    for order_id, amount in ids:
        payment = {"payment_id": f"pay-{order_id}", "order_id": order_id, "amount_cents": amount}
        producer.produce(topic, key=order_id, value=json.dumps(payment))
    producer.flush(30)
    print(f"fed {n} orders and their payments")


def apply_payments(messages: Sequence[dw.ConsumedMessage], tx: dw.DualWriteTransaction,
                   output: str) -> None:
    """The handler: one batch of payments, in one atomic decision."""
    for message in messages:
        payment = json.loads(message.value or b"{}")
        updated = tx.connection.execute(
            orders.update().where(orders.c.order_id == payment.get("order_id"))
            .values(paid_cents=orders.c.paid_cents + payment["amount_cents"],
                    payments=orders.c.payments + 1))
        if updated.rowcount:  # payments of unknown orders are skipped (consumed, no effect)
            tx.produce(output, key=payment["order_id"],
                       value=json.dumps({"order_id": payment["order_id"],
                                         "payment_id": payment["payment_id"]}))


def verify(engine: sa.Engine, bootstrap: str, output: str) -> bool:
    from dualwrite.dev import read_committed
    with engine.connect() as conn:
        rows = {r.order_id: (r.amount_cents, r.paid_cents, r.payments)
                for r in conn.execute(sa.select(orders))}
    records, unfinished = read_committed(bootstrap, output, timeout_s=30)
    events = Counter(k.decode() for k, _ in records if k is not None and k.decode() in rows)
    lost = sum(1 for a, paid, n in rows.values() if n == 0) + \
        sum(1 for o in rows if events[o] == 0)
    duplicates = sum(1 for a, paid, n in rows.values() if n > 1 or paid != a * n) + \
        sum(1 for o in rows if events[o] > 1)
    print(f"verified: lost={lost} duplicates={duplicates} open={len(unfinished)}")
    return lost == duplicates == len(unfinished) == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("-b", "--bootstrap-servers", required=True)
    parser.add_argument("--group", default="payments-consumer")
    parser.add_argument("--input", default="payments")
    parser.add_argument("--output", default="order-paid")
    parser.add_argument("--feed", type=int, default=0, help="orders and payments to create")
    parser.add_argument("--crash-after-db-commit", type=int, default=0, metavar="BATCH")
    parser.add_argument("--idle-s", type=float, default=3.0, help="stop after this long idle")
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus /metrics on 127.0.0.1:PORT (dualwrite[metrics])")
    args = parser.parse_args(argv)
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    dw.upgrade_database(args.db)
    engine = dw.create_engine(args.db)
    metadata.create_all(engine)
    ensure_topics(args.bootstrap_servers, [args.input, args.output])
    if args.feed:
        feed(engine, args.bootstrap_servers, args.input, args.feed)
    hooks = CrashAfterDatabaseCommit(args.crash_after_db_commit) \
        if args.crash_after_db_commit else None
    with dw.ExactlyOnceConsumer(engine, {"bootstrap.servers": args.bootstrap_servers},
                                group_id=args.group, topics=[args.input], max_batch=50,
                                max_batch_s=0.1, hooks=hooks,
                                consumer_config={"session.timeout.ms": 6000}) as consumer:
        done = consumer.run(lambda messages, tx: apply_payments(messages, tx, args.output),
                            idle_s=args.idle_s)
        print(f"{done} payments consumed as {consumer.transactional_id}, lag {consumer.lag()}")
    if args.verify:
        return 0 if verify(engine, args.bootstrap_servers, args.output) else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
