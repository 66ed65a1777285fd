"""The application tables tests write beside dualwrite's own, and the backends tests run on.

One home for each table's DDL: ``app_rows`` (the recipe tests), ``pool_rows`` (the pool tests),
``events`` (the crash workers) and ``lost_orders`` (the lost-response tests).
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

import dualwrite

# Every database, MariaDB only with ``--mariadb-full`` (for a module's ``backend`` override).
EVERY_BACKEND: list[Any] = [
    "postgresql", "sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb_full)]

ORDERS = sa.Table("lost_orders", sa.MetaData(), sa.Column("id", sa.String(64), primary_key=True))


def add_value_table(url: str, table: str) -> str:
    """Create ``table`` (one ``value`` column, the primary key) in the database of ``url``;
    return ``url``."""
    engine = dualwrite.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE TABLE {table} (value VARCHAR(100) PRIMARY KEY)")
    finally:
        engine.dispose()
    return url


def prepare_database(url: str) -> None:
    """dualwrite's tables and the crash workers' ``events``."""
    dualwrite.upgrade_database(url)
    engine = dualwrite.create_engine(url)
    try:
        with engine.begin() as conn:
            # VARCHAR: MariaDB keys no TEXT column without a prefix length.
            conn.execute(sa.text("CREATE TABLE events (id VARCHAR(100) PRIMARY KEY, "
                                 "txn INT NOT NULL)"))
    finally:
        engine.dispose()


def add_fault_rows_table(url: str) -> str:
    """Create the fault workers' ``fault_rows`` (an id and the worker that wrote it); return
    ``url``."""
    engine = dualwrite.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE fault_rows (id VARCHAR(200) PRIMARY KEY, "
                                 "worker VARCHAR(200) NOT NULL)")
    finally:
        engine.dispose()
    return url
