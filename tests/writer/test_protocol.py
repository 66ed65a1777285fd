"""Issue 9's writer-side interleavings, each pinned on a real broker and real databases.

Each test widens one window through a delayed call (a gated ``commit_transaction`` or
``ControlPlane.end_transaction``), or a real fault (a killed database session), so the
interleaving happens every run rather than by luck; each states which invariant broke before:

- recovery (or a second writer) ended a live writer's *next* transaction by (producer id, epoch);
- a fenced producer aborted the new owner's transaction and re-initialised over it;
- a heuristic-abort hook's re-publish rolled back with the block while the loss was forgotten;
- a lost COMMIT was judged by comparing stored states instead of asking about that transaction.
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
    DualWriter,
    HeuristicAbortError,
    ProducerFencedError,
    TwoPhaseProducer,
)
from dualwrite.participant import TxnState
from dualwrite.participant.control_plane import ControlPlane
from dualwrite.writer import PhaseHooks, StateStore
from tests.support.kafka import in_thread, read_committed, unique
from tests.support.recipe import (
    CommitWindow,
    assert_invariant,
    heuristic_state,
    kill_backend,
    kill_session_before_the_decision,
    lapsed_lease,
    rows,
    write,
    write_produce_first,
    writer_session,
)
from tests.support.tables import EVERY_BACKEND

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=EVERY_BACKEND)
def backend(request: pytest.FixtureRequest) -> str:
    """Every interleaving on every database (narrowed per test where it needs a server's own
    fault). On MariaDB the tests parametrized with it explicitly run always, the others with
    ``--mariadb-full``."""
    return str(request.param)


# -- 1. nobody ends a live writer's transaction by (producer id, epoch) ---------------------


def test_recovery_leaves_a_live_writer_alone_whatever_the_delays(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """recover() beside a live writer that is between its two commits. Before: recovery claimed
    the id, saw the writer's transaction open, and its (delayed) EndTxn(commit) landed on the
    writer's next transaction, whose record the writer then sent again: a duplicate. Now the
    writer holds its id's lease and recovery leaves the id to it: no claim, no EndTxn."""
    tid = unique("live-rec")
    writer = writers(engine, tid)
    write_produce_first(writer, topic, "t0")  # the session, its claim and its lease
    generation = StateStore(engine).read(tid).fencing_generation  # type: ignore[union-attr]
    window = CommitWindow(monkeypatch, writer.producer, engine, bootstrap)

    def two_writes() -> None:
        write_produce_first(writer, topic, "t1")  # held between its two commits
        write_produce_first(writer, topic, "t2")

    thread, errors = in_thread(two_writes)
    assert window.at_gate.wait(20)
    report = dualwrite.recover(engine, {"bootstrap.servers": bootstrap}, [tid], timeout_s=20)
    window.gate.set()
    thread.join(60)
    assert not thread.is_alive() and errors == []
    assert assert_invariant(engine, bootstrap, topic) == [b"t0", b"t1", b"t2"]
    assert window.commits_sent == [] and report.ok
    assert "starting the transaction over" not in caplog.text
    row = StateStore(engine).read(tid)
    assert row is not None and row.fencing_generation == generation  # not even claimed
    assert [r.outcome.value for r in report.results] == ["left-to-live-writer"]


def test_recovery_beside_a_busy_writer_never_makes_it_start_over(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """An operator's periodic recover costs a healthy writer nothing: before, every pass claimed
    the id and the writer started its transaction over (about three times a second)."""
    tid = unique("live-loop")
    writer = writers(engine, tid)
    write_produce_first(writer, topic, "w-first")
    generation = StateStore(engine).read(tid).fencing_generation  # type: ignore[union-attr]
    stop = threading.Event()
    reports: list[dualwrite.RecoveryReport] = []

    def recover_loop() -> None:
        while not stop.is_set():
            reports.append(dualwrite.recover(engine, {"bootstrap.servers": bootstrap},
                                             timeout_s=20))

    thread = threading.Thread(target=recover_loop)
    thread.start()
    written = 0
    try:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            write_produce_first(writer, topic, f"w{written}")
            written += 1
    finally:
        stop.set()
        thread.join(60)
    assert written > 10 and len(reports) > 3
    committed = assert_invariant(engine, bootstrap, topic)
    assert committed == sorted([b"w-first", *(f"w{i}".encode() for i in range(written))])
    assert "starting the transaction over" not in caplog.text
    row = StateStore(engine).read(tid)
    assert row is not None and row.fencing_generation == generation
    assert all(r.ok for r in reports)
    assert all(r.outcome.value == "left-to-live-writer"
               for rep in reports for r in rep.results if r.transactional_id == tid)


def test_a_second_writer_leaves_the_live_writers_transaction_to_it(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str, db_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A second writer of the same id starts while the first is between its two commits.
    Before: it committed the stored state's transaction by (producer id, epoch) and, delayed, the
    EndTxn landed on the first writer's next transaction: a record visible without its row.
    Now it waits for the lease holder to commit its own transaction, then takes over (fencing
    the first writer, which stops)."""
    tid = unique("live-two")
    first = writers(engine, tid)
    write_produce_first(first, topic, "t0")
    window = CommitWindow(monkeypatch, first.producer, engine, bootstrap)

    def first_writes() -> None:
        write_produce_first(first, topic, "t1")
        write_produce_first(first, topic, "t2")

    thread, first_errors = in_thread(first_writes)
    assert window.at_gate.wait(20)
    second_engine = dualwrite.create_engine(db_url)
    second = writers(second_engine, tid, take_over=True)
    second_thread, second_errors = in_thread(write_produce_first, second, topic, "s1")
    time.sleep(1.5)  # the second writer is waiting for the first one's commit
    window.gate.set()
    second_thread.join(60)
    thread.join(60)
    assert not thread.is_alive() and not second_thread.is_alive()
    assert assert_invariant(engine, bootstrap, topic) == [b"s1", b"t0", b"t1"]
    assert second_errors == []
    assert len(first_errors) == 1 and isinstance(first_errors[0], ProducerFencedError), \
        first_errors
    assert window.commits_sent == []  # nobody committed t1 but its own writer
    second_engine.dispose()


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"], indirect=True)
def test_recovery_after_the_lease_was_lost_cannot_commit_the_writers_next_transaction(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str, db_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """pg_terminate_backend (MariaDB: KILL) on the writer's session between its two commits
    frees its lease;
    recovery takes it and its EndTxn by (producer id, epoch) is delayed. Before: the writer
    began t2 in the same session, the late EndTxn committed t2's record before its rows, and the
    writer could only report it (HeuristicCommitError; Kafka [t0, t1, t2], rows [t0, t1]). Now
    the writer checks, after each Kafka commit, that its lease's session is still the one it
    took the lease on; it is not, so it starts a new session (epoch bump) and locks first."""
    writer = writers(engine, unique("lapsed"))

    def terminate() -> None:
        session = writer_session(engine, writer)
        assert session is not None
        kill_backend(db_url, session)

    lapsed_lease(writer, engine, bootstrap, topic, monkeypatch, terminate)


def test_a_writer_claimed_before_its_lock_starts_over_in_a_new_session(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """Another process claims the id while the writer's first record is on its way and its lock
    not yet taken. Whoever claimed may have sent an EndTxn by the session's (producer id, epoch)
    that is still travelling; on the TV1 path it would land on the next transaction of that
    session (KAFKA-17754). Before: the writer aborted and began again in the same session (same
    epoch). Now it starts a new session, whose epoch refuses such a late request."""
    tid = unique("claimed-early")
    at_lock, claimed = threading.Event(), threading.Event()

    class ClaimBeforeTheLock(PhaseHooks):
        def before_late_lock(self, records_sent: int) -> None:
            if records_sent and not claimed.is_set():
                at_lock.set()
                assert claimed.wait(20)

    writer = writers(engine, tid, hooks=ClaimBeforeTheLock())
    write_produce_first(writer, topic, "t0")  # the session is established: the lock comes late
    before = writer.producer.identity
    thread, errors = in_thread(write_produce_first, writer, topic, "t1")
    assert at_lock.wait(20)
    StateStore(engine).claim([tid], timeout_s=10)
    claimed.set()
    thread.join(60)
    assert not thread.is_alive() and errors == []
    after = writer.producer.identity
    assert before is not None and after is not None
    assert (after.producer_id, after.epoch) != (before.producer_id, before.epoch)
    assert assert_invariant(engine, bootstrap, topic) == [b"t0", b"t1"]


# -- 3. a fenced producer touches nothing ------------------------------------------------------


def test_a_fenced_producer_ends_nothing_of_the_new_owner(bootstrap: str, topic: str) -> None:
    """P1 prepared T1 (the database decided it) and stalled; P2 of the same id finished T1,
    began T_x. Before: P1's failed commit aborted T_x and re-initialised, fencing P2. Now P1
    raises ProducerFencedError and T_x stays open for P2, which commits it."""
    tid = unique("zombie")
    config = {"bootstrap.servers": bootstrap, "transactional.id": tid, "linger.ms": 0,
              "transaction.timeout.ms": 60_000}
    zombie = TwoPhaseProducer(config, timeout_s=20)
    owner = TwoPhaseProducer(config, timeout_s=20)
    try:
        zombie.init_transactions()
        zombie.begin_transaction()
        zombie.produce(topic, b"z1", key=b"z1")
        decided = zombie.prepare_transaction()
        owner.init_transactions(keep_prepared_txn=True)
        owner.complete_transaction(decided)  # commits T1 by (producer id, epoch), then inits
        owner.begin_transaction()
        owner.produce(topic, b"x1", key=b"x1")
        owner.flush_and_state()
        with pytest.raises(ProducerFencedError):
            zombie.commit_transaction()
        with ControlPlane({"bootstrap.servers": bootstrap}) as cp:
            desc = cp.describe_transaction(tid)
        assert owner.identity is not None
        assert desc is not None and desc.state is TxnState.ONGOING
        assert (desc.producer_id, desc.epoch) == (owner.identity.producer_id,
                                                  owner.identity.epoch)
        owner.commit_transaction()
    finally:
        zombie.close()
        owner.close()
    assert read_committed(bootstrap, topic) == [b"x1", b"z1"]


# -- 4. the heuristic hook's re-publish cannot be rolled back ----------------------------------


def test_the_hooks_republish_survives_a_failing_block(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook runs for a heuristic abort, then the block raises. Before: the rollback took the
    hook's re-publish with it and the next transaction overwrote the state, the loss forgotten.
    Now the re-publish and the acknowledgement commit together before the block runs."""
    tid = unique("hook-rollback")
    state = heuristic_state(writers, engine, bootstrap, topic, tid, monkeypatch)
    calls: list[str] = []

    def republish(exc: HeuristicAbortError, conn: sa.Connection) -> None:
        calls.append(exc.state)
        conn.execute(sa.text("INSERT INTO app_rows (value) VALUES (:v)"),
                     {"v": f"republished-{len(calls)}"})

    tolerant = writers(engine, tid, on_heuristic_abort=republish)
    with pytest.raises(ZeroDivisionError), tolerant.transaction() as tx:
        tx.produce(topic, b"never", key=b"never")
        _ = 1 / 0
    write(tolerant, topic, ["after"])
    assert calls == [state]
    assert rows(engine) == [b"after", b"h1", b"h2", b"republished-1"]
    assert read_committed(bootstrap, topic) == [b"after"]


# -- 6. a lost COMMIT is asked about by the transaction's id -----------------------------------


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"], indirect=True)
def test_a_lost_commit_of_an_empty_block_is_not_taken_for_committed(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str, db_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A block with rows and no records decides the empty state, which is what the row already
    held. Its session is killed before the COMMIT. Before: the stored "" equalled the decided ""
    and the writer reported success for rows that were never committed."""
    writer = writers(engine, unique("lost-empty"))
    with writer.transaction() as tx:  # rows only: the stored state stays ""
        tx.connection.execute(sa.text("INSERT INTO app_rows (value) VALUES ('kept')"))
    killed = kill_session_before_the_decision(monkeypatch, db_url)
    with pytest.raises((sa.exc.DBAPIError, dualwrite.DualWriteError)), \
            writer.transaction() as tx:
        tx.connection.execute(sa.text("INSERT INTO app_rows (value) VALUES ('ghost')"))
    monkeypatch.undo()
    assert killed
    assert rows(engine) == [b"kept"]
    write(writer, topic, ["next"])
    assert rows(engine) == [b"kept", b"next"]
    assert read_committed(bootstrap, topic) == [b"next"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_commit_whose_answer_was_lost_is_committed_even_if_the_state_was_cleared(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The COMMIT was applied, its answer lost, and the stored state cleared before the writer
    asked (as recovery does once a transaction is resolved). Before: the state comparison read
    that as "not committed" and aborted Kafka: rows without records."""
    tid = unique("lost-cleared")
    writer = writers(engine, tid)
    real = StateStore.write_and_commit
    armed = {"on": True}

    def commit_clear_then_lose_answer(self: StateStore, conn: sa.Connection, tid_: str,
                                      state: str) -> None:
        real(self, conn, tid_, state)
        if armed["on"]:
            armed["on"] = False
            assert StateStore(engine).compare_and_set(tid_, state, "")
            raise sa.exc.OperationalError("COMMIT", None, psycopg.OperationalError(
                "server closed the connection unexpectedly"))

    monkeypatch.setattr(StateStore, "write_and_commit", commit_clear_then_lose_answer)
    write(writer, topic, ["acked-late"])  # no exception: the database says it committed
    assert not armed["on"]
    monkeypatch.undo()
    write(writer, topic, ["next"])
    assert assert_invariant(engine, bootstrap, topic) == [b"acked-late", b"next"]


# -- every wait is bounded ------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"], indirect=True)
def test_a_state_row_held_too_long_fails_the_writer_with_a_typed_error(
        engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """Another process holds the state-row lock (a paused recovery, say): the writer waits no
    longer than its timeout and raises LockTimeoutError (retriable), not a driver error."""
    tid = unique("held")
    writer = DualWriter(engine, {"bootstrap.servers": bootstrap}, transactional_id=tid,
                        timeout_s=2)
    try:
        write_produce_first(writer, topic, "first")
        with engine.connect() as holder:
            holder.begin()
            StateStore(engine).lock_row(holder, tid)
            started = time.monotonic()
            with pytest.raises(dualwrite.LockTimeoutError), writer.transaction() as tx:
                tx.produce(topic, b"blocked", key=b"blocked")
            assert time.monotonic() - started < 10
            holder.rollback()
        write_produce_first(writer, topic, "after")
    finally:
        writer.close()
    assert assert_invariant(engine, bootstrap, topic) == [b"after", b"first"]


# -- the issue's own reproduction: writers and a recovery loop, every EndTxn and commit late ---

RECOVERY_LOOP_S = float(__import__("os").environ.get("DUALWRITE_RECOVERY_LOOP_S", "8"))


@pytest.mark.parametrize(
    "backend", ["postgresql", pytest.param("mariadb", marks=pytest.mark.mariadb_full)],
    indirect=True)
def test_writers_beside_a_recovery_loop_with_late_commits(
        writers: Any, db_url: str, bootstrap: str, topic: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Two writers (own ids, own engines) produce first while recover() runs in a loop, with
    every Kafka commit and every control-plane EndTxn delayed by 30 ms (a GC pause, a slow
    network). Measured before leases: duplicates, and each writer starting over on every pass.
    ``DUALWRITE_RECOVERY_LOOP_S`` sets the duration (default 8 s)."""
    real_end = ControlPlane.end_transaction
    real_commit = TwoPhaseProducer.commit_transaction

    def late_end(cp: ControlPlane, tid: str, pid: int, epoch: int, commit: bool) -> None:
        time.sleep(0.03)
        real_end(cp, tid, pid, epoch, commit)

    def late_commit(producer: TwoPhaseProducer) -> None:
        time.sleep(0.03)
        real_commit(producer)

    monkeypatch.setattr(ControlPlane, "end_transaction", late_end)
    monkeypatch.setattr(TwoPhaseProducer, "commit_transaction", late_commit)
    stop = threading.Event()
    counts = {"passes": 0}
    failures: list[BaseException] = []
    written: dict[str, int] = {}

    def write_loop(name: str) -> None:
        own = dualwrite.create_engine(db_url)
        writer = writers(own, unique(f"loop-{name}"))
        written[name] = 0
        try:
            while not stop.is_set():
                write_produce_first(writer, topic, f"{name}{written[name]}")
                written[name] += 1
        except BaseException as exc:
            failures.append(exc)
        finally:
            writer.close()
            own.dispose()

    def recover_loop() -> None:
        recovery_engine = dualwrite.create_engine(db_url)
        while not stop.is_set():
            report = dualwrite.recover(recovery_engine, {"bootstrap.servers": bootstrap},
                                       timeout_s=20)
            if not report.ok:
                failures.append(AssertionError(report.as_dict()))
            counts["passes"] += 1
        recovery_engine.dispose()

    threads = [threading.Thread(target=write_loop, args=(n,)) for n in "AB"]
    threads.append(threading.Thread(target=recover_loop))
    for t in threads:
        t.start()
    time.sleep(RECOVERY_LOOP_S)
    stop.set()
    for t in threads:
        t.join(60)
    engine = dualwrite.create_engine(db_url)
    committed_rows = rows(engine)
    records = read_committed(bootstrap, topic)
    engine.dispose()
    restarts = caplog.text.count("starting the transaction over")
    print(f"recovery loop: {RECOVERY_LOOP_S:g} s, {sum(written.values())} transactions, "
          f"{counts['passes']} recovery passes, {len(records)} records, "
          f"{len(committed_rows)} rows, {len(records) - len(set(records))} duplicates, "
          f"{restarts} restarts")
    assert failures == []
    assert records == committed_rows
    assert restarts == 0
    assert sum(written.values()) > 20 and counts["passes"] > 3
