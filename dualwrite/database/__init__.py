"""The database side of every dual write: engines, the one failure translation, schema, locks.

Everything that talks to the application's database goes through here: ``create_engine`` (the
settings dualwrite relies on), ``transaction`` and ``database_error`` (the one place SQLAlchemy,
psycopg and sqlite3 failures become dualwrite errors), dualwrite's tables (``schema``, one
MetaData) and their migrations (the package ``dualwrite.database.migrations``), and the
cross-process locks the writer leases and the batch sinks share.
"""

from dualwrite.database.engine import (
    MIGRATION_LOCK_KEY,
    MIGRATIONS_RESOURCE,
    SQLITE_BEGIN_OPTION,
    check_schema,
    create_engine,
    current_revision,
    database_error,
    head_revision,
    is_missing_schema,
    mask_url,
    migrations_dir,
    normalize_url,
    transaction,
    unreachable_error,
    upgrade_command,
    upgrade_database,
    uses_begin_immediate,
)
from dualwrite.database.locks import advisory_keys, lock_folder, try_file_lock
from dualwrite.database.schema import METADATA, STATE_TABLE, VERSION_TABLE, state_table

__all__ = [
    "METADATA",
    "MIGRATIONS_RESOURCE",
    "MIGRATION_LOCK_KEY",
    "SQLITE_BEGIN_OPTION",
    "STATE_TABLE",
    "VERSION_TABLE",
    "advisory_keys",
    "check_schema",
    "create_engine",
    "current_revision",
    "database_error",
    "head_revision",
    "is_missing_schema",
    "lock_folder",
    "mask_url",
    "migrations_dir",
    "normalize_url",
    "state_table",
    "transaction",
    "try_file_lock",
    "unreachable_error",
    "upgrade_command",
    "upgrade_database",
    "uses_begin_immediate",
]
