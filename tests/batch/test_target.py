from __future__ import annotations

import socket
from pathlib import Path

import pytest

import dualwrite
from dualwrite.batch.target import target_columns
from dualwrite.errors import DatabaseUnreachableError, FatalError

pytestmark = pytest.mark.unit


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_database_is_a_typed_error() -> None:
    """The sink reflects its target at start: a database down then is retriable, typed (the
    soak's Spark role got SQLAlchemy's OperationalError)."""
    engine = dualwrite.create_engine(
        f"postgresql+psycopg://dualwrite@127.0.0.1:{_closed_port()}/dualwrite")
    try:
        with pytest.raises(DatabaseUnreachableError):
            target_columns(engine, "events", None)
    finally:
        engine.dispose()


def test_a_missing_table_or_column(tmp_path: Path) -> None:
    engine = dualwrite.create_engine(f"sqlite:///{tmp_path}/t.db")
    try:
        with pytest.raises(FatalError, match="does not exist"):
            target_columns(engine, "events", None)
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE events (event_id INTEGER, payload TEXT)")
        assert target_columns(engine, "events", None)[1] == ("event_id", "payload")
        with pytest.raises(FatalError, match="not columns"):
            target_columns(engine, "events", ["nope"])
    finally:
        engine.dispose()
