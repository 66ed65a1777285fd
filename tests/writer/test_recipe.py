"""DualWriter (the KIP-939 recipe) against a real broker and real databases.

The invariant every test checks: the application rows that committed in the database are exactly
the records a read_committed consumer sees in Kafka (each row's value is also a record's value).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite import (
    BrokerUnreachableError,
    DatabaseUnreachableError,
    DualWriter,
    HeuristicAbortError,
    MigrationRequiredError,
    ProducerFencedError,
)
from dualwrite.participant import TxnState
from dualwrite.participant.completion import Outcome, complete
from dualwrite.participant.control_plane import ControlPlane
from dualwrite.writer import PhaseHooks, StateStore
from tests.support.kafka import closed_port, in_thread, read_committed, unique, wait_for
from tests.support.recipe import (
    assert_invariant,
    heuristic_state,
    kill_backend,
    kill_session_before_the_decision,
    lease_checked,
    rows,
    write,
    write_produce_first,
    writer_session,
)

pytestmark = pytest.mark.timeout(120)


# -- happy path and rollback -----------------------------------------------------------------


def test_happy_path_rows_equal_records(writers: Any, engine: sa.Engine, bootstrap: str,
                                       topic: str) -> None:
    tid = unique("recipe")
    writer = writers(engine, tid)
    assert writer.transactional_id == tid
    states = []
    for i in range(3):
        state = write(writer, topic, [f"r{i}-a", f"r{i}-b"])
        assert state is not None and not state.is_empty
        states.append(state)
    assert len(set(states)) == 3
    assert assert_invariant(engine, bootstrap, topic) == sorted(
        f"r{i}-{s}".encode() for i in range(3) for s in "ab")
    stored = StateStore(engine).read(tid)
    assert stored is not None and stored.prepared_txn_state == str(states[-1])
    # A transaction that writes rows only has an empty state and commits fine.
    with writer.transaction() as tx:
        tx.connection.execute(sa.text("INSERT INTO app_rows (value) VALUES ('db-only')"))
    assert tx.state is not None and tx.state.is_empty
    assert b"db-only" in rows(engine)


def test_body_exception_rolls_back_both(writers: Any, engine: sa.Engine, bootstrap: str,
                                        topic: str) -> None:
    writer = writers(engine, unique("recipe-rb"))
    write(writer, topic, ["before"])

    class Boom(Exception):
        pass

    with pytest.raises(Boom), writer.transaction() as tx:
        tx.connection.execute(sa.text("INSERT INTO app_rows (value) VALUES ('doomed')"))
        tx.produce(topic, b"doomed")
        raise Boom
    write(writer, topic, ["after"])
    assert assert_invariant(engine, bootstrap, topic) == [b"after", b"before"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_failed_abort_does_not_wedge_the_writer(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The body fails and the abort fails too (as librdkafka's EndTxn can on a busy coordinator):
    the open transaction is left to the next transaction's new session, which aborts it."""
    tid = unique("recipe-abort")
    writer = writers(engine, tid)
    write(writer, topic, ["before"])
    old = writer.producer

    def failing_abort() -> None:
        old._phase = old._phase.FAILED  # what a failed abort leaves behind
        raise dualwrite.RecoverableError("abort_transaction: INVALID_TXN_STATE (simulated)")

    monkeypatch.setattr(old, "abort_transaction", failing_abort)
    with ControlPlane({"bootstrap.servers": bootstrap}) as cp:
        with pytest.raises(ZeroDivisionError), writer.transaction() as tx:
            tx.produce(topic, b"doomed", key=b"doomed")
            wait_for(lambda: _in_the_log(cp, tid), 10, what="the doomed record in the log")
            _ = 1 / 0
        desc = cp.describe_transaction(tid)
        assert desc is not None and desc.state is TxnState.ONGOING  # left open
        write(writer, topic, ["after"])
        assert writer.producer is not old
        desc = cp.describe_transaction(tid)
        assert desc is not None and desc.state is not TxnState.ONGOING
    assert assert_invariant(engine, bootstrap, topic) == [b"after", b"before"]


def test_records_leave_at_once_unless_linger_is_configured(sqlite_url: str) -> None:
    """linger.ms defaults to 0 so that records are in flight while the block writes its rows."""
    engine = dualwrite.create_engine(sqlite_url)
    default = DualWriter(engine, {"bootstrap.servers": "127.0.0.1:1"}, transactional_id="a")
    chosen = DualWriter(engine, {"bootstrap.servers": "127.0.0.1:1", "linger.ms": 7},
                        transactional_id="b")
    assert default._settings.kafka_config["linger.ms"] == 0
    assert chosen._settings.kafka_config["linger.ms"] == 7
    default.close()
    chosen.close()
    engine.dispose()


def test_missing_migrations(empty_db_url: str, writers: Any) -> None:
    engine = dualwrite.create_engine(empty_db_url)
    try:
        writer = writers(engine, unique("recipe-nomig"))
        with pytest.raises(MigrationRequiredError, match="dualwrite db upgrade"), \
                writer.transaction():
            pytest.fail("the body must not run without the state table")
    finally:
        engine.dispose()


def test_broker_down_fails_fast(sqlite_url: str) -> None:
    dualwrite.upgrade_database(sqlite_url)
    config = {"bootstrap.servers": f"127.0.0.1:{closed_port()}"}
    writer = DualWriter(sqlite_url, config, transactional_id=unique("recipe-down"), timeout_s=3)
    started = time.monotonic()
    try:
        with pytest.raises(BrokerUnreachableError), writer.transaction():
            pytest.fail("the body must not run without a broker")
    finally:
        writer.close()
    assert time.monotonic() - started < 15


# -- concurrency ------------------------------------------------------------------------------


def run_two_writers(writers: Any, db_url: str, topic: str, tid: str, per_writer: int = 6
                    ) -> dict[str, list[Any]]:
    """Two DualWriters (own engines, own threads) on one transactional id, started together.

    Each writes ``per_writer`` transactions (row + record "<name><i>") and stops at its first
    error, as an application must once fenced. Returns "ok" or the exception, per writer.
    """
    outcomes: dict[str, list[Any]] = {"A": [], "B": []}
    start = threading.Barrier(2)

    def run(name: str) -> None:
        own_engine = dualwrite.create_engine(db_url)
        writer = writers(own_engine, tid, take_over=True)  # two live writers, on purpose
        start.wait()
        try:
            for i in range(per_writer):
                try:
                    write(writer, topic, [f"{name}{i}"])
                    outcomes[name].append("ok")
                except Exception as exc:
                    outcomes[name].append(exc)
                    break
        finally:
            own_engine.dispose()

    threads = [threading.Thread(target=run, args=(n,)) for n in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not any(t.is_alive() for t in threads)
    return outcomes


def test_two_writers_one_transactional_id_keep_invariant(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str, db_url: str) -> None:
    """The row lock serializes the two writers and fencing stops a stale one; whatever the
    interleaving, rows and records agree once recovery finished the last in-doubt state."""
    tid = unique("recipe-two")
    outcomes = run_two_writers(writers, db_url, topic, tid)
    assert sum(o == "ok" for outs in outcomes.values() for o in outs) >= 6, outcomes
    report = dualwrite.recover(engine, {"bootstrap.servers": bootstrap}, [tid], timeout_s=20)
    assert report.ok, report.as_dict()
    committed = assert_invariant(engine, bootstrap, topic)
    oks = {f"{n}{i}".encode() for n, outs in outcomes.items()
           for i, o in enumerate(outs) if o == "ok"}
    assert oks <= set(committed)  # every transaction that returned normally is in both


def test_two_writers_one_transactional_id_stale_one_is_fenced(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str, db_url: str) -> None:
    tid = unique("recipe-two-fenced")
    outcomes = run_two_writers(writers, db_url, topic, tid)
    failures = [o for outs in outcomes.values() for o in outs if o != "ok"]
    assert all(isinstance(f, ProducerFencedError) for f in failures), failures


# -- database connection lost during COMMIT (PostgreSQL) ------------------------------------


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_connection_killed_before_commit_resolves_by_asking_db(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str, db_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """pg_terminate_backend of the writer's own session right before the state row and COMMIT
    (one pipelined round trip) go out: they fail, the writer asks the database (which did not
    commit) and aborts Kafka: neither side."""
    writer = writers(engine, unique("recipe-kill"))
    write(writer, topic, ["kept"])
    killed = kill_session_before_the_decision(monkeypatch, db_url)
    # Issue 10: the application gets the typed error (chained from the driver's), not the raw
    # sa.exc.DBAPIError that used to escape.
    with pytest.raises(DatabaseUnreachableError) as failed:
        write(writer, topic, ["lost-1", "lost-2"])
    cause = failed.value.__cause__
    assert killed and isinstance(cause, sa.exc.DBAPIError) and cause.connection_invalidated
    monkeypatch.undo()
    # The writer carries on with a new connection.
    write(writer, topic, ["next"])
    assert assert_invariant(engine, bootstrap, topic) == [b"kept", b"next"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_connection_lost_while_idle_is_replaced(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str, db_url: str) -> None:
    """The writer keeps its connection between transactions; when the server dropped it
    meanwhile, the next transaction reconnects before anything happened and goes through."""
    writer = writers(engine, unique("recipe-idle"))
    write(writer, topic, ["first"])
    held = writer_session(engine, writer)
    assert held is not None
    kill_backend(db_url, held)
    write(writer, topic, ["second"])
    assert writer_session(engine, writer) != held
    assert assert_invariant(engine, bootstrap, topic) == [b"first", b"second"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_commit_error_after_db_committed_still_commits_kafka(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The COMMIT reached the database but the answer was lost (simulated): the writer asks the
    database, learns it committed, and commits Kafka: both sides."""
    writer = writers(engine, unique("recipe-lostack"))
    real = StateStore.write_and_commit
    armed = {"on": True}

    def commit_then_lose_answer(self: StateStore, conn: sa.Connection, tid: str,
                                state: str) -> None:
        real(self, conn, tid, state)
        if armed["on"]:
            armed["on"] = False
            raise sa.exc.OperationalError("COMMIT", None, psycopg.OperationalError(
                "server closed the connection unexpectedly"))

    monkeypatch.setattr(StateStore, "write_and_commit", commit_then_lose_answer)
    write(writer, topic, ["acked-late"])  # no exception: the outcome was resolved
    assert not armed["on"]
    monkeypatch.undo()
    write(writer, topic, ["next"])
    assert assert_invariant(engine, bootstrap, topic) == [b"acked-late", b"next"]


# -- heuristic abort --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_heuristic_abort_stops_writer_without_hook(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    tid = unique("recipe-heur")
    state = heuristic_state(writers, engine, bootstrap, topic, tid, monkeypatch)
    strict = writers(engine, tid)
    for _ in range(2):  # it refuses every time, and writes nothing
        with pytest.raises(HeuristicAbortError) as info, strict.transaction():
            pytest.fail("the body must not run after a heuristic abort")
        assert info.value.transactional_id == tid
        assert info.value.state == state
    assert rows(engine) == [b"h1", b"h2"]
    assert read_committed(bootstrap, topic) == []  # Kafka lost them: the heuristic outcome
    stored = StateStore(engine).read(tid)
    assert stored is not None and stored.prepared_txn_state == state  # left for an operator


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_heuristic_abort_hook_called_and_writer_continues(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    tid = unique("recipe-hook")
    state = heuristic_state(writers, engine, bootstrap, topic, tid, monkeypatch)
    calls: list[tuple[HeuristicAbortError, list[str]]] = []

    def hook(exc: HeuristicAbortError, conn: sa.Connection) -> None:
        assert conn.in_transaction()
        seen = sorted(conn.exec_driver_sql("SELECT value FROM app_rows").scalars())
        calls.append((exc, seen))

    tolerant = writers(engine, tid, on_heuristic_abort=hook)
    write(tolerant, topic, ["after"])
    assert len(calls) == 1
    exc, seen = calls[0]
    assert isinstance(exc, HeuristicAbortError)
    assert exc.transactional_id == tid and exc.state == state
    assert seen == ["h1", "h2"]  # the hook can re-publish from these rows
    write(tolerant, topic, ["after2"])
    assert len(calls) == 1  # resolved: not called again
    assert read_committed(bootstrap, topic) == [b"after", b"after2"]
    assert rows(engine) == [b"after", b"after2", b"h1", b"h2"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_heuristic_abort_between_the_two_commits_is_reported_then_hooked(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker aborts a transaction after the database committed it and before Kafka's commit
    (it outlived transaction.timeout.ms in between): the block raises HeuristicAbortError, and the
    same writer's next transaction hands the loss to the hook, then goes on."""
    calls: list[HeuristicAbortError] = []
    tid = unique("recipe-late")
    writer = writers(engine, tid, {"transaction.timeout.ms": 2000},
                     on_heuristic_abort=lambda exc, conn: calls.append(exc))
    write(writer, topic, ["before"])
    producer = writer.producer
    real_commit = producer.commit_transaction

    def late_commit() -> None:
        with ControlPlane({"bootstrap.servers": bootstrap}, timeout_s=10) as cp:
            wait_for(lambda: (d := cp.describe_transaction(tid)) is not None
                     and d.state is TxnState.COMPLETE_ABORT, 20, interval_s=0.25,
                     what="the broker to abort the timed-out transaction")
        real_commit()

    monkeypatch.setattr(producer, "commit_transaction", late_commit)
    with pytest.raises(HeuristicAbortError) as lost:
        write(writer, topic, ["late"])
    monkeypatch.undo()
    assert lost.value.transactional_id == tid and calls == []
    write(writer, topic, ["after"])
    assert [c.state for c in calls] == [lost.value.state]
    assert rows(engine) == [b"after", b"before", b"late"]
    assert read_committed(bootstrap, topic) == [b"after", b"before"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_coordinator_check_runs_only_when_the_transaction_is_old(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """verify="auto": a young transaction needs no coordinator round trip (nothing but a
    writer waiting for our state-row lock, or the broker timeout, can end it); one open for more
    than half its timeout is checked, and a timed-out one is caught before the database commit."""
    calls: list[str] = []
    real = dualwrite.TwoPhaseProducer.verify_prepared

    def counting(self: dualwrite.TwoPhaseProducer) -> None:
        calls.append(self.transactional_id)
        real(self)

    monkeypatch.setattr(dualwrite.TwoPhaseProducer, "verify_prepared", counting)
    writer = writers(engine, unique("auto"), {"transaction.timeout.ms": 4000})
    write(writer, topic, ["young"])
    assert calls == []
    with writer.transaction() as tx:
        tx.connection.execute(sa.text("INSERT INTO app_rows (value) VALUES ('old')"))
        tx.produce(topic, b"old", key=b"old")
        time.sleep(2.5)
    assert len(calls) == 1
    with pytest.raises(dualwrite.DualWriteError), writer.transaction() as tx:
        tx.connection.execute(sa.text("INSERT INTO app_rows (value) VALUES ('expired')"))
        tx.produce(topic, b"expired", key=b"expired")
        time.sleep(7)  # the broker aborts it (cleanup interval 1 s)
    assert len(calls) == 2
    assert assert_invariant(engine, bootstrap, topic) == [b"old", b"young"]
    always = writers(engine, unique("always"), verify="always")
    write(always, topic, ["checked"])
    assert len(calls) == 3


# -- the lock taken after the first record ----------------------------------------------------


def _in_the_log(cp: ControlPlane, tid: str) -> bool:
    """The open transaction of ``tid`` has a record in a partition's log."""
    desc = cp.describe_transaction(tid)
    if desc is None or desc.state is not TxnState.ONGOING or not desc.partitions:
        return False
    return any(p.producer_id == desc.producer_id and p.current_txn_start_offset is not None
               for ps in cp.describe_producers(desc.partitions).values() for p in ps)


def test_lock_waits_for_the_first_record_once_the_session_is_established(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    took: list[int] = []

    class Spy(PhaseHooks):
        def before_late_lock(self, records_sent: int) -> None:
            took.append(records_sent)

    writer = writers(engine, unique("ahead"), hooks=Spy())
    for i in range(4):
        write_produce_first(writer, topic, f"v{i}")
    # The first transaction of a session locks first (it claims the id and finishes what is in
    # doubt); the later ones lock right after their first record left.
    assert took == [1, 1, 1]
    write(writer, topic, ["rows-first"])  # no record yet: locks at the first use of the database
    assert took[-1] == 0
    with writer.transaction():
        pass  # neither: locks at the end of the block
    assert took[-1] == 0 and len(took) == 5
    # A block failing after its record aborts it. (On a busy coordinator librdkafka's abort can
    # fail; the next transaction's new session then aborts it.)
    with pytest.raises(ZeroDivisionError), writer.transaction() as tx:
        tx.produce(topic, b"never", key=b"k")
        _ = 1 / 0
    write_produce_first(writer, topic, "after")
    assert assert_invariant(engine, bootstrap, topic) == [
        b"after", b"rows-first", b"v0", b"v1", b"v2", b"v3"]
    row = StateStore(engine).read(writer.transactional_id)
    assert row is not None and row.fencing_generation == 1


def _write_while_the_lock_is_held(writer: DualWriter, topic: str, value: str
                                  ) -> tuple[threading.Thread, list[BaseException]]:
    """Start a produce-first dual write in a thread; its lock waits for whoever holds it."""
    return in_thread(write_produce_first, writer, topic, value)


def test_recovery_acting_before_the_lock_is_granted_makes_the_writer_start_over(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Recovery claims the id and, holding its lock, aborts the open transaction whose record
    already reached the log. The writer sees the claim under the lock, aborts, claims again and
    sends its record again: nothing lost, nothing doubled."""
    tid = unique("ahead-rec")
    writer = writers(engine, tid)
    write_produce_first(writer, topic, "first")
    lease_checked(writer)
    store = StateStore(engine)
    config = {"bootstrap.servers": bootstrap}
    stored = store.read(tid)
    assert stored is not None
    store.claim([tid])  # what recovery does before it acts
    with ControlPlane(config) as cp, engine.connect() as recovery:
        recovery.begin()
        store.lock_row(recovery, tid)
        thread, errors = _write_while_the_lock_is_held(writer, topic, "raced")
        wait_for(lambda: _in_the_log(cp, tid), 10, what="the raced record in the log")
        ended = complete(cp, config, tid,
                         dualwrite.PreparedTxnState.parse(stored.prepared_txn_state))
        assert ended is Outcome.ABORTED  # the writer's open transaction
        recovery.commit()
        thread.join(30)
        assert not thread.is_alive() and errors == []
        desc = cp.describe_transaction(tid)
        assert desc is not None and desc.state is not TxnState.ONGOING
    assert "starting the transaction over" in caplog.text
    assert assert_invariant(engine, bootstrap, topic) == [b"first", b"raced"]
    write_produce_first(writer, topic, "later")
    assert assert_invariant(engine, bootstrap, topic) == [b"first", b"later", b"raced"]


def test_a_new_producer_fencing_before_the_lock_is_granted_stops_the_old_writer(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """A new session of the id claims it and fences the old writer, whose record is already in
    the log: the old writer stops with ProducerFencedError and nothing of it commits."""
    from confluent_kafka import Producer

    tid = unique("ahead-fence")
    writer = writers(engine, tid)
    write_produce_first(writer, topic, "first")
    lease_checked(writer)
    store = StateStore(engine)
    store.claim([tid])  # the new session's claim
    with ControlPlane({"bootstrap.servers": bootstrap}) as cp, engine.connect() as newcomer:
        newcomer.begin()
        store.lock_row(newcomer, tid)
        thread, errors = _write_while_the_lock_is_held(writer, topic, "zombie")
        wait_for(lambda: _in_the_log(cp, tid), 10, what="the zombie record in the log")
        fencer = Producer({"bootstrap.servers": bootstrap, "transactional.id": tid})
        fencer.init_transactions(20)  # aborts the open transaction, bumps the epoch
        newcomer.commit()
        thread.join(30)
        assert not thread.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], ProducerFencedError), errors
        del fencer
    assert assert_invariant(engine, bootstrap, topic) == [b"first"]


def test_recovery_running_beside_a_writer_keeps_the_invariant(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """recover() in a loop while a writer takes its locks late: whatever the interleaving, the
    writer never fails and rows equal records."""
    tid = unique("ahead-loop")
    writer = writers(engine, tid)
    stop = threading.Event()
    reports: list[Any] = []

    def recover_loop() -> None:
        while not stop.is_set():
            reports.append(dualwrite.recover(engine, {"bootstrap.servers": bootstrap}, [tid],
                                             timeout_s=20))

    thread = threading.Thread(target=recover_loop)
    thread.start()
    try:
        deadline = time.monotonic() + 5
        written = 0
        while time.monotonic() < deadline:
            write_produce_first(writer, topic, f"w{written}")
            written += 1
    finally:
        stop.set()
        thread.join(60)
    assert written > 10 and len(reports) > 3
    assert all(r.ok or r.failed[0].detail.startswith("a writer of this transactional id")
               for r in reports), [r.as_dict() for r in reports if not r.ok]
    committed = assert_invariant(engine, bootstrap, topic)
    assert committed == sorted(f"w{i}".encode() for i in range(written))
