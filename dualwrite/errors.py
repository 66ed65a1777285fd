"""The exceptions dualwrite raises, grouped by what the caller should do about them.

- :class:`RetriableError`: nothing was decided; try the same call again.
- :class:`RecoverableError`: the process must stop using this producer and run recovery
  (``dualwrite recover`` / :func:`dualwrite.recover`), which finishes the in-doubt work.
- :class:`FatalError`: a configuration, permission or programming problem; retrying will not help.
- :class:`OutcomeUnknownError`: a commit was sent and its outcome is not known; recovery asks the
  coordinator and the database, it never guesses.
- :class:`HeuristicOutcomeError`: the database and Kafka disagree and a human (or a re-publish hook)
  has to act.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BatchHeuristicAbortError",
    "BatchInDoubtError",
    "BatchTasksFailedError",
    "BlockCommittedError",
    "BrokerUnreachableError",
    "ConfigurationError",
    "DatabaseUnreachableError",
    "DeliveryTimeoutError",
    "DualWriteError",
    "FatalError",
    "HeuristicAbortError",
    "HeuristicCommitError",
    "HeuristicOutcomeError",
    "InvalidPreparedStateError",
    "InvalidRecordError",
    "KafkaErrorInfo",
    "KafkaProtocolError",
    "LockTimeoutError",
    "MigrationRequiredError",
    "OutcomeUnknownError",
    "OutcomeUnreadableError",
    "PartitionFencedError",
    "PreparedRowsLostError",
    "PreparedRowsUnreadableError",
    "ProducerFencedError",
    "RecordTooLargeError",
    "RecoverableError",
    "RetriableError",
    "TransactionConflictError",
    "TransactionStateError",
    "UnknownTopicError",
    "UnsupportedBrokerError",
]


class DualWriteError(Exception):
    """Base class of every error dualwrite raises on purpose."""


class RetriableError(DualWriteError):
    """A transient failure; nothing was decided and the same call may be retried."""


class RecoverableError(DualWriteError):
    """This producer can no longer be used; run recovery to finish or abort in-doubt work."""


class FatalError(DualWriteError):
    """Retrying will not help: configuration, permissions, or a bug in the caller."""


class OutcomeUnknownError(RecoverableError):
    """A commit was sent but its result never arrived; recovery resolves it by asking."""


class HeuristicOutcomeError(DualWriteError):
    """Kafka and the database reached different outcomes; a human or a hook must act."""


class BrokerUnreachableError(RetriableError):
    """No Kafka broker answered within the timeout."""


class DeliveryTimeoutError(RetriableError):
    """Records of the open transaction were not acknowledged in time (a leader election, a
    coordinator move, a paused broker); nothing was decided. Abort, then retry."""


class LockTimeoutError(RetriableError):
    """A database lock dualwrite needs stayed held by another process past the timeout."""


class DatabaseUnreachableError(RetriableError):
    """The database did not answer, or the connection to it was lost (also: server shutting
    down or restarting); nothing of the failed transaction was committed unless stated."""


class TransactionConflictError(RetriableError):
    """The database rolled the transaction back to resolve a conflict with a concurrent one
    (serialization failure, deadlock); nothing was written, run the transaction again."""


class PartitionFencedError(RetriableError):
    """An exactly-once consumer's batch was refused: another consumer of its group owns an input
    partition of the batch now (a rebalance moved it). Nothing of the batch committed (rows,
    records and positions rolled back together); the new owner consumes from the decided
    position."""


class BatchTasksFailedError(RetriableError):
    """A batch sink's tasks failed on their executors (Spark gave up on one of them) before the
    batch was decided: nothing of it is visible, and running the batch again (a restarted
    query does) writes it. ``task_error`` names what the failed task raised."""

    def __init__(self, message: str, task_error: str) -> None:
        super().__init__(message)
        self.task_error = task_error


class ProducerFencedError(FatalError):
    """Another producer with the same transactional id took over; this one must stop."""


class TransactionStateError(FatalError):
    """A call was made in the wrong phase of the transaction (e.g. produce after prepare)."""


class MigrationRequiredError(FatalError):
    """The dualwrite state table is missing or out of date."""


class ConfigurationError(FatalError, ValueError):
    """A setting is missing, malformed or unsupported: an empty or malformed
    ``bootstrap.servers``, a Kafka client setting librdkafka rejects, a database URL that is not
    a URL, a database dialect or driver dualwrite does not support. Fix the setting."""


class UnknownTopicError(FatalError):
    """The topic does not exist (and the brokers do not create topics on first use): create it,
    or fix its name. Nothing of the transaction was committed."""

    def __init__(self, topic: str, detail: str) -> None:
        super().__init__(f"topic {topic!r} does not exist ({detail}): create it (kafka-topics.sh "
                         "--create) or fix the name")
        self.topic = topic


class UnsupportedBrokerError(FatalError):
    """The Kafka cluster lacks a protocol behaviour dualwrite's recovery needs (``missing``
    names each, with its API key): dualwrite refuses to start rather than leave a prepared
    transaction it could not finish. ``dualwrite probe`` shows what the brokers offer."""

    def __init__(self, servers: str, missing: Sequence[str]) -> None:
        super().__init__(f"the Kafka cluster at {servers} cannot be a two-phase-commit "
                         f"participant: it lacks {'; '.join(missing)} (Kafka 3.0 or newer has "
                         "them all); see `dualwrite probe`")
        self.missing = tuple(missing)


class InvalidRecordError(FatalError, ValueError, TypeError):
    """Kafka cannot take this record as it is: a key or value that is not bytes, str or None,
    or one the broker rejects (INVALID_RECORD, CORRUPT_MESSAGE, INVALID_TIMESTAMP …). Sending it
    again will fail again; the transaction was rolled back. ``topic`` names where it went."""

    def __init__(self, topic: str, message: str) -> None:
        super().__init__(message)
        self.topic = topic


class RecordTooLargeError(InvalidRecordError):
    """A record is larger than a limit: the client's ``message.max.bytes`` (checked before
    sending) or the topic's ``max.message.bytes`` / the broker's ``message.max.bytes``. Make the
    record smaller or raise the limit on both sides; retrying cannot help.

    ``size`` is the record's size in bytes when known, ``limit`` the limit's name and value.
    """

    def __init__(self, topic: str, message: str, *, size: int | None = None,
                 limit: str = "") -> None:
        super().__init__(topic, message)
        self.size = size
        self.limit = limit


class InvalidPreparedStateError(FatalError, ValueError):
    """A prepared-state string could not be parsed."""

    def __init__(self, text: str, reason: str) -> None:
        super().__init__(f"invalid prepared transaction state {text!r}: {reason}")
        self.text = text
        self.reason = reason


@dataclass(frozen=True)
class KafkaErrorInfo:
    """A Kafka protocol error code as data: its name, whether it is retriable, what to do."""

    code: int
    name: str
    retriable: bool
    advice: str


class KafkaProtocolError(DualWriteError):
    """A broker answered with an error code; ``info`` says what it means and what to do."""

    def __init__(self, info: KafkaErrorInfo, context: str) -> None:
        super().__init__(f"{context}: {info.name} (error code {info.code}). {info.advice}")
        self.info = info
        self.context = context

    @property
    def retriable(self) -> bool:
        return self.info.retriable


class HeuristicAbortError(HeuristicOutcomeError):
    """The database decided commit but Kafka aborted the transaction (e.g. broker timeout).

    The Kafka records of that transaction are lost; the database rows exist. Re-publish them from
    the database (see ``DualWriter(on_heuristic_abort=...)``) or repair by hand.
    """

    def __init__(self, transactional_id: str, state: str, detail: str) -> None:
        super().__init__(
            f"transactional id {transactional_id!r}: the database committed prepared state "
            f"{state!r} but Kafka aborted that transaction ({detail}); its records are lost. "
            "Re-publish them from the database rows of that transaction, then run "
            "`dualwrite recover --acknowledge-heuristic` to clear the state."
        )
        self.transactional_id = transactional_id
        self.state = state
        self.detail = detail


class BlockCommittedError(HeuristicAbortError):
    """A statement of a ``writer.transaction()`` block ended the database transaction itself
    (one dualwrite could not tell from its text, e.g. a stored procedure that commits): the rows
    written before it may be committed while the transaction's records were aborted.

    The block's later statements were refused and its records never committed; handed to
    ``on_heuristic_abort`` (if given) like any heuristic abort, and raised either way.
    """

    def __init__(self, transactional_id: str, detail: str, *, certain: bool = True) -> None:
        super().__init__(transactional_id, "", detail)
        self.args = (
            f"transactional id {transactional_id!r}: {detail}; the rows the block wrote before "
            f"that statement {'are' if certain else 'may be'} committed without their records "
            "(Kafka aborted them). "
            "Re-publish them from the database, or undo them; a block must leave ending its "
            "transaction to dualwrite.",)


class BatchHeuristicAbortError(HeuristicOutcomeError):
    """A batch sink decided a batch (its SQL rows are published) but Kafka aborted participants.

    Raised with the sink id and batch id so the lost partitions can be re-published; the batch
    stays in doubt until ``dualwrite recover --acknowledge-heuristic``.
    """

    def __init__(self, sink_id: str, batch_id: int,
                 causes: Sequence[HeuristicAbortError | OutcomeUnreadableError
                                  | PreparedRowsLostError]) -> None:
        ids = ", ".join(c.transactional_id for c in causes)
        if not all(isinstance(c, HeuristicAbortError) for c in causes):
            what = (f"{len(causes)} participant(s) ({ids}) lost their Kafka records or their "
                    f"prepared database rows, or their outcome can no longer be read (first "
                    f"cause: {causes[0].detail}). Check, then re-publish (or re-insert) what "
                    f"batch {batch_id} of those partitions is missing")
        else:
            what = (f"Kafka aborted {len(causes)} participant transaction(s) ({ids}); their "
                    f"records are lost (first cause: {causes[0].detail}). Re-publish batch "
                    f"{batch_id} of those partitions from the database")
        super().__init__(
            f"sink {sink_id!r} batch {batch_id}: the database decided commit but {what}, then "
            "run `dualwrite recover --acknowledge-heuristic`."
        )
        self.sink_id = sink_id
        self.batch_id = batch_id
        self.causes = list(causes)


class HeuristicCommitError(HeuristicOutcomeError):
    """Kafka committed records that no database decision covers.

    A writer's records left before its state-row lock was granted and another process then
    committed them by (producer id, epoch). A guard: the lease rules (see "Leases" in
    docs/design.md) leave that only to a process that does so without claiming the id first.
    The block stops before it wrote anything; the records it names are visible without their
    rows: compensate, or write the rows that match them.
    """

    def __init__(self, transactional_id: str, state: str, detail: str) -> None:
        super().__init__(
            f"transactional id {transactional_id!r}: the records of Kafka transaction {state!r} "
            f"are committed although the database decided nothing for them ({detail}); the "
            "block was stopped before it wrote its rows."
        )
        self.transactional_id = transactional_id
        self.state = state
        self.detail = detail


class PreparedRowsLostError(HeuristicOutcomeError):
    """A decided batch's prepared database transaction was rolled back outside dualwrite.

    Write-once mode of a batch sink: the task's rows were in a prepared transaction (its
    ``gid``) that the decision said to commit, and someone ran ``ROLLBACK PREPARED``. Its Kafka
    records are (or will be) committed; the rows are lost.
    """

    def __init__(self, transactional_id: str, gid: str, detail: str) -> None:
        super().__init__(
            f"transactional id {transactional_id!r}: the decided batch's prepared database "
            f"transaction {gid!r} was rolled back outside dualwrite ({detail}); its rows are "
            "lost while its records are committed. Re-insert those rows from the topic, then "
            "run `dualwrite recover --acknowledge-heuristic` to clear the state."
        )
        self.transactional_id = transactional_id
        self.gid = gid
        self.detail = detail


class OutcomeUnreadableError(HeuristicOutcomeError):
    """The log no longer shows whether the named transaction committed.

    Its record at the anchor offset is gone: compacted away, below the log start (retention,
    DeleteRecords), or its topic deleted. Nothing is re-published automatically (it may have
    committed); an operator checks the records and runs ``dualwrite recover
    --acknowledge-heuristic``.
    """

    def __init__(self, transactional_id: str, state: str, detail: str) -> None:
        super().__init__(
            f"transactional id {transactional_id!r}: whether Kafka transaction {state!r} "
            f"committed can no longer be read from the log ({detail}). Check whether its records "
            "reached the topic, re-publish only what is missing, then run "
            "`dualwrite recover --acknowledge-heuristic` to clear the state."
        )
        self.transactional_id = transactional_id
        self.state = state
        self.detail = detail


class PreparedRowsUnreadableError(OutcomeUnreadableError):
    """The database no longer knows whether a decided batch's prepared transaction committed.

    Write-once mode of a batch sink: its ``gid`` is no longer prepared and its transaction id is
    older than the commit log the database keeps. Nothing is written again automatically.
    """

    def __init__(self, transactional_id: str, gid: str, detail: str) -> None:
        HeuristicOutcomeError.__init__(
            self,
            f"transactional id {transactional_id!r}: whether the decided batch's prepared "
            f"database transaction {gid!r} committed can no longer be read from the database "
            f"({detail}). Check whether its rows are in the table, re-insert only what is "
            "missing from the topic, then run `dualwrite recover --acknowledge-heuristic` to "
            "clear the state."
        )
        self.transactional_id = transactional_id
        self.state = gid
        self.detail = detail


class BatchInDoubtError(RetriableError):
    """The sink's last decided batch is not completed yet: complete it before deciding another.

    Raised by :meth:`DecisionLog.decide` before anything is written; the coordinator completes
    the batch and decides again (a later decision must not overwrite an in-doubt one).
    """

    def __init__(self, sink_id: str, batch_id: int) -> None:
        super().__init__(f"sink {sink_id!r}: batch {batch_id} was decided but is not completed; "
                         "its participants must be committed before another batch is decided")
        self.sink_id = sink_id
        self.batch_id = batch_id
