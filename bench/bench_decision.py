"""Benchmark: a batch sink's decision transaction and its apply, against the batch's size.

For each size N, N rows are staged for one batch (through ``StagingTable.writer``, the COPY the
Spark tasks use, 8 attempts of N/8 rows), then timed:

- ``decide``: :meth:`DecisionLog.decide` with 8 participants, the transaction every sink's
  decision waits on (it records the decision and names the winning staged rows);
- ``apply``: :meth:`DecisionLog.mark_completed`, the transaction after the participants' commit
  that moves the rows into the target and deletes them from staging, kept out of the decision
  so that the decision's cost does not grow with the batch (docs/design.md, "Batch sinks").

    ./run.sh bench decision [--sizes 10000,200000,1000000] [--db-url URL]

Without ``--db-url`` (or ``DUALWRITE_DATABASE_URL``) a throwaway local PostgreSQL is started; with
it, the run works in a schema of its own, dropped at the end (the database's own dualwrite tables
and migration level are left alone).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from contextlib import ExitStack

import pyarrow as pa
import sqlalchemy as sa

import dualwrite as dw
from dualwrite.batch.decision_log import DecisionLog, Participant, StagingTable
from dualwrite.participant.prepared_state import PreparedTxnState

PARTICIPANTS = 8


def run(engine: sa.Engine, size: int, value_bytes: int) -> tuple[float, float, float, int]:
    """(staging s, decide s, apply s, rows applied) for one batch of ``size`` rows."""
    run_id = uuid.uuid4().hex[:8]
    table, sink = f"bench_decision_{run_id}", f"bench-decision-{run_id}"
    sa.Table(table, sa.MetaData(), sa.Column("id", sa.BigInteger, primary_key=True),
             sa.Column("value", sa.String(max(value_bytes, 32)), nullable=False)
             ).create(engine)
    try:
        staging = StagingTable(engine, table)
        staging.create()
        per = size // PARTICIPANTS
        started = time.perf_counter()
        participants = []
        for p in range(PARTICIPANTS):
            key = f"attempt-{p}"
            with staging.writer(sink, 1, key) as stage:
                for start in range(p * per, (p + 1) * per, 10_000):
                    ids = pa.array(range(start, min(start + 10_000, (p + 1) * per)), pa.int64())
                    values = pa.compute.utf8_lpad(ids.cast(pa.string()), value_bytes, "0")
                    stage(pa.RecordBatch.from_arrays([ids, values], names=["id", "value"]))
            participants.append(Participant(p, f"{sink}-p{p}", PreparedTxnState(1000 + p, 0),
                                            per, key))
        staged = time.perf_counter() - started
        log = DecisionLog(engine)
        t0 = time.perf_counter()
        assert log.decide(sink, 1, participants, staging)
        t1 = time.perf_counter()
        moved = log.mark_completed(sink, 1)
        t2 = time.perf_counter()
        assert moved == per * PARTICIPANTS and staging.count(sink) == 0, (moved, size)
        log.forget(sink)
        return staged, t1 - t0, t2 - t1, moved
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {table}"))
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {table}_dw_staging"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,200000,1000000")
    parser.add_argument("--value-bytes", type=int, default=200)
    parser.add_argument("--db-url", default=os.environ.get("DUALWRITE_DATABASE_URL"))
    args = parser.parse_args()
    with ExitStack() as stack:
        url = args.db_url
        if not url:
            from dualwrite.dev import LocalPostgres
            url = stack.enter_context(LocalPostgres()).url
        else:
            schema = f"bench_decision_{uuid.uuid4().hex[:8]}"
            base = dw.create_engine(url)
            with base.begin() as conn:
                conn.execute(sa.text(f"CREATE SCHEMA {schema}"))

            def drop() -> None:
                with base.begin() as conn:
                    conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
                base.dispose()
            stack.callback(drop)
            url = sa.make_url(url).update_query_dict(
                {"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)
        engine = dw.create_engine(url)
        stack.callback(engine.dispose)
        dw.upgrade_database(engine)
        print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
              f"{PARTICIPANTS} participants, {args.value_bytes} B values")
        print(f"{'rows':>9} {'staging (COPY) ms':>18} {'decide ms':>10} {'apply ms':>9}")
        for size in (int(x) for x in args.sizes.split(",")):
            staged, decide, apply, _ = run(engine, size, args.value_bytes)
            print(f"{size:>9} {staged * 1e3:>18.0f} {decide * 1e3:>10.1f} {apply * 1e3:>9.0f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
