"""The README demo: atomic orders + events, a SIGKILL in the worst place, recovery, verification.

1. start a local Kafka (or use $DUALWRITE_BOOTSTRAP_SERVERS), create the `orders` topic;
2. run the order service (examples/order_service.py) against an SQLite file (or --db URL);
3. run it again and SIGKILL it after the database committed an order, before Kafka did;
4. `dualwrite recover`, then restart the service for the remaining orders;
5. compare the rows with what a read_committed consumer sees (`dualwrite.verify`) and print
   the verdict.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import dualwrite as dw
from dualwrite.dev import create_topic

HERE = Path(__file__).resolve().parent


def step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    print("$ " + " ".join(cmd[1:] if cmd[0] == sys.executable else cmd), flush=True)
    return subprocess.run(cmd, text=True, **kw)  # type: ignore[call-overload, no-any-return]


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
        create_topic(bootstrap, topic, 3)  # its client logs through `logging`, quiet
        db = args.db or f"sqlite:///{workdir / 'orders.db'}"
        print(f"database: {db}\ntopic: {topic}")
        service = [sys.executable, str(HERE / "order_service.py"), "--db", db,
                   "-b", bootstrap, "--topic", topic]
        half = args.orders // 2

        step(f"placing {half} orders: each a `service_orders` row and an event, atomically")
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
        # The event's key is the order id: `dualwrite verify --table service_orders --key order_id`.
        report = dw.verify(db, {"bootstrap.servers": bootstrap}, table="service_orders",
                           key_column="order_id", topic=topic, timeout_s=30)
        for label, value in (("rows in the database", report.rows),
                             ("records visible to read_committed", report.records),
                             ("records without a row (phantoms)", len(report.phantoms)),
                             ("duplicates", report.duplicate_records),
                             ("lost (row without record)", len(report.lost)),
                             ("partitions held by an open transaction",
                              len(report.open_partitions))):
            print(f"{label:<40}{value:>8}")
        print(report.summary)
        return 0 if report.ok and report.rows else 1
    finally:
        if cluster is not None:
            step("stopping Kafka")
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
