"""The README demo: atomic orders + events, a SIGKILL in the worst place, recovery, verification.

1. start a local Kafka (or use $DUALWRITE_BOOTSTRAP_SERVERS), create the `orders` topic;
2. run the order service (examples/order_service.py) against an SQLite file (or --db URL);
3. run it again and SIGKILL it after the database committed an order, before Kafka did;
4. `dualwrite recover`, then restart the service for the remaining orders;
5. compare the rows with what a read_committed consumer sees and print the verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import sqlalchemy as sa

import dualwrite as dw
from dualwrite.dev import read_committed

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from order_service import orders  # noqa: E402


def step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    print("$ " + " ".join(cmd[1:] if cmd[0] == sys.executable else cmd), flush=True)
    return subprocess.run(cmd, text=True, **kw)  # type: ignore[call-overload, no-any-return]


def read_committed_ids(bootstrap: str, topic: str) -> list[str]:
    """Every order id a read_committed consumer sees in `topic`, up to the end."""
    records, _ = read_committed(bootstrap, topic, timeout_s=30)
    return [json.loads(value or b"{}")["order_id"] for _, value in records]


def main() -> int:
    parser = argparse.ArgumentParser(description="dualwrite demo")
    parser.add_argument("--db", help="database URL (default: an SQLite file in a temp dir)")
    parser.add_argument("--orders", type=int, default=20)
    args = parser.parse_args()

    cluster = None
    bootstrap = os.environ.get("DUALWRITE_BOOTSTRAP_SERVERS")
    workdir = Path(tempfile.mkdtemp(prefix="dualwrite-demo-"))
    try:
        if not bootstrap:
            from dualwrite.dev import LocalKafkaCluster

            step("starting a local Apache Kafka 4.3.1 (KRaft, one broker)")
            started = time.monotonic()
            cluster = LocalKafkaCluster(brokers=1)
            cluster.start()
            bootstrap = cluster.bootstrap_servers
            print(f"Kafka at {bootstrap} ({time.monotonic() - started:.1f} s)")
        topic = f"orders-{uuid.uuid4().hex[:6]}"
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(topic, 3, 1)])[topic].result()
        db = args.db or f"sqlite:///{workdir / 'orders.db'}"
        print(f"database: {db}\ntopic: {topic}")
        service = [sys.executable, str(HERE / "order_service.py"), "--db", db,
                   "-b", bootstrap, "--topic", topic]
        half = args.orders // 2

        step(f"placing {half} orders: each an `orders` row and an event, atomically")
        run([*service, "--orders", str(half)], check=True, stdout=subprocess.DEVNULL)

        crash_on = half + 3
        step(f"placing more orders, SIGKILLed after the database committed order {crash_on} "
             "and before Kafka did")
        killed = run([*service, "--orders", str(args.orders - half), "--first", str(half),
                      "--crash-at", "after-db-commit", "--crash-on", str(crash_on)],
                     stdout=subprocess.DEVNULL)
        print(f"order service exited with {killed.returncode} (-9 = SIGKILL)")

        step("recovering: the database decided commit, so the in-doubt event is committed")
        rec = run([sys.executable, "-m", "dualwrite.cli", "recover", "--db", db,
                   "-b", bootstrap])
        if rec.returncode != 0:
            print(f"recover exited with {rec.returncode}")

        rest = args.orders - (crash_on + 1)
        step(f"restarting the order service for the remaining {rest} orders")
        run([*service, "--orders", str(rest), "--first", str(crash_on + 1)], check=True,
            stdout=subprocess.DEVNULL)

        step("verifying: database rows vs records a read_committed consumer sees")
        engine = dw.create_engine(db)
        with engine.connect() as conn:
            rows = {r[0] for r in conn.execute(sa.select(orders.c.order_id))}
        seen = read_committed_ids(bootstrap, topic)
        counts = Counter(seen)
        duplicates = sum(c - 1 for c in counts.values() if c > 1)
        lost = len(rows - set(counts))
        extra = len(set(counts) - rows)
        status = dw.status(engine, {"bootstrap.servers": bootstrap}, prefix="order-service")
        open_txns = sum(1 for r in status.rows if r.broker and r.broker.state.in_flight)
        open_txns += len(status.hanging)
        print(f"{'rows in the database':<40}{len(rows):>8}")
        print(f"{'records visible to read_committed':<40}{len(seen):>8}")
        print(f"{'records without a row (phantoms)':<40}{extra:>8}")
        print(f"{'duplicates':<40}{duplicates:>8}")
        print(f"{'lost (row without record)':<40}{lost:>8}")
        print(f"{'open transactions':<40}{open_txns:>8}")
        ok = lost == 0 and duplicates == 0 and open_txns == 0 and extra == 0 and rows
        print(f"verified: lost={lost} duplicates={duplicates} open={open_txns}"
              + ("" if extra == 0 else f" phantoms={extra}"))
        return 0 if ok else 1
    finally:
        if cluster is not None:
            step("stopping Kafka")
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
