"""Writer-pool worker process for ``tests/writer/pool/test_pool.py``.

    python tests/support/workers/pool_worker.py --db URL --bootstrap HOST:PORT --topic T \
        --prefix P [--size 2] [--threads 16] [--no-group-commit] [--ids-only] [--block-after N] \
        [--asyncio] [--run]

Opens a :class:`dualwrite.DualWriterPool` and prints ``IDS <id> ...``. With ``--ids-only`` it
then waits for a line on stdin, closes the pool and exits. Otherwise ``threads`` threads run
requests (one row in ``pool_rows(value)`` and the same value as one record) until killed; each
request that returned prints ``OK <value> <prepared state>``. With ``--block-after N``, once N
requests returned, every writer stops right after its group's database COMMIT (the decision,
before Kafka's commit; ``PhaseHooks.database_committed``) and the worker prints ``AT
database-committed``: the parent SIGKILLs it with decided groups in flight. With ``--asyncio``
the requests are ``threads`` tasks on one event loop over an :class:`AsyncDualWriterPool` of an
application's ``AsyncEngine``. With ``--run`` each request is a ``pool.run(fn, value)`` (``await
apool.run(...)`` with ``--asyncio``) instead of a ``with pool.transaction()`` block, and every
5th one raises after writing (its group runs its other calls again).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time

from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import create_async_engine

from dualwrite import (
    AsyncDualWriterPool,
    DualWriterPool,
    DualWriteTransaction,
    GroupedTransaction,
    create_engine,
)
from dualwrite.participant import PreparedTxnState
from dualwrite.writer import PhaseHooks
from tests.support.workers import say


class BlockAfter(PhaseHooks):
    def __init__(self, after: int) -> None:
        self.after = after
        self.returned = 0
        self.lock = threading.Lock()
        self.announced = False

    def database_committed(self, state: PreparedTxnState) -> None:
        with self.lock:
            if self.returned < self.after:
                return
            if not self.announced:
                self.announced = True
                say("AT database-committed")
        time.sleep(600)


class Boom(Exception):
    """A request of ``--run`` that fails on purpose."""


def insert(conn: Connection, value: str) -> None:
    conn.execute(text("INSERT INTO pool_rows (value) VALUES (:v)"), {"v": value})


def write(tx: DualWriteTransaction | GroupedTransaction, topic: str, value: str, fail: bool
          ) -> DualWriteTransaction | GroupedTransaction:
    """The request of ``--run``: its row and record; returns its handle (its state once
    committed)."""
    insert(tx.connection, value)
    tx.produce(topic, value, value)
    if fail:
        raise Boom(value)
    return tx


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", required=True)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--no-group-commit", action="store_true")
    ap.add_argument("--ids-only", action="store_true")
    ap.add_argument("--block-after", type=int, default=0)
    ap.add_argument("--asyncio", action="store_true")
    ap.add_argument("--run", action="store_true")
    args = ap.parse_args()
    hooks = BlockAfter(args.block_after) if args.block_after else None
    if args.asyncio:
        asyncio.run(run_tasks(args, hooks))
        return 0
    pool = DualWriterPool(create_engine(args.db), {"bootstrap.servers": args.bootstrap},
                          id_prefix=args.prefix, size=args.size, timeout_s=20,
                          group_commit=not args.no_group_commit, hooks=hooks)
    print("IDS", *pool.transactional_ids, flush=True)
    if args.ids_only:
        sys.stdin.readline()
        pool.close()
        return 0
    out = threading.Lock()

    def client(i: int) -> None:
        n = 0
        while True:
            value = f"w{i}-{n}"
            n += 1
            if args.run:
                try:
                    handle = pool.run(write, args.topic, value, n % 5 == 0)
                except Boom:
                    continue
                with out:
                    returned(value, handle.state, hooks)
                continue
            with pool.transaction() as tx:
                tx.connection.exec_driver_sql("INSERT INTO pool_rows (value) VALUES (?)"
                                              if tx.connection.dialect.name == "sqlite" else
                                              "INSERT INTO pool_rows (value) VALUES (%s)",
                                              (value,))
                tx.produce(args.topic, value, value)
            with out:
                returned(value, tx.state, hooks)

    threads = [threading.Thread(target=client, args=(i,), daemon=True)
               for i in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 0


def returned(value: str, state: object, hooks: BlockAfter | None) -> None:
    say("OK", value, state)
    if hooks is not None:
        with hooks.lock:
            hooks.returned += 1


async def run_tasks(args: argparse.Namespace, hooks: BlockAfter | None) -> None:
    engine = create_async_engine(args.db)
    pool = AsyncDualWriterPool(engine, {"bootstrap.servers": args.bootstrap},
                               id_prefix=args.prefix, size=args.size, timeout_s=20,
                               group_commit=not args.no_group_commit, hooks=hooks)
    await pool.start()
    print("IDS", *pool.pool.transactional_ids, flush=True)

    async def client(i: int) -> None:
        n = 0
        while True:
            value = f"a{i}-{n}"
            n += 1
            if args.run:
                try:
                    handle = await pool.run(write, args.topic, value, n % 5 == 0)
                except Boom:
                    continue
                returned(value, handle.state, hooks)
                continue
            async with pool.transaction() as tx:
                await tx.connection.execute(
                    text("INSERT INTO pool_rows (value) VALUES (:v)"), {"v": value})
                tx.produce(args.topic, value, value)
            returned(value, tx.state, hooks)

    await asyncio.gather(*(client(i) for i in range(args.threads)))


if __name__ == "__main__":
    sys.exit(main())
