"""The backends' pure parts, without a server: which backend serves which URL, and the lock keys,
names and folders each kind of session lock uses (fixed: running processes lock them)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import sqlalchemy as sa

from dualwrite.database import (
    LEASE_LOCKS,
    POOL_SLOT_LOCKS,
    SINK_LOCKS,
    MariaDB,
    PostgreSQL,
    SessionLocks,
    SQLite,
    backend_for,
)
from dualwrite.errors import FatalError

pytestmark = pytest.mark.unit


def _engine(url: str) -> sa.Engine:
    """An engine that is never connected (``pool_pre_ping`` off, no connection made)."""
    return sa.create_engine(url)


@pytest.mark.parametrize(("url", "backend"), [
    ("postgresql+psycopg://u@h/db", PostgreSQL),
    ("mysql+pymysql://u@h/db", MariaDB),
    ("mariadb+pymysql://u@h/db", MariaDB),
    ("sqlite:///x.db", SQLite),
    ("sqlite://", SQLite),
])
def test_backend_for_picks_by_dialect(url: str, backend: type) -> None:
    assert type(backend_for(_engine(url))) is backend


def test_backend_for_refuses_another_database() -> None:
    oracle = cast(sa.Engine, SimpleNamespace(dialect=SimpleNamespace(name="oracle")))
    with pytest.raises(FatalError, match="not 'oracle'"):
        backend_for(oracle)


def test_postgresql_advisory_keys_are_unchanged() -> None:
    pg = PostgreSQL()
    assert pg.keys(LEASE_LOCKS, "orders-0") == (420444722, 1260975932)
    assert pg.keys(POOL_SLOT_LOCKS, "orders-0") == (-1795417744, 2036894267)
    assert pg.keys(SINK_LOCKS, "sink-a") == (-654808607, 278543469)
    assert pg.try_lock_columns(LEASE_LOCKS, ["orders-0"]) == [
        "pg_try_advisory_lock(420444722, 1260975932)"]
    assert pg.unlock_sql(POOL_SLOT_LOCKS, "orders-0") == (
        "SELECT pg_advisory_unlock(-1795417744, 2036894267)")
    assert pg.transaction_lock_sql(SINK_LOCKS, "sink-a") == (
        "SELECT pg_advisory_xact_lock(-654808607, 278543469)")
    # pg_locks shows each key as an unsigned oid
    assert f"({-1795417744 & 0xFFFFFFFF}, 2036894267)" in pg.holder_sql(POOL_SLOT_LOCKS,
                                                                         "orders-0")


def test_mariadb_user_lock_names_are_unchanged() -> None:
    names = {space: MariaDB.lock_name(space, name) for space, name in
             ((LEASE_LOCKS, "orders-0"), (POOL_SLOT_LOCKS, "orders-0"), (SINK_LOCKS, "sink-a"))}
    assert names == {
        LEASE_LOCKS: "dualwrite-lease-85d2a9f30000d7baba9eb51a96bde647d5f3e899",
        POOL_SLOT_LOCKS: "dualwrite-pool-94fc197079688a3b4d470fe190a7bf92eb13015b",
        SINK_LOCKS: "dualwrite-sink-d72c1dbf86dd355d9e310468430b7f4cb5fc8332",
    }
    assert all(len(name) <= 64 for name in names.values())
    lease = names[LEASE_LOCKS]
    assert MariaDB().try_lock_columns(LEASE_LOCKS, ["orders-0"]) == [
        f"GET_LOCK('{lease}', 0) = 1"]
    assert MariaDB().lock_sql(LEASE_LOCKS, "orders-0", 2.5) == (
        f"SELECT GET_LOCK('{lease}', 2.500) = 1")


def test_session_numbers_and_lock_kinds() -> None:
    pg, maria, lite = PostgreSQL(), MariaDB(), SQLite()
    assert (pg.session_id_sql, maria.session_id_sql) == ("pg_backend_pid()", "CONNECTION_ID()")
    assert pg.session_locks and maria.session_locks and not lite.session_locks
    assert pg.transaction_locks and not maria.transaction_locks
    assert pg.lock_timeout_sql(1.5) == "SET LOCAL lock_timeout = 1500"
    assert maria.lock_timeout_sql(1.5) is None


def test_sqlite_locks_are_files_beside_a_database_file(tmp_path: Path) -> None:
    db = tmp_path / "app.db"
    locks = SessionLocks(_engine(f"sqlite:///{db}"), LEASE_LOCKS)
    assert locks.folder == tmp_path / "app.db.dualwrite-leases"
    assert locks.exclusive and not locks.on_server
    assert SessionLocks(_engine(f"sqlite:///{db}"), POOL_SLOT_LOCKS).folder == (
        tmp_path / "app.db.dualwrite-pool")
    assert SessionLocks(_engine(f"sqlite:///{db}"), SINK_LOCKS).folder == (
        tmp_path / "app.db.dualwrite-sinks")
    memory = SessionLocks(_engine("sqlite://"), LEASE_LOCKS)
    assert memory.folder is None and not memory.exclusive
    assert memory.take(["a", "b"]).names == {"a", "b"}  # nothing to lock against


def test_sqlite_file_locks_exclude_a_second_holder(tmp_path: Path) -> None:
    engine = _engine(f"sqlite:///{tmp_path / 'app.db'}")
    first, second = SessionLocks(engine, POOL_SLOT_LOCKS), SessionLocks(engine, POOL_SLOT_LOCKS)
    assert first.take(["a", "b"]).names == {"a", "b"}
    assert second.take(["a", "c"]).names == {"c"}
    assert not second.wait_file("b", 0.05)
    first.give_back("b")
    assert second.wait_file("b", 1.0)
    first.release_all()
    assert second.take(["a"]).names == {"a"}
    second.release_all()
