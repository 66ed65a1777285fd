"""PulsarDualWriter worker: transactions in a loop, optionally killed dead at a phase.

Run by ``tests/writer/pulsar/`` as a separate process::

    python -m tests.support.workers.pulsar_worker --db URL --pulsar URL --writer W \
        --topic T --first 7 --count 3 [--kill-at 9 --phase database_committed] \
        [--txn-timeout 30] [--acknowledge-hook]

Transaction ``n`` (``first`` .. ``first + count - 1``) inserts row ``n`` into
``pulsar_orders(id, writer)`` and sends message ``n`` (key and value ``str(n)``) to ``topic``;
``COMMITTED n`` is printed after each. With ``--kill-at n --phase P`` the process SIGKILLs itself
at phase ``P`` of transaction ``n`` (through :class:`PulsarPhaseHooks`, the writer's seam).
A dualwrite error ends the worker with ``ERROR <class> <message>`` and exit 3; with ``--retry``
(a broker or database restarting under it) a :class:`RetriableError` retries the same
transaction (``RETRY n``) and an :class:`OutcomeUnknownError` goes on to the next (``UNKNOWN n``:
the row may or may not be committed; recovery or the next transaction settles its messages).

With ``--pool SIZE --threads T`` the transactions run through a :class:`PulsarDualWriterPool`
(ids ``--writer``-0 .. SIZE-1) from T threads at once, each taking the next number; with
``--kill-after K`` the process SIGKILLs itself once K of them committed, the others wherever
they are.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import threading
import time
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import Connection

from dualwrite import create_engine
from dualwrite.errors import (
    DualWriteError,
    HeuristicAbortError,
    OutcomeUnknownError,
    RetriableError,
)
from dualwrite.pulsar import (
    PulsarDualWriter,
    PulsarDualWriterPool,
    PulsarPhaseHooks,
    PulsarPreparedTxn,
)
from tests.support.workers import say

PHASES = ("begun", "sent", "prepared", "database_committed", "committed")
ORDERS = sa.table("pulsar_orders", sa.column("id", sa.BigInteger),
                  sa.column("writer", sa.String))


def create_orders_table(url: str) -> None:
    meta = sa.MetaData()
    # Not AUTO_INCREMENT (MariaDB would take id 0 for "the next value").
    sa.Table("pulsar_orders", meta,
             sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=False),
             sa.Column("writer", sa.String(64), nullable=False))
    engine = create_engine(url)
    meta.create_all(engine)
    engine.dispose()


class KillAt(PulsarPhaseHooks):
    """SIGKILL this process at ``phase`` once ``armed`` is set."""

    def __init__(self, phase: str | None) -> None:
        self.phase = phase
        self.armed = False

    def _at(self, phase: str) -> None:
        if self.armed and phase == self.phase:
            print(f"KILL {phase}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def begun(self, txn: str) -> None:
        self._at("begun")

    def sent(self, txn: str) -> None:
        self._at("sent")

    def prepared(self, state: PulsarPreparedTxn) -> None:
        print(f"PREPARED {state}", flush=True)
        self._at("prepared")

    def database_committed(self, state: PulsarPreparedTxn) -> None:
        self._at("database_committed")

    def committed(self, state: PulsarPreparedTxn) -> None:
        self._at("committed")


def run_pool(args: argparse.Namespace) -> int:
    """The transactions from ``args.threads`` threads through a pool (module docstring)."""
    numbers = itertools.count(args.first)
    committed = 0
    lock = threading.Lock()
    errors: list[str] = []

    def serve(pool: PulsarDualWriterPool) -> None:
        nonlocal committed
        while (n := next(numbers)) < args.first + args.count:
            try:
                with pool.transaction() as tx:
                    tx.connection.execute(sa.insert(ORDERS).values(id=n, writer=args.writer))
                    tx.send(args.topic, str(n), key=str(n))
            except DualWriteError as exc:
                errors.append(f"ERROR {n} {type(exc).__name__} {exc}")
                say(errors[-1])
                continue
            say(f"COMMITTED {n}")
            with lock:
                committed += 1
                if committed == args.kill_after:
                    say("KILL")
                    os.kill(os.getpid(), signal.SIGKILL)

    with PulsarDualWriterPool(args.db, args.pulsar, id_prefix=args.writer, size=args.pool,
                              txn_timeout_s=args.txn_timeout, timeout_s=20,
                              token=args.token) as pool:
        threads = [threading.Thread(target=serve, args=(pool,)) for _ in range(args.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return 3 if errors else 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--pulsar", required=True)
    p.add_argument("--writer", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--phase", choices=PHASES)
    p.add_argument("--txn-timeout", type=float, default=30.0)
    p.add_argument("--retry", action="store_true",
                   help="retry retriable errors, go on after unknown outcomes")
    p.add_argument("--acknowledge-hook", action="store_true",
                   help="pass on_heuristic_abort (prints HOOK <state>)")
    p.add_argument("--token-file", help="Pulsar token authentication: the token's file")
    p.add_argument("--pool", type=int, help="run through a pool of this many writers")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--kill-after", type=int)
    args = p.parse_args()
    args.token = (Path(args.token_file).read_text(encoding="utf-8").strip()
                  if args.token_file else None)
    if args.pool:
        return run_pool(args)

    def hook(exc: HeuristicAbortError, conn: Connection) -> None:
        print(f"HOOK {exc.state}", flush=True)

    hooks = KillAt(args.phase)
    writer = PulsarDualWriter(args.db, args.pulsar, writer_id=args.writer,
                              txn_timeout_s=args.txn_timeout, timeout_s=20, hooks=hooks,
                              token=args.token,
                              on_heuristic_abort=hook if args.acknowledge_hook else None)
    try:
        n = args.first
        while n < args.first + args.count:
            hooks.armed = n == args.kill_at
            try:
                with writer.transaction() as tx:
                    tx.connection.execute(sa.insert(ORDERS).values(id=n, writer=args.writer))
                    tx.send(args.topic, str(n), key=str(n))
            except RetriableError as exc:
                if not args.retry:
                    raise
                print(f"RETRY {n} {type(exc).__name__}", flush=True)
                time.sleep(0.5)
                continue
            except OutcomeUnknownError as exc:
                if not args.retry:
                    raise
                print(f"UNKNOWN {n} {type(exc).__name__}", flush=True)
            else:
                print(f"COMMITTED {n}", flush=True)
            n += 1
    except DualWriteError as exc:
        print(f"ERROR {type(exc).__name__} {exc}", flush=True)
        return 3
    finally:
        writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
