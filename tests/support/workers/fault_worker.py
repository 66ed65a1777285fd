"""Fault-suite worker: DualWriter transactions in a loop that outlives broker and database faults.

Run by ``tests/faults/test_fault_suite.py`` as a separate process::

    python tests/support/workers/fault_worker.py --db URL --bootstrap HOST:PORT --topic T \
        --tid TID --instance 2 --out FILE [--rows 3] [--timeout-s 20] [--pause-ms 20]

Transaction ``n`` inserts ``rows`` rows into ``fault_rows(id, worker)`` and produces the same ids
(key = value = id) to ``topic``. Ids are ``<tid>:<instance>:<n>:<i>``, unique across restarts of
the same transactional id. Every outcome is a JSON line in ``--out`` (flushed at once, so a
SIGKILL loses nothing already written): ``start``, ``commit`` (ids, start and end time),
``error`` (the exception's class, its family, message, cause chain and stack) and ``stop``.

Error handling is what an application following the README does, through the public API only:
after a :class:`~dualwrite.RetriableError` the same writer runs the next transaction; after any
other dualwrite error the writer is closed and a new one made. Any exception outside the
dualwrite hierarchy is recorded as ``foreign`` (an anomaly for the suite) and handled like a fatal
one, so the run goes on and every such escape is counted. SIGTERM ends the loop cleanly.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import sqlalchemy as sa

from dualwrite import DualWriter, create_engine
from tests.support.journal import Journal

ROWS = sa.table("fault_rows", sa.column("id", sa.String), sa.column("worker", sa.String))


class Worker:
    """One transactional id's loop; a fresh DualWriter after every non-retriable error."""

    def __init__(self, args: argparse.Namespace, journal: Journal) -> None:
        self.args = args
        self.journal = journal
        # No server-side prepared statements: a prepared COMMIT crosses the wire as a bare
        # Bind/Execute, and the fault runner's database proxy finds COMMIT by its text.
        self.engine = create_engine(args.db, connect_args={"connect_timeout": 3,
                                                           "prepare_threshold": None})
        # socket.timeout.ms is librdkafka's client-side request timeout (request.timeout.ms is
        # the broker's ack timeout): a paused broker or a held request outlasts both.
        self.kafka = {"bootstrap.servers": args.bootstrap,
                      "request.timeout.ms": args.request_timeout_ms,
                      "socket.timeout.ms": args.request_timeout_ms}
        self.stopping = threading.Event()
        self.failures = 0
        """Failed transactions in a row."""
        self.writer = self.new_writer()

    def new_writer(self) -> DualWriter:
        return DualWriter(self.engine, self.kafka, transactional_id=self.args.tid,
                          timeout_s=self.args.timeout_s)

    def replace_writer(self) -> None:
        """Close the writer (recording what that raises) and make a new one."""
        self.guarded("close", self.writer.close)
        self.writer = self.new_writer()

    def guarded(self, phase: str, call: Callable[[], object]) -> str | None:
        """Run ``call``; record what it raised (its family) instead of raising it."""
        try:
            call()
        except Exception as exc:
            return self.journal.error(exc, phase)
        return None

    def ids(self, n: int) -> list[str]:
        a = self.args
        return [f"{a.tid}:{a.instance}:{n}:{i}" for i in range(a.rows)]

    def one(self, n: int) -> None:
        ids = self.ids(n)
        started = time.time()
        try:
            with self.writer.transaction() as tx:
                for key in ids:
                    tx.produce(self.args.topic, value=key, key=key)
                tx.connection.execute(sa.insert(ROWS), [{"id": i, "worker": self.args.tid}
                                                        for i in ids])
        except Exception as exc:
            kind = self.journal.error(exc, "transaction", n=n, ids=ids, t0=started)
            self.failures += 1
            # Back off while the failures last, as an application would (at most 1 s).
            self.stopping.wait(min(1.0, 0.05 * 2 ** min(self.failures, 5)))
            if kind != "retriable":
                # Not the writer's to carry on with: a new one, as after a restart. Heuristic
                # outcomes refuse until recovery; do not spin on them.
                if kind == "heuristic":
                    self.stopping.wait(1.0)
                self.replace_writer()
            return
        self.failures = 0
        self.journal.write("commit", n=n, ids=ids, t0=started)

    def run(self) -> None:
        self.journal.write("start", pid=os.getpid(), tid=self.args.tid,
                           instance=self.args.instance)
        n = 0
        while not self.stopping.is_set():
            n += 1
            self.one(n)
            if self.args.pause_ms:
                self.stopping.wait(self.args.pause_ms / 1000)
        self.guarded("close", self.writer.close)
        self.engine.dispose()
        self.journal.write("stop", transactions=n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--tid", required=True)
    parser.add_argument("--instance", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=20.0)
    parser.add_argument("--request-timeout-ms", type=int, default=5000)
    parser.add_argument("--pause-ms", type=float, default=20.0)
    args = parser.parse_args(argv)

    journal = Journal(args.out)
    worker = Worker(args, journal)
    signal.signal(signal.SIGTERM, lambda *_: worker.stopping.set())
    try:
        worker.run()
    finally:
        journal.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
