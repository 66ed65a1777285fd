"""A fresh PostgreSQL schema or database (or MariaDB database) per test: the one way the tests
get an empty database on a shared server; and a private PostgreSQL server a test may stop and
start (``private_postgres``, ``pg_ctl``)."""

from __future__ import annotations

import contextlib
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

import dualwrite
from dualwrite.batch.prepared_writes import PreparedTransactions
from dualwrite.database import normalize_url
from dualwrite.dev import LocalMariaDB, LocalPostgres
from dualwrite.dev.postgres_cluster import find_postgres_bindir, postgres_server_account


@contextmanager
def fresh_schema(base_url: str, prefix: str, *, quiet_drop: bool = False) -> Iterator[str]:
    """A new schema on ``base_url``'s database, as a URL whose ``search_path`` is that schema;
    dropped afterwards. ``quiet_drop``: a drop that fails (the test stopped the server) is
    ignored."""
    schema = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = dualwrite.create_engine(base_url)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    url = normalize_url(base_url).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with (contextlib.suppress(Exception) if quiet_drop else contextlib.nullcontext()):
            # A write-once Spark test that failed can leave prepared transactions whose locks
            # would hold the drop forever: those locking this schema's tables are the test's.
            prepared = PreparedTransactions(admin)
            with admin.connect() as conn:
                leftovers = conn.exec_driver_sql(
                    # A prepared transaction's locks keep its virtual id and lose their pid.
                    "SELECT DISTINCT p.gid FROM pg_prepared_xacts p "
                    "JOIN pg_locks x ON x.locktype = 'transactionid' AND x.pid IS NULL "
                    "AND x.transactionid = p.transaction "
                    "JOIN pg_locks l ON l.virtualtransaction = x.virtualtransaction "
                    "AND l.pid IS NULL AND l.locktype = 'relation' "
                    "JOIN pg_class c ON c.oid = l.relation "
                    "WHERE c.relnamespace = %(s)s::regnamespace", {"s": schema}).scalars().all()
            for gid in leftovers:
                prepared.rollback(gid)
            with admin.begin() as conn:
                conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
        admin.dispose()


@contextmanager
def fresh_postgres_database(base_url: str, prefix: str) -> Iterator[str]:
    """A new database on ``base_url``'s PostgreSQL server, as a URL naming it; dropped
    afterwards with its sessions. For what a schema cannot isolate: session locks (their keys
    are per database) and poolers (which route by database name)."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(sa.make_url(base_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.make_url(base_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextmanager
def fresh_mariadb_database(base_url: str, prefix: str) -> Iterator[str]:
    """A new database on ``base_url``'s MariaDB server, as a URL naming it; dropped afterwards
    (MariaDB's schemas are its databases)."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = dualwrite.create_engine(base_url)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    try:
        yield normalize_url(base_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
        admin.dispose()


def pg_ctl(pg: LocalPostgres, *args: str) -> None:
    """Run ``pg_ctl`` on ``pg``'s data directory as the account the server runs as."""
    assert pg.data_dir is not None
    user = postgres_server_account()
    run_as: dict[str, Any] = (
        {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if user else {})
    subprocess.run([str(find_postgres_bindir() / "pg_ctl"), *args, "-D",
                    str(pg.data_dir / "pgdata")], check=True, capture_output=True, timeout=60,
                   **run_as)


DatabaseServer = LocalPostgres | LocalMariaDB
"""A database server a test started and may stop at once (the fault runner's, the soak's)."""


def crash_and_restart(db: DatabaseServer, down_s: float) -> None:
    """Stop ``db`` at once, with no shutdown (PostgreSQL: ``pg_ctl stop -m immediate``, WAL
    replayed at the next start; MariaDB: SIGKILL, its redo log replayed), ``down_s`` seconds
    down, then start it again on the same data and port."""
    if isinstance(db, LocalMariaDB):
        db.crash()
        time.sleep(down_s)
        db.restart()
        return
    pg_ctl(db, "stop", "-m", "immediate", "-w")
    time.sleep(down_s)
    assert db.data_dir is not None
    pg_ctl(db, "start", "-w", "-l", str(db.data_dir / "postgres.log"))


def ensure_running(db: DatabaseServer) -> None:
    """``db`` up again if a fault left it down."""
    if isinstance(db, LocalMariaDB):
        if not db.running():
            db.restart()
        return
    try:
        pg_ctl(db, "status")
    except subprocess.CalledProcessError:
        assert db.data_dir is not None
        pg_ctl(db, "start", "-w", "-l", str(db.data_dir / "postgres.log"))


def terminate_sessions(db: DatabaseServer) -> int:
    """End every client session of ``db`` but this one (``pg_terminate_backend``, MariaDB's
    ``KILL CONNECTION``); how many."""
    engine = sa.create_engine(db.url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            if isinstance(db, LocalPostgres):
                return len(conn.exec_driver_sql(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> "
                    "pg_backend_pid() AND backend_type = 'client backend'").all())
            sessions = conn.exec_driver_sql(
                "SELECT id FROM information_schema.processlist WHERE id <> CONNECTION_ID() "
                "AND command <> 'Daemon' AND user <> 'system user'").scalars().all()
            killed = 0
            for session in sessions:
                try:
                    conn.exec_driver_sql(f"KILL CONNECTION {int(session)}")
                    killed += 1
                except sa.exc.OperationalError:  # it ended meanwhile (unknown thread id)
                    pass
            return killed
    finally:
        engine.dispose()


@contextmanager
def private_postgres(*, stop_mode: str = "fast", **settings: str) -> Iterator[LocalPostgres]:
    """A PostgreSQL server of the test's own, which it may stop and start with :func:`pg_ctl`;
    at the end the server ``pg_ctl`` started, if running, is stopped (``stop_mode``) first."""
    pg = LocalPostgres(backend="binaries", settings=settings or None)
    pg.start()
    try:
        yield pg
    finally:
        with contextlib.suppress(Exception):
            pg_ctl(pg, "stop", "-m", stop_mode, "-w")
        pg.stop()
