"""The database side of every dual write: engines, the one failure translation, schema, locks.

Everything that talks to the application's database goes through here: ``create_engine`` (the
settings dualwrite relies on), ``transaction`` and ``database_error`` (the one place SQLAlchemy,
psycopg and sqlite3 failures become dualwrite errors), dualwrite's tables (``schema``, one
MetaData) and their migrations (the package ``dualwrite.database.migrations``), what differs
between the databases (``backends``), and the session locks of writer leases, pool slots and
batch sinks (``session_locks``).
"""

from dualwrite.database import backends, engine, locks, schema, session_locks
from dualwrite.database.backends import *  # noqa: F403 (see backends.__all__)
from dualwrite.database.engine import *  # noqa: F403 (see engine.__all__)
from dualwrite.database.locks import *  # noqa: F403
from dualwrite.database.schema import *  # noqa: F403
from dualwrite.database.session_locks import *  # noqa: F403

__all__ = (backends.__all__ + engine.__all__ + locks.__all__ + schema.__all__
           + session_locks.__all__)
