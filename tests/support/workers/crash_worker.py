"""Crash-matrix worker: dual-write transactions in a loop, stopping dead at a crash point.

Run by ``tests/faults/test_crash_matrix.py`` as a separate process::

    python tests/support/workers/crash_worker.py --db URL --bootstrap HOST:PORT --topic T \
        --tid TID --first-txn 7 --count 3 [--crash-point after-db-commit] [--rows 3]

Transactions ``first-txn`` .. ``first-txn + count - 1`` each insert ``rows`` rows into
``events(id, txn)`` and produce the same ids (key = value = id) with :class:`dualwrite.DualWriter`.
Without ``--crash-point`` every transaction commits, ``COMMITTED <txn>`` is printed after each and
the worker exits 0. With it, the last transaction prints ``AT <point>`` at that point and blocks
until the parent SIGKILLs it; ``during-kafka-commit`` prints and then commits at once, so the kill
races into the commit. Points are injected through the writer's fault-injection seam
(:class:`dualwrite.writer.PhaseHooks`) and a :class:`StateStore` subclass, never by editing or
patching the library.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import sqlalchemy as sa
from sqlalchemy import Connection

from dualwrite import DualWriter, TwoPhaseProducer, create_engine
from dualwrite.participant import PreparedTxnState, TxnState
from dualwrite.writer import PhaseHooks, StateStore

POINTS = (
    "after-begin",
    "before-lock",
    "mid-produce",
    "after-flush",
    "after-prepare",
    "after-state-row",
    "after-db-commit",
    "during-kafka-commit",
    "after-kafka-commit",
)
BLOCK_S = 60.0
EVENTS = sa.table("events", sa.column("id", sa.String), sa.column("txn", sa.Integer))


def row_ids(txn: int, rows: int) -> list[str]:
    """The ids (DB primary keys and Kafka keys) of transaction ``txn``."""
    return [f"t{txn}-{i}" for i in range(rows)]


def announce(point: str) -> None:
    print(f"AT {point}", flush=True)


def stop_here(point: str) -> None:
    """Announce the crash point and wait for SIGKILL; exit 2 if it never comes."""
    announce(point)
    time.sleep(BLOCK_S)
    print(f"worker was not killed within {BLOCK_S:g} s at {point}", file=sys.stderr, flush=True)
    os._exit(2)


class Crasher:
    """Knows the current transaction and whether it is the one to crash."""

    def __init__(self, point: str | None, crash_txn: int, rows: int) -> None:
        self.point = point
        self.crash_txn = crash_txn
        self.rows = rows
        self.txn = 0
        self.verified = threading.Event()

    def at(self, point: str) -> bool:
        """Whether the current transaction should crash at ``point``."""
        return self.point == point and self.txn == self.crash_txn

    @property
    def rows_after_prepare(self) -> bool:
        """For ``after-prepare`` the app rows are written after the prepare, with the state row."""
        return self.point == "after-prepare"

    def insert_rows(self, conn: Connection) -> None:
        conn.execute(sa.insert(EVENTS), [{"id": i, "txn": self.txn}
                                         for i in row_ids(self.txn, self.rows)])


class CrashingStateStore(StateStore):
    """Writes the app rows after the prepare (``after-prepare`` runs) and crashes before them."""

    crasher: Crasher

    def write(self, conn: Connection, transactional_id: str, state: str) -> None:
        crasher = self.crasher
        if crasher.rows_after_prepare:
            if crasher.at("after-prepare"):
                # Kafka side prepared and verified; nothing of this transaction in the DB yet.
                if not crasher.verified.wait(30):
                    print("verify_prepared did not finish", file=sys.stderr, flush=True)
                    os._exit(3)
                stop_here("after-prepare")
            crasher.insert_rows(conn)
        super().write(conn, transactional_id, state)

    def write_and_commit(self, conn: Connection, transactional_id: str, state: str) -> None:
        if self.crasher.at("after-state-row"):
            # The state row is written (not pipelined with the COMMIT, so there is a moment to
            # die in); the COMMIT never comes.
            self.write(conn, transactional_id, state)
            stop_here("after-state-row")
        super().write_and_commit(conn, transactional_id, state)


class CrashHooks(PhaseHooks):
    """The crash points at the writer's named phases (the state store has the DB's)."""

    def __init__(self, crasher: Crasher) -> None:
        self.crasher = crasher
        self.writer: DualWriter | None = None

    def kafka_begun(self) -> None:
        if self.crasher.at("after-begin"):
            stop_here("after-begin")

    def before_late_lock(self, records_sent: int) -> None:
        # The first record is in the log; the state-row lock is not taken yet.
        if self.crasher.at("before-lock"):
            assert self.writer is not None
            wait_until_in_log(self.writer.producer)
            stop_here("before-lock")

    def prepared(self, state: PreparedTxnState) -> None:
        if self.crasher.at("after-flush"):
            stop_here("after-flush")

    def verified(self, state: PreparedTxnState) -> None:
        self.crasher.verified.set()

    def database_committed(self, state: PreparedTxnState) -> None:
        if self.crasher.at("after-db-commit"):
            stop_here("after-db-commit")
        if self.crasher.at("during-kafka-commit"):
            announce("during-kafka-commit")  # the writer commits Kafka right after

    def kafka_committed(self, state: PreparedTxnState) -> None:
        if self.crasher.at("during-kafka-commit"):
            time.sleep(BLOCK_S)  # never go on to the next transaction
            os._exit(2)
        if self.crasher.at("after-kafka-commit"):
            stop_here("after-kafka-commit")


def wait_until_in_log(producer: TwoPhaseProducer, timeout_s: float = 20.0) -> None:
    """Block until the open transaction has a record in a partition's log (``mid-produce``)."""
    cp = producer.control_plane
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        desc = cp.describe_transaction(producer.transactional_id)
        if desc is not None and desc.state is TxnState.ONGOING and desc.partitions:
            producers = cp.describe_producers(desc.partitions)
            if any(p.producer_id == desc.producer_id and p.current_txn_start_offset is not None
                   for ps in producers.values() for p in ps):
                return
        time.sleep(0.02)
    print("mid-produce: the record never reached the log", file=sys.stderr, flush=True)
    os._exit(3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--tid", required=True)
    parser.add_argument("--first-txn", type=int, default=1)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--crash-point", choices=POINTS)
    args = parser.parse_args(argv)

    last = args.first_txn + args.count - 1
    crasher = Crasher(args.crash_point, last, args.rows)
    engine = create_engine(args.db)
    store = CrashingStateStore(engine)
    store.crasher = crasher
    kafka = {"bootstrap.servers": args.bootstrap, "linger.ms": 1}
    hooks = CrashHooks(crasher)
    # ``after-prepare`` crashes once the coordinator confirmed the prepare: always ask it there.
    with DualWriter(engine, kafka, transactional_id=args.tid, state_store=store, hooks=hooks,
                    verify="always" if crasher.point == "after-prepare" else "auto") as writer:
        hooks.writer = writer
        for txn in range(args.first_txn, last + 1):
            crasher.txn = txn
            crasher.verified.clear()
            with writer.transaction() as tx:
                # Records first (the writer takes the state-row lock after the first), then rows.
                for n, key in enumerate(row_ids(txn, args.rows)):
                    tx.produce(args.topic, value=key, key=key)
                    if n == 0 and crasher.at("mid-produce"):
                        wait_until_in_log(writer.producer)
                        stop_here("mid-produce")
                if not crasher.rows_after_prepare:
                    crasher.insert_rows(tx.connection)
            print(f"COMMITTED {txn}", flush=True)
    engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
