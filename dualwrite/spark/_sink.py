"""The driver side of the sink: ``df.writeStream.foreachBatch(ExactlyOnceSink(...))``."""

from __future__ import annotations

import functools
import logging
import re
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from py4j.protocol import Py4JError
from pyspark.errors import AnalysisException, PySparkException
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from sqlalchemy import Engine

from dualwrite import errors
from dualwrite.batch.coordinator import BatchCoordinator, BatchTimings, SinkRecovery
from dualwrite.batch.decision_log import Participant, StagingTable, check_sink_id
from dualwrite.batch.prepared_writes import PreparedDatabaseTxn, PreparedTransactions
from dualwrite.batch.target import target_columns
from dualwrite.database import create_engine, mask_url, upgrade_database
from dualwrite.errors import (
    BatchTasksFailedError,
    ConfigurationError,
    DualWriteError,
    FatalError,
    RetriableError,
)
from dualwrite.participant.control_plane import ControlPlane
from dualwrite.participant.prepared_state import PreparedTxnState
from dualwrite.spark._task import KEY, RESULT_SCHEMA, VALUE, TaskPlan, write_partition
from dualwrite.spark.faults import DriverFaults

log = logging.getLogger(__name__)

DEFAULT_DATABASE_URL = "sqlite:///dualwrite.db"
SqlMode = Literal["auto", "write-once", "staging"]


class ExactlyOnceSink:
    """A ``foreachBatch`` function that writes each micro-batch to Kafka (and SQL) exactly once.

    Each partition of the batch is produced in its own Kafka transaction by the task that holds
    it and prepared (with its SQL rows: see ``sql_mode``); the driver records the decision in
    one short database transaction and commits every participant. A batch id that was decided
    before is skipped, so replays after a restart write nothing twice.

    Kafka record: ``key_column`` and ``value_column`` (string or binary); without a value column
    the value is the row as JSON. SQL (optional): ``target_table`` receives ``table_columns``
    (default: every column of the table) from the batch's rows. ``database_url`` holds the
    decision log, and the target table; the default is an embedded SQLite file, for local mode.

    ``sql_mode``: ``"write-once"`` writes each task's rows straight into the target in a
    database transaction the task prepares (``PREPARE TRANSACTION``) and the driver commits with
    its Kafka transaction; ``"staging"`` stages them and moves them into the target after the
    participants' commit (each row written twice); ``"auto"`` (default) takes write-once where
    the database allows prepared transactions (PostgreSQL with ``max_prepared_transactions``
    at least the tasks in flight), staging otherwise (SQLite, MariaDB). See spark/README.md for
    what readers of the table see in each mode.

    ``max_participants`` caps the Kafka transactions per batch: the batch is coalesced (no
    shuffle) to that many tasks. Each participant costs a producer initialisation and a commit,
    so the default is the cluster's default parallelism: one per core, all of them busy.
    """

    def __init__(self, *, sink_id: str, kafka_config: Mapping[str, Any], topic: str,
                 database_url: str = DEFAULT_DATABASE_URL, key_column: str | None = None,
                 value_column: str | None = None, target_table: str | None = None,
                 table_columns: Sequence[str] | None = None, timeout_s: float = 30.0,
                 batch_attempts: int = 3, migrate: bool = True,
                 max_participants: int | None = None, sql_mode: SqlMode = "auto") -> None:
        if "transactional.id" in kafka_config:
            raise ConfigurationError("ExactlyOnceSink assigns transactional ids itself (a pool "
                                     "per sink); remove 'transactional.id' from kafka_config")
        self.sink_id = check_sink_id(sink_id)
        self.topic = topic
        self.database_url = database_url
        self.key_column = key_column
        self.value_column = value_column
        self.target_table = target_table
        self._table_columns = tuple(table_columns) if table_columns is not None else None
        self._kafka_config = dict(kafka_config)
        self._timeout_s = timeout_s
        self._batch_attempts = max(1, batch_attempts)
        self._migrate = migrate
        if max_participants is not None and max_participants < 1:
            raise ConfigurationError("max_participants must be at least 1")
        self._max_participants = max_participants
        if sql_mode not in ("auto", "write-once", "staging"):
            raise ConfigurationError(f"sql_mode must be 'auto', 'write-once' or 'staging', not "
                                     f"{sql_mode!r}")
        self.sql_mode = sql_mode
        self._write_once = False
        self._coordinator: BatchCoordinator | None = None
        self._control_plane: ControlPlane | None = None
        """The sink's own client, lent to its coordinator; :meth:`close` closes it."""
        self._faults = DriverFaults()
        self._needs_recovery = False
        self._start_lock = threading.Lock()
        self.recovery: SinkRecovery | None = None
        """What the start of this run recovered."""
        self.last_timings: BatchTimings | None = None
        self.on_batch: Callable[[int, BatchTimings | None, int], None] | None = None
        """Called after each batch with (batch id, timings or None if skipped, records)."""

    def _start(self, df: DataFrame | None = None) -> BatchCoordinator:
        """The coordinator, made (and its recovery run) on the first batch, ``df``."""
        with self._start_lock:
            if self._coordinator is not None:
                if self._needs_recovery:
                    # A batch failed: the query stopped and this is (likely) its restart in the
                    # same process. Recover as a fresh start would, before anything else.
                    log.info("sink=%s: the last batch failed; recovering before the next one",
                             self.sink_id)
                    self.recovery = self._coordinator.recover()
                    self._needs_recovery = False
                return self._coordinator
            engine = create_engine(self.database_url)
            if self._migrate:
                upgrade_database(engine)
            staging = None
            if self.target_table is not None:
                self._write_once = self._choose_write_once(
                    engine, self._tasks(df) if df is not None else self._max_participants or 1)
                if self._write_once:
                    _, self._table_columns = target_columns(engine, self.target_table,
                                                            self._table_columns)
                else:
                    staging = StagingTable(engine, self.target_table, self._table_columns)
                    staging.create()
                    self._table_columns = staging.columns
            cp = self._control_plane = ControlPlane(self._kafka_config,
                                                    timeout_s=self._timeout_s)
            if "transaction.timeout.ms" not in self._kafka_config:
                # Participants must outlive a driver restart: ask for the broker's maximum.
                probe = cp.probe(check_2pc=False)
                if probe.max_transaction_timeout_ms:
                    self._kafka_config["transaction.timeout.ms"] = probe.max_transaction_timeout_ms
            coordinator = BatchCoordinator(self.sink_id, engine, self._kafka_config,
                                           staging=staging, control_plane=cp,
                                           timeout_s=self._timeout_s, hooks=self._faults)
            log.info("sink=%s starting on %s: recovering the last run", self.sink_id,
                     mask_url(engine.url))
            self.recovery = coordinator.recover()
            self._coordinator = coordinator
            return coordinator

    @property
    def mode(self) -> str | None:
        """The SQL mode the sink runs in (``write-once`` or ``staging``), once it started; None
        for a Kafka-only sink or before its first batch."""
        if self.target_table is None or self._coordinator is None:
            return None
        return "write-once" if self._write_once else "staging"

    def _choose_write_once(self, engine: Engine, tasks: int) -> bool:
        """The SQL mode: write-once where the database can hold a batch's ``tasks``
        transactions prepared at once (or as forced)."""
        capacity = PreparedTransactions(engine).capacity()
        if self.sql_mode == "write-once" and capacity < tasks:
            raise ConfigurationError(
                f"sink {self.sink_id!r}: sql_mode='write-once' needs a prepared transaction per "
                f"task, {tasks} at once; {mask_url(engine.url)} has "
                f"max_prepared_transactions = {capacity}. Raise it (a server restart), lower "
                "max_participants, or use sql_mode='staging'")
        write_once = capacity >= tasks and self.sql_mode != "staging"
        why = ("prepared transactions" if write_once else
               "forced" if self.sql_mode == "staging" else
               f"the database holds {capacity} prepared transactions at most, fewer than the "
               f"{tasks} tasks of a batch")
        log.info("sink=%s writes table %s in %s mode (%s)", self.sink_id, self.target_table,
                 "write-once" if write_once else "staging", why)
        return write_once

    def _prepare(self, df: DataFrame) -> DataFrame:
        key: Column = F.col(self.key_column) if self.key_column else F.lit(None).cast("binary")
        if self.value_column:
            value = F.col(self.value_column)
        else:
            value = F.to_json(F.struct(*[F.col(c) for c in df.columns]))
        table = [F.col(c) for c in (self._table_columns or ())]
        try:
            return df.select(key.alias(KEY), value.alias(VALUE), *table)
        except AnalysisException as exc:  # Spark resolves the columns here, on the driver
            raise ConfigurationError(
                f"sink {self.sink_id}: the batch's columns {df.columns} do not give the sink's "
                f"key_column={self.key_column!r}, value_column={self.value_column!r}, "
                f"table_columns={list(self._table_columns or ())}: "
                f"{str(exc).splitlines()[0][:300]}") from exc

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        coordinator = self._start(df)
        try:
            self._write(coordinator, df, batch_id)
        except BaseException:
            self._needs_recovery = True  # the next call recovers first (a restarted query)
            raise

    def _tasks(self, df: DataFrame) -> int:
        """The most tasks (participants) a batch has: ``max_participants``, or one per core."""
        return self._max_participants or df.sparkSession.sparkContext.defaultParallelism

    def _write(self, coordinator: BatchCoordinator, df: DataFrame, batch_id: int) -> None:
        """Write one batch; re-run its tasks only while it is certainly not decided."""
        # An in-doubt batch is completed first; a decided one is skipped as a replay.
        if not coordinator.should_write(batch_id):
            if self.on_batch is not None:
                self.on_batch(batch_id, None, 0)
            return
        # A missing or unwritable topic fails the batch here, typed, before any task runs (a
        # task would learn it only after message.timeout.ms, and Spark would retry it).
        assert self._control_plane is not None
        self._control_plane.check_topics_writable([self.topic])
        plan = TaskPlan(self.sink_id, batch_id, self.topic, self._kafka_config,
                        self.database_url if self.target_table else None, self.target_table,
                        self._table_columns or (), self._timeout_s, self._write_once)
        prepared = self._prepare(df)
        try:  # no-op when the batch has fewer partitions
            prepared = prepared.coalesce(self._tasks(df))
        except (PySparkException, Py4JError) as exc:
            raise tasks_failed(exc, self.sink_id, batch_id, self.topic) from exc
        for attempt in range(1, self._batch_attempts + 1):
            try:
                rows = prepared.mapInArrow(functools.partial(write_partition, plan),
                                           RESULT_SCHEMA).collect()
            except (PySparkException, Py4JError) as exc:  # whatever a task raised
                raise tasks_failed(exc, self.sink_id, batch_id, self.topic) from exc
            participants = [Participant(r.partition_id, r.transactional_id,
                                        PreparedTxnState.parse(r.state), r.records,
                                        r.attempt_key,
                                        PreparedDatabaseTxn.parse(r.database_txn)
                                        if r.database_txn else None) for r in rows]
            self._faults.at("prepared", batch_id)
            try:
                # RetriableError only while the batch is not decided; after the decision, a
                # failure to complete it is a RecoverableError, and the tasks never run again.
                timings = coordinator.finish(batch_id, participants)
            except RetriableError as exc:
                if attempt == self._batch_attempts:
                    raise
                log.warning("sink=%s batch=%d attempt %d not decided (%s); writing it again",
                            self.sink_id, batch_id, attempt, exc)
                continue
            self.last_timings = timings
            if self.on_batch is not None:
                self.on_batch(batch_id, timings, sum(p.records for p in participants))
            return

    def close(self) -> None:
        """Abort what losing task attempts left open, release the clients.

        Call it after the query stopped: a killed straggler can still prepare a transaction
        for a moment after its batch was committed (PySpark kills its worker after
        ``spark.python.task.killTimeout``), and an open transaction stalls read_committed
        consumers of its partitions until it is aborted.
        """
        if self._coordinator is not None:
            try:
                # Never the participants of a batch left in doubt: the next start commits them.
                self._coordinator.abort_lingering()
            except DualWriteError as exc:
                log.warning("sink=%s could not abort lingering transactions on close (%s); "
                            "the next run or `dualwrite recover` will", self.sink_id, exc)
            self._coordinator.close()
            self._coordinator = None
        if self._control_plane is not None:
            self._control_plane.close()
            self._control_plane = None


_FINAL_EXCEPTION = re.compile(r"^(?P<name>[A-Za-z_][\w.]*): ?(?P<message>.*)$", re.M)
_TOPIC_AND_MESSAGE = (errors.InvalidRecordError, errors.UnknownTopicError)
"""Fatal classes constructed as ``(topic, message)``; the others' own ``__init__`` is not
guessed at."""


def task_exception(text: str) -> tuple[str, str] | None:
    """``(qualified class name, message)`` of the exception a failed task ended with: the first
    unindented ``Name: message`` line after the text's last ``Traceback`` header (the frames
    are indented; chained causes come in earlier tracebacks)."""
    _, header, last = text.rpartition("Traceback (most recent call last):")
    match = _FINAL_EXCEPTION.search(last) if header else None
    return (match["name"], match["message"].strip()) if match else None


def _dualwrite_class(name: str) -> type[DualWriteError] | None:
    module, _, attr = name.rpartition(".")
    if not module.startswith("dualwrite."):
        return None
    kind = getattr(sys.modules.get(module), attr, None)
    return kind if isinstance(kind, type) and issubclass(kind, DualWriteError) else None


def tasks_failed(exc: Exception, sink_id: str, batch_id: int, topic: str) -> DualWriteError:
    """The typed error for a batch whose tasks failed. Spark reports a failed task as its own
    exception (``PythonException``, ``Py4JJavaError``) carrying the task's traceback as text;
    nothing was decided yet (the decision follows the tasks). A task's dualwrite
    :class:`FatalError` (a bad record, a missing topic or permission) stays fatal, as running
    the batch again would fail the same way; anything else is :class:`BatchTasksFailedError`,
    ``task_error`` naming what the task raised (which may be the query's own code)."""
    found = task_exception(str(exc))
    name, message = found or (type(exc).__name__,
                              (str(exc).strip().splitlines() or [""])[0][:300])
    kind = _dualwrite_class(name)
    if kind is not None and issubclass(kind, FatalError):
        text = f"sink {sink_id} batch {batch_id}: a task failed: {message}"
        if issubclass(kind, _TOPIC_AND_MESSAGE):
            return kind(topic, text)
        if all("__init__" not in vars(c) for c in kind.__mro__ if issubclass(c, DualWriteError)):
            return kind(text)
        return FatalError(f"{text} ({name.rsplit('.', 1)[-1]})")
    cause = f"{name.rsplit('.', 1)[-1]}: {message}"[:500]
    return BatchTasksFailedError(
        f"sink {sink_id} batch {batch_id}: its tasks failed before the batch was decided "
        f"({cause}); nothing of it is visible, and running the batch again writes it once "
        "what failed is back", task_error=cause)
