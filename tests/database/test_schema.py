"""dualwrite.database.schema is what the migrations create, on PostgreSQL, MariaDB and SQLite.

Alembic's autogenerate compares a freshly migrated database with ``METADATA``: any difference
(a column, type, length, nullability, server default, key or index) means the two drifted apart.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from dualwrite.database import (
    METADATA,
    STATE_TABLE,
    VERSION_TABLE,
    create_engine,
    state_table,
    upgrade_database,
)
from dualwrite.database.schema import TRANSACTION_STATE, include_name

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["postgresql", "sqlite", "mariadb"])
def backend(request: pytest.FixtureRequest) -> str:
    """Every supported database."""
    return str(request.param)


def _differences(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={
            "version_table": VERSION_TABLE,
            "include_name": include_name,  # not the version table, not app_orders
            "compare_type": True,
            "compare_server_default": True,
        })
        return list(compare_metadata(context, METADATA))


def test_the_migrated_database_matches_the_metadata(empty_db_url: str) -> None:
    engine = create_engine(empty_db_url)
    try:
        upgrade_database(engine)
        with engine.begin() as conn:  # the application's table beside dualwrite's is ignored
            conn.exec_driver_sql("CREATE TABLE app_orders (id INTEGER PRIMARY KEY)")
        tables = set(sa.inspect(engine).get_table_names())
        assert set(METADATA.tables) | {VERSION_TABLE, "app_orders"} == tables
        assert _differences(engine) == []
    finally:
        engine.dispose()


@pytest.mark.unit
def test_a_state_table_of_another_name_has_the_same_columns() -> None:
    other = state_table("my_dualwrite_state")
    assert other.metadata is not METADATA and "my_dualwrite_state" not in METADATA.tables

    def shape(table: sa.Table) -> list[tuple[Any, ...]]:
        return [(c.name, repr(c.type), c.nullable, c.primary_key,
                 str(c.server_default.arg) if isinstance(c.server_default, sa.DefaultClause)
                 else None) for c in table.columns]

    assert shape(other) == shape(METADATA.tables[STATE_TABLE]) == shape(TRANSACTION_STATE)
