"""Engines and schema management for the database side of a dual write.

- :func:`create_engine` makes an engine whose transactions behave the way dualwrite needs: on SQLite
  every transaction starts with ``BEGIN IMMEDIATE`` (the writer holds SQLite's write lock from the
  first statement on, which is SQLite's stand-in for the per-transactional-id row lock),
  ``postgresql://`` URLs use psycopg 3, and ``mysql://`` / ``mariadb://`` URLs PyMySQL in READ
  COMMITTED.
- :func:`upgrade_database`, :func:`current_revision` and :func:`check_schema` manage dualwrite's own
  tables with Alembic, using the version table ``dualwrite_alembic_version`` so that the
  application's own Alembic history is never touched.
- :func:`database_error` is the one place database errors become :mod:`dualwrite.errors` types,
  by what the caller does next (retry, upgrade, give up).
- :func:`transaction` opens a short transaction and turns connection failures into
  :class:`~dualwrite.errors.DatabaseUnreachableError`.

Credentials never appear in messages or logs: URLs are always rendered with the password masked.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shlex
import socket
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine import URL, make_url

from dualwrite.database import alarms
from dualwrite.database._pymysql_seam import socket_fileno
from dualwrite.database.backends import BACKENDS, MariaDB
from dualwrite.database.schema import STATE_TABLE, TRANSACTION_STATE, VERSION_TABLE
from dualwrite.deadline import current_deadline
from dualwrite.errors import (
    ConfigurationError,
    DatabaseUnreachableError,
    DualWriteError,
    FatalError,
    LockTimeoutError,
    MigrationRequiredError,
    TransactionConflictError,
)

__all__ = [
    "MIGRATIONS_RESOURCE",
    "MIGRATION_LOCK_KEY",
    "MYSQL_ISOLATION_LEVEL",
    "SQLITE_BEGIN_OPTION",
    "as_utc",
    "bounded_wait",
    "check_database_file",
    "check_mariadb_version",
    "check_schema",
    "connection_refusal",
    "create_engine",
    "current_revision",
    "database_error",
    "head_revision",
    "is_missing_schema",
    "is_mysql",
    "mask_url",
    "migrations_dir",
    "normalize_url",
    "transaction",
    "unreachable_error",
    "upgrade_command",
    "upgrade_database",
    "uses_begin_immediate",
]

logger = logging.getLogger(__name__)

#: Alembic's ``script_location`` of dualwrite's migrations, as a package resource.
MIGRATIONS_RESOURCE = "dualwrite.database:migrations"
#: PostgreSQL advisory-lock key held while migrating, so that concurrent upgrades run one at a time.
MIGRATION_LOCK_KEY = 0x6477_6D69_6772_6174  # "dwmigrat"
#: Connection execution option naming the SQLite BEGIN mode: "IMMEDIATE" (default) or "DEFERRED".
SQLITE_BEGIN_OPTION = "dualwrite_sqlite_begin"

DEFAULT_SQLITE_BUSY_TIMEOUT_S = 30.0
DEFAULT_PG_CONNECT_TIMEOUT_S = 10
#: libpq's TCP settings on every PostgreSQL connection (unless the URL or connect_args set them):
#: a dead peer (half-open connection, packets silently dropped) is found in about 25 s while
#: idle (keepalives) and 30 s while data waits for its acknowledgement (tcp_user_timeout, ms).
#: Under a dualwrite deadline (a writer's connect) they are scaled down to its ``timeout_s``.
DEFAULT_PG_TCP_SETTINGS = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
                           "keepalives_count": 3, "tcp_user_timeout": 30_000}

_SQLITE_BEGIN_MODES = frozenset({"DEFERRED", "IMMEDIATE", "EXCLUSIVE"})
_IMMEDIATE_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()
# Alembic's ``context`` and ``op`` are process-wide proxies, so one migration run at a time per
# process. Between processes env.py serializes runs: PostgreSQL advisory lock, SQLite write lock.
_ALEMBIC_LOCK = threading.Lock()


SUPPORTED_URLS = ("sqlite:///path/to/file.db, postgresql://user@host:5432/dbname (psycopg 3) "
                  "or mysql://user@host:3306/dbname (MariaDB, PyMySQL)")
_SUPPORTED_BACKENDS = frozenset(d for backend in BACKENDS for d in backend.dialects)
#: SQLAlchemy's names of MariaDB (``mariadb://``) and MySQL (``mysql://``, MariaDB served too).
_MYSQL_DIALECTS = MariaDB.dialects
DEFAULT_MYSQL_CONNECT_TIMEOUT_S = 10
#: The isolation level of dualwrite's engines on MariaDB: PostgreSQL's default, which the recipe
#: is written for. Under InnoDB's own default (REPEATABLE READ) a plain read inside a writer's
#: transaction would see the snapshot of its first read, and inserts of new state rows would
#: take gap locks that deadlock two writers of different new ids.
MYSQL_ISOLATION_LEVEL = "READ COMMITTED"


def as_utc(value: datetime) -> datetime:
    """A datetime read back from dualwrite's tables, in UTC: dualwrite stores UTC, and SQLite and
    MariaDB return it naive."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def is_mysql(engine_or_conn: Engine | Connection) -> bool:
    """Whether ``engine_or_conn`` talks to MariaDB (or MySQL) through SQLAlchemy."""
    return engine_or_conn.dialect.name in _MYSQL_DIALECTS


def normalize_url(url: str | URL) -> URL:
    """Parse ``url``; ``postgresql://`` and ``postgres://`` become ``postgresql+psycopg://``,
    ``mysql://`` and ``mariadb://`` their ``+pymysql`` forms.

    :class:`ConfigurationError` if it is not a URL, or not one of a supported database: SQLite or
    PostgreSQL (the text is shown only when it cannot hold a password).
    """
    if not isinstance(url, (str, URL)):
        raise ConfigurationError(f"the database URL must be a str like {SUPPORTED_URLS}, not "
                                 f"{type(url).__name__}")
    try:
        parsed = make_url(url)
    except (sa.exc.ArgumentError, ValueError, TypeError) as exc:
        shown = repr(url) if "@" not in str(url) else "(not shown: it may hold a password)"
        hint = (f"; for a SQLite file say sqlite:///{url}" if isinstance(url, str)
                and url and "://" not in url and "@" not in url else "")
        raise ConfigurationError(f"{shown} is not a database URL ({type(exc).__name__}): use "
                                 f"{SUPPORTED_URLS}{hint}") from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    elif parsed.drivername in _MYSQL_DIALECTS:
        parsed = parsed.set(drivername=parsed.drivername + "+pymysql")
    backend = parsed.drivername.split("+", 1)[0]
    if backend == "postgres":
        parsed = parsed.set(drivername="postgresql+" + parsed.drivername.split("+", 1)[1])
    elif backend not in _SUPPORTED_BACKENDS:
        raise ConfigurationError(f"database {parsed.drivername!r} is not supported: dualwrite "
                                 f"works with SQLite, PostgreSQL and MariaDB; use {SUPPORTED_URLS}")
    return parsed


_SECRET_QUERY_KEYS = ("password", "passfile", "sslpassword", "token", "secret")


def check_database_file(url: str | URL) -> None:
    """For a command that only reads (``dualwrite status``): raise :class:`ConfigurationError`
    ("no such database file") if ``url`` is a SQLite file that does not exist, which
    connecting would create empty. Other databases, ``:memory:`` and ``?uri=true`` URLs pass."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.query.get("uri") in ("true", "1"):
        return
    path = parsed.database or ""
    if path in ("", ":memory:") or os.path.exists(path):
        return
    raise ConfigurationError(
        f"no such database file: {os.path.abspath(path)} ({mask_url(parsed)}); check --db "
        "(a read-only command does not create it; `dualwrite db upgrade` does)")


def mask_url(url: str | URL) -> str:
    """The URL as text with its password, and secret query parameters (``?password=...``,
    ``sslpassword``), replaced by ``***``: safe for messages and logs."""
    parsed = make_url(url)
    secret = {k: "***" for k in parsed.query
              if any(word in k.lower() for word in _SECRET_QUERY_KEYS)}
    if secret:
        parsed = parsed.update_query_dict(secret)
    return parsed.render_as_string(hide_password=True)


def upgrade_command(url: str | URL) -> str:
    """The shell command that installs or upgrades dualwrite's tables (password masked)."""
    return f"dualwrite db upgrade --db {shlex.quote(mask_url(url))}"


def create_engine(url: str | URL, **kw: Any) -> Engine:
    """Create a SQLAlchemy engine configured for dualwrite.

    SQLite: busy timeout (30 s unless ``connect_args={"timeout": ...}``), WAL journal, and every
    transaction begins with ``BEGIN IMMEDIATE`` so a writer takes the database write lock at its
    start. A connection may ask for a plain deferred BEGIN (for read-only work) with
    ``conn.execution_options(dualwrite_sqlite_begin="DEFERRED")`` before it begins.

    PostgreSQL: ``postgresql://`` means psycopg 3; ``connect_timeout`` defaults to 10 s and
    ``pool_pre_ping`` to True, so a restarted server costs a reconnect, not an error. psycopg's
    automatic server-side prepared statements are off (``prepare_threshold=None``): behind a
    pooler that hands each transaction another server session (PgBouncer's transaction
    pooling) a statement prepared in one session is missing in the next. TCP
    keepalives and ``tcp_user_timeout`` are on (:data:`DEFAULT_PG_TCP_SETTINGS`), so a
    connection to a peer that silently vanished fails instead of hanging for ~15 minutes. A
    connection made under a :func:`dualwrite.deadline.deadline_scope` (a DualWriter's, a
    recovery's) waits no longer than the deadline to connect, and its TCP timeouts are scaled
    to the scope's budget.

    MariaDB (``mysql://``, ``mariadb://``): PyMySQL, ``connect_timeout`` 10 s (shortened to the
    deadline of a :func:`dualwrite.deadline.deadline_scope`), ``utf8mb4``, ``pool_pre_ping``, and
    every transaction in READ COMMITTED (:data:`MYSQL_ISOLATION_LEVEL`) unless
    ``isolation_level`` is given.

    Other keyword arguments go to :func:`sqlalchemy.create_engine`.
    """
    parsed = normalize_url(url)
    backend = parsed.get_backend_name()
    connect_args: dict[str, Any] = dict(kw.pop("connect_args", None) or {})
    if backend == "sqlite":
        connect_args.setdefault("timeout", DEFAULT_SQLITE_BUSY_TIMEOUT_S)
        engine = _sa_engine(parsed, connect_args, kw)
        _install_sqlite_hooks(engine, float(connect_args["timeout"]))
        return engine
    if backend in _MYSQL_DIALECTS:
        if "connect_timeout" not in parsed.query:
            connect_args.setdefault("connect_timeout", DEFAULT_MYSQL_CONNECT_TIMEOUT_S)
        if "charset" not in parsed.query:
            connect_args.setdefault("charset", "utf8mb4")
        kw.setdefault("isolation_level", MYSQL_ISOLATION_LEVEL)
        kw.setdefault("pool_pre_ping", True)
        engine = _sa_engine(parsed, connect_args, kw)
        event.listen(engine, "connect", _refuse_mysql)
        event.listen(engine, "do_connect", _mysql_connect_within_deadline)
        _bound_pre_ping(engine)
        return engine
    if "connect_timeout" not in parsed.query:
        connect_args.setdefault("connect_timeout", DEFAULT_PG_CONNECT_TIMEOUT_S)
    if parsed.get_driver_name() == "psycopg":
        connect_args.setdefault("prepare_threshold", None)
    libpq = parsed.get_driver_name() in ("psycopg", "psycopg2")
    if libpq:
        for key, value in DEFAULT_PG_TCP_SETTINGS.items():
            if key not in parsed.query:
                connect_args.setdefault(key, value)
    kw.setdefault("pool_pre_ping", True)
    engine = _sa_engine(parsed, connect_args, kw)
    if libpq:
        event.listen(engine, "do_connect", _connect_within_deadline)
    _bound_pre_ping(engine)
    return engine


def check_mariadb_version(version: str) -> None:
    """Refuse a MySQL server behind a ``mysql://`` URL: the recipe's MariaDB forms (``INSERT …
    RETURNING``, ``SET STATEMENT … FOR``) do not exist there, and a first statement failing
    with an SQL error would not say why."""
    if "mariadb" not in version.lower():
        raise ConfigurationError(
            f"the server behind this mysql:// URL is MySQL {version.split('-')[0]}, not "
            "MariaDB: dualwrite supports MariaDB (10.11 tested); MySQL lacks the INSERT … "
            "RETURNING and SET STATEMENT forms the recipe uses")


def _refuse_mysql(dbapi_connection: Any, _record: Any) -> None:
    check_mariadb_version(str(dbapi_connection.get_server_info()))


def _sa_engine(url: URL, connect_args: dict[str, Any], kw: dict[str, Any]) -> Engine:
    """SQLAlchemy's engine; a driver that is not installed or a URL it cannot take is a
    :class:`ConfigurationError` naming the URL with its password masked."""
    try:
        return sa.create_engine(url, connect_args=connect_args, **kw)
    except ImportError as exc:
        raise ConfigurationError(
            f"the database driver for {url.drivername!r} is not installed ({exc}); "
            "postgresql:// needs psycopg 3 (pip install 'psycopg[binary]'), mysql:// PyMySQL "
            "(pip install 'dualwrite[mariadb]')") from None
    except (sa.exc.ArgumentError, ValueError, TypeError) as exc:
        raise ConfigurationError(f"database URL {mask_url(url)}: {exc}") from None


def _connect_within_deadline(_dialect: Any, _record: Any, _cargs: Any,
                             cparams: dict[str, Any]) -> None:
    """Cap libpq's connect and TCP timeouts by the current deadline (dualwrite.deadline)."""
    deadline = current_deadline()
    if deadline is None:
        return
    budget = max(1.0, deadline.budget_s)

    def cap(key: str, value: int) -> None:
        try:
            own = int(cparams.get(key) or 0)
        except (TypeError, ValueError):
            own = 0
        cparams[key] = value if own <= 0 else min(own, value)

    # libpq's minimum connect_timeout is 2 s, whole seconds.
    cap("connect_timeout", max(2, math.ceil(deadline.left())))
    cap("tcp_user_timeout", int(budget * 1000))
    cap("keepalives_idle", max(1, int(budget / 3)))
    cap("keepalives_interval", max(1, int(budget / 6)))


def _mysql_connect_within_deadline(_dialect: Any, _record: Any, _cargs: Any,
                                   cparams: dict[str, Any]) -> None:
    """Cap PyMySQL's connect timeout (whole seconds, at least 1) by the current deadline."""
    deadline = current_deadline()
    if deadline is None:
        return
    cap = max(1, math.ceil(deadline.left()))
    try:
        own = float(cparams.get("connect_timeout") or 0)
    except (TypeError, ValueError):
        own = 0
    cparams["connect_timeout"] = cap if own <= 0 else min(own, cap)


@contextmanager
def bounded_wait(conn: Connection, what: str) -> Iterator[None]:
    """Bound a wait for the database on ``conn`` (psycopg or PyMySQL) by the current deadline.

    The kernel's TCP timeouts do not see a peer that acknowledges packets and never answers (a
    stuck proxy or pooler, a paused server), and neither libpq nor PyMySQL has a client-side
    bound on one statement: past the deadline the connection's socket is shut down, which ends
    the driver's wait with a lost connection, raised as :class:`DatabaseUnreachableError`
    naming the server and ``what`` was waited for. Nothing is bounded outside a deadline scope
    or on SQLite (a local file).
    """
    deadline = current_deadline()
    fileno = _socket_of(conn.dialect.driver, conn.connection.dbapi_connection)
    if deadline is None or fileno is None:
        yield
        return
    wait = deadline.wait_s()
    watch = _SocketWatch(fileno, wait)
    try:
        yield
    except BaseException as exc:
        if watch.fired and not isinstance(exc, DualWriteError):
            raise DatabaseUnreachableError(
                f"the database at {_endpoint(conn.engine.url)} did not answer {what} within "
                f"{wait:.3g} s (no answer on an open connection: a half-open connection, a "
                "stuck pooler or a paused server); the connection was abandoned") from exc
        if watch.fired and isinstance(exc, DatabaseUnreachableError):
            raise DatabaseUnreachableError(
                f"the database at {_endpoint(conn.engine.url)} did not answer {what} within "
                f"{wait:.3g} s; the connection was abandoned ({exc})") from exc
        raise
    finally:
        watch.finish()


class _SocketWatch:
    """Shuts a connection's socket down after ``wait_s`` unless :meth:`finish` came first."""

    def __init__(self, fileno: Callable[[], int | None], wait_s: float) -> None:
        self._fileno = fileno
        self._guard = threading.Lock()
        self._done = False
        self.fired = False
        self._alarm = alarms.arm(wait_s, self._abandon)

    def _abandon(self) -> None:
        with self._guard:
            if self._done:
                return
            self.fired = True
        with contextlib.suppress(OSError, ValueError, AttributeError):
            fd = self._fileno()
            if fd is None:  # closed meanwhile: its wait has ended
                return
            with socket.socket(fileno=os.dup(fd)) as dup:
                dup.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        with self._guard:
            self._done = True
        self._alarm.disarm()


def _bound_pre_ping(engine: Engine) -> None:
    """Bound ``pool_pre_ping`` by the current deadline, as :func:`bounded_wait` bounds a
    statement.

    SQLAlchemy pings a pooled connection before handing it out and waits for the answer
    without a bound, so a silent peer would hold a checkout, and a deadline's whole call,
    forever. ``Dialect.do_ping`` is the dialect's documented hook for that ping; this engine's
    dialect gets one that shuts the socket down at the deadline and then answers "not alive"
    (whatever the driver raised on the way out: psycopg's own ping raises a ProgrammingError
    restoring autocommit on the broken connection), so the pool replaces the connection, and a
    new connection is bounded by its connect timeout."""
    dialect = engine.dialect
    ping = dialect.do_ping
    driver = dialect.driver

    def bounded_ping(dbapi_connection: Any) -> bool:
        deadline = current_deadline()
        fileno = _socket_of(driver, dbapi_connection)
        if deadline is None or fileno is None:
            return ping(dbapi_connection)
        watch = _SocketWatch(fileno, deadline.wait_s())
        try:
            return ping(dbapi_connection)
        except Exception:
            if watch.fired:
                return False
            raise
        finally:
            watch.finish()

    dialect.do_ping = bounded_ping  # type: ignore[method-assign]


def _socket_of(driver: str, raw: Any) -> Callable[[], int | None] | None:
    """How to find the socket of ``raw``, a connection of ``driver``, when its wait is
    abandoned; None for a driver without one that :func:`bounded_wait` can shut down."""
    if driver == "psycopg":
        return lambda: int(raw.pgconn.socket)
    if driver == "pymysql":
        return lambda: socket_fileno(raw)
    return None


def _endpoint(url: URL) -> str:
    """host:port of a database URL (never its password)."""
    default = 3306 if url.get_backend_name() in _MYSQL_DIALECTS else 5432
    return f"{url.host or 'localhost'}:{url.port or default}"


def _enable_wal(dbapi_connection: Any, busy_timeout_s: float) -> None:
    """``PRAGMA journal_mode=WAL`` (an in-memory database stays "memory"), retried while the
    database is locked: SQLite answers a switch that races another connection's with "database
    is locked" at once, without waiting the busy timeout (several processes opening a new file)."""
    deadline = time.monotonic() + busy_timeout_s
    cursor = dbapi_connection.cursor()
    try:
        while True:
            try:
                cursor.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)
    finally:
        cursor.close()


def _install_sqlite_hooks(engine: Engine, busy_timeout_s: float) -> None:
    """SQLAlchemy's pysqlite recipe: the driver sends no BEGIN; we send BEGIN IMMEDIATE."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Stop the sqlite3 module from issuing its own (deferred, lazily placed) BEGIN.
        dbapi_connection.isolation_level = None
        _enable_wal(dbapi_connection, busy_timeout_s)

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = str(conn.get_execution_options().get(SQLITE_BEGIN_OPTION, "IMMEDIATE")).upper()
        if mode not in _SQLITE_BEGIN_MODES:
            raise ValueError(f"{SQLITE_BEGIN_OPTION} must be one of {sorted(_SQLITE_BEGIN_MODES)}")
        conn.exec_driver_sql(f"BEGIN {mode}")

    _IMMEDIATE_ENGINES.add(engine)


def uses_begin_immediate(engine: Engine) -> bool:
    """True if ``engine`` is a SQLite engine made by :func:`create_engine` (BEGIN IMMEDIATE)."""
    return engine in _IMMEDIATE_ENGINES


def _driver_detail(url: URL, exc: BaseException) -> str:
    """The first line of the driver's message, with the URL's password scrubbed."""
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    detail = lines[0] if lines else type(exc).__name__
    if url.password:
        detail = detail.replace(str(url.password), "***")
    return detail


def unreachable_error(url: URL, exc: BaseException) -> DualWriteError:
    """The error for a failed connection; the driver's text is kept, the password scrubbed.

    A server that answered but refused the connection for a reason retrying cannot fix (no such
    database, no such role, bad credentials) is a :class:`ConfigurationError`, not
    :class:`DatabaseUnreachableError`.
    """
    refused = connection_refusal(url, exc)
    if refused is not None:
        return refused
    return DatabaseUnreachableError(
        f"cannot reach the database {mask_url(url)}: {_driver_detail(url, exc)}")


#: Connection refusals by the server that no retry fixes, by SQLSTATE: invalid_catalog_name
#: (no such database), invalid_authorization_specification (no such role, no pg_hba.conf
#: entry), invalid_password.
_REFUSED_SQLSTATES = {"3D000": "the database does not exist",
                      "28000": "the role does not exist or may not connect",
                      "28P01": "authentication failed (user or password)"}
#: The same, by libpq's text: psycopg 3 raises a failed connect without a SQLSTATE.
_REFUSED_PG_TEXT = (
    (re.compile(r'database "[^"]*" does not exist'), "the database does not exist"),
    (re.compile(r'role "[^"]*" does not exist'), "the role does not exist"),
    (re.compile(r"password authentication failed|authentication failed for user|"
                r"no password supplied|password is required"),
     "authentication failed (user or password)"),
    (re.compile(r"no pg_hba\.conf entry"), "the server's pg_hba.conf refuses this user/host"),
)
#: MariaDB: 1049 unknown database, 1045 access denied (user or password), 1044 access denied
#: to the database, 1698 access denied (unix_socket / plugin authentication).
_REFUSED_MYSQL = {1049: "the database does not exist",
                  1045: "access denied (user or password)",
                  1044: "access denied to the database",
                  1698: "access denied (authentication plugin)"}


def connection_refusal(url: URL, exc: BaseException) -> ConfigurationError | None:
    """A :class:`ConfigurationError` if ``exc`` is the server refusing the connection
    for a reason in the URL (database name, user, password), else None. The message names the
    URL with its password masked and never carries the password."""
    orig = getattr(exc, "orig", None) or exc
    reason = _REFUSED_SQLSTATES.get(_sqlstate(orig) or "") or _REFUSED_MYSQL.get(
        _mysql_errno(orig) or -1)
    if reason is None and type(orig).__module__.split(".", 1)[0] == "psycopg":
        text = str(orig)
        reason = next((why for pattern, why in _REFUSED_PG_TEXT if pattern.search(text)), None)
    if reason is None:
        return None
    return ConfigurationError(
        f"the database server refused the connection to {mask_url(url)}: {reason} "
        f"({_driver_detail(url, exc)}); check the database name, user and password in the URL "
        "(retrying will not help)")


# SQLSTATEs, grouped by what the caller does next (see database_error).
#: The session is gone or cannot start: admin_shutdown, crash_shutdown, cannot_connect_now,
#: idle_session_timeout, idle_in_transaction_session_timeout, too_many_connections (and class 08).
_UNREACHABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "57P05", "25P03", "53300"})
#: The server rolled the transaction back to resolve a conflict: serialization failure, deadlock.
_CONFLICT_SQLSTATES = frozenset({"40001", "40P01"})
#: lock_not_available: lock_timeout (or NOWAIT) expired.
_LOCK_NOT_AVAILABLE = "55P03"
#: query_canceled: statement_timeout expired (or a cancel request).
_QUERY_CANCELED = "57014"
#: undefined_table, undefined_column.
_MISSING_SCHEMA_SQLSTATES = frozenset({"42P01", "42703"})
_SQLITE_MISSING_SCHEMA = ("no such table", "no such column", "has no column named")
_SQLITE_BUSY = ("database is locked", "database table is locked", "database is busy")
#: PgBouncer in statement pooling refuses every transaction block (SQLSTATE 08P01, which would
#: otherwise read as a lost connection): no retry helps.
_STATEMENT_POOLING = "transaction blocks not allowed in statement pooling mode"


# MariaDB's error numbers (PyMySQL's ``args[0]``), grouped the same way.
#: Server gone or going: 2002/2003 cannot connect, 2006 server has gone away, 2013 lost during a
#: query, 2055 lost at a handshake step, 1040 too many connections, 1053 server shutdown, 1077
#: normal shutdown, 1927 connection killed, 4031 disconnected for inactivity.
_MYSQL_UNREACHABLE = frozenset({2002, 2003, 2006, 2013, 2055, 1040, 1053, 1077, 1927, 4031})
#: 1213 deadlock (the transaction was rolled back); 1020 "record has changed since last read"
#: (InnoDB snapshot isolation).
_MYSQL_CONFLICT = frozenset({1213, 1020})
#: 1205 innodb_lock_wait_timeout (the statement was rolled back); 3572 NOWAIT.
_MYSQL_LOCK_TIMEOUT = frozenset({1205, 3572})
#: 1969 max_statement_time exceeded; 1317 query interrupted (KILL QUERY).
_MYSQL_CANCELED = frozenset({1969, 1317})
#: 1146 table does not exist, 1054 unknown column.
_MYSQL_MISSING_SCHEMA = frozenset({1146, 1054})


_DRIVER_MODULES = frozenset({"psycopg", "pymysql", "sqlite3"})


def _sqlstate(orig: BaseException | None) -> str | None:
    state = getattr(orig, "sqlstate", None)
    return state if isinstance(state, str) else None


def _mysql_errno(orig: BaseException | None) -> int | None:
    """The MariaDB error number of a PyMySQL exception (None for other drivers' errors)."""
    if orig is None or type(orig).__module__.split(".", 1)[0] != "pymysql":
        return None
    code = orig.args[0] if orig.args else None
    return code if isinstance(code, int) else None


def is_missing_schema(exc: BaseException) -> bool:
    """The statement failed because a table, or a column a later migration added, is missing."""
    orig = getattr(exc, "orig", None) or exc
    if _sqlstate(orig) in _MISSING_SCHEMA_SQLSTATES or _mysql_errno(orig) in _MYSQL_MISSING_SCHEMA:
        return True
    if isinstance(orig, sqlite3.Error):
        text = str(orig).lower()
        return any(s in text for s in _SQLITE_MISSING_SCHEMA)
    return False


def _connection_lost(exc: BaseException, orig: BaseException | None) -> bool:
    """The connection is gone or could not be made, whatever the statement was."""
    if isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, (sa.exc.TimeoutError, sa.exc.DisconnectionError)):
        return True  # no pooled connection came free in time / the pool's ping failed
    state = _sqlstate(orig)
    if state is not None:
        return state.startswith("08") or state in _UNREACHABLE_SQLSTATES
    errno = _mysql_errno(orig)
    if errno is not None:
        # PyMySQL: a closed connection is InterfaceError (0, ''); errors from the server carry
        # their number, and only those of _MYSQL_UNREACHABLE mean a lost session.
        return errno in _MYSQL_UNREACHABLE or (errno == 0
                                               and isinstance(exc, sa.exc.InterfaceError))
    # psycopg reports a failed connect, a closed connection and a dropped socket without a
    # SQLSTATE (wrapped by SQLAlchemy, or raw from a driver connection); SQLite's errors never
    # mean a lost server.
    if orig is exc:
        return type(orig).__name__ in ("OperationalError", "InterfaceError") \
            and not isinstance(orig, sqlite3.Error)
    return (isinstance(exc, (sa.exc.OperationalError, sa.exc.InterfaceError))
            and orig is not None and not isinstance(orig, sqlite3.Error))


def database_error(exc: BaseException, url: URL, *, table: str | None = None) -> DualWriteError:
    """The :mod:`dualwrite.errors` exception for a database error of dualwrite's own statements.

    The one translation layer of the database side; chain it (``raise database_error(exc, url)
    from exc``). Grouped by what the caller does next:

    - PgBouncer's refusal of transactions in statement pooling mode: :class:`FatalError`
      (connect directly or through session pooling);
    - connection lost, cannot connect, server shutting down or restarting (SQLSTATE class 08,
      57P01-57P03, 57P05, 25P03, 53300, an invalidated connection, psycopg's errors without a
      SQLSTATE, a pool timeout; MariaDB 2002, 2003, 2006, 2013, 2055, 1040, 1053, 1077, 1927,
      4031): :class:`DatabaseUnreachableError` (retry);
    - a lock held past the timeout (55P03; MariaDB 1205 innodb_lock_wait_timeout, 3572; SQLite
      "database is locked" past its busy timeout): :class:`LockTimeoutError` (retry);
    - a statement past its statement_timeout, or cancelled (57014; MariaDB 1969
      max_statement_time, 1317): :class:`DatabaseUnreachableError` (retry);
    - serialization failure (40001), deadlock (40P01; MariaDB 1213, 1020):
      :class:`TransactionConflictError` (run the transaction again);
    - a missing table or column (42P01, 42703, MariaDB 1146, 1054, SQLite "no such
      table/column"):
      :class:`MigrationRequiredError` (upgrade the schema);
    - anything else: :class:`FatalError` with the driver's message.

    ``table`` names the table the statement used (its name goes into the message; for
    dualwrite's state table the migration message gives the upgrade command). Messages never
    carry the password. A :class:`DualWriteError` is returned unchanged.
    """
    if isinstance(exc, DualWriteError):
        return exc
    # A driver's own exception (from a raw connection, e.g. a task's COPY) is read as the
    # DBAPIError it would have been wrapped in.
    orig = exc.orig if isinstance(exc, sa.exc.DBAPIError) else (
        exc if type(exc).__module__.split(".", 1)[0] in _DRIVER_MODULES else None)
    where = mask_url(url)
    detail = _driver_detail(url, exc)
    state = _sqlstate(orig)
    if _STATEMENT_POOLING in detail:
        return FatalError(
            f"the database {where} is reached through a connection pooler in statement pooling "
            f"mode ({detail}): dualwrite needs transactions and a server session per client "
            "connection. Connect dualwrite directly to PostgreSQL, or through a pooler in "
            "session pooling mode (PgBouncer pool_mode = session)")
    refused = connection_refusal(url, exc)
    if refused is not None:
        return refused
    if _connection_lost(exc, orig):
        return unreachable_error(url, exc)
    errno = _mysql_errno(orig)
    if state == _LOCK_NOT_AVAILABLE or errno in _MYSQL_LOCK_TIMEOUT or (
            isinstance(orig, sqlite3.OperationalError)
            and any(s in str(orig).lower() for s in _SQLITE_BUSY)):
        what = (f"the {table} row is locked by another process (a writer of the same "
                "transactional id, or recovery)" if table else
                f"a lock in the database {where} stayed held by another process")
        return LockTimeoutError(f"{what} for longer than the lock timeout ({detail}); retry")
    if state == _QUERY_CANCELED or errno in _MYSQL_CANCELED:
        return DatabaseUnreachableError(
            f"the database {where} did not complete dualwrite's statement in time "
            f"(statement_timeout, or a cancel: {detail}); nothing of it was committed, retry")
    if state in _CONFLICT_SQLSTATES or errno in _MYSQL_CONFLICT:
        return TransactionConflictError(
            f"the database {where} rolled the transaction back to resolve a conflict with a "
            f"concurrent transaction ({detail}); nothing of it was written, retry")
    if is_missing_schema(exc):
        if table is None or table == STATE_TABLE:
            how = (f"Create or upgrade it with: {upgrade_command(url)} (or, if the "
                   "application's own migrations made it, see docs/sql.md)")
        else:
            how = "Create or alter it in the application's own migrations (see docs/sql.md)."
        name = f"the dualwrite table {table!r}" if table else "a dualwrite table"
        return MigrationRequiredError(
            f"{name} does not exist or lacks a column of this dualwrite version in {where} "
            f"({detail}). {how}")
    return FatalError(f"database error on {where}: {detail}")


@contextmanager
def _in_transaction(conn: Connection, url: URL) -> Iterator[Connection]:
    """Begin on ``conn``; commit after the block, roll back if it raises.

    BEGIN and COMMIT failures are translated (:func:`database_error`). An error of the block is
    the caller's own and propagates unchanged, except a lost connection
    (:class:`DatabaseUnreachableError`).
    """
    try:
        trans = conn.begin()
    except sa.exc.SQLAlchemyError as exc:
        raise database_error(exc, url) from exc
    try:
        yield conn
    except BaseException as exc:
        try:
            trans.rollback()
        except sa.exc.SQLAlchemyError as failed:
            logger.debug("rollback on %s failed: %s", mask_url(url), failed)
        if isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated:
            raise unreachable_error(url, exc) from exc
        raise
    try:
        trans.commit()
    except sa.exc.SQLAlchemyError as exc:
        raise database_error(exc, url) from exc


@contextmanager
def transaction(engine: Engine, *, read_only: bool = False,
                connection: Connection | None = None) -> Iterator[Connection]:
    """A short transaction of its own: commit on success, roll back on error.

    Failing to connect, BEGIN or COMMIT raise the :func:`database_error` of the failure
    (:class:`DatabaseUnreachableError` when the connection is lost or cannot be made); an
    error raised inside the block propagates unchanged, except a lost connection
    (:class:`DatabaseUnreachableError`). Under a :func:`dualwrite.deadline.deadline_scope` the
    transaction is bounded by the deadline (:func:`bounded_wait`). ``read_only`` only matters on
    SQLite, where it begins a
    deferred transaction that does not wait for (or block) writers. ``connection``: run it on
    this open connection (not in a transaction) instead of one from the pool; it stays open.
    """
    if connection is not None:
        with (bounded_wait(connection, "a statement of dualwrite"),
              _in_transaction(connection, engine.url) as conn):
            yield conn
        return
    try:
        conn = engine.connect()
    except sa.exc.SQLAlchemyError as exc:
        raise database_error(exc, engine.url) from exc
    with conn:
        if read_only and engine.dialect.name == "sqlite":
            conn.execution_options(**{SQLITE_BEGIN_OPTION: "DEFERRED"})
        with (bounded_wait(conn, "a statement of dualwrite"),
              _in_transaction(conn, engine.url) as inner):
            yield inner


def migrations_dir() -> Path:
    """Where dualwrite's Alembic environment lives: the package ``dualwrite.database.migrations``
    (:data:`MIGRATIONS_RESOURCE`)."""
    path = Path(__file__).resolve().parent / "migrations"
    if not (path / "env.py").is_file():
        raise MigrationRequiredError(
            "dualwrite's migration scripts are missing from this installation; reinstall "
            "dualwrite")
    return path


def _alembic_config() -> Config:
    migrations_dir()  # a broken installation fails with a typed error, not Alembic's
    cfg = Config()
    cfg.set_main_option("script_location", MIGRATIONS_RESOURCE)
    return cfg


def head_revision() -> str:
    """The newest schema revision this version of dualwrite knows."""
    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    if head is None:  # pragma: no cover - the package always ships revision 0001
        raise MigrationRequiredError("dualwrite ships no migration revisions; reinstall dualwrite")
    return head


def _known_revisions() -> set[str]:
    return {s.revision for s in ScriptDirectory.from_config(_alembic_config()).walk_revisions()}


def upgrade_database(url_or_engine: str | URL | Engine, revision: str = "head") -> str | None:
    """Create or upgrade dualwrite's tables to ``revision``; safe to run again and concurrently.

    Returns the revision the database is at afterwards.
    """
    owned = not isinstance(url_or_engine, Engine)
    engine = url_or_engine if isinstance(url_or_engine, Engine) else create_engine(url_or_engine)
    try:
        logger.info("upgrading dualwrite schema of %s to %s", mask_url(engine.url), revision)
        cfg = _alembic_config()
        with _ALEMBIC_LOCK, transaction(engine) as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
        return current_revision(engine)
    finally:
        if owned:
            engine.dispose()


def current_revision(engine: Engine) -> str | None:
    """dualwrite's schema revision in this database; None if dualwrite never migrated it."""
    with transaction(engine, read_only=True) as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return ctx.get_current_revision()


def _missing_state_columns(engine: Engine) -> list[str] | None:
    """Columns the state table lacks, or None when there is no state table."""
    with transaction(engine, read_only=True) as conn:
        inspector = sa.inspect(conn)
        if not inspector.has_table(STATE_TABLE):
            return None
        columns = {c["name"] for c in inspector.get_columns(STATE_TABLE)}
    return [c.name for c in TRANSACTION_STATE.columns if c.name not in columns]


def check_schema(engine: Engine) -> None:
    """Raise :class:`MigrationRequiredError` unless dualwrite's tables are present and current.

    A state table that the application created through its own Alembic (so without
    ``dualwrite_alembic_version``) is accepted as long as it has the expected columns.
    """
    current = current_revision(engine)
    head = head_revision()
    if current == head:
        return
    where = mask_url(engine.url)
    if current is None:
        missing = _missing_state_columns(engine)
        if missing == []:
            logger.debug("%s is managed outside dualwrite's migrations; accepting it", STATE_TABLE)
            return
        if missing:
            raise MigrationRequiredError(
                f"{STATE_TABLE} in {where} lacks {', '.join(missing)}, added by a later dualwrite "
                "revision: add it in the application's migrations that made the table (the "
                "statement is in docs/sql.md)")
        message = (
            f"the dualwrite tables are missing from {where}. "
            f"Create them with: {upgrade_command(engine.url)}"
        )
    elif current in _known_revisions():
        message = (
            f"the dualwrite schema in {where} is at revision {current}, this dualwrite needs "
            f"{head}. Upgrade it with: {upgrade_command(engine.url)}"
        )
    else:
        message = (
            f"the dualwrite schema in {where} is at revision {current!r}, which this dualwrite "
            f"does not know (its newest is {head}): a newer dualwrite upgraded the database. "
            "Upgrade the dualwrite package."
        )
    raise MigrationRequiredError(message)
