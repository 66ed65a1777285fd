"""Database faults a DualWriter can meet reach the application as dualwrite's typed errors.

Issue 10, item 1 (database side, writer path): a driver exception (SQLAlchemy, psycopg,
sqlite3) escaping ``DualWriter.transaction()``, ``close()`` or ``producer`` is a bug. Each test
drives one fault against a real PostgreSQL or SQLite database and checks

- the exact :mod:`dualwrite.errors` type that reached the application (chained from the
  driver's exception),
- the invariant: the committed rows are exactly the read_committed records,
- that the next ``writer.transaction()`` of the same writer works.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite import DatabaseUnreachableError, DualWriter, LockTimeoutError
from dualwrite.database import database_error, normalize_url
from dualwrite.dev import LocalPostgres
from dualwrite.errors import (
    ConfigurationError,
    FatalError,
    MigrationRequiredError,
    TransactionConflictError,
)
from dualwrite.writer import StateStore
from tests.support.db import pg_ctl, private_postgres
from tests.support.kafka import unique
from tests.support.recipe import (
    assert_invariant,
    backend_pid,
    kill_backend,
    lease_checked,
    rows,
    write,
    writer_session,
)
from tests.support.tables import add_value_table
from tests.support.tcp_proxy import TcpProxy, contains

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def db_url(db_url: str) -> str:
    """dualwrite's tables and the application table ``app_rows``."""
    return add_value_table(db_url, "app_rows")


TIMEOUT_S = 5.0


@pytest.fixture
def make_writer(bootstrap: str) -> Iterator[Callable[..., DualWriter]]:
    """``make(engine, tid, timeout_s=..., **kw)``: a DualWriter, closed at the end of the test."""
    made: list[DualWriter] = []

    def make(engine: Any, tid: str, timeout_s: float = TIMEOUT_S, **kw: Any) -> DualWriter:
        config = {"bootstrap.servers": bootstrap, "transaction.timeout.ms": 60_000}
        writer = DualWriter(engine, config, transactional_id=tid, timeout_s=timeout_s, **kw)
        made.append(writer)
        return writer

    yield make
    for writer in made:
        with contextlib.suppress(Exception):
            writer.close()


def _typed(failed: pytest.ExceptionInfo[Any], expected: type[Exception]) -> None:
    """Exactly ``expected`` reached the application, chained from a driver error."""
    assert type(failed.value) is expected, repr(failed.value)
    assert isinstance(failed.value.__cause__, sa.exc.SQLAlchemyError), failed.value.__cause__


# -- the translation table --------------------------------------------------------------------

_PG = sa.make_url("postgresql+psycopg://dw:hunter2@db.example:5432/app")


def _pg_error(sqlstate: str | None, text: str = "boom", *, invalidated: bool = False
              ) -> sa.exc.DBAPIError:
    orig = (psycopg.errors.lookup(sqlstate)(text) if sqlstate
            else psycopg.OperationalError(text))
    error = sa.exc.DBAPIError.instance("SELECT 1", None, orig, psycopg.Error,
                                       connection_invalidated=invalidated)
    assert isinstance(error, sa.exc.DBAPIError)
    return error


@pytest.mark.unit
@pytest.mark.parametrize(("sqlstate", "invalidated", "expected"), [
    ("08006", False, DatabaseUnreachableError),   # connection_failure
    ("57P01", False, DatabaseUnreachableError),   # admin_shutdown (pg_terminate_backend)
    ("57P02", False, DatabaseUnreachableError),   # crash_shutdown
    ("57P03", False, DatabaseUnreachableError),   # cannot_connect_now (starting up)
    ("53300", False, DatabaseUnreachableError),   # too_many_connections
    (None, False, DatabaseUnreachableError),      # psycopg: socket closed, connect refused
    ("XX000", True, DatabaseUnreachableError),    # whatever, on an invalidated connection
    ("55P03", False, LockTimeoutError),           # lock_not_available (lock_timeout)
    ("57014", False, DatabaseUnreachableError),   # query_canceled (statement_timeout)
    ("40001", False, TransactionConflictError),   # serialization_failure
    ("40P01", False, TransactionConflictError),   # deadlock_detected
    ("42P01", False, MigrationRequiredError),     # undefined_table
    ("42703", False, MigrationRequiredError),     # undefined_column
    ("23505", False, FatalError),                 # unique_violation
    ("42501", False, FatalError),                 # insufficient_privilege
    ("28P01", False, ConfigurationError),         # invalid_password: exit 2, not retried
    ("28000", False, ConfigurationError),         # invalid_authorization_specification
    ("3D000", False, ConfigurationError),         # invalid_catalog_name (no such database)
])
def test_database_error_translation_table(sqlstate: str | None, invalidated: bool,
                                          expected: type[Exception]) -> None:
    exc = _pg_error(sqlstate, "failed for dw:hunter2 at db.example", invalidated=invalidated)
    typed = database_error(exc, _PG)
    assert type(typed) is expected
    assert "hunter2" not in str(typed) and "***" in str(typed)


@pytest.mark.unit
@pytest.mark.parametrize(("text", "expected"), [
    ("database is locked", LockTimeoutError),
    ("no such table: dualwrite_transaction_state", MigrationRequiredError),
    ("table dualwrite_transaction_state has no column named fencing_generation",
     MigrationRequiredError),
    ("unable to open database file", FatalError),
    ("disk I/O error", FatalError),
])
def test_database_error_translation_table_sqlite(text: str, expected: type[Exception]) -> None:
    exc = sa.exc.OperationalError("BEGIN IMMEDIATE", None, sqlite3.OperationalError(text))
    assert type(database_error(exc, sa.make_url("sqlite:///x.db"))) is expected


@pytest.mark.unit
def test_database_error_outside_the_driver() -> None:
    assert type(database_error(sa.exc.TimeoutError("QueuePool limit"), _PG)) is \
        DatabaseUnreachableError
    assert type(database_error(sa.exc.ResourceClosedError("closed"), _PG)) is FatalError
    already = LockTimeoutError("x")
    assert database_error(already, _PG) is already


@pytest.mark.unit
def test_an_invalid_url_is_a_fatal_error_without_the_password() -> None:
    with pytest.raises(FatalError) as failed:
        DualWriter("postgresql://dw:hunter2@db.example:notaport/app",
                   {"bootstrap.servers": "127.0.0.1:1"}, transactional_id="x")
    assert "hunter2" not in str(failed.value)


# -- the application's own statements are the application's ---------------------------------


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"], indirect=True)
def test_the_applications_own_errors_propagate_unchanged(
        make_writer: Any, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """An IntegrityError of the application's INSERT in the block is the application's: it
    reaches it unchanged (not translated), both sides are rolled back, the writer goes on."""
    writer = make_writer(engine, unique("fault-app"))
    write(writer, topic, ["kept"])
    with pytest.raises(sa.exc.IntegrityError):
        write(writer, topic, ["dup", "kept"])  # the second INSERT violates the primary key
    write(writer, topic, ["next"])
    assert assert_invariant(engine, bootstrap, topic) == [b"kept", b"next"]


# -- PostgreSQL: the writer's session terminated ---------------------------------------------


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_session_terminated_before_the_lock(
        make_writer: Any, engine: sa.Engine, bootstrap: str, topic: str, db_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """pg_terminate_backend right before each lock statement of one transaction (the writer
    replaces a lost connection once, so both attempts are cut): DatabaseUnreachableError."""
    writer = make_writer(engine, unique("fault-lock"))
    write(writer, topic, ["kept"])
    real = StateStore.lock_row
    killed: list[int] = []

    def kill_then_lock(self: StateStore, conn: sa.Connection, tid: str,
                       **kw: Any) -> dualwrite.writer.StateRow:
        killed.append(backend_pid(conn))
        kill_backend(db_url, killed[-1])
        return real(self, conn, tid, **kw)

    monkeypatch.setattr(StateStore, "lock_row", kill_then_lock)
    with pytest.raises(DatabaseUnreachableError) as failed:
        write(writer, topic, ["lost"])
    monkeypatch.undo()
    _typed(failed, DatabaseUnreachableError)
    assert len(killed) == 2
    write(writer, topic, ["next"])
    assert assert_invariant(engine, bootstrap, topic) == [b"kept", b"next"]


@pytest.mark.parametrize("verify", ["auto", "always"])
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_session_terminated_before_the_commit(
        make_writer: Any, engine: sa.Engine, bootstrap: str, topic: str, db_url: str,
        verify: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The session is cut right before the decision's COMMIT (``auto``: the pipelined state
    write and COMMIT; ``always``: SQLAlchemy's COMMIT after the state write). The writer asks
    the database, which did not commit, aborts Kafka and raises DatabaseUnreachableError."""
    writer = make_writer(engine, unique("fault-commit"), verify=verify)
    write(writer, topic, ["kept"])
    killed: list[int] = []
    if verify == "auto":
        real_wc = StateStore.write_and_commit

        def kill_then_write_and_commit(self: StateStore, conn: sa.Connection, tid: str,
                                       state: str) -> None:
            killed.append(backend_pid(conn))
            kill_backend(db_url, killed[-1])
            real_wc(self, conn, tid, state)

        monkeypatch.setattr(StateStore, "write_and_commit", kill_then_write_and_commit)
    else:
        real_w = StateStore.write

        def write_then_kill(self: StateStore, conn: sa.Connection, tid: str,
                            state: str) -> None:
            real_w(self, conn, tid, state)
            killed.append(backend_pid(conn))
            kill_backend(db_url, killed[-1])

        monkeypatch.setattr(StateStore, "write", write_then_kill)
    with pytest.raises(DatabaseUnreachableError) as failed:
        write(writer, topic, ["lost-1", "lost-2"])
    monkeypatch.undo()
    _typed(failed, DatabaseUnreachableError)
    assert len(killed) == 1
    write(writer, topic, ["next"])
    assert assert_invariant(engine, bootstrap, topic) == [b"kept", b"next"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_session_terminated_while_idle_and_its_replacement_too(
        make_writer: Any, engine: sa.Engine, bootstrap: str, topic: str, db_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's kept session is terminated between transactions, and so is the one that
    replaces it (the server keeps dropping sessions): DatabaseUnreachableError, raised from
    the block's first ``produce`` (the lock comes after the first record once the lease is
    held). A single idle kill is replaced silently (test_recipe covers that)."""
    writer = make_writer(engine, unique("fault-idle"))
    write(writer, topic, ["kept"])
    # The check after the commit first: killed under it, the session reads as lost, and the next
    # transaction locks first and replaces the connection twice (CI at 9ed9cb2).
    lease_checked(writer)
    held = writer_session(engine, writer)
    assert held is not None
    kill_backend(db_url, held)
    import dualwrite.writer.connection as recipe
    real_connect = recipe.writer_connection  # type: ignore[attr-defined]
    replaced: list[int] = []

    def connect_then_kill(engine_: sa.Engine, *args: Any) -> sa.Connection:
        conn = real_connect(engine_, *args)
        replaced.append(backend_pid(conn))
        kill_backend(db_url, replaced[-1])
        return conn

    monkeypatch.setattr(recipe, "writer_connection", connect_then_kill)
    with pytest.raises(DatabaseUnreachableError) as failed:
        write(writer, topic, ["lost"])
    monkeypatch.undo()
    _typed(failed, DatabaseUnreachableError)
    assert len(replaced) == 1
    write(writer, topic, ["next"])
    assert writer_session(engine, writer) != held
    assert assert_invariant(engine, bootstrap, topic) == [b"kept", b"next"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_the_database_lost_under_the_applications_statement_is_typed(
        make_writer: Any, engine: sa.Engine, bootstrap: str, topic: str, db_url: str) -> None:
    """The session is terminated just before the block's own INSERT (the fault suite's
    PostgreSQL restart): the application gets DatabaseUnreachableError, not psycopg's error
    through SQLAlchemy; nothing was decided, and the same writer's next transaction works."""
    writer = make_writer(engine, unique("fault-app-stmt"))
    write(writer, topic, ["kept"])
    with pytest.raises(DatabaseUnreachableError) as failed, writer.transaction() as tx:
        tx.produce(topic, b"lost", key=b"lost")
        conn = tx.connection
        kill_backend(db_url, backend_pid(conn))
        conn.execute(sa.text("INSERT INTO app_rows (value) VALUES ('lost')"))
    _typed(failed, DatabaseUnreachableError)
    write(writer, topic, ["next"])
    assert assert_invariant(engine, bootstrap, topic) == [b"kept", b"next"]


# -- PostgreSQL: locks and conflicts -----------------------------------------------------------


def _plain(url: str) -> str:
    return normalize_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_state_row_locked_past_the_timeout_when_the_writer_claims(
        make_writer: Any, engine: sa.Engine, bootstrap: str, topic: str, db_url: str) -> None:
    """Another session (a paused recovery, say) holds the id's state-row lock while a new
    writer starts: its claim waits no longer than ``timeout_s``, then LockTimeoutError.
    (Before: the claim waited, unbounded, for the holder.) A running writer's lock past the
    timeout is covered by tests/writer/test_protocol.py."""
    tid = unique("fault-held")
    StateStore(engine).claim([tid])  # the row exists
    with psycopg.connect(_plain(db_url)) as holder:
        holder.execute("SELECT 1 FROM dualwrite_transaction_state WHERE transactional_id = %s "
                       "FOR UPDATE", (tid,))
        release = threading.Timer(TIMEOUT_S * 3, holder.rollback)
        release.start()
        try:
            writer = make_writer(engine, tid)
            started = time.monotonic()
            with pytest.raises(LockTimeoutError) as failed:
                write(writer, topic, ["blocked"])
            waited = time.monotonic() - started
        finally:
            release.cancel()
            holder.rollback()
    _typed(failed, LockTimeoutError)
    assert TIMEOUT_S - 0.5 <= waited < TIMEOUT_S * 2
    write(writer, topic, ["after"])
    assert assert_invariant(engine, bootstrap, topic) == [b"after"]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_serialization_failure_on_the_lock(
        make_writer: Any, db_url: str, bootstrap: str, topic: str) -> None:
    """A SERIALIZABLE writer's lock waits for another transaction that updates the state row
    (recovery's compare_and_set, say) and commits: the lock statement fails with 40001
    ("could not serialize access due to concurrent update"): TransactionConflictError."""
    engine = dualwrite.create_engine(db_url, isolation_level="SERIALIZABLE")
    try:
        tid = unique("fault-serial")
        writer = make_writer(engine, tid)
        write(writer, topic, ["kept"])
        with psycopg.connect(_plain(db_url)) as other:
            other.execute("UPDATE dualwrite_transaction_state SET updated_at = now() "
                          "WHERE transactional_id = %s", (tid,))
            commit = threading.Timer(1.0, other.commit)
            commit.start()
            try:
                with pytest.raises(TransactionConflictError) as failed:
                    write(writer, topic, ["lost"])
            finally:
                commit.join()
        _typed(failed, TransactionConflictError)
        orig = getattr(failed.value.__cause__, "orig", None)
        assert getattr(orig, "sqlstate", None) == "40001"
        write(writer, topic, ["next"])
        assert assert_invariant(engine, bootstrap, topic) == [b"kept", b"next"]
    finally:
        engine.dispose()


# -- PostgreSQL restarted in the middle of a run (a private server) ---------------------------


@pytest.fixture
def private_pg() -> Iterator[LocalPostgres]:
    """A PostgreSQL server of this test's own (it is stopped and started). Commits are
    synchronous: an immediate shutdown must not lose what a COMMIT acknowledged."""
    with private_postgres(synchronous_commit="on") as pg:
        yield pg


def test_postgres_restarted_in_the_middle_of_a_run(
        make_writer: Any, private_pg: LocalPostgres, bootstrap: str, topic: str) -> None:
    """``pg_ctl stop -m immediate`` between two transactions: the next one, a new writer's
    ``producer`` and ``close()`` meet a server that is gone (DatabaseUnreachableError or
    nothing); once it is started again the same writer carries on."""
    url = private_pg.url
    dualwrite.upgrade_database(url)
    engine = dualwrite.create_engine(url, connect_args={"connect_timeout": 2})
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE app_rows (value VARCHAR(100) PRIMARY KEY)")
        writer = make_writer(engine, unique("fault-restart"))
        write(writer, topic, ["before-1"])
        write(writer, topic, ["before-2"])
        pg_ctl(private_pg, "stop", "-m", "immediate", "-w")
        with pytest.raises(DatabaseUnreachableError) as failed:
            write(writer, topic, ["while-down"])
        _typed(failed, DatabaseUnreachableError)
        fresh = make_writer(engine, unique("fault-restart-new"))
        with pytest.raises(DatabaseUnreachableError) as failed:
            fresh.producer  # noqa: B018 - the claim needs the database
        _typed(failed, DatabaseUnreachableError)
        fresh.close()  # nothing to clean up: no error either
        assert private_pg.data_dir is not None
        pg_ctl(private_pg, "start", "-w", "-l", str(private_pg.data_dir / "postgres.log"))
        write(writer, topic, ["after-1"])
        write(writer, topic, ["after-2"])
        writer.close()
        assert assert_invariant(engine, bootstrap, topic) == [
            b"after-1", b"after-2", b"before-1", b"before-2"]
    finally:
        engine.dispose()


@contextlib.contextmanager
def _through_a_proxy(pg: LocalPostgres) -> Iterator[tuple[TcpProxy, sa.Engine]]:
    """An engine on ``pg`` (dualwrite's tables and app_rows) whose connections pass a proxy."""
    dualwrite.upgrade_database(pg.url)
    direct = sa.make_url(pg.url)
    with TcpProxy(int(direct.port or 0)) as proxy:
        through = direct.set(port=proxy.port).render_as_string(hide_password=False)
        engine = dualwrite.create_engine(through, connect_args={"connect_timeout": 2})
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql("CREATE TABLE app_rows (value VARCHAR(100) PRIMARY KEY)")
            yield proxy, engine
        finally:
            engine.dispose()


def _commit_lost_then_retried(writer: DualWriter, proxy: TcpProxy, engine: sa.Engine,
                              bootstrap: str, topic: str, fault: Callable[[], None]) -> None:
    """The writer's COMMIT is held at the proxy while ``fault`` runs (it ends by cutting the
    proxy's connections): the writer must answer "not committed" (DatabaseUnreachableError,
    retriable), carry on, and keep rows == records."""
    write(writer, topic, ["before"])
    held = proxy.hold_next_request(contains(b"COMMIT"))

    def once_held() -> None:
        assert held.wait(30)
        fault()

    faulting = threading.Thread(target=once_held, daemon=True)
    faulting.start()
    with pytest.raises(DatabaseUnreachableError) as failed:
        write(writer, topic, ["lost"])
    faulting.join(60)
    assert held.is_set() and not faulting.is_alive()
    _typed(failed, DatabaseUnreachableError)
    write(writer, topic, ["after"])
    writer.close()
    assert assert_invariant(engine, bootstrap, topic) == [b"after", b"before"]


def test_a_commit_lost_in_a_crash_restart_is_read_from_the_state_row(
        make_writer: Any, private_pg: LocalPostgres, bootstrap: str, topic: str) -> None:
    """The COMMIT never reaches the server, which then restarts after a crash (``-m
    immediate``): the restarted server may give the transaction's id to another transaction, so
    the writer reads the outcome from the state row; it shows the version the transaction
    locked, so the writer aborts the Kafka side and the application may retry. Before the row
    was read, this was an OutcomeUnknownError (the fault suite, CI at bd5b9c1)."""
    assert private_pg.data_dir is not None
    log = str(private_pg.data_dir / "postgres.log")
    with _through_a_proxy(private_pg) as (proxy, engine):
        def crash_restart() -> None:
            # The lock's WAL reaches the disk: the restarted server does not hand the
            # transaction's id out again, and txid_status says "aborted" (not believed).
            with psycopg.connect(_plain(private_pg.url), autocommit=True) as other:
                other.execute("CHECKPOINT")
            pg_ctl(private_pg, "stop", "-m", "immediate", "-w")
            proxy.cut()
            pg_ctl(private_pg, "start", "-w", "-l", log)

        writer = make_writer(engine, unique("fault-crash-commit"), timeout_s=20)
        _commit_lost_then_retried(writer, proxy, engine, bootstrap, topic, crash_restart)


def test_a_commit_lost_in_a_backend_crash_is_not_answered_by_a_reused_id(
        make_writer: Any, bootstrap: str, topic: str) -> None:
    """A backend's crash (here another session's SIGKILL, as the OOM killer would) makes the
    postmaster end every session and replay the WAL without restarting: its start time stays.
    The writer's COMMIT never reached the server, and its lock's WAL was not written yet (the
    WAL writer sleeps 10 s here), so the server hands the transaction's id out again; another
    transaction with that id commits. Asked by id, the server says "committed", and the writer
    committed a Kafka record without its row until the server identity read the statistics'
    reset time, which the reinitialization changes. The state row decides instead."""
    with (private_postgres(synchronous_commit="on", wal_writer_delay="10s") as pg,
          _through_a_proxy(pg) as (proxy, engine)):
        spare = psycopg.connect(_plain(pg.url), autocommit=True)
        last = int(spare.execute("SELECT txid_current()").fetchone()[0])  # type: ignore[index]
        reused: list[int] = []

        def backend_crash_then_ids_reused() -> None:
            os.kill(spare.info.backend_pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not reused:
                with contextlib.suppress(psycopg.OperationalError), \
                        psycopg.connect(_plain(pg.url), autocommit=True) as other:
                    while not reused or reused[-1] <= last + 50:
                        reused.append(int(other.execute(  # type: ignore[index]
                            "SELECT txid_current()").fetchone()[0]))
                time.sleep(0.2)
            proxy.cut()

        writer = make_writer(engine, unique("fault-backend-crash"), timeout_s=20)
        _commit_lost_then_retried(writer, proxy, engine, bootstrap, topic,
                                  backend_crash_then_ids_reused)
        assert reused and reused[0] <= last + 5, (
            f"the server did not hand out the lost ids again: {reused[:3]} after {last}")


# -- SQLite: the database locked by another connection past the busy timeout ------------------


@pytest.mark.parametrize("established", [False, True], ids=["new-writer", "running-writer"])
@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_sqlite_locked_past_the_busy_timeout(
        make_writer: Any, db_url: str, bootstrap: str, topic: str, established: bool) -> None:
    """Another connection holds SQLite's write lock (BEGIN IMMEDIATE) for longer than the busy
    timeout: a new writer's claim, or a running writer's lock, raises LockTimeoutError."""
    engine = dualwrite.create_engine(db_url, connect_args={"timeout": 1.0})
    try:
        writer = make_writer(engine, unique("fault-sqlite"))
        if established:
            write(writer, topic, ["kept"])
        path = normalize_url(db_url).database
        assert path is not None
        holder = sqlite3.connect(Path(path), isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            started = time.monotonic()
            with pytest.raises(LockTimeoutError) as failed:
                write(writer, topic, ["blocked"])
            assert time.monotonic() - started < 10
        finally:
            holder.rollback()
            holder.close()
        _typed(failed, LockTimeoutError)
        write(writer, topic, ["after"])
        expected = [b"after", b"kept"] if established else [b"after"]
        assert assert_invariant(engine, bootstrap, topic) == expected
        assert rows(engine) == expected
    finally:
        engine.dispose()
