"""The Spark sink when the broker drops out after a batch was decided (issue 9, item 1).

Runs tests/support/workers/spark_worker.py as in tests/spark/test_sink.py; the fault is the
documented ``down:<point>:<batch>`` rule of dualwrite/spark/faults.py (``BrokerUnreachableError``
raised in the driver's commit phase, as a broker restart would).
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from dualwrite.batch.decision_log import DecisionLog
from dualwrite.batch.prepared_writes import PreparedTransactions
from dualwrite.errors import ConfigurationError
from dualwrite.participant.control_plane import ControlPlane
from tests.support.batch import encoded, open_in_pool, prepare
from tests.support.kafka import read_committed, unique
from tests.support.spark import Pipeline, batches

pytest.importorskip("pyspark", reason="the Spark sink needs dualwrite[spark]")

from dualwrite.spark import ExactlyOnceSink

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_broker_error_after_the_decision_never_rewrites_the_batch(
        pipeline: Pipeline) -> None:
    """Batch 1 decided, then the broker is unreachable between its participant commits: the
    sink must complete batch 1, not write it again (which aborts its decided participants and
    then skips the new decision as a replay: rows published, records lost)."""
    result = pipeline.run(faults="down:committed-one:1")
    assert "DUALWRITE-DOWN committed-one 1" in result.stdout
    pipeline.assert_exactly_once()
    assert "writing it again" not in result.stderr  # the tasks of batch 1 ran once
    assert batches(result.stdout, "committed")[:2] == [0, 1]


def _failing_batch(df: Any) -> Any:
    """Stands in for ``ExactlyOnceSink._prepare``: the batch fails in the driver."""
    raise RuntimeError("injected: the batch failed")


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_query_restarted_in_the_same_process_recovers_first(
        engine: sa.Engine, db_url: str, bootstrap: str, topic: str) -> None:
    """The sink caches its coordinator; after a failed batch the restarted query (same sink
    object, same process) must complete the in-doubt batch and abort what lingers, as a fresh
    start does, before it writes anything."""
    sink_id = unique("sink")
    kconf = {"bootstrap.servers": bootstrap}
    sink = ExactlyOnceSink(sink_id=sink_id, kafka_config=kconf, topic=topic,
                           database_url=db_url, timeout_s=20, migrate=False)
    with ControlPlane(kconf, timeout_s=20) as cp:
        try:
            sink._start()  # the query's first batch started the sink
            parts = [prepare(bootstrap, cp, sink_id, topic, 3, p, 0, [f"b3-p{p}"])
                     for p in range(2)]
            assert DecisionLog(engine).decide(sink_id, 3, parts)  # decided; completion failed
            sink._prepare = _failing_batch  # type: ignore[method-assign]
            with pytest.raises(RuntimeError, match="injected"):
                sink(None, 4)  # type: ignore[arg-type]
            # A task attempt of batch 4 prepared before the query died; the query restarts.
            loser = prepare(bootstrap, cp, sink_id, topic, 4, 2, 0, ["b4-loser"])
            coordinator = sink._start()
            assert sink.recovery is not None
            assert sink.recovery.aborted == (loser.transactional_id,)
            assert coordinator.should_write(3) is False and coordinator.should_write(4)
        finally:
            sink.close()
        assert read_committed(bootstrap, topic) == encoded("b3-p0", "b3-p1")
        assert open_in_pool(cp, sink_id) == []
    record = DecisionLog(engine).read(sink_id)
    assert record is not None and record.last_batch_id == 3 and record.completed


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_close_keeps_the_participants_of_a_batch_in_doubt(
        engine: sa.Engine, db_url: str, bootstrap: str, topic: str) -> None:
    """The query stopped with a decided batch in doubt (its completion failed); ``close()``
    aborts lingering transactions, but never the decided participants: those are committed by
    the next start (or `dualwrite recover`), not lost."""
    sink_id = unique("sink")
    kconf = {"bootstrap.servers": bootstrap}
    sink = ExactlyOnceSink(sink_id=sink_id, kafka_config=kconf, topic=topic,
                           database_url=db_url, timeout_s=20, migrate=False)
    with ControlPlane(kconf, timeout_s=20) as cp:
        try:
            sink._start()
            parts = [prepare(bootstrap, cp, sink_id, topic, 5, p, 0, [f"b5-p{p}"])
                     for p in range(2)]
            loser = prepare(bootstrap, cp, sink_id, topic, 5, 2, 1, ["b5-loser"])
            assert DecisionLog(engine).decide(sink_id, 5, parts)
        finally:
            sink.close()
        assert open_in_pool(cp, sink_id) == sorted(p.transactional_id for p in parts)
        assert loser.transactional_id not in open_in_pool(cp, sink_id)
        restarted = ExactlyOnceSink(sink_id=sink_id, kafka_config=kconf, topic=topic,
                                    database_url=db_url, timeout_s=20, migrate=False)
        try:
            restarted._start()
            assert restarted.recovery is not None and restarted.recovery.completed_batch == 5
        finally:
            restarted.close()
        assert read_committed(bootstrap, topic) == encoded("b5-p0", "b5-p1")
        assert open_in_pool(cp, sink_id) == []


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_write_once_needs_a_prepared_transaction_per_task(engine: sa.Engine, db_url: str) -> None:
    """Fewer prepared-transaction slots than a batch's tasks: auto writes through staging,
    a forced write-once refuses to start (its ninth PREPARE would fail every batch)."""
    capacity = PreparedTransactions(engine).capacity()
    assert capacity > 0
    kconf = {"bootstrap.servers": "127.0.0.1:9"}  # never contacted here
    auto = ExactlyOnceSink(sink_id=unique("sink"), kafka_config=kconf, topic="t",
                           database_url=db_url, target_table="t", migrate=False)
    assert auto._choose_write_once(engine, capacity) is True
    assert auto._choose_write_once(engine, capacity + 1) is False
    forced = ExactlyOnceSink(sink_id=unique("sink"), kafka_config=kconf, topic="t",
                             database_url=db_url, target_table="t", migrate=False,
                             sql_mode="write-once")
    assert forced._choose_write_once(engine, capacity) is True
    with pytest.raises(ConfigurationError, match=f"max_prepared_transactions = {capacity}\\."):
        forced._choose_write_once(engine, capacity + 1)
