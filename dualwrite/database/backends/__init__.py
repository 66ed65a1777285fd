"""One object per supported database holding what differs between them (:class:`Backend`).

``backend_for(engine)`` picks it by SQLAlchemy's dialect name; code elsewhere asks the backend
instead of testing the dialect, so a new database is one module here and one entry in
:data:`BACKENDS`.
"""

from __future__ import annotations

from sqlalchemy import Connection, Engine

from dualwrite.database.backends.base import Backend, LockSpace
from dualwrite.database.backends.mariadb import MariaDB
from dualwrite.database.backends.postgresql import PostgreSQL
from dualwrite.database.backends.sqlite import SQLite
from dualwrite.errors import FatalError

__all__ = ["BACKENDS", "Backend", "LockSpace", "MariaDB", "PostgreSQL", "SQLite", "backend_for"]

BACKENDS: tuple[Backend, ...] = (PostgreSQL(), MariaDB(), SQLite())
_BY_DIALECT = {dialect: backend for backend in BACKENDS for dialect in backend.dialects}


def backend_for(database: Engine | Connection | str) -> Backend:
    """The backend of an engine's or a connection's database, or of a SQLAlchemy dialect name;
    :class:`FatalError` for a database dualwrite does not support."""
    name = database if isinstance(database, str) else database.dialect.name
    try:
        return _BY_DIALECT[name]
    except KeyError:
        supported = ", ".join(type(b).__name__ for b in BACKENDS)
        raise FatalError(f"dualwrite supports {supported}, not {name!r}") from None
