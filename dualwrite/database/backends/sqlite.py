"""SQLite: no server sessions; locks are ``flock``s on files beside the database file."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.dialects import sqlite

from dualwrite.database.backends.base import Backend

__all__ = ["SQLite"]


class SQLite(Backend):
    name = "sqlite"
    dialects = frozenset({"sqlite"})
    sql_family = "sqlite"
    single_writer = True
    failed_commit_rolled_back = True

    def insert_missing(self, table: sa.Table, values: Mapping[str, Any]) -> Any:
        return sqlite.insert(table).values(values).on_conflict_do_nothing()

    def upsert(self, table: sa.Table, rows: Sequence[Mapping[str, Any]], key: sa.Column[Any],
               update: Mapping[str, Any]) -> Any:
        return sqlite.insert(table).values(list(rows)).on_conflict_do_update(
            index_elements=[key], set_=dict(update))

    def tuple_insert_sql(self, table: str, columns: Sequence[str]) -> str:
        names = ", ".join(f'"{c}"' for c in columns)
        marks = ", ".join("?" for _ in columns)
        return f'INSERT INTO "{table}" ({names}) VALUES ({marks})'

    def lock_folder(self, engine: Engine, suffix: str) -> Path | None:
        """``<db><suffix>`` beside the database file; None for an in-memory database (one
        process: nothing to lock against)."""
        database = engine.url.database
        if not database or database == ":memory:" or database.startswith("file:"):
            return None
        db = Path(database).resolve()
        return db.with_name(db.name + suffix)
