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
from dualwrite.database import create_engine, mask_url
from dualwrite.participant.control_plane import ControlPlane
from dualwrite.participant.producer import TwoPhaseProducer
from dualwrite.spark import faults

log = logging.getLogger(__name__)

KEY = "__dw_key"
VALUE = "__dw_value"
RESULT_SCHEMA = ("partition_id int, transactional_id string, state string, records long, "
                 "attempt_key string")

_lock = threading.Lock()
_control_planes: dict[tuple[tuple[str, str], ...], ControlPlane] = {}
_staging: dict[tuple[str, str, tuple[str, ...]], StagingTable] = {}
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

    def __repr__(self) -> str:
        return (f"TaskPlan(sink_id={self.sink_id!r}, batch_id={self.batch_id!r}, "
                f"topic={self.topic!r}, producer_config={_masked_config(self.producer_config)!r}, "
                f"database_url={_masked_url(self.database_url)!r}, "
                f"target_table={self.target_table!r}, table_columns={self.table_columns!r}, "
                f"timeout_s={self.timeout_s!r})")

    __str__ = __repr__


def _control_plane(config: Mapping[str, Any], timeout_s: float) -> ControlPlane:
    """One admin client per worker process and cluster (not per transactional id)."""
    key = tuple(sorted((k, str(v)) for k, v in config.items() if k != "transactional.id"))
    with _lock:
        cp = _control_planes.get(key)
        if cp is None:
            cp = _control_planes[key] = ControlPlane(config, timeout_s=timeout_s)
        return cp


def _staging_table(plan: TaskPlan) -> StagingTable:
    assert plan.database_url is not None and plan.target_table is not None
    key = (plan.database_url, plan.target_table, plan.table_columns)
    with _lock:
        table = _staging.get(key)
        if table is None:
            engine = _engines.get(plan.database_url)
            if engine is None:
                engine = _engines[plan.database_url] = create_engine(plan.database_url)
            table = _staging[key] = StagingTable(engine, plan.target_table, plan.table_columns)
        return table


def _decided(plan: TaskPlan, staging: StagingTable) -> bool:
    """Whether the decision log already holds this task's batch (or a later one)."""
    record = DecisionLog(staging.engine).read(plan.sink_id)
    return record is not None and record.last_batch_id >= plan.batch_id


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
    """Produce (and stage) this partition's rows in one transaction, prepare, report the state.

    A partition without rows opens no transaction and reports nothing.
    """
    ctx = TaskContext.get()
    assert ctx is not None, "write_partition runs inside a Spark task"
    partition_id, attempt = ctx.partitionId(), ctx.attemptNumber()
    staging = _staging_table(plan) if plan.target_table is not None else None
    tid = transactional_id(plan.sink_id, plan.batch_id, partition_id, attempt)
    attempt_key = uuid.uuid4().hex
    # InitProducerId runs while the first rows cross from the JVM. It opens no transaction, and
    # the id's previous owner (batch N-2) was committed before this batch began.
    starting = _start_producer(plan, tid)
    producer: TwoPhaseProducer | None = None
    records = 0
    with contextlib.ExitStack() as stack:
        # The partition's rows are staged in one COPY (one transaction), committed before the
        # transaction is prepared: the decision only names attempts whose rows are all staged.
        stage = (stack.enter_context(staging.writer(plan.sink_id, plan.batch_id, attempt_key))
                 if staging is not None else None)
        try:
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
                records += batch.num_rows
        finally:
            if producer is None:  # no rows (or failed before any): no transaction was opened
                with contextlib.suppress(Exception):
                    starting.result().close()
    if producer is None:
        return
    if staging is not None and _decided(plan, staging):
        # A straggler whose batch a faster attempt already won. Its rows were staged before
        # this read, so either the batch's clean-up (after the decision) sees them or they are
        # dropped here; nothing of it stays in the staging table.
        staging.discard(plan.sink_id, plan.batch_id, attempt_key)
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
             "records=%d", plan.sink_id, plan.batch_id, partition_id, attempt, tid, state,
             records)
    yield pa.RecordBatch.from_pydict({
        "partition_id": pa.array([partition_id], pa.int32()),
        "transactional_id": [tid],
        "state": [str(state)],
        "records": pa.array([records], pa.int64()),
        "attempt_key": [attempt_key if staging is not None else ""],
    })
