"""The executor side of the sink: one task writes its partition of a batch and prepares.

Runs inside PySpark's Python workers through ``DataFrame.mapInArrow``. Workers are reused across
tasks, so the control-plane client and database engines are cached per worker process.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from sqlalchemy import Engine, make_url

from dualwrite.batch.decision_log import DecisionLog, StagingTable
from dualwrite.batch.naming import transactional_id
from dualwrite.batch.prepared_writes import PreparedDatabaseTxn, PreparedTransactions, gid_prefix
from dualwrite.database import create_engine, mask_url
from dualwrite.participant.control_plane import ControlPlane
from dualwrite.participant.producer import TwoPhaseProducer
from dualwrite.spark import faults

log = logging.getLogger(__name__)

KEY = "__dw_key"
VALUE = "__dw_value"
RESULT_SCHEMA = ("partition_id int, transactional_id string, state string, records long, "
                 "attempt_key string, database_txn string")

_lock = threading.Lock()
_control_planes: dict[tuple[tuple[str, str], ...], ControlPlane] = {}
_staging: dict[tuple[str, str, tuple[str, ...]], StagingTable] = {}
_prepared: dict[str, PreparedTransactions] = {}
_engines: dict[str, Engine] = {}
_starter = ThreadPoolExecutor(1, thread_name_prefix="dualwrite-task-init")


_SECRET_KEY_PARTS = ("password", "secret", "token", "jaas", "sasl.oauthbearer", "ssl.key",
                     "credential")


def _masked_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with the value of every secret-looking key replaced by ``***``."""
    return {k: "***" if any(p in k.lower() for p in _SECRET_KEY_PARTS) else v
            for k, v in config.items()}


def _masked_url(url: str | None) -> str | None:
    """A database URL with its password (and secret query parameters such as ``?password=``)
    replaced by ``***``; the whole URL if it cannot be parsed."""
    if url is None:
        return None
    try:
        parsed = make_url(url)
        hidden = {k: "***" for k in parsed.query
                  if any(p in k.lower() for p in _SECRET_KEY_PARTS)}
        return mask_url(parsed.update_query_dict(hidden) if hidden else parsed)
    except Exception:  # a repr must not fail, nor echo what it cannot parse
        return "***"


@dataclass(frozen=True)
class TaskPlan:
    """Everything a task needs, pickled to the executors with the function.

    Its repr (and str) masks the Kafka secrets and the database password.
    """

    sink_id: str
    batch_id: int
    topic: str
    producer_config: Mapping[str, Any]
    database_url: str | None = None
    target_table: str | None = None
    table_columns: tuple[str, ...] = ()
    timeout_s: float = 30.0
    write_once: bool = False
    """SQL rows straight into the target in a prepared transaction (else: staged)."""

    def __repr__(self) -> str:
        return (f"TaskPlan(sink_id={self.sink_id!r}, batch_id={self.batch_id!r}, "
                f"topic={self.topic!r}, producer_config={_masked_config(self.producer_config)!r}, "
                f"database_url={_masked_url(self.database_url)!r}, "
                f"target_table={self.target_table!r}, table_columns={self.table_columns!r}, "
                f"timeout_s={self.timeout_s!r}, write_once={self.write_once!r})")

    __str__ = __repr__


def _control_plane(config: Mapping[str, Any], timeout_s: float) -> ControlPlane:
    """One admin client per worker process and cluster (not per transactional id)."""
    key = tuple(sorted((k, str(v)) for k, v in config.items() if k != "transactional.id"))
    with _lock:
        cp = _control_planes.get(key)
        if cp is None:
            cp = _control_planes[key] = ControlPlane(config, timeout_s=timeout_s)
        return cp


def _engine(url: str) -> Engine:
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            engine = _engines[url] = create_engine(url)
        return engine


def _staging_table(plan: TaskPlan) -> StagingTable:
    assert plan.database_url is not None and plan.target_table is not None
    key = (plan.database_url, plan.target_table, plan.table_columns)
    engine = _engine(plan.database_url)
    with _lock:
        table = _staging.get(key)
        if table is None:
            table = _staging[key] = StagingTable(engine, plan.target_table, plan.table_columns)
        return table


def _prepared_transactions(plan: TaskPlan) -> PreparedTransactions:
    assert plan.database_url is not None
    engine = _engine(plan.database_url)
    with _lock:
        found = _prepared.get(plan.database_url)
        if found is None:
            found = _prepared[plan.database_url] = PreparedTransactions(engine)
        return found


def _decided(plan: TaskPlan, engine: Engine) -> bool:
    """Whether the decision log already holds this task's batch (or a later one)."""
    record = DecisionLog(engine).read(plan.sink_id)
    return record is not None and record.last_batch_id >= plan.batch_id


def _roll_back_earlier_attempts(plan: TaskPlan, prepared: PreparedTransactions,
                                partition_id: int) -> None:
    """Roll back what earlier attempts of this partition prepared, while the batch is not
    decided: their rows would hold this attempt's COPY on the target's unique keys.

    Under the sink's decision lock, which the driver verifies its participants under: either
    this runs first and the driver finds a participant rolled back (the batch is written
    again), or the batch is decided first and this attempt is a straggler that leaves it.
    """
    prefix = gid_prefix(plan.sink_id, plan.batch_id, partition_id)
    if not prepared.list(prefix):
        return
    with DecisionLog(prepared.engine).locked(plan.sink_id, timeout_s=plan.timeout_s) as (_, rec):
        if rec is not None and rec.last_batch_id >= plan.batch_id:
            return
        for earlier in prepared.list(prefix):
            if prepared.rollback(earlier.gid):
                log.info("sink=%s batch=%d partition=%d rolled back an earlier attempt's "
                         "prepared database transaction gid=%s", plan.sink_id, plan.batch_id,
                         partition_id, earlier.gid)


def _start_producer(plan: TaskPlan, tid: str) -> Future[TwoPhaseProducer]:
    def start() -> TwoPhaseProducer:
        config = {**plan.producer_config, "transactional.id": tid}
        producer = TwoPhaseProducer(config, timeout_s=plan.timeout_s,
                                    control_plane=_control_plane(config, plan.timeout_s))
        producer.init_transactions()
        return producer

    return _starter.submit(start)


def _as_bytes(values: list[Any]) -> list[bytes | None]:
    return [v.encode() if isinstance(v, str) else v for v in values]


def write_partition(plan: TaskPlan, batches: Iterator[pa.RecordBatch]
                    ) -> Iterator[pa.RecordBatch]:
    """Produce (and write) this partition's rows in one transaction, prepare, report the state.

    A partition without rows opens no transaction and reports nothing.
    """
    ctx = TaskContext.get()
    assert ctx is not None, "write_partition runs inside a Spark task"
    partition_id, attempt = ctx.partitionId(), ctx.attemptNumber()
    staging = (_staging_table(plan) if plan.target_table is not None and not plan.write_once
               else None)
    prepared = _prepared_transactions(plan) if plan.write_once else None
    tid = transactional_id(plan.sink_id, plan.batch_id, partition_id, attempt)
    attempt_key = uuid.uuid4().hex
    # InitProducerId runs while the first rows cross from the JVM. It opens no transaction, and
    # the id's previous owner (batch N-2) was committed before this batch began.
    starting = _start_producer(plan, tid)
    producer: TwoPhaseProducer | None = None
    database_txn: PreparedDatabaseTxn | None = None
    straggler = False
    records = 0
    rows = None
    with contextlib.ExitStack() as stack:
        try:
            # Staging: the partition's rows in one COPY (one transaction), committed before the
            # transaction is prepared: the decision only names attempts whose rows are all
            # staged.
            stage = (stack.enter_context(staging.writer(plan.sink_id, plan.batch_id,
                                                        attempt_key))
                     if staging is not None else None)
            # Write-once: one COPY into the target, in a transaction prepared beside Kafka's.
            if prepared is not None:
                assert plan.target_table is not None
                _roll_back_earlier_attempts(plan, prepared, partition_id)
                rows = stack.enter_context(prepared.write(
                    plan.target_table, plan.table_columns, plan.sink_id, plan.batch_id,
                    partition_id, attempt_key, lock_timeout_s=plan.timeout_s))
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                if producer is None:
                    producer = starting.result()
                    producer.begin_transaction()
                    faults.task_point("producing", partition_id, attempt, plan.batch_id)
                keys = _as_bytes(batch.column(KEY).to_pylist())
                values = _as_bytes(batch.column(VALUE).to_pylist())
                producer.produce_many(plan.topic, zip(keys, values, strict=True))
                if stage is not None:
                    stage(batch)
                if rows is not None:
                    rows.write(batch)
                records += batch.num_rows
        finally:
            if producer is None:  # no rows (or failed before any): no transaction was opened
                with contextlib.suppress(Exception):
                    starting.result().close()
        if producer is not None and prepared is not None and rows is not None:
            # Leaving the block unprepared rolls the rows back.
            straggler = _decided(plan, prepared.engine)
            if not straggler:
                database_txn = rows.prepare()
    if producer is None:
        return
    if staging is not None:
        # Its rows were staged before this read, so either the batch's clean-up (after the
        # decision) sees them or they are dropped here; nothing of it stays in the staging table.
        straggler = _decided(plan, staging.engine)
        if straggler:
            staging.discard(plan.sink_id, plan.batch_id, attempt_key)
    if straggler:
        # A straggler whose batch a faster attempt already won.
        producer.abort_transaction()
        producer.close()
        log.info("sink=%s batch=%d partition=%d attempt=%d: the batch was decided without this "
                 "attempt; aborted transactional_id=%s", plan.sink_id, plan.batch_id,
                 partition_id, attempt, tid)
        return
    state = producer.prepare_transaction()
    producer.close()  # drops the handle; the transaction stays open for the driver
    faults.task_point("prepared", partition_id, attempt, plan.batch_id)
    log.info("sink=%s batch=%d partition=%d attempt=%d prepared transactional_id=%s state=%s "
             "records=%d%s", plan.sink_id, plan.batch_id, partition_id, attempt, tid, state,
             records, f" gid={database_txn.gid}" if database_txn is not None else "")
    yield pa.RecordBatch.from_pydict({
        "partition_id": pa.array([partition_id], pa.int32()),
        "transactional_id": [tid],
        "state": [str(state)],
        "records": pa.array([records], pa.int64()),
        "attempt_key": [attempt_key if staging is not None else ""],
        "database_txn": [str(database_txn) if database_txn is not None else ""],
    })
