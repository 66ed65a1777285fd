"""The batch sink's protocol holes (issue 9), each reproduced on the real broker and databases.

- a retriable error after the decision must never make the sink write the batch again (its
  tasks would re-initialise the pooled ids and abort the decided participants);
- a decision whose COMMIT is still in flight when the client loses the connection is asked about
  under the sink's lock, which waits for that COMMIT (a real slow COMMIT, a real cut socket);
- `dualwrite recover` beside a running driver deciding the sink's first batch;
- one unreadable participant row fails its own sink only.

Faults go through documented seams: ``CoordinatorHooks``, a wrapped ``verify`` (the
window under the decision lock), a PostgreSQL trigger that makes COMMIT slow, and a socket shut
down from the client side.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite import Outcome, RetriableError
from dualwrite.batch.coordinator import BatchCoordinator
from dualwrite.batch.decision_log import DecisionLog, Participant
from dualwrite.errors import (
    BrokerUnreachableError,
    DualWriteError,
    OutcomeUnknownError,
    RecoverableError,
)
from dualwrite.participant import ControlPlane
from tests.support.batch import Hooks, encoded, open_in_pool, prepare
from tests.support.kafka import read_committed, unique

pytestmark = pytest.mark.timeout(180)


def values(batch: int, partition: int) -> list[str]:
    return [f"b{batch}-p{partition}-{i}" for i in range(2)]


def write_tasks(bootstrap: str, cp: ControlPlane, sink: str, topic: str,
                batch: int) -> list[Participant]:
    """One run of a batch's tasks: attempt 0 of partitions 0..2 (a re-run reuses the ids)."""
    return [prepare(bootstrap, cp, sink, topic, batch, p, 0, values(batch, p)) for p in range(3)]


def all_values(*batches: int) -> list[bytes]:
    return encoded(*(v for b in batches for p in range(3) for v in values(b, p)))


def sink_loop(coord: BatchCoordinator, batch: int, tasks: Callable[[], list[Participant]],
              attempts: int = 3) -> tuple[int, BaseException | None]:
    """What ``ExactlyOnceSink`` does with one batch: run the tasks, finish, and run them again
    only on a :class:`RetriableError`. Returns (task runs, the error that ended it)."""
    for run in range(1, attempts + 1):
        parts = tasks()
        try:
            coord.finish(batch, parts)
            return run, None
        except RetriableError as exc:
            if run == attempts:
                return run, exc
        except DualWriteError as exc:
            return run, exc
    raise AssertionError("unreachable")


def broker_down_at(phase: str, batch: int, times: int) -> Callable[[str, int], None]:
    """A hook: the broker is unreachable at ``phase`` of ``batch``, ``times`` times."""
    left = [times]

    def hook(name: str, batch_id: int) -> None:
        if name == phase and batch_id == batch and left[0] > 0:
            left[0] -= 1
            raise BrokerUnreachableError("injected: broker restarting during the commit phase")
    return hook


def after_verify(coord: BatchCoordinator, action: Callable[[], None]) -> None:
    """Run ``action`` right after the driver verified, under its decision lock."""
    real = coord.verify

    def verify(participants: Any) -> None:
        real(participants)
        action()

    coord.verify = verify  # type: ignore[method-assign]


# -- 1. after the decision, nothing re-runs the batch -----------------------------------------


def test_a_broker_error_during_the_commit_does_not_write_the_batch_again(
        engine: sa.Engine, kconf: dict[str, Any], cp: ControlPlane, bootstrap: str, topic: str,
        sink: str) -> None:
    """Batch 0 is decided; the broker drops out after its first participant committed. Writing
    the batch again would re-initialise the pooled ids (aborting the decided participants) and
    the new decision would be refused as a replay: rows published, records lost."""
    hooks = Hooks(broker_down_at("committed-one", 0, times=1))
    with BatchCoordinator(sink, engine, kconf, control_plane=cp, timeout_s=20,
                          hooks=hooks) as coord:
        runs, error = sink_loop(coord, 0, lambda: write_tasks(bootstrap, cp, sink, topic, 0))
    assert read_committed(bootstrap, topic) == all_values(0)  # the decided batch's records
    assert (runs, error) == (1, None)  # completed in place, the tasks ran once
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.last_batch_id == 0 and record.completed
    assert open_in_pool(cp, sink) == []


def test_a_batch_left_in_doubt_is_completed_before_the_next_is_decided(
        engine: sa.Engine, kconf: dict[str, Any], cp: ControlPlane, bootstrap: str, topic: str,
        sink: str) -> None:
    """The broker stays away past the completion budget: the error must not be retriable, and
    batch 1's decision must commit batch 0's participants first instead of overwriting it (and
    sweeping its still-open participants as losers)."""
    hooks = Hooks(broker_down_at("committed-one", 0, times=1000))
    with BatchCoordinator(sink, engine, kconf, control_plane=cp, timeout_s=2,
                          hooks=hooks) as coord:
        started = time.monotonic()
        runs, error = sink_loop(coord, 0, lambda: write_tasks(bootstrap, cp, sink, topic, 0))
        gave_up_s = time.monotonic() - started
        record = DecisionLog(engine).read(sink)
        assert record is not None and record.in_doubt and record.last_batch_id == 0
        hooks.on = None  # the broker is back; Spark goes on with batch 1
        assert coord.finish(1, write_tasks(bootstrap, cp, sink, topic, 1)) is not None
    assert read_committed(bootstrap, topic) == all_values(0, 1)
    assert runs == 1 and isinstance(error, RecoverableError), error
    assert "do not write it again" in str(error) and gave_up_s < 10
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.last_batch_id == 1 and record.completed
    assert open_in_pool(cp, sink) == []


def test_a_replay_of_an_in_doubt_batch_completes_it(
        engine: sa.Engine, kconf: dict[str, Any], cp: ControlPlane, bootstrap: str, topic: str,
        sink: str) -> None:
    """The query failed with batch 0 in doubt and restarts in the same process: Spark replays
    batch 0, which must be completed, neither written again nor skipped blindly."""
    hooks = Hooks(broker_down_at("decided", 0, times=1000))
    with BatchCoordinator(sink, engine, kconf, control_plane=cp, timeout_s=1,
                          hooks=hooks) as coord:
        with pytest.raises(RecoverableError):
            coord.finish(0, write_tasks(bootstrap, cp, sink, topic, 0))
        hooks.on = None
        assert coord.should_write(0) is False  # the replay: completed, then skipped
        assert coord.should_write(1) is True
    assert read_committed(bootstrap, topic) == all_values(0)
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.completed
    assert open_in_pool(cp, sink) == []


# -- 2. an unknown COMMIT of the decision is asked about under the lock ------------------------


def slow_commit(engine: sa.Engine, seconds: float) -> None:
    """Make the COMMIT of a sink's first decision take ``seconds`` on the server (a deferred
    constraint trigger: what a slow fsync or synchronous replication does)."""
    with engine.begin() as conn:
        conn.exec_driver_sql(f"""
CREATE FUNCTION dw_test_slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep({seconds}); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER dw_test_slow_commit AFTER INSERT ON dualwrite_batch_sink
DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION dw_test_slow_commit();
""")


def cut_the_decision(engine: sa.Engine, coord: BatchCoordinator, after_s: float) -> list[float]:
    """Shut the decision's socket down from the client side ``after_s`` into its COMMIT; the
    returned list gets the time of the cut."""
    armed: list[threading.Thread] = []
    cuts: list[float] = []

    @sa.event.listens_for(engine, "commit")
    def cut_while_committing(conn: sa.Connection) -> None:
        if not armed or armed[0] is not threading.current_thread():
            return
        armed.clear()
        fd = os.dup(conn.connection.dbapi_connection.pgconn.socket)  # type: ignore[union-attr]

        def cut() -> None:
            time.sleep(after_s)
            with socket.socket(fileno=fd) as sock:
                sock.shutdown(socket.SHUT_RDWR)
            cuts.append(time.monotonic())
        threading.Thread(target=cut, daemon=True).start()

    after_verify(coord, lambda: armed.append(threading.current_thread()))
    return cuts


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_decision_whose_commit_was_cut_off_in_flight_is_committed(
        engine: sa.Engine, kconf: dict[str, Any], cp: ControlPlane, bootstrap: str, topic: str,
        sink: str) -> None:
    """The decision's COMMIT takes 2 s on the server; 0.5 s in, the client's socket is shut
    down. The server still commits. Asking with a plain SELECT reads "not decided", aborts the
    participants, and then the decision lands: a decided batch with aborted participants.
    Asked under the lock, the answer waits for the COMMIT."""
    slow_commit(engine, 2)
    parts = write_tasks(bootstrap, cp, sink, topic, 0)
    with BatchCoordinator(sink, engine, kconf, control_plane=cp, timeout_s=20) as coord:
        cuts = cut_the_decision(engine, coord, 0.5)
        started = time.monotonic()
        error: BaseException | None = None
        try:
            coord.finish(0, parts)
        except DualWriteError as exc:
            error = exc
        elapsed = time.monotonic() - started
    assert cuts, "the decision's connection was not cut"
    time.sleep(2.5)  # whatever COMMIT was in flight has ended on the server
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.last_batch_id == 0  # the server committed it
    assert read_committed(bootstrap, topic) == all_values(0)  # ... and so did Kafka
    assert error is None and elapsed > 1.5, (error, elapsed)  # it waited for the COMMIT
    assert DecisionLog(engine).read(sink).completed  # type: ignore[union-attr]
    assert open_in_pool(cp, sink) == []


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_decision_that_cannot_be_asked_about_is_left_to_recovery(
        engine: sa.Engine, kconf: dict[str, Any], cp: ControlPlane, bootstrap: str, topic: str,
        sink: str) -> None:
    """The cut-off COMMIT hangs longer than the lock timeout (1 s): the driver cannot tell,
    raises a typed, non-retriable error and aborts nothing; once the COMMIT landed, recovery
    commits the batch as the database decided."""
    slow_commit(engine, 4)
    parts = write_tasks(bootstrap, cp, sink, topic, 0)
    with BatchCoordinator(sink, engine, kconf, control_plane=cp, timeout_s=1) as coord:
        cuts = cut_the_decision(engine, coord, 0.3)
        with pytest.raises(DualWriteError) as info:
            coord.finish(0, parts)
        still_open = open_in_pool(cp, sink)
    assert cuts, "the decision's connection was not cut"
    time.sleep(4.5)  # the COMMIT lands on the server
    record = DecisionLog(engine).read(sink)
    assert record is not None and record.last_batch_id == 0 and record.in_doubt
    report = dualwrite.recover(engine, kconf, sink_ids=[sink], timeout_s=20)
    assert read_committed(bootstrap, topic) == all_values(0)
    assert still_open == sorted(p.transactional_id for p in parts)  # nothing was aborted
    assert isinstance(info.value, OutcomeUnknownError), info.value
    assert not isinstance(info.value, RetriableError)
    assert report.ok and [s.outcome for s in report.sinks] == [Outcome.COMMITTED]
    assert open_in_pool(cp, sink) == []


# -- 3. recover beside a running driver, first batch -------------------------------------------


def test_recover_beside_a_driver_deciding_the_first_batch(
        engine: sa.Engine, db_url: str, kconf: dict[str, Any], cp: ControlPlane, bootstrap: str,
        topic: str, sink: str) -> None:
    """Batch 0 has no decision row to lock yet. `dualwrite recover` runs while the driver holds
    its verified participants under the decision lock; it must wait for the decision and keep
    them, never abort them (which turns the decided batch into a heuristic abort)."""
    parts = write_tasks(bootstrap, cp, sink, topic, 0)
    verified = threading.Event()
    driver = BatchCoordinator(sink, engine, kconf, control_plane=cp, timeout_s=20)

    def hold_after_verify() -> None:
        verified.set()
        time.sleep(2.0)  # the window in which an unserialized sweep aborts them

    after_verify(driver, hold_after_verify)
    errors: list[BaseException] = []

    def run_driver() -> None:
        try:
            driver.finish(0, parts)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=run_driver)
    thread.start()
    try:
        assert verified.wait(30)
        started = time.monotonic()
        report = dualwrite.recover(db_url, kconf, sink_ids=[sink], timeout_s=20)
        waited = time.monotonic() - started
    finally:
        thread.join(60)
        driver.close()
    assert read_committed(bootstrap, topic) == all_values(0)  # the decided batch's records
    assert errors == []
    assert report.ok, report.as_dict()
    [result] = report.sinks
    assert set(result.aborted).isdisjoint(p.transactional_id for p in parts)
    assert waited > 1.0  # it waited for the decision lock
    assert open_in_pool(cp, sink) == []


# -- 4. one unreadable row fails its own sink only ---------------------------------------------


def test_an_unreadable_participant_row_fails_only_its_sink(
        engine: sa.Engine, kconf: dict[str, Any], cp: ControlPlane, bootstrap: str, topic: str,
        sink: str) -> None:
    broken = unique("broken")
    good_parts = [prepare(bootstrap, cp, sink, topic, 0, 0, 0, ["good"])]
    bad_parts = [prepare(bootstrap, cp, broken, topic, 0, 1, 0, ["bad"])]
    for name, parts in ((sink, good_parts), (broken, bad_parts)):
        assert DecisionLog(engine).decide(name, 0, parts)  # decided, then the driver died
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE dualwrite_batch_participant SET prepared_txn_state = "
                             f"'not-a-state' WHERE sink_id = '{broken}'")
    try:
        report = dualwrite.recover(engine, kconf, timeout_s=20)
        by_sink = {s.sink_id: s for s in report.sinks}
        assert by_sink[sink].outcome is Outcome.COMMITTED
        assert by_sink[broken].outcome is Outcome.FAILED
        assert "not-a-state" in by_sink[broken].detail and not report.ok
        record = DecisionLog(engine).read(broken)
        assert record is not None and record.invalid is not None and record.in_doubt
    finally:
        with BatchCoordinator(broken, engine, kconf, control_plane=cp, timeout_s=20) as coord:
            coord.sweep(keep=())
    assert open_in_pool(cp, sink) == [] and open_in_pool(cp, broken) == []
    assert read_committed(bootstrap, topic) == [b"good"]


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_slow_broker_under_the_decision_lock_does_not_block_other_sqlite_writers(
        engine: sa.Engine, db_url: str, kconf: dict[str, Any], cp: ControlPlane, bootstrap: str,
        topic: str, sink: str) -> None:
    """Recovery works under the sink's decision lock, talking to Kafka. On SQLite that lock must
    not be the database-wide write lock: another writer (busy timeout 1 s) writes at once while
    the broker takes 3 s to answer, and a second recovery of the sink gets a typed timeout."""
    parts = write_tasks(bootstrap, cp, sink, topic, 0)
    assert DecisionLog(engine).decide(sink, 0, parts)  # decided, then the driver died
    in_kafka = threading.Event()
    with ControlPlane(kconf, timeout_s=20) as slow:
        real_list = slow.list_transactions

        def slow_list(*args: Any, **kw: Any) -> Any:
            in_kafka.set()
            time.sleep(3.0)  # a slow broker
            return real_list(*args, **kw)

        slow.list_transactions = slow_list  # type: ignore[method-assign]
        results: list[Any] = []
        recovery = threading.Thread(target=lambda: results.append(BatchCoordinator(
            sink, engine, kconf, control_plane=slow, timeout_s=20).recover()))
        recovery.start()
        try:
            assert in_kafka.wait(30)
            other = dualwrite.create_engine(db_url, connect_args={"timeout": 1})
            started = time.monotonic()
            blocked: Exception | None = None
            try:
                with other.begin() as conn:
                    conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS app_rows (x INTEGER)")
                    conn.exec_driver_sql("INSERT INTO app_rows VALUES (1)")
            except sa.exc.OperationalError as exc:
                blocked = exc
            wrote_s = time.monotonic() - started
            other.dispose()
            second_error: BaseException | None = None
            started = time.monotonic()
            try:
                with BatchCoordinator(sink, engine, kconf, control_plane=cp,
                                      timeout_s=1) as second:
                    second.recover()
            except DualWriteError as exc:
                second_error = exc
            second_s = time.monotonic() - started
        finally:
            recovery.join(60)
    assert blocked is None and wrote_s < 1.0, (blocked, wrote_s)
    assert isinstance(second_error, dualwrite.LockTimeoutError), (second_error, second_s)
    assert second_s < 2.5
    assert results and results[0].completed_batch == 0
    assert read_committed(bootstrap, topic) == all_values(0)
    assert open_in_pool(cp, sink) == []
