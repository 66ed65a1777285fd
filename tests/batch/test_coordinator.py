"""BatchCoordinator (the driver side of the Spark sink) without Spark: real Kafka, real databases.

Participants are built the way a task leaves them: a TwoPhaseProducer with the pooled
transactional id prepares and is closed, so its transaction stays open at the coordinator. A
driver crash is a coordinator hook that raises; a restarted driver is a new coordinator instance.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite import Outcome, RetriableError, TwoPhaseProducer
from dualwrite.batch.coordinator import BatchCoordinator
from dualwrite.batch.decision_log import DecisionLog, StagingTable
from dualwrite.batch.target import ArrowCopy
from dualwrite.errors import BatchHeuristicAbortError
from dualwrite.participant import ControlPlane, TxnState
from tests.support.batch import Hooks, encoded, open_in_pool, prepare
from tests.support.kafka import read_committed, unique
from tests.support.tables import EVERY_BACKEND

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=EVERY_BACKEND)
def backend(request: pytest.FixtureRequest) -> str:
    """Every database; on MariaDB the decision lock's race always, the rest with
    ``--mariadb-full``."""
    return str(request.param)

class DriverCrash(Exception):
    """Raised by a phase hook: the driver dies at that point."""


def coordinator(sink: str, engine: sa.Engine, kconf: dict[str, Any], cp: ControlPlane,
                **kw: Any) -> BatchCoordinator:
    return BatchCoordinator(sink, engine, kconf, control_plane=cp, timeout_s=20, **kw)


def crash_at(phase: str) -> Any:
    def hook(name: str, _batch: int) -> None:
        if name == phase:
            raise DriverCrash(name)
    return hook


def test_finish_commits_every_participant(engine: sa.Engine, kconf: dict[str, Any],
                                          cp: ControlPlane, bootstrap: str, topic: str,
                                          sink: str) -> None:
    parts = [prepare(bootstrap, cp, sink, topic, 3, p, 0, [f"b3-p{p}-{i}" for i in range(3)])
             for p in range(3)]
    assert read_committed(bootstrap, topic) == []
    with coordinator(sink, engine, kconf, cp) as coord:
        assert coord.last_decided() is None
        timings = coord.finish(3, parts)
    assert timings is not None and timings.aborted == []
    assert read_committed(bootstrap, topic) == encoded(
        *(f"b3-p{p}-{i}" for p in range(3) for i in range(3)))
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.last_batch_id == 3 and record.completed
    assert record.completed_at is not None and record.decided_at.tzinfo is not None
    assert [p.transactional_id for p in record.participants] == [p.transactional_id
                                                                 for p in parts]
    assert open_in_pool(cp, sink) == []


def test_replayed_batch_is_skipped(engine: sa.Engine, kconf: dict[str, Any], cp: ControlPlane,
                                   bootstrap: str, topic: str, sink: str) -> None:
    sa.Table("items", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("name", sa.String(50))).create(engine)
    staging = StagingTable(engine, "items")
    staging.create()
    with coordinator(sink, engine, kconf, cp, staging=staging) as coord:
        staging.write(sink, 4, "k-first", [(1, "first")])
        first = [prepare(bootstrap, cp, sink, topic, 4, 0, 0, ["first"], attempt_key="k-first")]
        assert coord.finish(4, first) is not None
        # Spark replays batch 4 (its checkpoint lagged behind the decision): the tasks write
        # again, under the same pooled ids.
        staging.write(sink, 4, "k-replay", [(2, "replay")])
        replay = [prepare(bootstrap, cp, sink, topic, 4, 0, 0, ["replay"],
                          attempt_key="k-replay")]
        assert coord.decide(4, replay) is False
        assert coord.decide(3, replay) is False
        assert coord.finish(4, replay) is None  # skipped; its sweep aborts the replay
        assert open_in_pool(cp, sink) == []
        record = coord.last_decided()
        assert record is not None and record.last_batch_id == 4 and record.completed
        assert read_committed(bootstrap, topic) == [b"first"]
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT id, name FROM items")).all() == [(1, "first")]
        # The replay's staged rows are dropped when the sink starts again.
        assert coord.recover().purged_rows == 1
        assert staging.count(sink) == 0
        # The next batch goes through.
        nxt = [prepare(bootstrap, cp, sink, topic, 5, 1, 0, ["next"])]
        assert coord.finish(5, nxt) is not None
    assert read_committed(bootstrap, topic) == [b"first", b"next"]


def test_losers_are_aborted_by_the_sweep(engine: sa.Engine, kconf: dict[str, Any],
                                         cp: ControlPlane, bootstrap: str, topic: str,
                                         sink: str) -> None:
    loser = prepare(bootstrap, cp, sink, topic, 7, 0, 0, ["loser"])  # e.g. a lost executor
    winner = prepare(bootstrap, cp, sink, topic, 7, 0, 1, ["winner-p0"])
    other = prepare(bootstrap, cp, sink, topic, 7, 1, 0, ["winner-p1"])
    with coordinator(sink, engine, kconf, cp) as coord:
        timings = coord.finish(7, [winner, other])
    assert timings is not None and timings.aborted == [loser.transactional_id]
    assert read_committed(bootstrap, topic) == [b"winner-p0", b"winner-p1"]
    desc = cp.describe_transaction(loser.transactional_id)
    assert desc is not None and desc.state is TxnState.COMPLETE_ABORT
    assert open_in_pool(cp, sink) == []


def test_verify_rejects_a_reinitialised_participant(engine: sa.Engine, kconf: dict[str, Any],
                                                    cp: ControlPlane, bootstrap: str,
                                                    topic: str, sink: str) -> None:
    parts = [prepare(bootstrap, cp, sink, topic, 2, p, 0, [f"p{p}"]) for p in range(2)]
    # A late attempt with the same id initialises it again: that aborts participant 1.
    zombie = TwoPhaseProducer({"bootstrap.servers": bootstrap,
                               "transactional.id": parts[1].transactional_id,
                               "transaction.timeout.ms": 600_000}, control_plane=cp,
                              timeout_s=20)
    zombie.init_transactions()
    zombie.close()
    with coordinator(sink, engine, kconf, cp) as coord:
        with pytest.raises(RetriableError, match=parts[1].transactional_id):
            coord.verify(parts)
        with pytest.raises(RetriableError):
            coord.finish(2, parts)
        assert coord.last_decided() is None  # nothing decided
    assert open_in_pool(cp, sink) == []  # finish swept participant 0 too
    assert read_committed(bootstrap, topic) == []


def test_recover_commits_a_decided_batch_after_a_driver_crash(
        engine: sa.Engine, kconf: dict[str, Any], cp: ControlPlane, bootstrap: str, topic: str,
        sink: str) -> None:
    parts = [prepare(bootstrap, cp, sink, topic, 9, p, 0, [f"p{p}-a", f"p{p}-b"])
             for p in range(3)]
    loser = prepare(bootstrap, cp, sink, topic, 9, 2, 1, ["speculative"])
    crashed = coordinator(sink, engine, kconf, cp, hooks=Hooks(crash_at("decided")))
    with pytest.raises(DriverCrash):
        crashed.finish(9, parts)
    crashed.close()
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.in_doubt and record.last_batch_id == 9
    assert read_committed(bootstrap, topic) == []

    with coordinator(sink, engine, kconf, cp) as restarted:  # the driver restarted
        done = restarted.recover()
        assert done.completed_batch == 9 and done.committed == 3
        assert done.aborted == (loser.transactional_id,)
        again = restarted.recover()
        assert again.completed_batch is None and again.aborted == ()
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.completed and record.last_batch_id == 9
    assert read_committed(bootstrap, topic) == encoded(
        *(f"p{p}-{s}" for p in range(3) for s in "ab"))
    assert open_in_pool(cp, sink) == []


def test_recover_aborts_undecided_participants(engine: sa.Engine, kconf: dict[str, Any],
                                               cp: ControlPlane, bootstrap: str, topic: str,
                                               sink: str) -> None:
    with coordinator(sink, engine, kconf, cp) as coord:
        assert coord.finish(0, [prepare(bootstrap, cp, sink, topic, 0, 0, 0, ["b0"])])
    # Batch 1 was being written when the driver died: prepared, never decided.
    undecided = [prepare(bootstrap, cp, sink, topic, 1, p, 0, [f"b1-p{p}"]) for p in range(2)]
    assert open_in_pool(cp, sink) == sorted(p.transactional_id for p in undecided)

    report = dualwrite.recover(engine, kconf, timeout_s=20)  # what `dualwrite recover` runs
    assert report.ok, report.as_dict()
    [result] = report.sinks
    assert result.sink_id == sink and result.batch_id == 0 and not result.was_in_doubt
    assert result.outcome is Outcome.ABORTED
    assert sorted(result.aborted) == sorted(p.transactional_id for p in undecided)
    assert report.as_dict()["sinks"][0]["outcome"] == "aborted"
    assert open_in_pool(cp, sink) == []
    assert read_committed(bootstrap, topic) == [b"b0"]
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.last_batch_id == 0  # batch 1 is written again
    later = dualwrite.recover(engine, kconf, timeout_s=20)
    assert [(s.sink_id, s.outcome) for s in later.sinks] == [(sink, Outcome.NOTHING)]


def test_heuristic_abort_after_the_decision(engine: sa.Engine, kconf: dict[str, Any],
                                            cp: ControlPlane, bootstrap: str, topic: str,
                                            sink: str) -> None:
    parts = [prepare(bootstrap, cp, sink, topic, 12, p, 0, [f"p{p}"]) for p in range(2)]
    victim = parts[1]

    def abort_victim(name: str, _batch: int) -> None:
        if name == "decided":  # Kafka aborts it after the decision (a timeout, an operator)
            cp.end_transaction(victim.transactional_id, victim.state.producer_id,
                               victim.state.epoch, commit=False)

    with coordinator(sink, engine, kconf, cp, hooks=Hooks(abort_victim)) as coord, \
            pytest.raises(BatchHeuristicAbortError) as info:
        coord.finish(12, parts)
    assert info.value.sink_id == sink and info.value.batch_id == 12
    assert repr(sink) in str(info.value) and "batch 12" in str(info.value)
    assert [c.transactional_id for c in info.value.causes] == [victim.transactional_id]
    assert read_committed(bootstrap, topic) == [b"p0"]

    with coordinator(sink, engine, kconf, cp) as restarted, \
            pytest.raises(BatchHeuristicAbortError, match="batch 12"):
        restarted.recover()
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.in_doubt  # until acknowledged

    report = dualwrite.recover(engine, kconf, timeout_s=20)
    assert not report.ok
    [result] = report.heuristic_sinks
    assert (result.sink_id, result.batch_id, result.outcome) == (sink, 12,
                                                                 Outcome.HEURISTIC_ABORT)
    assert victim.transactional_id in result.detail
    assert DecisionLog(engine).read(sink).in_doubt  # type: ignore[union-attr]

    acked = dualwrite.recover(engine, kconf, acknowledge_heuristic=True, timeout_s=20)
    assert acked.ok
    assert [(s.batch_id, s.outcome) for s in acked.sinks] == [(12, Outcome.ACKNOWLEDGED)]
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.completed
    assert dualwrite.recover(engine, kconf, timeout_s=20).sinks[0].outcome is Outcome.NOTHING
    assert read_committed(bootstrap, topic) == [b"p0"]


def test_recover_checks_an_aborted_participant_behind_a_loser(
        engine: sa.Engine, kconf: dict[str, Any], cp: ControlPlane, bootstrap: str, topic: str,
        sink: str) -> None:
    """A loser that began earlier on the partition holds the stable offset below the winner's
    anchor: recovery must abort it before checking the anchor, or it never learns the outcome."""
    loser = prepare(bootstrap, cp, sink, topic, 4, 0, 0, ["loser"])
    winner = prepare(bootstrap, cp, sink, topic, 4, 0, 1, ["winner"])
    with coordinator(sink, engine, kconf, cp) as coord:
        assert coord.decide(4, [winner])
    cp.end_transaction(winner.transactional_id, winner.state.producer_id, winner.state.epoch,
                       commit=False)
    with BatchCoordinator(sink, engine, kconf, control_plane=cp, timeout_s=5) as restarted, \
            pytest.raises(BatchHeuristicAbortError, match="batch 4"):
        restarted.recover()
    assert open_in_pool(cp, sink) == []
    desc = cp.describe_transaction(loser.transactional_id)
    assert desc is not None and desc.state is TxnState.COMPLETE_ABORT
    assert read_committed(bootstrap, topic) == []


def test_staging_publishes_only_the_winning_attempts(engine: sa.Engine, kconf: dict[str, Any],
                                                     cp: ControlPlane, bootstrap: str,
                                                     topic: str, sink: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    sa.Table("items", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("name", sa.String(50))).create(engine)
    copies: list[str] = []
    real_copy = ArrowCopy.__init__

    def spy(self: ArrowCopy, cursor: Any, table: str, columns: Any, constants: Any = ()) -> None:
        copies.append(dict(constants)["dw_attempt"])
        real_copy(self, cursor, table, columns, constants)

    monkeypatch.setattr(ArrowCopy, "__init__", spy)
    staging = StagingTable(engine, "items")
    staging.create()
    other_sink = unique("sink-other")
    staging.write(sink, 20, "k-old", [(100, "older batch, never decided")])
    staging.write(other_sink, 21, "k-x", [(200, "another sink")])
    staging.write(sink, 21, "k-lose", [(10, "loser"), (11, "loser")])
    staging.write(sink, 21, "k-p0", [(1, "p0-a"), (2, "p0-b")])
    staging.write(sink, 21, "k-p1", [(3, "p1-a")])
    loser = prepare(bootstrap, cp, sink, topic, 21, 0, 0, ["loser"], attempt_key="k-lose")
    parts = [prepare(bootstrap, cp, sink, topic, 21, 0, 1, ["p0-a", "p0-b"], attempt_key="k-p0"),
             prepare(bootstrap, cp, sink, topic, 21, 1, 0, ["p1-a"], attempt_key="k-p1")]
    with coordinator(sink, engine, kconf, cp, staging=staging) as coord:
        timings = coord.finish(21, parts)
    assert timings is not None and timings.aborted == [loser.transactional_id]
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, name FROM items ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [(1, "p0-a"), (2, "p0-b"), (3, "p1-a")]
    assert staging.count(sink) == 0
    assert staging.count(other_sink) == 1 and staging.count() == 1
    assert read_committed(bootstrap, topic) == encoded("p0-a", "p0-b", "p1-a")
    if engine.dialect.name == "postgresql":
        assert sorted(copies) == ["k-lose", "k-old", "k-p0", "k-p1", "k-x"]
    else:
        assert copies == []


def test_a_stragglers_late_staging_is_dropped_with_its_transaction(
        engine: sa.Engine, kconf: dict[str, Any], cp: ControlPlane, bootstrap: str, topic: str,
        sink: str) -> None:
    """A losing attempt that stages (and opens a transaction) after its batch was decided and
    cleaned up: ``abort_lingering`` (the sink's close, ``dualwrite recover``) aborts the
    transaction and drops its rows; staged rows of a later, undecided batch stay."""
    sa.Table("items", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("name", sa.String(50))).create(engine)
    staging = StagingTable(engine, "items")
    staging.create()
    staging.write(sink, 5, "k-win", [(1, "winner")])
    winner = prepare(bootstrap, cp, sink, topic, 5, 0, 1, ["winner"], attempt_key="k-win")
    with coordinator(sink, engine, kconf, cp, staging=staging) as coord:
        assert coord.finish(5, [winner]) is not None
        assert staging.count(sink) == 0
        staging.write(sink, 5, "k-late", [(10, "straggler")])  # after the batch's clean-up
        late = prepare(bootstrap, cp, sink, topic, 5, 0, 0, ["straggler"], attempt_key="k-late")
        staging.write(sink, 6, "k-next", [(20, "next batch, undecided")])
        assert coord.abort_lingering() == [late.transactional_id]
    assert staging.count(sink) == 1, "the straggler's staged rows stayed"
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id FROM items_dw_staging")).scalar_one() == 20
        assert conn.execute(sa.text("SELECT id FROM items")).scalars().all() == [1]
    assert open_in_pool(cp, sink) == []
    assert read_committed(bootstrap, topic) == encoded("winner")


def test_status_shows_the_in_doubt_batch_and_lingering(engine: sa.Engine, kconf: dict[str, Any],
                                                       cp: ControlPlane, bootstrap: str,
                                                       topic: str, sink: str) -> None:
    parts = [prepare(bootstrap, cp, sink, topic, 5, p, 0, [f"p{p}"]) for p in range(2)]
    loser = prepare(bootstrap, cp, sink, topic, 5, 0, 1, ["loser"])
    hanging = f"{sink}-not-in-the-pool"
    prepare_tid = TwoPhaseProducer({"bootstrap.servers": bootstrap, "transactional.id": hanging,
                                    "linger.ms": 0, "transaction.timeout.ms": 600_000},
                                   control_plane=cp, timeout_s=20)
    prepare_tid.init_transactions()
    prepare_tid.begin_transaction()
    prepare_tid.produce(topic, b"hanging", partition=2)
    prepare_tid.prepare_transaction()
    prepare_tid.close()
    with coordinator(sink, engine, kconf, cp, hooks=Hooks(crash_at("decided"))) as coord, \
            pytest.raises(DriverCrash):
        coord.finish(5, parts)

    report = dualwrite.status(engine, kconf, prefix=sink, timeout_s=20)
    [s] = [s for s in report.sinks if s.sink_id == sink]
    assert s.in_doubt and s.last_batch_id == 5 and 0 <= s.decided_age_s() < 120
    assert [p.transactional_id for p in s.participants] == [p.transactional_id for p in parts]
    for p in s.participants:
        assert p.open_as_prepared and p.broker is not None
        assert p.broker.state is TxnState.ONGOING
    assert [d.transactional_id for d in s.lingering] == [loser.transactional_id]
    assert [h.transactional_id for h in report.hanging] == [hanging]  # the loser is the sink's
    assert report.active_transaction_open_time_max_ms > 0
    as_json = report.as_dict()["sinks"]
    assert [j["sink_id"] for j in as_json] == [sink] and as_json[0]["in_doubt"] is True

    assert dualwrite.recover(engine, kconf, timeout_s=20).ok
    after = dualwrite.status(engine, kconf, prefix=sink, timeout_s=20)
    [s] = after.sinks
    assert s.completed and s.lingering == ()
    assert all(p.broker is not None and p.broker.state is TxnState.COMPLETE_COMMIT
               and not p.open_as_prepared for p in s.participants)
    assert [h.transactional_id for h in after.hanging] == [hanging]
    cp.fence(hanging)
    assert read_committed(bootstrap, topic) == [b"p0", b"p1"]


def test_recover_and_status_without_the_batch_tables(empty_db_url: str, kconf: dict[str, Any],
                                                     cp: ControlPlane, bootstrap: str,
                                                     topic: str) -> None:
    """A state table the application made itself, without the decision log (docs/sql.md):
    recovery and status still work."""
    engine = dualwrite.create_engine(empty_db_url)
    try:
        dualwrite.writer.StateStore(engine).table.create(engine)
        assert not DecisionLog(engine).has_tables()
        tid = unique("old-schema")
        p = TwoPhaseProducer({"bootstrap.servers": bootstrap, "transactional.id": tid,
                              "linger.ms": 0, "transaction.timeout.ms": 600_000},
                             control_plane=cp, timeout_s=20)
        p.init_transactions()
        p.begin_transaction()
        p.produce(topic, b"old")
        state = p.prepare_transaction()
        p.close()
        assert dualwrite.writer.StateStore(engine).compare_and_set(tid, "", str(state))
        report = dualwrite.recover(engine, kconf, timeout_s=20)
        assert report.ok and report.sinks == ()
        assert [(r.transactional_id, r.outcome) for r in report.results] == [
            (tid, Outcome.COMMITTED)]
        assert report.as_dict()["sinks"] == []
        assert dualwrite.status(engine, kconf, prefix=tid, timeout_s=20).sinks == ()
        # Naming a sink explicitly reports that the tables are missing.
        named = dualwrite.recover(engine, kconf, sink_ids=["some-sink"], timeout_s=20)
        [failed] = named.failed_sinks
        assert "dualwrite db upgrade" in failed.detail and not named.ok
    finally:
        engine.dispose()
    assert read_committed(bootstrap, topic) == [b"old"]


def test_recover_on_a_state_table_of_an_older_revision_names_the_upgrade(
        empty_db_url: str, kconf: dict[str, Any]) -> None:
    """Revision 0003 added the fencing generation, which recovery's claims need."""
    dualwrite.upgrade_database(empty_db_url, "0002")
    with pytest.raises(dualwrite.MigrationRequiredError, match="dualwrite db upgrade"):
        dualwrite.recover(empty_db_url, kconf, timeout_s=20)


@pytest.mark.parametrize("backend", ["postgresql", "sqlite", "mariadb"], indirect=True)
def test_recover_during_a_running_batch_cannot_abort_a_verified_participant(
        engine: sa.Engine, kconf: dict[str, Any], cp: ControlPlane, bootstrap: str, topic: str,
        sink: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dualwrite recover` racing a live driver: recovery waits for the driver's decision lock,
    so it cannot abort participants between their verification and their commit."""
    first = [prepare(bootstrap, cp, sink, topic, 0, 0, 0, ["b0"])]
    with coordinator(sink, engine, kconf, cp) as coord:
        coord.finish(0, first)  # the sink now has a decision row to lock
    parts = [prepare(bootstrap, cp, sink, topic, 1, p, 0, [f"b1-p{p}"]) for p in range(2)]
    driver = coordinator(sink, engine, kconf, cp)
    real_verify = driver.verify
    verified = threading.Event()

    def slow_verify(participants: Any) -> None:
        real_verify(participants)
        verified.set()
        time.sleep(1.5)  # the window in which an unserialized recovery would abort them

    monkeypatch.setattr(driver, "verify", slow_verify)
    errors: list[BaseException] = []

    def run_driver() -> None:
        try:
            driver.finish(1, parts)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=run_driver)
    thread.start()
    assert verified.wait(30)
    with coordinator(sink, engine, kconf, cp) as recovery:
        result = recovery.recover()  # blocks until the driver's decision committed
    thread.join(60)
    driver.close()
    assert errors == []
    assert result.completed_batch in (None, 1)
    assert set(result.aborted).isdisjoint(p.transactional_id for p in parts)
    assert read_committed(bootstrap, topic) == encoded("b0", "b1-p0", "b1-p1")
    assert open_in_pool(cp, sink) == []


def test_apply_counts_the_rows_it_moves(engine: sa.Engine, sink: str) -> None:
    """The apply logs how many staged rows it moved (INSERT ... SELECT: PostgreSQL reported -1
    unless the row count is asked for) and deletes the batch's staged rows, losers' too."""
    sa.Table("items", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("name", sa.String(50))).create(engine)
    staging = StagingTable(engine, "items")
    staging.create()
    staging.write(sink, 1, "k-win", [(1, "a"), (2, "b")])
    staging.write(sink, 1, "k-lose", [(3, "c")])
    with engine.begin() as conn:
        assert StagingTable.apply(conn, sink, 1, staging.pending(["k-win"])) == 2
    assert staging.count(sink) == 0


def test_staging_failures_are_typed(engine: sa.Engine, sink: str) -> None:
    """The staging table's own statements fail with dualwrite's errors (the sink's close and
    ``dualwrite recover`` purge it), never SQLAlchemy's."""
    sa.Table("items", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("name", sa.String(50))).create(engine)
    staging = StagingTable(engine, "items")
    staging.create()
    staging.write(sink, 1, "k", [(1, "a")])
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE {staging.name}"))
    calls: list[Callable[[], object]] = [lambda: staging.purge(sink),
                                         lambda: staging.discard(sink, 1, "k"),
                                         lambda: staging.count(sink)]
    for call in calls:
        with pytest.raises(dualwrite.DualWriteError):
            call()


def test_rows_appear_at_the_apply_and_recovery_applies_them_once(
        engine: sa.Engine, kconf: dict[str, Any], cp: ControlPlane, bootstrap: str, topic: str,
        sink: str) -> None:
    """The decision does not touch the target: a driver that dies after it leaves the rows
    staged (invisible) and the batch in doubt. Sweeping lingering transactions keeps them; a
    recovery that does not know the sink's target (``dualwrite recover``) commits the records
    and moves the rows in one go; a second recovery moves nothing."""
    sa.Table("items", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("name", sa.String(50))).create(engine)
    staging = StagingTable(engine, "items")
    staging.create()
    staging.write(sink, 9, "k-win", [(1, "a"), (2, "b")])
    staging.write(sink, 9, "k-lose", [(3, "loser")])
    parts = [prepare(bootstrap, cp, sink, topic, 9, 0, 0, ["a", "b"], attempt_key="k-win")]

    def items() -> list[tuple[Any, ...]]:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text("SELECT id, name FROM items "
                                                           "ORDER BY id"))]

    with coordinator(sink, engine, kconf, cp, staging=staging,
                     hooks=Hooks(crash_at("decided"))) as driver:
        with pytest.raises(DriverCrash):
            driver.finish(9, parts)
        record = driver.last_decided()
        assert record is not None and record.in_doubt and items() == []
        driver.abort_lingering()  # the sink's close: the in-doubt batch's rows must stay
        assert staging.count(sink) == 3
    with coordinator(sink, engine, kconf, cp) as recovery:  # no staging: `dualwrite recover`
        assert recovery.recover().completed_batch == 9
        assert recovery.recover().completed_batch is None
    assert items() == [(1, "a"), (2, "b")]
    assert staging.count(sink) == 0
    assert read_committed(bootstrap, topic) == encoded("a", "b")
    assert DecisionLog(engine).mark_completed(sink, 9) == 0  # a late completer moves nothing
    assert items() == [(1, "a"), (2, "b")]


def test_a_row_the_target_refuses_keeps_the_batch_in_doubt(
        engine: sa.Engine, kconf: dict[str, Any], cp: ControlPlane, bootstrap: str, topic: str,
        sink: str) -> None:
    """The rows move after the decision, so a primary-key clash surfaces there: the batch stays
    decided and in doubt with its rows staged (never half applied) until the clash is removed."""
    sa.Table("items", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
             sa.Column("name", sa.String(50))).create(engine)
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO items VALUES (2, 'already there')"))
    staging = StagingTable(engine, "items")
    staging.create()
    staging.write(sink, 3, "k", [(1, "a"), (2, "b")])
    parts = [prepare(bootstrap, cp, sink, topic, 3, 0, 0, ["a", "b"], attempt_key="k")]
    with coordinator(sink, engine, kconf, cp, staging=staging) as driver:
        with pytest.raises(dualwrite.FatalError, match="refused its staged rows"):
            driver.finish(3, parts)
        record = driver.last_decided()
        assert record is not None and record.last_batch_id == 3 and record.in_doubt
        assert staging.count(sink) == 2
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM items WHERE id = 2"))
        assert driver.recover().completed_batch == 3
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id, name FROM items ORDER BY id")).all() == [
            (1, "a"), (2, "b")]
    assert read_committed(bootstrap, topic) == encoded("a", "b")
