"""The SQLite side of :func:`dualwrite.create_engine` that needs no server."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

import dualwrite

pytestmark = pytest.mark.unit


def _open_at(path: str, start: float) -> str:
    """Connect to ``path`` at ``start`` (epoch seconds) and write; "ok" or the error."""
    while time.time() < start:
        pass
    engine = dualwrite.create_engine(f"sqlite:///{path}")
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
        return "ok"
    except Exception as exc:
        return repr(exc)
    finally:
        engine.dispose()


def test_processes_opening_a_new_database_file_at_once_all_connect(tmp_path: Path) -> None:
    """Switching a new file to WAL races between processes; SQLite answers the losers "database is
    locked" at once instead of waiting its busy timeout, so each must retry the switch."""
    context = multiprocessing.get_context("fork")
    with context.Pool(6) as pool:
        for round_ in range(15):
            start = time.time() + 0.2
            path = str(tmp_path / f"{round_}.db")
            results = pool.starmap(_open_at, [(path, start)] * 6)
            assert results == ["ok"] * 6, f"round {round_}: {results}"
