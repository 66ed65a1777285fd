"""What finishing an in-doubt transaction did: one enum for completion and for recovery.

:func:`~dualwrite.participant.completion.complete` returns the first four members; recovery
(:func:`dualwrite.recover`) reports all of them, by their values, in its JSON and text output.
"""

from __future__ import annotations

import enum

__all__ = ["Outcome"]


class Outcome(enum.Enum):
    COMMITTED = "committed"
    """The named transaction was still open and has now been committed."""
    ALREADY_COMMITTED = "already-committed"
    """The named transaction had committed before; nothing to do."""
    ABORTED = "aborted"
    """An open transaction that the state does not name was aborted."""
    NOTHING = "nothing-to-do"
    """No prepared state and nothing open."""
    HEURISTIC_ABORT = "heuristic-abort"
    """Recovery: Kafka aborted a transaction the database decided to commit; it waits for
    --acknowledge-heuristic."""
    OUTCOME_UNREADABLE = "outcome-unreadable"
    """Recovery: the log no longer shows whether the named transaction committed (its anchor
    record was compacted or deleted): like a heuristic abort, it waits for
    --acknowledge-heuristic."""
    ACKNOWLEDGED = "heuristic-acknowledged"
    """Recovery: a heuristic outcome recorded as seen (its state cleared)."""
    LEFT_TO_WRITER = "left-to-live-writer"
    """Recovery: a live writer holds the id's lease: it finishes its own transactions (and
    recovery, acting by producer id and epoch, could end the writer's next one instead)."""
    FAILED = "failed"
    """Recovery: resolving it failed; the report's detail says why."""

    @property
    def resolved(self) -> bool:
        """Nothing is left in doubt (heuristic outcomes and failures are not resolved)."""
        return self not in (Outcome.HEURISTIC_ABORT, Outcome.OUTCOME_UNREADABLE, Outcome.FAILED)
