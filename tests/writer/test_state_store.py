"""The state table, its migrations and its lock, on PostgreSQL and on SQLite.

Every test gets an empty database: the fresh SQLite file of ``sqlite_url``, or a fresh schema
(selected through ``search_path``) in the session's PostgreSQL database of ``postgres_url``.
"""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from dualwrite.database import (
    STATE_TABLE,
    VERSION_TABLE,
    check_schema,
    create_engine,
    current_revision,
    head_revision,
    migrations_dir,
    normalize_url,
    upgrade_command,
    upgrade_database,
)
from dualwrite.errors import (
    DatabaseUnreachableError,
    MigrationRequiredError,
    TransactionStateError,
)
from dualwrite.writer.commit_inquiry import SERVER_IDENTITY, CommitStatus
from dualwrite.writer.state_store import (
    MAX_LENGTH,
    StateRow,
    StateStore,
    writer_connection,
)

#: The newest schema revision (0003 added the fencing generation, 0004 the consumer positions,
#: 0005 the batch sinks' pending apply).
HEAD = "0005"

pytestmark = pytest.mark.timeout(120)

HOLD_S = 0.6  # how long the first writer keeps the lock in the concurrency tests


@pytest.fixture
def db_url(empty_db_url: str) -> str:
    """URL of an empty database on each backend."""
    return empty_db_url


@pytest.fixture
def store(engine: sa.Engine) -> StateStore:
    upgrade_database(engine)
    return StateStore(engine)


APP_METADATA = sa.MetaData()
ORDERS = sa.Table(
    "app_orders",
    APP_METADATA,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("note", sa.String(50), nullable=False),
)


def _order_ids(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(ORDERS.c.id).order_by(ORDERS.c.id)).scalars())


class _Thread(threading.Thread):
    """A thread whose exception is re-raised by :meth:`result`."""

    def __init__(self, target: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self._fn = target
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._fn()
        except BaseException as exc:
            self.error = exc

    def result(self, timeout: float = 30) -> None:
        self.join(timeout)
        assert not self.is_alive(), "thread did not finish"
        if self.error is not None:
            raise self.error


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# -- packaging and URLs ----------------------------------------------------------------------


@pytest.mark.unit
def test_migrations_are_installed_with_the_package() -> None:
    path = migrations_dir()
    assert (path / "env.py").is_file()
    assert (path / "script.py.mako").is_file()
    assert any(path.glob("versions/0001_*.py"))
    assert any(path.glob("versions/0002_*.py"))
    assert head_revision() == HEAD


@pytest.mark.unit
def test_urls_use_psycopg_and_commands_mask_the_password() -> None:
    assert normalize_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    assert normalize_url("postgres://u@h/db").drivername == "postgresql+psycopg"
    assert normalize_url("sqlite:///x.db").drivername == "sqlite"
    command = upgrade_command("postgresql://u:hunter2@h:5432/db")
    assert command == "dualwrite db upgrade --db 'postgresql://u:***@h:5432/db'"


# -- migrations ------------------------------------------------------------------------------


def test_upgrade_creates_the_table_and_is_idempotent(engine: sa.Engine) -> None:
    assert current_revision(engine) is None
    assert upgrade_database(engine) == HEAD
    assert upgrade_database(engine) == HEAD
    assert current_revision(engine) == HEAD
    check_schema(engine)
    inspector = sa.inspect(engine)
    tables = set(inspector.get_table_names())
    assert {STATE_TABLE, VERSION_TABLE, "dualwrite_batch_sink",
            "dualwrite_batch_participant"} <= tables
    assert "alembic_version" not in tables  # the application's own Alembic stays untouched
    columns = {c["name"]: c for c in inspector.get_columns(STATE_TABLE)}
    assert set(columns) == {"transactional_id", "prepared_txn_state", "updated_at",
                            "fencing_generation"}
    assert not any(c["nullable"] for c in columns.values())
    assert inspector.get_pk_constraint(STATE_TABLE)["constrained_columns"] == ["transactional_id"]
    # The default of prepared_txn_state is the empty string.
    with engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {STATE_TABLE} (transactional_id, updated_at) VALUES ('d', :now)"),
            {"now": datetime.now(UTC)},
        )
    row = StateStore(engine).read("d")
    assert row is not None and row.prepared_txn_state == "" and row.fencing_generation == 0


def test_upgrade_from_a_url_string(db_url: str) -> None:
    assert upgrade_database(db_url) == HEAD


def test_concurrent_upgrades_all_succeed(engine: sa.Engine, db_url: str) -> None:
    """Several processes (and threads) upgrading one database at once, as at a fleet's start."""
    code = (
        "import sys\n"
        "from dualwrite.database import upgrade_database\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "upgrade_database(sys.argv[1])\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, db_url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    go = threading.Event()

    def in_process() -> None:
        assert go.wait(60)
        upgrade_database(engine)

    threads = [_Thread(in_process) for _ in range(2)]
    for t in threads:
        t.start()
    for p in procs:  # every interpreter has imported dualwrite and waits
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    go.set()
    for t in threads:
        t.result()
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    assert current_revision(engine) == HEAD


def test_check_schema_on_an_empty_database_names_the_command(engine: sa.Engine) -> None:
    with pytest.raises(MigrationRequiredError, match="dualwrite db upgrade --db") as info:
        check_schema(engine)
    assert "***" in str(info.value) or engine.url.password is None
    if engine.url.password:
        assert str(engine.url.password) not in str(info.value)


def test_check_schema_rejects_an_unknown_revision(engine: sa.Engine) -> None:
    upgrade_database(engine)
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = '9999'"))
    with pytest.raises(MigrationRequiredError, match="newer dualwrite"):
        check_schema(engine)


def _create_state_table_as_the_application(engine: sa.Engine, *, revision: str) -> None:
    """The state table as docs/sql.md tells an application to create it (0001 or 0003)."""
    columns: list[sa.Column[Any]] = [
        sa.Column("transactional_id", sa.String(255), primary_key=True),
        sa.Column("prepared_txn_state", sa.String(255), nullable=False, server_default=""),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    ]
    if revision >= "0003":
        columns.append(sa.Column("fencing_generation", sa.BigInteger, nullable=False,
                                 server_default="0"))
    meta = sa.MetaData()
    sa.Table(STATE_TABLE, meta, *columns)
    meta.create_all(engine)


def test_check_schema_accepts_a_table_made_by_the_application(engine: sa.Engine) -> None:
    """An application may create the table in its own Alembic history (docs/sql.md)."""
    _create_state_table_as_the_application(engine, revision="0003")
    check_schema(engine)


def test_a_table_of_an_older_shape_requires_migration(engine: sa.Engine) -> None:
    """Before 0003 the table had no fencing generation: every use names the upgrade."""
    _create_state_table_as_the_application(engine, revision="0001")
    with pytest.raises(MigrationRequiredError, match="lacks fencing_generation"):
        check_schema(engine)
    store = StateStore(engine)
    with pytest.raises(MigrationRequiredError, match="dualwrite db upgrade"), \
            engine.begin() as conn:
        store.lock(conn, "tid")
    with pytest.raises(MigrationRequiredError, match="dualwrite db upgrade"):
        store.claim(["tid"])


def test_upgrade_from_0002_keeps_the_rows_at_generation_zero(engine: sa.Engine) -> None:
    assert upgrade_database(engine, "0002") == "0002"
    with engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {STATE_TABLE} (transactional_id, prepared_txn_state, "
                             "updated_at) VALUES ('old', '7:0:t:0:5', :now)"),
                     {"now": datetime.now(UTC)})
    assert upgrade_database(engine) == HEAD
    row = StateStore(engine).read("old")
    assert row is not None and (row.prepared_txn_state, row.fencing_generation) == ("7:0:t:0:5",
                                                                                    0)


def test_claim_raises_the_generation_and_lock_row_returns_it(engine: sa.Engine,
                                                             store: StateStore) -> None:
    assert store.claim(["b", "a"]) == {"a": 1, "b": 1}  # rows created on first claim
    assert store.claim(["a"]) == {"a": 2}
    assert store.claim([]) == {}
    with engine.begin() as conn:
        row = store.lock_row(conn, "a")
        store.write(conn, "a", "s")  # a writer's state leaves the generation alone
    assert (row.transactional_id, row.prepared_txn_state, row.fencing_generation) == ("a", "",
                                                                                        2)
    after = store.read("a")
    assert after is not None and (after.prepared_txn_state, after.fencing_generation) == ("s", 2)


def test_claim_waits_for_the_lock_holder(engine: sa.Engine, store: StateStore) -> None:
    """A claim made while a writer holds the lock lands after that writer's commit."""
    store.claim(["w"])
    with engine.connect() as holder:
        holder.begin()
        assert store.lock_row(holder, "w").fencing_generation == 1
        claimed: dict[str, int] = {}
        thread = threading.Thread(target=lambda: claimed.update(store.claim(["w"])))
        thread.start()
        time.sleep(0.5)
        assert not claimed and thread.is_alive()  # waiting for the row
        holder.commit()
        thread.join(10)
    assert claimed == {"w": 2}


def test_lock_on_a_missing_table_requires_migration(engine: sa.Engine) -> None:
    store = StateStore(engine)
    with (
        pytest.raises(MigrationRequiredError, match="dualwrite db upgrade"),
        engine.begin() as conn,
    ):
        store.lock(conn, "tid")
    with pytest.raises(MigrationRequiredError):
        store.read_all()
    with pytest.raises(MigrationRequiredError):
        store.compare_and_set("tid", "", "x")


# -- in the caller's transaction -------------------------------------------------------------


def test_state_commits_and_rolls_back_with_the_application_rows(
    engine: sa.Engine, store: StateStore
) -> None:
    APP_METADATA.create_all(engine)
    before = datetime.now(UTC) - timedelta(seconds=5)

    with engine.begin() as conn:
        assert store.lock(conn, "orders-0") == ""
        conn.execute(ORDERS.insert().values(id=1, note="first"))
        store.write(conn, "orders-0", "1000:0@orders-3:41")
    row = store.read("orders-0")
    assert row is not None
    assert row.prepared_txn_state == "1000:0@orders-3:41"
    assert row.updated_at.tzinfo is not None
    assert before <= row.updated_at <= datetime.now(UTC) + timedelta(seconds=5)

    with pytest.raises(RuntimeError), engine.begin() as conn:
        assert store.lock(conn, "orders-0") == "1000:0@orders-3:41"
        conn.execute(ORDERS.insert().values(id=2, note="second"))
        store.write(conn, "orders-0", "1000:0@orders-3:77")
        raise RuntimeError("the application fails before the database commit")
    assert store.read("orders-0") == row
    assert _order_ids(engine) == [1]

    # A first transaction that rolls back leaves no row at all.
    with pytest.raises(RuntimeError), engine.begin() as conn:
        store.lock(conn, "orders-1")
        conn.execute(ORDERS.insert().values(id=3, note="third"))
        store.write(conn, "orders-1", "1001:0@orders-0:0")
        raise RuntimeError("boom")
    assert store.read("orders-1") is None
    assert _order_ids(engine) == [1]


def test_lock_and_write_need_an_open_transaction(engine: sa.Engine, store: StateStore) -> None:
    with engine.connect() as conn:
        with pytest.raises(TransactionStateError, match="open database transaction"):
            store.lock(conn, "tid")
        with pytest.raises(TransactionStateError):
            store.write(conn, "tid", "x")


def test_write_without_lock_is_refused(engine: sa.Engine, store: StateStore) -> None:
    with pytest.raises(TransactionStateError, match="lock"), engine.begin() as conn:
        store.write(conn, "never-locked", "x")


def test_length_limits(engine: sa.Engine, store: StateStore) -> None:
    longest = "t" * MAX_LENGTH
    with engine.begin() as conn:
        store.lock(conn, longest)
        store.write(conn, longest, "s" * MAX_LENGTH)
    row = store.read(longest)
    assert row is not None and row.prepared_txn_state == "s" * MAX_LENGTH
    with engine.begin() as conn:
        with pytest.raises(ValueError, match="255"):
            store.lock(conn, "t" * (MAX_LENGTH + 1))
        with pytest.raises(ValueError, match="255"):
            store.write(conn, longest, "s" * (MAX_LENGTH + 1))
    with pytest.raises(ValueError, match="255"):
        store.compare_and_set(longest, "", "s" * (MAX_LENGTH + 1))
    with pytest.raises(ValueError, match="empty"):
        store.read("")


# -- the lock --------------------------------------------------------------------------------


@pytest.mark.parametrize("a_connection", ["pooled", "writer"])
@pytest.mark.parametrize("row_exists", [True, False], ids=["existing-row", "first-use"])
def test_two_writers_of_one_transactional_id_serialize(
    engine: sa.Engine, store: StateStore, row_exists: bool, a_connection: str
) -> None:
    """Writer B's lock waits until writer A commits, then B sees A's state. Writer A runs on a
    pooled connection or on a DualWriter's (on psycopg: autocommit mode, BEGIN sent with the
    lock, state and COMMIT in one round trip)."""
    tid = "orders-7"
    if row_exists:
        with engine.begin() as conn:
            store.lock(conn, tid)
            store.write(conn, tid, "old")
    expected_first = "old" if row_exists else ""
    log: list[tuple[str, float]] = []
    log_lock = threading.Lock()

    def note(event: str) -> None:
        with log_lock:
            log.append((event, time.monotonic()))

    a_locked, b_trying, b_locked = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, str] = {}

    def writer_a() -> None:
        if a_connection == "writer":
            with writer_connection(engine) as conn:
                conn.begin()
                seen["a"] = store.lock(conn, tid)
                note("a locked")
                a_locked.set()
                assert b_trying.wait(10)
                time.sleep(HOLD_S)  # B must stay blocked all this time
                note("a commits")
                store.write_and_commit(conn, tid, "from-a")
            note("a committed")
            return
        with engine.begin() as conn:
            seen["a"] = store.lock(conn, tid)
            note("a locked")
            a_locked.set()
            assert b_trying.wait(10)
            time.sleep(HOLD_S)  # B must stay blocked all this time
            store.write(conn, tid, "from-a")
            note("a commits")
        note("a committed")

    def writer_b() -> None:
        assert a_locked.wait(10)
        b_trying.set()
        note("b begins")
        with engine.begin() as conn:  # on SQLite, BEGIN IMMEDIATE already waits here
            seen["b"] = store.lock(conn, tid)
            note("b locked")
            b_locked.set()
            store.write(conn, tid, "from-b")

    a, b = _Thread(writer_a), _Thread(writer_b)
    a.start()
    b.start()
    assert b_trying.wait(10)
    assert not b_locked.wait(HOLD_S / 2), "B got the lock while A held it"
    a.result()
    b.result()

    times = dict(log)
    assert times["b begins"] < times["a commits"] <= times["b locked"]
    assert times["b locked"] - times["b begins"] >= HOLD_S * 0.8
    assert seen == {"a": expected_first, "b": "from-a"}
    row = store.read(tid)
    assert row is not None and row.prepared_txn_state == "from-b"


def test_write_and_commit_refuses_a_vanished_state_row(engine: sa.Engine,
                                                      store: StateStore) -> None:
    with writer_connection(engine) as conn:
        conn.begin()
        store.lock(conn, "gone")
        conn.execute(sa.delete(store.table).where(store.table.c.transactional_id == "gone"))
        with pytest.raises(TransactionStateError, match="gone"):
            store.write_and_commit(conn, "gone", "1000:0@t-0:5")
    assert store.read("gone") is None


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_writer_connection_begins_with_the_engines_isolation_level(db_url: str) -> None:
    engine = create_engine(db_url, isolation_level="REPEATABLE READ")
    try:
        upgrade_database(engine)
        store = StateStore(engine)
        with writer_connection(engine) as conn:
            for _ in range(2):  # and again after the first commit
                conn.begin()
                store.lock(conn, "iso")
                level = conn.exec_driver_sql("SHOW transaction_isolation").scalar_one()
                assert level == "repeatable read"
                store.write_and_commit(conn, "iso", "")
        row = store.read("iso")
        assert row is not None and row.prepared_txn_state == ""
    finally:
        engine.dispose()


def test_other_transactional_ids_and_readers_do_not_wait_for_the_lock(
    engine: sa.Engine, store: StateStore
) -> None:
    """Readers never wait; on PostgreSQL other ids don't either (SQLite has one write lock)."""
    with engine.begin() as conn:
        store.lock(conn, "busy")
        store.write(conn, "busy", "committed")
    holding, release = threading.Event(), threading.Event()

    def holder() -> None:
        with engine.begin() as conn:
            store.lock(conn, "busy")
            store.write(conn, "busy", "uncommitted")
            holding.set()
            assert release.wait(20)

    t = _Thread(holder)
    t.start()
    try:
        assert holding.wait(10)
        started = time.monotonic()
        row = store.read("busy")
        assert row is not None and row.prepared_txn_state == "committed"
        assert [r.transactional_id for r in store.read_all()] == ["busy"]
        if engine.dialect.name == "postgresql":
            with engine.begin() as conn:
                assert store.lock(conn, "idle") == ""
        assert time.monotonic() - started < 2
    finally:
        release.set()
        t.result()


# -- own transactions ------------------------------------------------------------------------


def test_compare_and_set(engine: sa.Engine, store: StateStore) -> None:
    with engine.begin() as conn:
        store.lock(conn, "tid")
        store.write(conn, "tid", "p1")
    before = store.read("tid")
    assert store.compare_and_set("tid", "other", "") is False
    assert store.read("tid") == before
    assert isinstance(before, StateRow) and before.prepared_txn_state == "p1"
    assert store.compare_and_set("tid", "p1", "") is True
    row = store.read("tid")
    assert row is not None and row.prepared_txn_state == ""
    # A missing row counts as the empty state.
    assert store.compare_and_set("missing", "p1", "") is False
    assert store.read("missing") is None
    assert store.compare_and_set("created", "", "p9") is True
    created = store.read("created")
    assert created is not None and created.prepared_txn_state == "p9"


def test_compare_and_set_waits_for_a_writer_and_sees_its_commit(
    engine: sa.Engine, store: StateStore
) -> None:
    """Recovery must not clear a state that a live writer is replacing right now."""
    with engine.begin() as conn:
        store.lock(conn, "tid")
        store.write(conn, "tid", "p1")
    holding = threading.Event()
    results: list[bool] = []

    def writer() -> None:
        with engine.begin() as conn:
            store.lock(conn, "tid")
            holding.set()
            time.sleep(HOLD_S)
            store.write(conn, "tid", "p2")

    def recovery() -> None:
        assert holding.wait(10)
        results.append(store.compare_and_set("tid", "p1", ""))

    w, r = _Thread(writer), _Thread(recovery)
    w.start()
    r.start()
    w.result()
    r.result()
    assert results == [False]
    row = store.read("tid")
    assert row is not None and row.prepared_txn_state == "p2"


def test_read_all_and_delete(engine: sa.Engine, store: StateStore) -> None:
    with engine.begin() as conn:
        for tid, state in [("b", "2"), ("a", "1"), ("c", "")]:
            store.lock(conn, tid)
            store.write(conn, tid, state)
    assert [(r.transactional_id, r.prepared_txn_state) for r in store.read_all()] == [
        ("a", "1"),
        ("b", "2"),
        ("c", ""),
    ]
    assert [r.transactional_id for r in store.read_all(["c", "a", "zz"])] == ["a", "c"]
    assert store.read_all([]) == []
    assert store.delete("b") is True
    assert store.delete("b") is False
    assert store.read("b") is None


@pytest.mark.unit
def test_sqlite_engine_uses_wal_and_begin_immediate(tmp_path: Any) -> None:
    eng = create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    other = create_engine(f"sqlite:///{tmp_path / 'x.db'}", connect_args={"timeout": 0.2})
    try:
        with eng.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        with eng.begin():  # holds the write lock without having written anything yet
            started = time.monotonic()
            with pytest.raises(sa.exc.OperationalError, match="locked"), other.begin():
                pass
            assert time.monotonic() - started >= 0.15
    finally:
        eng.dispose()
        other.dispose()


# -- unreachable database --------------------------------------------------------------------


@pytest.mark.unit
def test_unreachable_postgres_fails_fast_without_leaking_the_password() -> None:
    url = f"postgresql://dw:hunter2@127.0.0.1:{_closed_port()}/dw"
    eng = create_engine(url)
    try:
        started = time.monotonic()
        for call in (
            lambda: check_schema(eng),
            lambda: StateStore(eng).read("tid"),
            lambda: upgrade_database(url),
        ):
            with pytest.raises(DatabaseUnreachableError) as info:
                call()
            assert "hunter2" not in str(info.value)
            assert "127.0.0.1" in str(info.value)
        assert time.monotonic() - started < 10
    finally:
        eng.dispose()


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_transaction_id_the_server_never_logged_did_not_commit(engine: sa.Engine,
                                                                 store: StateStore) -> None:
    """After ``pg_ctl stop -m immediate`` the server's next transaction id restarts from its WAL,
    so the id of a COMMIT that never reached the WAL is "in the future": not committed (the
    fault suite's PostgreSQL restarts met it as a FatalError)."""
    with engine.begin() as conn:
        current = int(conn.execute(sa.text("SELECT txid_current()")).scalar_one())
    assert store.inquiry.transaction_status(current) is CommitStatus.COMMITTED
    assert store.inquiry.transaction_status(current + 1_000_000) is CommitStatus.ABORTED


def _committed_then_pending(conn: sa.Connection, store: StateStore, tid: str, committed: str,
                            pending: str) -> tuple[StateRow, StateRow]:
    """On ``conn``: one transaction stores ``committed``, then a second locks the row and writes
    ``pending``, left open for the caller; the rows each lock returned."""
    conn.begin()
    first = store.lock_row(conn, tid)
    store.write_and_commit(conn, tid, committed)
    conn.begin()
    second = store.lock_row(conn, tid)
    store.write(conn, tid, pending)
    return first, second


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_commit_status_trusts_a_transaction_id_only_on_the_server_that_ran_it(
        engine: sa.Engine, store: StateStore) -> None:
    """The lock names its server; asked there, the id's verdict stands. Asked of another server
    (a failover, a crash restart: here a row claiming another server), only the row version the
    transaction wrote counts as committed, and anything else is unknown, even a "committed" of
    whatever transaction has that id there."""
    with engine.connect() as conn:
        mine, rolled_back = _committed_then_pending(conn, store, "cs-1", "state-1", "state-2")
        conn.rollback()
        server = conn.exec_driver_sql(f"SELECT {SERVER_IDENTITY}").scalar_one()
    assert mine.locked_on == server and mine.locked_by_xid is not None
    assert store.inquiry.commit_status(mine, "state-1") is CommitStatus.COMMITTED
    assert store.inquiry.commit_status(rolled_back, "state-2") is CommitStatus.ABORTED
    elsewhere = dataclasses.replace(mine, locked_on="another server")
    # Its row version is there.
    assert store.inquiry.commit_status(elsewhere, "state-1") is CommitStatus.COMMITTED
    assert store.inquiry.commit_status(elsewhere, "state-other") is None
    with engine.begin() as conn:  # a later transaction rewrites the row: it is not ours any more
        store.lock_row(conn, "cs-1")
        store.write(conn, "cs-1", "state-1")
    assert store.inquiry.commit_status(elsewhere, "state-1") is None
    assert store.inquiry.commit_status(
        dataclasses.replace(rolled_back, locked_on="another server"), "state-2") is None


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_commit_status_after_a_crash_restart_reads_the_row(engine: sa.Engine,
                                                           store: StateStore) -> None:
    """A crash restart keeps the WAL timeline and replays the WAL in full: a row version the
    transaction did not write, with the generation it locked, means it did not commit (the
    fault suite's immediate restarts met it as an OutcomeUnknownError). After a promotion (a
    new timeline) or a claim since, that says nothing."""
    with engine.connect() as conn:
        _, lost = _committed_then_pending(conn, store, "cr-1", "state-1", "state-2")
        conn.rollback()
    assert lost.locked_on is not None
    timeline, _, _started = lost.locked_on.partition("/")
    restarted = dataclasses.replace(lost, locked_on=f"{timeline}/2000-01-01 00:00:00+00")
    promoted = dataclasses.replace(lost, locked_on=f"{int(timeline, 16) + 1:08X}/{_started}")
    assert store.inquiry.commit_status(restarted, "state-2") is CommitStatus.ABORTED
    assert store.inquiry.commit_status(promoted, "state-2") is None
    # The row holds this state in a version of another transaction's id (a server fed by
    # logical replication may share the timeline number): it cannot tell.
    assert store.inquiry.commit_status(restarted, "state-1") is None
    store.claim(["cr-1"])
    assert store.inquiry.commit_status(restarted, "state-2") is None


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_commit_status_waits_for_a_running_transaction_after_a_statistics_reset(
        engine: sa.Engine, store: StateStore) -> None:
    """An administrator's ``pg_stat_reset_shared('bgwriter')`` changes the server identity
    under a transaction whose COMMIT is still running: the row does not show it yet, and reading
    that as "aborted" would abort Kafka records whose rows then commit. Asked by id on the same
    timeline, it is "in progress" until it ends."""
    with engine.connect() as conn:
        _, running = _committed_then_pending(conn, store, "sr-1", "state-0", "state-1")
        with engine.begin() as admin:
            admin.exec_driver_sql("SELECT pg_stat_reset_shared('bgwriter')")
            assert admin.exec_driver_sql(f"SELECT {SERVER_IDENTITY}").scalar_one() \
                != running.locked_on
        assert store.inquiry.commit_status(running, "state-1") is CommitStatus.IN_PROGRESS
        conn.commit()
    assert store.inquiry.commit_status(running, "state-1") is CommitStatus.COMMITTED


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_commit_status_of_an_id_another_server_has_not_reached_reads_the_row(
        engine: sa.Engine, store: StateStore) -> None:
    """A server other than the lock's that has not reached the transaction's id (a logical
    replica after a blue-green switch hands out ids of its own) says nothing about it: there
    "in the future" is not "aborted", the row decides. Only the server that handed the id out
    says "aborted" when it has not reached it."""
    with engine.connect() as conn:
        mine, _ = _committed_then_pending(conn, store, "fu-1", "state-1", "state-2")
        conn.rollback()
    with engine.begin() as conn:
        current = int(conn.execute(sa.text("SELECT txid_current()")).scalar_one())
    assert mine.locked_by_xid is not None and mine.locked_on is not None
    # The same 32-bit xmin an epoch later: the row version this transaction wrote.
    ahead = dataclasses.replace(mine, locked_on="another server",
                                locked_by_xid=mine.locked_by_xid + 2**32)
    assert store.inquiry.commit_status(ahead, "state-1") is CommitStatus.COMMITTED
    assert store.inquiry.commit_status(ahead, "state-other") is None
    # The row holds the state, in a version another transaction wrote (replication's apply).
    far = dataclasses.replace(mine, locked_on="another server", locked_by_xid=current + 10**6)
    assert store.inquiry.commit_status(far, "state-1") is None
    assert store.inquiry.commit_status(far, "state-other") is None
    # A logical replica's timeline number may match: the same-history rules still hold.
    timeline = mine.locked_on.partition("/")[0]
    replica = dataclasses.replace(far, locked_on=f"{timeline}/2000-01-01 00:00:00+00")
    assert store.inquiry.commit_status(replica, "state-1") is None
    assert store.inquiry.commit_status(replica, "state-other") is CommitStatus.ABORTED
    assert store.inquiry.commit_status(dataclasses.replace(far, locked_on=mine.locked_on),
                                       "state-1") is CommitStatus.ABORTED


@contextmanager
def _commit_after_first(engine: sa.Engine, conn: sa.Connection,
                        *markers: str) -> Iterator[list[str]]:
    """Commit ``conn``'s open transaction right after the first statement run on ``engine``
    that contains one of ``markers``; yields the statements it followed (one, once it ran)."""
    after: list[str] = []

    def commit(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if not after and any(marker in statement for marker in markers):
            after.append(statement)
            conn.commit()

    sa.event.listen(engine, "after_cursor_execute", commit)
    try:
        yield after
    finally:
        sa.event.remove(engine, "after_cursor_execute", commit)


def _identity_reset(row: StateRow) -> StateRow:
    """``row`` as if the server's statistics had been reset since it was locked (the
    :data:`SERVER_IDENTITY` changes, the server and its transaction ids stay)."""
    assert row.locked_on is not None
    kept = row.locked_on.rpartition("/")[0]
    return dataclasses.replace(row, locked_on=f"{kept}/2000-01-01 00:00:00+00")


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_commit_status_asks_the_id_before_reading_the_row(engine: sa.Engine,
                                                          store: StateStore) -> None:
    """The id is asked first, then the row read: a COMMIT still running at the first question
    and ended before the second shows in the row. Read the other way round, the row still
    showed the version it locked, txid_status then said it had ended, and it was judged
    "aborted"."""
    with engine.connect() as conn:
        _, running = _committed_then_pending(conn, store, "ro-1", "state-0", "state-1")
        with _commit_after_first(engine, conn, "txid_status", "xmin") as after:
            assert store.inquiry.commit_status(_identity_reset(running), "state-1") \
                is CommitStatus.COMMITTED
        assert after


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_commit_status_reads_the_row_in_a_snapshot_where_the_transaction_has_ended(
        engine: sa.Engine, store: StateStore) -> None:
    """Under REPEATABLE READ the row is read in the snapshot of the question's first
    statement, which a COMMIT ending just after it does not show, though txid_status then says
    it has ended (as in the instant between txid_status's "committed" and the end of the
    transaction under READ COMMITTED). Then the answer is "in progress", and asked again,
    "committed"."""
    repeatable = StateStore(engine.execution_options(isolation_level="REPEATABLE READ"))
    with engine.connect() as conn:
        _, running = _committed_then_pending(conn, store, "rr-1", "state-0", "state-1")
        reset = _identity_reset(running)
        with _commit_after_first(engine, conn, "pg_is_in_recovery()") as after:
            assert repeatable.inquiry.commit_status(reset, "state-1") is CommitStatus.IN_PROGRESS
        assert after
    assert repeatable.inquiry.commit_status(reset, "state-1") is CommitStatus.COMMITTED
