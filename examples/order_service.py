"""A small order service: each order is a `service_orders` row and an `orders` event, atomically.

    python examples/order_service.py --db sqlite:///orders.db -b 127.0.0.1:9092 --orders 20

``--crash-at after-db-commit --crash-on N`` kills the process with SIGKILL in the worst place of
order N: after the database committed the order, before Kafka committed its event. Then
``dualwrite recover`` (or simply starting the service again) publishes that event exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import uuid
from typing import Any

import sqlalchemy as sa

import dualwrite as dw

metadata = sa.MetaData()
orders = sa.Table(
    "service_orders", metadata,  # its own table: the README's `orders` has other columns
    sa.Column("order_id", sa.String(64), primary_key=True),
    sa.Column("customer", sa.String(64), nullable=False),
    sa.Column("amount_cents", sa.Integer, nullable=False),
)

CRASH_POINTS = ("before-db-commit", "after-db-commit")


def place_order(writer: dw.DualWriter, topic: str, n: int, crash_at: str | None) -> str:
    """Insert one order and publish its event in one atomic dual write."""
    order_id = f"order-{n:05d}-{uuid.uuid4().hex[:6]}"
    event: dict[str, Any] = {"order_id": order_id, "customer": f"c{n % 7}",
                             "amount_cents": 100 + n}
    with writer.transaction() as tx:
        tx.produce(topic, key=order_id, value=json.dumps(event))  # first: it travels while
        tx.connection.execute(orders.insert().values(**event))  # the row lock is taken
        if crash_at == "before-db-commit":
            os.kill(os.getpid(), signal.SIGKILL)
        if crash_at == "after-db-commit":
            # Kill right after the database decided, before Kafka hears of it.
            producer = writer.producer

            def die() -> None:
                os.kill(os.getpid(), signal.SIGKILL)

            producer.commit_transaction = die  # type: ignore[method-assign]
    return order_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("-b", "--bootstrap-servers", required=True)
    parser.add_argument("--topic", default="orders")
    parser.add_argument("--transactional-id", default="order-service-1")
    parser.add_argument("--orders", type=int, default=10)
    parser.add_argument("--first", type=int, default=0, help="number of the first order")
    parser.add_argument("--crash-at", choices=CRASH_POINTS)
    parser.add_argument("--crash-on", type=int, default=-1, help="order number to crash on")
    args = parser.parse_args(argv)

    engine = dw.create_engine(args.db)
    dw.upgrade_database(engine)
    metadata.create_all(engine)
    config = {"bootstrap.servers": args.bootstrap_servers}
    with dw.DualWriter(engine, config, transactional_id=args.transactional_id) as writer:
        for n in range(args.first, args.first + args.orders):
            crash = args.crash_at if n == args.crash_on else None
            order_id = place_order(writer, args.topic, n, crash)
            print(f"placed {order_id}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
