"""Alembic environment for dualwrite's own tables.

Kept apart from the application's Alembic: the version table is ``dualwrite_alembic_version``.
``target_metadata`` is :data:`dualwrite.database.schema.METADATA`, so ``alembic revision
--autogenerate`` proposes what a changed schema module needs, looking at dualwrite's tables only.
:func:`dualwrite.database.upgrade_database` hands in an open connection through
``config.attributes["connection"]``; the Alembic command line gives the URL with ``-x db=URL``, the
``DUALWRITE_DB_URL`` environment variable or ``sqlalchemy.url`` in the ini file.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection, text

from dualwrite.database import MIGRATION_LOCK_KEY, VERSION_TABLE, create_engine
from dualwrite.database.schema import METADATA, include_name

config = context.config
target_metadata = METADATA


def _url() -> str:
    url = (
        context.get_x_argument(as_dictionary=True).get("db")
        or os.environ.get("DUALWRITE_DB_URL")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise SystemExit("no database URL: pass -x db=URL or set DUALWRITE_DB_URL")
    return url


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        version_table=VERSION_TABLE,
        target_metadata=target_metadata,
        include_name=include_name,  # never the application's tables
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Two processes upgrading at once: the second waits here, then finds nothing to do.
            lock = text("SELECT pg_advisory_xact_lock(:key)")
            connection.execute(lock, {"key": MIGRATION_LOCK_KEY})
        elif connection.dialect.name in ("mysql", "mariadb"):
            # MariaDB commits each DDL statement itself: a session lock (GET_LOCK) instead,
            # released when the run ends or the session does.
            got = connection.execute(text("SELECT GET_LOCK('dualwrite-migrate', 300)")).scalar()
            if got != 1:
                raise RuntimeError("another dualwrite migration held its lock for 300 s")
            try:
                context.run_migrations()
            finally:
                connection.execute(text("SELECT RELEASE_LOCK('dualwrite-migrate')"))
            return
        context.run_migrations()


def run_offline() -> None:
    """Print the SQL instead of running it (``alembic ... upgrade head --sql``)."""
    context.configure(url=_url(), version_table=VERSION_TABLE, target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(_url())
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
