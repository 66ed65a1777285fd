"""The one place dualwrite reaches below PyMySQL's public API.

:func:`dualwrite.database.bounded_wait` ends a wait for a server that stopped answering on an open
connection (a half-open connection, a stuck proxy, a paused server) by shutting the connection's
socket down at the deadline. psycopg names its socket publicly (``pgconn.socket``); PyMySQL does
not, and its only client-side bound, ``read_timeout``, applies to every read of the connection, so
it would also cut an application's own long statement on ``tx.connection``. PyMySQL keeps the
socket in ``Connection._sock`` (None once closed), as every release since 0.x has.
tests/database/test_mariadb.py checks this against a real server, and the bounded COMMIT
there fails if a release renames it: the wait would be unbounded again, not silently.

No other dualwrite module may use PyMySQL's underscore names.
"""

from __future__ import annotations

from typing import Any


def socket_fileno(dbapi_connection: Any) -> int | None:
    """The file descriptor of a PyMySQL connection's socket; None if it has none (closed)."""
    sock = getattr(dbapi_connection, "_sock", None)
    if sock is None:
        return None
    try:
        fileno = sock.fileno()
    except OSError:
        return None
    return int(fileno) if fileno >= 0 else None
