"""The writer's callbacks: the phase hooks (fault injection, observability) and the re-publish
hook called on a heuristic abort."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import Connection

from dualwrite.errors import HeuristicAbortError
from dualwrite.participant.prepared_state import PreparedTxnState

__all__ = ["NO_HOOKS", "HeuristicHook", "PhaseHooks"]

HeuristicHook = Callable[[HeuristicAbortError, Connection], None]


class PhaseHooks:
    """Named points of the writer's protocol: the fault-injection and observability seam.

    Pass a subclass as ``DualWriter(hooks=...)`` and override the points of interest; the base
    class does nothing. Each is called at the point its name says, in the thread running the
    transaction (``verified`` excepted); a transaction that starts over (docs/design.md,
    "Claims") passes ``locked`` and ``kafka_begun`` again. An exception a hook raises fails the
    transaction there, as if the next step had failed (after ``kafka_committed`` it only
    propagates); the crash tests stop the process at a point and kill it.
    """

    def kafka_begun(self) -> None:
        """The Kafka transaction has begun (librdkafka's begin is local; nothing is sent)."""

    def before_late_lock(self, records_sent: int) -> None:
        """The writer is about to take its deferred state-row lock: after the block's first
        record (``records_sent`` 1, which may already be in the log), or at its first use of
        ``tx.connection`` or its end (0)."""

    def locked(self) -> None:
        """The state row is locked under this writer's claim and the stored state settled."""

    def resending(self, records: int) -> None:
        """The flush stalled: the transaction was aborted by a new session, which sends its
        ``records`` again (before ``prepared``)."""

    def prepared(self, state: PreparedTxnState) -> None:
        """The records are flushed and acknowledged; ``state`` names the transaction."""

    def verified(self, state: PreparedTxnState) -> None:
        """The coordinator confirmed the prepared transaction. Called on the writer's helper
        thread, while the state row is being written; only when verification runs."""

    def database_committed(self, state: PreparedTxnState) -> None:
        """The database committed ``state``, the decision; Kafka's commit comes next."""

    def kafka_committed(self, state: PreparedTxnState) -> None:
        """Kafka committed the transaction too: it is complete."""


NO_HOOKS = PhaseHooks()
