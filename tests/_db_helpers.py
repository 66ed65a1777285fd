"""A fresh PostgreSQL schema (or MariaDB database) per test: the one way the tests get an empty
database on a shared server."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import dualwrite
from dualwrite.database import normalize_url


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
        with (contextlib.suppress(Exception) if quiet_drop else contextlib.nullcontext()), \
                admin.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
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
