"""The writer tests' shared steps: one dual write and the invariant, a server session ended under
a writer, a heuristic outcome, and the window in which a delayed EndTxn could land on the
next transaction."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite import (
    DualWriter,
    PreparedTxnState,
    TwoPhaseProducer,
)
from dualwrite.database import LEASE_LOCKS, SessionLocks, normalize_url
from dualwrite.participant import TxnState
from dualwrite.participant.control_plane import ControlPlane
from dualwrite.writer import StateStore
from tests.support.kafka import in_thread, read_committed, wait_for


def rows(engine: sa.Engine) -> list[bytes]:
    with engine.connect() as conn:
        return sorted(v.encode() for v in conn.exec_driver_sql(
            "SELECT value FROM app_rows").scalars())


def write(writer: DualWriter, topic: str, values: list[str]) -> dualwrite.PreparedTxnState | None:
    """One dual write: a row and a record per value."""
    with writer.transaction() as tx:
        for v in values:
            tx.connection.execute(sa.text("INSERT INTO app_rows (value) VALUES (:v)"), {"v": v})
            tx.produce(topic, v.encode(), key=v.encode())
    return tx.state


def assert_invariant(engine: sa.Engine, bootstrap: str, topic: str) -> list[bytes]:
    committed_rows = rows(engine)
    assert read_committed(bootstrap, topic) == committed_rows
    return committed_rows


def kill_backend(db_url: str, pid: int) -> None:
    """End the server session ``pid``: pg_terminate_backend, or MariaDB's KILL CONNECTION."""
    if normalize_url(db_url).get_backend_name() in ("mysql", "mariadb"):
        killer_engine = dualwrite.create_engine(db_url)
        try:
            with killer_engine.connect() as killer:
                killer.exec_driver_sql(f"KILL CONNECTION {int(pid)}")
        finally:
            killer_engine.dispose()
        return
    plain_url = normalize_url(db_url).set(drivername="postgresql").render_as_string(
        hide_password=False)
    with psycopg.connect(plain_url, autocommit=True) as killer:
        killer.execute("SELECT pg_terminate_backend(%s)", (pid,))


def backend_pid(conn: sa.Connection) -> int:
    """The server session of ``conn``: PostgreSQL's backend pid, MariaDB's CONNECTION_ID()."""
    if conn.dialect.name in ("mysql", "mariadb"):
        return int(conn.connection.dbapi_connection.thread_id())  # type: ignore[union-attr]
    return int(conn.connection.dbapi_connection.info.backend_pid)  # type: ignore[union-attr]


def writer_session(engine: sa.Engine, writer: DualWriter) -> int | None:
    """The server session of ``writer``'s own connection: the one holding its lease (None when
    nobody holds it)."""
    with engine.connect() as conn:
        return SessionLocks(engine, LEASE_LOCKS).holder(conn, writer.transactional_id)


def kill_session_before_the_decision(monkeypatch: pytest.MonkeyPatch, db_url: str
                                     ) -> list[int]:
    """Make the next state-row write and COMMIT (one pipelined round trip on psycopg) go out on a
    session that pg_terminate_backend (MariaDB: KILL CONNECTION) has just ended; returns the
    killed backend's pid, once it ran."""
    real = StateStore.write_and_commit
    killed: list[int] = []

    def kill_then_write_and_commit(self: StateStore, conn: sa.Connection, tid: str,
                                   state: str) -> None:
        if not killed:
            killed.append(backend_pid(conn))
            kill_backend(db_url, killed[0])
        real(self, conn, tid, state)

    monkeypatch.setattr(StateStore, "write_and_commit", kill_then_write_and_commit)
    return killed


def crash_between_db_and_kafka_commit(writer: DualWriter, topic: str, values: list[str],
                                       monkeypatch: pytest.MonkeyPatch) -> str:
    """Run one transaction whose Kafka commit never happens (the process 'dies' after the DB
    commit), then close the writer; returns the state the database committed."""
    producer = writer.producer
    monkeypatch.setattr(producer, "commit_transaction", lambda: None)
    state = write(writer, topic, values)
    monkeypatch.undo()
    writer.close()
    assert state is not None and not state.is_empty
    return str(state)


def heuristic_state(writers: Any, engine: sa.Engine, bootstrap: str, topic: str, tid: str,
                     monkeypatch: pytest.MonkeyPatch) -> str:
    """Leave ``tid`` with a database-committed state whose Kafka transaction the broker aborted
    (transaction.timeout.ms=2000 passed after a crash between the two commits)."""
    crashed = writers(engine, tid, {"transaction.timeout.ms": 2000})
    state = crash_between_db_and_kafka_commit(crashed, topic, ["h1", "h2"], monkeypatch)
    with ControlPlane({"bootstrap.servers": bootstrap}, timeout_s=10) as cp:
        wait_for(lambda: (d := cp.describe_transaction(tid)) is not None
                 and d.state is TxnState.COMPLETE_ABORT, 20, interval_s=0.25,
                 what="the broker to abort the timed-out transaction")
    return state


def write_produce_first(writer: DualWriter, topic: str, value: str) -> None:
    """A dual write whose record leaves before the state-row lock is taken."""
    with writer.transaction() as tx:
        tx.produce(topic, value.encode(), key=value.encode())
        tx.connection.execute(sa.text("INSERT INTO app_rows (value) VALUES (:v)"), {"v": value})


def lease_checked(writer: DualWriter) -> None:
    """Wait for the lease check the writer runs after its Kafka commit: a claim made before it
    answered would make the next transaction lock first (docs/design.md, "The lease under
    session loss"), and these tests claim the id while that transaction's record is on its way."""
    writer.lease_keeper.verdict()


def next_transaction_in_the_log(cp: ControlPlane, tid: str, anchor: PreparedTxnState) -> bool:
    """The coordinator's open transaction of ``tid`` started somewhere other than ``anchor``'s
    offset: the session's next transaction has a record in a partition's log."""
    desc = cp.describe_transaction(tid)
    if desc is None or desc.state is not TxnState.ONGOING or not desc.partitions:
        return False
    assert anchor.anchor is not None
    named = (anchor.anchor.partition, anchor.anchor.offset)
    return any(p.producer_id == desc.producer_id and p.current_txn_start_offset is not None
               and (tp.partition, p.current_txn_start_offset) != named
               for tp, ps in cp.describe_producers(desc.partitions).items() for p in ps)


class CommitWindow:
    """Holds a writer between its database COMMIT and its Kafka commit, and delays every
    EndTxn(commit) sent by (producer id, epoch) until that writer committed its transaction and
    its next transaction's first record is in the log: the window in which an EndTxn decided
    from a snapshot lands on the wrong transaction. ``patience_s``: how long the EndTxn waits
    for that next transaction before it is sent anyway (``next_seen`` tells whether it came)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, producer: TwoPhaseProducer,
                 engine: sa.Engine, bootstrap: str, patience_s: float | None = None) -> None:
        self.at_gate = threading.Event()
        self.gate = threading.Event()
        self.commits_sent: list[str] = []
        self.next_seen = False
        tid = producer.transactional_id
        real_commit = producer.commit_transaction

        def gated_commit() -> None:
            if not self.gate.is_set():
                self.at_gate.set()
                self.gate.wait(30)
            real_commit()

        real_end = ControlPlane.end_transaction

        def delayed_end(cp: ControlPlane, tid_: str, pid: int, epoch: int,
                        commit: bool) -> None:
            if commit and tid_ == tid:
                self.commits_sent.append(tid_)
                row = StateStore(engine).read(tid)
                assert row is not None
                decided = PreparedTxnState.parse(row.prepared_txn_state)
                self.gate.set()  # the writer commits its transaction and begins the next one
                with ControlPlane({"bootstrap.servers": bootstrap}, timeout_s=10) as probe:
                    if patience_s is None:
                        wait_for(lambda: next_transaction_in_the_log(probe, tid, decided), 15,
                                 what="the writer's next transaction in the log")
                        self.next_seen = True
                    else:
                        deadline = time.monotonic() + patience_s
                        while not self.next_seen and time.monotonic() < deadline:
                            self.next_seen = next_transaction_in_the_log(probe, tid, decided)
                            time.sleep(0.05)
            real_end(cp, tid_, pid, epoch, commit)

        monkeypatch.setattr(producer, "commit_transaction", gated_commit)
        monkeypatch.setattr(ControlPlane, "end_transaction", delayed_end)


def lapsed_lease(writer: DualWriter, engine: sa.Engine, bootstrap: str, topic: str,
                 monkeypatch: pytest.MonkeyPatch, lose_session: Callable[[], None]) -> CommitWindow:
    """The writer's database session is lost (``lose_session``) while it is between its two
    commits of t1, so its lease is free; recovery takes the lease and sends EndTxn(commit) for
    t1 by (producer id, epoch), delayed until the writer's next transaction (t2) is in the log
    (at most 3 s). Asserts the invariant; returns the window for more checks."""
    tid = writer.transactional_id
    write_produce_first(writer, topic, "t0")
    window = CommitWindow(monkeypatch, writer.producer, engine, bootstrap, patience_s=3.0)
    before = writer.producer.identity

    def two_writes() -> None:
        write_produce_first(writer, topic, "t1")
        write_produce_first(writer, topic, "t2")

    thread, errors = in_thread(two_writes)
    assert window.at_gate.wait(20)
    lose_session()  # the lease goes with the session
    dualwrite.recover(engine, {"bootstrap.servers": bootstrap}, [tid], timeout_s=20)
    window.gate.set()
    thread.join(60)
    assert not thread.is_alive()
    assert errors == []  # before: HeuristicCommitError (t2 committed by recovery's EndTxn)
    assert assert_invariant(engine, bootstrap, topic) == [b"t0", b"t1", b"t2"]
    assert window.commits_sent == [tid]  # recovery did send its EndTxn by (producer id, epoch)
    assert not window.next_seen, "the writer began t2 on the (producer id, epoch) recovery used"
    after = writer.producer.identity
    assert before is not None and after is not None and after.epoch != before.epoch
    return window


def assert_clean(writer: DualWriter, engine: sa.Engine, bootstrap: str, topic: str,
                 expected: list[bytes]) -> None:
    """Rows == ``expected``, nothing open (the state row can be locked at once), and the next
    transaction of the same writer commits: then rows == read_committed records (which also
    needs every partition's end reachable, i.e. no Kafka transaction left open)."""
    assert rows(engine) == expected
    with engine.connect() as conn, conn.begin():  # nobody holds the state row's lock
        StateStore(engine).lock_row(conn, writer.transactional_id, timeout_s=2)
    write(writer, topic, ["next"])
    assert rows(engine) == sorted([*expected, b"next"])
    assert read_committed(bootstrap, topic, timeout_s=10) == rows(engine)
