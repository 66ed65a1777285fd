"""The writer role: KIP-939's dual-write recipe for a service's own transactions.

``DualWriter`` runs the recipe as one ``with`` block; ``StateStore`` is the prepared-state table
it writes with the application's rows; ``Leases`` say which writer may end an id's transactions;
``DualWriterPool`` serves many requests at once over a bounded set of ids (group commit);
``PhaseHooks`` names the points of the recipe (for fault injection and observability).
"""

from dualwrite.writer.dual_writer import DualWriter, DualWriteTransaction, PhaseHooks
from dualwrite.writer.lease import Leases
from dualwrite.writer.pool import (
    AsyncConnection,
    AsyncDualWriterPool,
    AsyncTransaction,
    DualWriterPool,
    GroupedTransaction,
)
from dualwrite.writer.state_store import StateRow, StateStore

__all__ = [
    "AsyncConnection",
    "AsyncDualWriterPool",
    "AsyncTransaction",
    "DualWriteTransaction",
    "DualWriter",
    "DualWriterPool",
    "GroupedTransaction",
    "Leases",
    "PhaseHooks",
    "StateRow",
    "StateStore",
]
