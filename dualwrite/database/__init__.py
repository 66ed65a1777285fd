"""The database side of every dual write: engines, the one failure translation, schema, locks.

Everything that talks to the application's database goes through here: ``create_engine`` (the
settings dualwrite relies on), ``transaction`` and ``database_error`` (the one place SQLAlchemy,
psycopg and sqlite3 failures become dualwrite errors), dualwrite's tables (``schema``, one
MetaData) and their migrations (the package ``dualwrite.database.migrations``), and the
cross-process locks the writer leases and the batch sinks share.
"""

from dualwrite.database import engine, locks, schema
from dualwrite.database.engine import *  # noqa: F403 (see engine.__all__)
from dualwrite.database.locks import *  # noqa: F403
from dualwrite.database.schema import *  # noqa: F403

__all__ = engine.__all__ + locks.__all__ + schema.__all__
