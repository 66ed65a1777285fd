"""DualWriterPool: many requests at once over a bounded set of transactional ids.

A service serves tens of requests at once; one :class:`DualWriter` serves one at a time, and one
transactional id's back-to-back transactions are bounded by the broker (the next one waits for
the last one's markers).
The pool owns ``size`` writers, one per transactional id ``{id_prefix}-{n}``, and hands one to each
request; with ``group_commit`` the requests that arrive while the writers are busy share the next
transaction of a free writer: one prepare, one state row, one COMMIT and one EndTxn serve the
group, each request's rows in a savepoint of their own and its records produced only after its
block succeeded.

Ids per process (docs/design.md, "The writer pool"): a pool takes the lowest numbers ``n`` whose
*pool slot* is free — a session-level PostgreSQL advisory lock (an SQLite ``flock`` beside the
database file) held for the pool's life by a connection of its own, released by the server or
kernel when the process dies. Several processes with one prefix therefore never run the same id,
and the ids of all processes stay in ``{prefix}-0 .. {prefix}-{total size - 1}``: a restarted
process takes the numbers its predecessor left. At start the pool finishes what the prefix's other
free ids left in doubt (a pool that shrank, a process that died and was not replaced) with one
empty transaction each, and its own ids with their first (warm-up) transaction; ``dualwrite
recover`` finds them all too (every id that ever ran has a state row).
"""

from __future__ import annotations

from dualwrite.writer.pool.async_pool import (
    AsyncConnection,
    AsyncDualWriterPool,
    AsyncTransaction,
    sync_engine_for,
)
from dualwrite.writer.pool.pool import DualWriterPool
from dualwrite.writer.pool.requests import GroupedTransaction
from dualwrite.writer.pool.writers import breaks_writer

__all__ = [
    "AsyncConnection",
    "AsyncDualWriterPool",
    "AsyncTransaction",
    "DualWriterPool",
    "GroupedTransaction",
    "breaks_writer",
    "sync_engine_for",
]
