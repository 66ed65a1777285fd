"""``python -m tests.soak`` (``./run.sh soak``): the soak over every role (tests/soak/__init__.py).

Exit 0 when the invariant held (every anomaly 0), 1 otherwise; the report is in ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import random
import signal
import sys
import time
from pathlib import Path

from tests.soak.report import load_events, render_text
from tests.soak.runner import SoakConfig, run_soak
from tests.support.settings import KAFKA_VERSION


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="./run.sh soak",
                                 description="Every role at once under mixed faults, then "
                                 "checked by Kafka's own clients.")
    ap.add_argument("--minutes", type=float, default=60.0,
                    help="how long to inject faults at most (default: %(default)s)")
    ap.add_argument("--faults", type=int, default=200,
                    help="stop injecting after this many faults (default: %(default)s; 0: no "
                    "limit but --minutes)")
    ap.add_argument("--seed", type=int, default=random.randrange(2**31),
                    help="the fault schedule's seed (default: random, printed)")
    ap.add_argument("--out", type=Path,
                    default=Path("soak-reports") / time.strftime("%Y%m%d-%H%M%S"),
                    help="folder for the report, the events and every process's log "
                    "(default: soak-reports/<time>)")
    ap.add_argument("--clients", type=int, default=4, help="HTTP clients of the load")
    ap.add_argument("--no-spark", action="store_true", help="leave the Spark role out")
    ap.add_argument("--kafka-version", default=KAFKA_VERSION)
    ap.add_argument("--db", choices=("postgresql", "mariadb"), default="postgresql",
                    help="the database server every role writes to (default: %(default)s)")
    ap.add_argument("-v", "--verbose", action="store_true", help="the runner's INFO logs")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.verbose:  # the runner's own Kafka clients while brokers are down
        logging.getLogger("kafka").setLevel(logging.CRITICAL)
    config = SoakConfig(out=args.out.resolve(), minutes=args.minutes,
                        faults=args.faults or None, seed=args.seed, clients=args.clients,
                        spark=not args.no_spark, kafka_version=args.kafka_version,
                        database=args.db)
    print(f"soak: seed {config.seed}, {config.database}, up to {config.minutes:g} minutes"
          + (f" or {config.faults} faults" if config.faults else "")
          + f"; report in {config.out}", flush=True)
    # SIGTERM (a CI timeout, a kill) stops the servers as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    summary = run_soak(config)
    print(render_text(summary, load_events(config.out / "timeline.jsonl")))
    print(f"report: {config.out / 'report.html'}")
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
