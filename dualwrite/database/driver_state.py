"""The transaction state a driver connection already knows, read without a round trip.

Each server tells its client, with every answer, whether a transaction is open: PostgreSQL in
ReadyForQuery (psycopg's ``info.transaction_status``), MariaDB in the OK packet's status flags
(PyMySQL's ``server_status``); SQLite's library answers directly (``in_transaction``). This is
the authority on whether a statement ended the transaction it ran in, whatever its text.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["DriverTransaction", "driver_transaction"]

# MariaDB's SERVER_STATUS_IN_TRANS flag (include/mysql_com.h; pymysql.constants.SERVER_STATUS).
_MYSQL_IN_TRANS = 1


class DriverTransaction(enum.Enum):
    """The state of a driver connection's transaction after its last statement."""

    OPEN = "open"
    FAILED = "failed"
    """Open, but a statement failed in it: only a rollback (to a savepoint) is accepted
    (PostgreSQL)."""
    NONE = "none"
    """No transaction: the last statement ended it (or none was begun)."""
    UNKNOWN = "unknown"
    """The driver does not know (a broken connection, an unsupported driver)."""


def driver_transaction(dbapi_connection: Any, cursor: Any = None) -> DriverTransaction:
    """The transaction state of ``dbapi_connection`` (psycopg 3, sqlite3 or PyMySQL).

    PyMySQL keeps the status of the last OK packet only: a statement that returned rows leaves
    an older one. So there it is known only right after ``cursor`` ran a statement that
    returned no rows (every statement that can end a transaction is one)."""
    info = getattr(dbapi_connection, "info", None)
    status = getattr(info, "transaction_status", None)
    if status is not None:  # psycopg 3: psycopg.pq.TransactionStatus
        return _PSYCOPG.get(int(status), DriverTransaction.UNKNOWN)
    in_transaction = getattr(dbapi_connection, "in_transaction", None)
    if isinstance(in_transaction, bool):  # sqlite3
        return DriverTransaction.OPEN if in_transaction else DriverTransaction.NONE
    server_status = getattr(dbapi_connection, "server_status", None)
    if isinstance(server_status, int) and cursor is not None and cursor.description is None:
        return DriverTransaction.OPEN if server_status & _MYSQL_IN_TRANS else DriverTransaction.NONE
    return DriverTransaction.UNKNOWN


# psycopg.pq.TransactionStatus: IDLE 0, ACTIVE 1 (a command in progress), INTRANS 2, INERROR 3,
# UNKNOWN 4 (the connection is bad).
_PSYCOPG = {0: DriverTransaction.NONE, 1: DriverTransaction.OPEN, 2: DriverTransaction.OPEN,
            3: DriverTransaction.FAILED}
