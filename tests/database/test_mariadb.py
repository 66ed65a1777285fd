"""The MariaDB semantics the recipe relies on, each against a real server (``mariadb_url``).

- the state row's lock is InnoDB's exclusive row lock, bounded by innodb_lock_wait_timeout;
- dualwrite's engines run READ COMMITTED;
- a deadlock, a lock wait timeout and a killed session become the typed errors;
- the writer lease is a GET_LOCK user lock: the session's, and gone with it;
- a COMMIT whose answer was lost is asked about by its session and the row version it wrote:
  applied (the answer dropped on the way back) reads "committed", never arrived reads
  "aborted", both through a real TCP proxy between the writer and the server.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite import DatabaseUnreachableError, DualWriter, OutcomeUnknownError
from dualwrite.database import check_mariadb_version
from dualwrite.database._pymysql_seam import socket_fileno
from dualwrite.deadline import MARGIN_S
from dualwrite.errors import ConfigurationError, LockTimeoutError, TransactionConflictError
from dualwrite.writer import StateStore
from dualwrite.writer.commit_inquiry import CommitStatus
from dualwrite.writer.lease import Leases
from tests.support.kafka import read_committed, unique, wait_for
from tests.support.tables import add_value_table
from tests.support.tcp_proxy import TcpProxy, contains

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.parametrize("backend", ["mariadb"], indirect=True)]


@pytest.fixture
def db_url(db_url: str) -> str:
    """A fresh MariaDB database with dualwrite's tables and the application table."""
    return add_value_table(db_url, "app_rows")


def _session(conn: sa.Connection) -> int:
    return int(conn.exec_driver_sql("SELECT CONNECTION_ID()").scalar_one())


def _kill(engine: sa.Engine, session: int) -> None:
    with engine.connect() as killer:
        killer.exec_driver_sql(f"KILL CONNECTION {session}")


def test_a_mysql_server_is_refused_by_name(engine: sa.Engine) -> None:
    """MariaDB's version string passes; MySQL's is a ConfigurationError saying why (no MySQL
    server here: the check is the pure function every mysql:// connection runs)."""
    with engine.connect() as conn:
        version = conn.exec_driver_sql("SELECT VERSION()").scalar()
    check_mariadb_version(str(version))
    with pytest.raises(ConfigurationError, match=r"MySQL 8\.4\.3, not MariaDB"):
        check_mariadb_version("8.4.3")


def test_engines_run_read_committed(engine: sa.Engine) -> None:
    """InnoDB's default is REPEATABLE READ; dualwrite's engines ask for PostgreSQL's default."""
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT @@tx_isolation").scalar_one() == "READ-COMMITTED"


def test_the_state_row_lock_is_exclusive_and_bounded(engine: sa.Engine) -> None:
    """A second locker waits for the first (InnoDB row lock, also on an existing row), gets
    LockTimeoutError (1205) after its timeout, and then sees what the first committed."""
    store = StateStore(engine)
    tid = unique("mdb-lock")
    store.claim([tid])
    with engine.connect() as first, engine.connect() as second:
        with first.begin():
            row = store.lock_row(first, tid)
            assert row.locked_by_pid == _session(first) and row.locked_on
            with second.begin():
                started = time.monotonic()
                with pytest.raises(LockTimeoutError, match="1205"):
                    store.lock_row(second, tid, timeout_s=1.5)
                waited = time.monotonic() - started
            assert 0.9 < waited < 5, waited
            store.write(first, tid, "state-1")
        with second.begin():
            again = store.lock_row(second, tid, timeout_s=5)
    assert again.prepared_txn_state == "state-1"
    assert again.updated_at > row.updated_at


def test_every_write_raises_the_row_version(engine: sa.Engine) -> None:
    """updated_at (DATETIME(6)) grows with every write, even of the same state within one
    microsecond of the clock: what names a committed transaction's row version."""
    store = StateStore(engine)
    tid = unique("mdb-version")
    seen = []
    for _ in range(5):
        with engine.begin() as conn:
            seen.append(store.lock_row(conn, tid).updated_at)
            store.write(conn, tid, "same")
    assert seen == sorted(set(seen)), seen
    assert store.compare_and_set(tid, "same", "")
    assert store.read(tid).updated_at > seen[-1]  # type: ignore[union-attr]


def test_a_deadlock_and_a_killed_session_are_typed(engine: sa.Engine) -> None:
    """1213 (deadlock: the server rolled one back) is TransactionConflictError; a session
    killed under a statement is DatabaseUnreachableError."""
    store = StateStore(engine)
    a_id, b_id = unique("mdb-dl-a"), unique("mdb-dl-b")
    store.claim([a_id, b_id])
    errors: list[BaseException] = []
    with engine.connect() as a, engine.connect() as b:
        a.begin()
        b.begin()
        store.lock_row(a, a_id)
        store.lock_row(b, b_id)

        def a_wants_b() -> None:
            try:
                store.lock_row(a, b_id, timeout_s=10)
            except BaseException as exc:
                errors.append(exc)

        waiter = threading.Thread(target=a_wants_b)
        waiter.start()
        time.sleep(0.3)
        try:
            store.lock_row(b, a_id, timeout_s=10)
        except BaseException as exc:
            errors.append(exc)
        waiter.join(15)
        a.rollback()
        b.rollback()
    assert len(errors) == 1 and isinstance(errors[0], TransactionConflictError), errors
    assert "1213" in str(errors[0])

    with engine.connect() as victim:
        session = _session(victim)
        victim.rollback()
        _kill(engine, session)
        with pytest.raises(DatabaseUnreachableError), victim.begin():
            store.lock_row(victim, a_id)


def test_the_lease_is_the_sessions_user_lock(engine: sa.Engine) -> None:
    """GET_LOCK: one session holds an id's lease, another cannot take it, and the holder's
    session ending (KILL) frees it."""
    leases = Leases(engine)
    tid = unique("mdb-lease")
    with engine.connect() as a, engine.connect() as b:
        held = leases.try_acquire(a, tid)
        assert held is not None and held.backend_pid == _session(a)
        a.commit()
        assert leases.try_acquire(b, tid) is None  # a's transactions end; its lease does not
        b.rollback()
        assert leases.still_held_by_its_session(b, held)  # asked on another session
        _kill(engine, held.backend_pid)

        def taken() -> bool:
            got = leases.try_acquire(b, tid) is not None
            b.rollback()
            return got

        assert wait_for(taken, 10)
        assert not leases.still_held_by_its_session(b, held)  # b's now


def test_a_live_writers_lease_keeps_recovery_off(engine: sa.Engine, bootstrap: str) -> None:
    """Recovery's hold_free leaves an id whose writer session holds the lease."""
    tid = unique("mdb-hold")
    writer = DualWriter(engine, {"bootstrap.servers": bootstrap}, transactional_id=tid,
                        timeout_s=20)
    try:
        with writer.transaction():
            pass
        with Leases(engine).hold_free(engine, [tid, tid + "-free"]) as held:
            assert held.ids == {tid + "-free"}
    finally:
        writer.close()


@pytest.fixture
def proxied(db_url: str) -> Iterator[tuple[TcpProxy, sa.Engine]]:
    """A TCP proxy in front of the server and an engine through it."""
    url = sa.make_url(db_url)
    with TcpProxy(int(url.port or 3306)) as proxy:
        engine = dualwrite.create_engine(url.set(port=proxy.port))
        yield proxy, engine
        engine.dispose()


def _write(writer: DualWriter, topic: str, value: str) -> None:
    with writer.transaction() as tx:
        tx.connection.execute(sa.text("INSERT INTO app_rows (value) VALUES (:v)"), {"v": value})
        tx.produce(topic, value.encode())


def _rows(engine: sa.Engine) -> list[bytes]:
    with engine.connect() as conn:
        return sorted(v.encode() for v in conn.exec_driver_sql(
            "SELECT value FROM app_rows").scalars())


def test_a_commit_whose_answer_was_lost_is_found_committed(
        proxied: tuple[TcpProxy, sa.Engine], engine: sa.Engine, bootstrap: str,
        topic: str) -> None:
    """The COMMIT reaches the server and is applied; its answer is dropped and the connection
    cut. The writer asks (session gone, the row holds its state at a later version) and
    commits Kafka: the write succeeds, rows and records agree."""
    proxy, through = proxied
    writer = DualWriter(through, {"bootstrap.servers": bootstrap},
                        transactional_id=unique("mdb-lost"), timeout_s=20)
    try:
        _write(writer, topic, "kept")
        dropped = proxy.drop_next_response(contains(b"COMMIT"))
        _write(writer, topic, "answer-lost")
        assert dropped.is_set()
        _write(writer, topic, "next")
    finally:
        writer.close()
    assert _rows(engine) == [b"answer-lost", b"kept", b"next"]
    assert read_committed(bootstrap, topic) == _rows(engine)


def test_a_commit_that_never_arrived_is_found_aborted(
        proxied: tuple[TcpProxy, sa.Engine], engine: sa.Engine, bootstrap: str,
        topic: str) -> None:
    """The COMMIT is held in the proxy and the connection cut: the server never gets it and
    rolls back when the session ends. The writer asks (the row is at the locked version),
    aborts Kafka and raises the typed error: neither side."""
    proxy, through = proxied
    writer = DualWriter(through, {"bootstrap.servers": bootstrap},
                        transactional_id=unique("mdb-never"), timeout_s=20)
    failure: list[BaseException] = []
    try:
        _write(writer, topic, "kept")
        held = proxy.hold_next_request(contains(b"COMMIT"))

        def lost() -> None:
            try:
                _write(writer, topic, "never")
            except BaseException as exc:
                failure.append(exc)

        thread = threading.Thread(target=lost)
        thread.start()
        assert held.wait(20)
        proxy.cut()
        proxy.release()
        thread.join(30)
        assert len(failure) == 1 and isinstance(failure[0], DatabaseUnreachableError), failure
        _write(writer, topic, "next")
    finally:
        writer.close()
    assert _rows(engine) == [b"kept", b"next"]
    assert read_committed(bootstrap, topic) == _rows(engine)


def test_the_pymysql_seam_finds_the_connections_socket(engine: sa.Engine) -> None:
    """``_pymysql_seam.socket_fileno`` names the socket connected to the server (what
    bounded_wait shuts down), and nothing once the connection is closed."""
    port = int(engine.url.port or 3306)
    with engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        fd = socket_fileno(raw)
        assert fd is not None
        with socket.socket(fileno=os.dup(fd)) as sock:
            assert sock.getpeername()[1] == port
        conn.invalidate()  # closes the PyMySQL connection
        assert socket_fileno(raw) is None


def test_a_silent_server_ends_the_commit_within_the_bound(
        proxied: tuple[TcpProxy, sa.Engine], engine: sa.Engine, db_url: str, bootstrap: str,
        topic: str) -> None:
    """The COMMIT is held in the proxy, its connection left open: the server never answers.
    The writer gives the connection up at its deadline (bounded_wait shuts the socket down;
    before, PyMySQL waited as long as the proxy held, here for ever), asks the outcome and
    raises a typed error within timeout_s and the margin; once the connection ends, recovery
    settles the id: rows == read_committed records."""
    proxy, through = proxied
    timeout_s = 6.0
    tid = unique("mdb-silent")
    writer = DualWriter(through, {"bootstrap.servers": bootstrap}, transactional_id=tid,
                        timeout_s=timeout_s)
    failure: list[BaseException] = []
    took: list[float] = []
    try:
        _write(writer, topic, "kept")
        held = proxy.hold_next_request(contains(b"COMMIT"))

        def silent() -> None:
            started = time.monotonic()
            try:
                _write(writer, topic, "silent")
            except BaseException as exc:
                failure.append(exc)
            took.append(time.monotonic() - started)

        thread = threading.Thread(target=silent, daemon=True)
        thread.start()
        thread.join(timeout_s + MARGIN_S + 5)
        finished = not thread.is_alive()
        proxy.cut()
        proxy.release()
        thread.join(30)
        assert held.is_set()
        assert finished, "the writer still waited for the COMMIT's answer"
        print(f"silent COMMIT on MariaDB: {type(failure[0]).__name__} after {took[0]:.1f} s "
              f"(timeout_s={timeout_s})")
        assert took[0] <= timeout_s + MARGIN_S, took
        assert len(failure) == 1, failure
        assert type(failure[0]) in (DatabaseUnreachableError, OutcomeUnknownError), failure
    finally:
        writer.close()
    report = dualwrite.recover(db_url, {"bootstrap.servers": bootstrap}, [tid], timeout_s=20)
    assert report.ok, report.as_dict()
    assert _rows(engine) in ([b"kept"], [b"kept", b"silent"])
    assert read_committed(bootstrap, topic) == _rows(engine)


def test_commit_status_waits_for_a_live_session(engine: sa.Engine) -> None:
    """While the locking session still runs, the answer is "in progress" (and the session is
    killed, which decides it): its uncommitted write then reads "aborted"."""
    store = StateStore(engine)
    tid = unique("mdb-live")
    store.claim([tid])
    with engine.connect() as conn:
        conn.begin()
        row = store.lock_row(conn, tid)
        store.write(conn, tid, "pending")
        assert store.inquiry.commit_status(row, "pending") is CommitStatus.IN_PROGRESS
        answers: list[Any] = []

        def decided() -> bool:
            answers.append(store.inquiry.commit_status(row, "pending"))
            return bool(answers[-1] is not CommitStatus.IN_PROGRESS)

        assert wait_for(decided, 10)
        assert answers[-1] is CommitStatus.ABORTED
        conn.invalidate()
