"""Write-once mode's database participants: prepared transactions decided with Kafka's.

The unit tests check the gid and its state string. The rest run on the real broker and a real
PostgreSQL (``max_prepared_transactions`` > 0): a batch whose rows are in prepared transactions
is committed whole, a loser rolled back; a participant rolled back before the decision fails
verification (the batch is written again); one rolled back after it is a heuristic outcome,
never silent; a crash between COMMIT PREPARED and the completion is finished by asking the
transaction id.
"""

from __future__ import annotations

import uuid
from typing import Any

import pyarrow as pa
import pytest
import sqlalchemy as sa

from dualwrite import Outcome, RetriableError
from dualwrite.batch.coordinator import BatchCoordinator
from dualwrite.batch.decision_log import DecisionLog, Participant
from dualwrite.batch.prepared_writes import (
    PreparedDatabaseTxn,
    PreparedTransactions,
    gid_prefix,
)
from dualwrite.errors import (
    BatchHeuristicAbortError,
    InvalidPreparedStateError,
    PreparedRowsLostError,
)
from dualwrite.participant import ControlPlane
from dualwrite.recovery import status
from tests.support.batch import Hooks, encoded, open_in_pool, prepare
from tests.support.kafka import read_committed

pytestmark = pytest.mark.timeout(180)


# -- the gid and its state string (no server) --------------------------------------------------


@pytest.mark.unit
def test_a_prepared_database_txn_round_trips_and_rejects_what_is_not_one() -> None:
    txn = PreparedDatabaseTxn.for_attempt("orders.v2_x-1", 12, 3, "ab" * 16, 9_000_000_001)
    assert txn.gid == f"dw:orders.v2_x-1:12:3:{'ab' * 16}"
    assert PreparedDatabaseTxn.parse(str(txn)) == txn
    for bad in ("", "12", "x/dw:s:1:2:ab", "0/dw:s:1:2:ab", "7/other:s:1:2:ab",
                "7/dw:s:1:2:ab';DROP TABLE t;--", "7/dw:s:one:2:ab"):
        with pytest.raises(InvalidPreparedStateError):
            PreparedDatabaseTxn.parse(bad)


@pytest.mark.unit
def test_gids_of_long_sink_ids_fit_and_stay_apart() -> None:
    a, b = "s" * 200, "s" * 199 + "t"
    gids = [PreparedDatabaseTxn.for_attempt(s, 2**62, 65535, "f" * 32, 1).gid for s in (a, b)]
    assert all(len(g) <= 199 for g in gids) and gids[0] != gids[1]
    assert gids[0].startswith(gid_prefix(a)) and not gids[0].startswith(gid_prefix(b))
    # A prefix never matches another sink whose id merely starts the same way.
    assert not gid_prefix("orders-1", 5).startswith(gid_prefix("orders"))


# -- on PostgreSQL and Kafka ---------------------------------------------------------------------


@pytest.fixture
def items(engine: sa.Engine) -> PreparedTransactions:
    if engine.dialect.name != "postgresql":
        pytest.fail("write-once tests run on PostgreSQL")
    sa.Table("items", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("name", sa.String(50))).create(engine)
    prepared = PreparedTransactions(engine)
    assert prepared.available(), "the test PostgreSQL must allow prepared transactions"
    return prepared


def participant(bootstrap: str, cp: ControlPlane, prepared: PreparedTransactions, sink: str,
                topic: str, batch: int, partition: int, attempt: int,
                rows: dict[int, str]) -> Participant:
    """One write-once task attempt: its rows COPYed and prepared, its records prepared."""
    with prepared.write("items", ("id", "name"), sink, batch, partition, uuid.uuid4().hex,
                        lock_timeout_s=5) as write:
        write.write(pa.RecordBatch.from_pydict({"id": list(rows), "name": list(rows.values())}))
        txn = write.prepare()
    kafka = prepare(bootstrap, cp, sink, topic, batch, partition, attempt, list(rows.values()))
    return Participant(partition, kafka.transactional_id, kafka.state, len(rows),
                       database_txn=txn)


def table(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text("SELECT id, name FROM items ORDER BY id"))]


def coordinator(sink: str, engine: sa.Engine, kconf: dict[str, Any], cp: ControlPlane,
                **kw: Any) -> BatchCoordinator:
    return BatchCoordinator(sink, engine, kconf, control_plane=cp, timeout_s=20, **kw)


class DriverDied(Exception):
    """Raised by a hook: the driver dies at that point of the batch."""


def dies_at(point: str) -> Hooks:
    def crash(reached: str, _batch: int) -> None:
        if reached == point:
            raise DriverDied(point)
    return Hooks(crash)


def finish_until_the_driver_dies(coord: BatchCoordinator, batch_id: int,
                                 parts: list[Participant]) -> None:
    with coord, pytest.raises(DriverDied):
        coord.finish(batch_id, parts)


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_write_once_batch_commits_its_rows_with_its_records(
        engine: sa.Engine, items: PreparedTransactions, kconf: dict[str, Any],
        cp: ControlPlane, bootstrap: str, topic: str, sink: str) -> None:
    loser = participant(bootstrap, cp, items, sink, topic, 4, 0, 0, {10: "loser"})
    parts = [participant(bootstrap, cp, items, sink, topic, 4, 0, 1, {1: "p0-a", 2: "p0-b"}),
             participant(bootstrap, cp, items, sink, topic, 4, 1, 0, {3: "p1-a"})]
    assert table(engine) == []  # prepared: nothing visible yet
    with coordinator(sink, engine, kconf, cp) as coord:
        timings = coord.finish(4, parts)
    assert timings is not None
    assert loser.database_txn is not None
    assert sorted(timings.aborted) == sorted([loser.transactional_id, loser.database_txn.gid])
    assert table(engine) == [(1, "p0-a"), (2, "p0-b"), (3, "p1-a")]
    assert read_committed(bootstrap, topic) == encoded("p0-a", "p0-b", "p1-a")
    assert items.list(gid_prefix(sink)) == [] and open_in_pool(cp, sink) == []
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.completed


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.timeout(60)
def test_a_write_left_unprepared_is_rolled_back_at_once(
        engine: sa.Engine, items: PreparedTransactions, sink: str) -> None:
    """A task failing after it sent rows (its produce failed), and a straggler of a decided
    batch, leave the block without preparing: the open COPY is ended or cancelled first (psycopg
    holds the connection's lock for it, so a rollback under it would wait forever)."""
    batch = pa.RecordBatch.from_pydict({"id": [1, 2], "name": ["a", "b"]})

    def write() -> Any:
        return items.write("items", ("id", "name"), sink, 8, 0, uuid.uuid4().hex,
                           lock_timeout_s=5)

    with pytest.raises(RuntimeError, match="mid-partition"), write() as failing:
        failing.write(batch)
        raise RuntimeError("the task failed mid-partition")
    with write() as straggler:
        straggler.write(batch)
    assert table(engine) == [] and items.list(gid_prefix(sink)) == []
    with write() as later:  # the pooled connections came back clean
        later.write(batch)
        later.prepare()
    assert [t.gid for t in items.list(gid_prefix(sink))] == [later.txn.gid]
    assert items.rollback(later.txn.gid) and table(engine) == []


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_rows_rolled_back_before_the_decision_fail_verification(
        engine: sa.Engine, items: PreparedTransactions, kconf: dict[str, Any],
        cp: ControlPlane, bootstrap: str, topic: str, sink: str) -> None:
    """What a retried task attempt does to its predecessor's transaction, or `recover` beside
    the driver: the batch is not decided and nothing of it stays."""
    parts = [participant(bootstrap, cp, items, sink, topic, 5, p, 0, {p: f"p{p}"})
             for p in range(2)]
    assert parts[1].database_txn is not None
    assert items.rollback(parts[1].database_txn.gid)
    with coordinator(sink, engine, kconf, cp) as coord, pytest.raises(RetriableError,
                                                                     match="rolled back"):
        coord.finish(5, parts)
    assert DecisionLog(engine).read(sink) is None
    assert table(engine) == [] and read_committed(bootstrap, topic) == []
    assert items.list(gid_prefix(sink)) == [] and open_in_pool(cp, sink) == []


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_rows_rolled_back_after_the_decision_are_a_heuristic_outcome(
        engine: sa.Engine, items: PreparedTransactions, kconf: dict[str, Any],
        cp: ControlPlane, bootstrap: str, topic: str, sink: str) -> None:
    parts = [participant(bootstrap, cp, items, sink, topic, 6, p, 0, {p: f"p{p}"})
             for p in range(2)]
    finish_until_the_driver_dies(coordinator(sink, engine, kconf, cp, hooks=dies_at("decided")),
                                 6, parts)
    # The decision names each participant's database transaction, read back as written.
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.in_doubt
    assert [p.database_txn for p in record.participants] == [p.database_txn for p in parts]
    # Status shows the prepared rows, whose they are and how long they hold their locks.
    straggler = participant(bootstrap, cp, items, sink, topic, 6, 2, 1, {9: "straggler"})
    assert straggler.database_txn is not None
    report = status(engine, kconf)
    (shown,) = [s for s in report.sinks if s.sink_id == sink]
    assert {t.gid: shown.prepared_is_participant(t.gid) for t in shown.prepared} == {
        **{p.database_txn.gid: True for p in parts if p.database_txn is not None},
        straggler.database_txn.gid: False}
    assert all(0 <= t.held_s() < 60 for t in shown.prepared)
    lost = parts[0].database_txn
    assert lost is not None and items.rollback(lost.gid)  # an operator, by hand
    with coordinator(sink, engine, kconf, cp) as coord:
        with pytest.raises(BatchHeuristicAbortError) as raised:
            coord.recover()
        assert [type(c) for c in raised.value.causes] == [PreparedRowsLostError]
        assert lost.gid in str(raised.value.causes[0])
        assert DecisionLog(engine).read(sink).in_doubt  # type: ignore[union-attr]
        coord.recover(acknowledge_heuristic=True)
    # The other participant is whole on both sides; the lost one's records are committed.
    assert table(engine) == [(1, "p1")]
    assert read_committed(bootstrap, topic) == encoded("p0", "p1")
    assert items.list(gid_prefix(sink)) == [] and open_in_pool(cp, sink) == []


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_crash_after_commit_prepared_is_finished_by_asking_the_transaction_id(
        engine: sa.Engine, items: PreparedTransactions, kconf: dict[str, Any],
        cp: ControlPlane, bootstrap: str, topic: str, sink: str) -> None:
    parts = [participant(bootstrap, cp, items, sink, topic, 7, p, 0, {p: f"p{p}"})
             for p in range(2)]
    # After COMMIT PREPARED and EndTxn, before the batch is marked completed.
    finish_until_the_driver_dies(coordinator(sink, engine, kconf, cp,
                                             hooks=dies_at("committed")), 7, parts)
    assert table(engine) == [(0, "p0"), (1, "p1")] and items.list(gid_prefix(sink)) == []
    assert parts[0].database_txn is not None
    assert items.commit("t", parts[0].database_txn) is Outcome.ALREADY_COMMITTED
    with coordinator(sink, engine, kconf, cp) as coord:
        done = coord.recover()
    assert done.completed_batch == 7
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.completed
    assert table(engine) == [(0, "p0"), (1, "p1")]
    assert read_committed(bootstrap, topic) == encoded("p0", "p1")
