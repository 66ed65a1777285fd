"""Pulsar as a two-phase-commit participant: prepare with an anchor, end by TxnID, and tell a
finished transaction's outcome from the data.

The coordinator forgets a transaction once it ends, so ``END_TXN`` answering TransactionNotFound
proves nothing. :func:`txn_outcome` decides from the anchor (the last message the transaction sent
to a partition): it sends a non-transactional probe there and reads from the anchor on. The
broker dispatches committed transactional messages, never aborted ones, and holds every later
message while a transaction on the partition is open (docs/broker-facts.md, "Pulsar
transactions (measured)"). So: anchor read → committed; probe read without the anchor →
aborted, if the anchor's ledger is provably still stored (else unreadable); nothing before the
deadline → still open.
"""

from __future__ import annotations

import enum
import logging
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from dualwrite.errors import InvalidPreparedStateError
from dualwrite.participant.prepared_state import PULSAR_STATE_PREFIX as _PREFIX
from dualwrite.participant.pulsar._wire import MessageId, TxnId
from dualwrite.participant.pulsar.client import PulsarTxnClient, full_topic_name
from dualwrite.participant.pulsar.errors import (
    InvalidTxnStatusError,
    PulsarError,
    PulsarFatalError,
    PulsarHeuristicAbortError,
    PulsarHeuristicCommitError,
    PulsarOutcomeUnknownError,
    PulsarOutcomeUnreadableError,
    PulsarProtocolError,
    PulsarTimeoutError,
    PulsarTxnStillOpenError,
    TransactionNotFoundError,
)

__all__ = ["PulsarParticipant", "PulsarPreparedTxn", "PulsarTxnOutcome", "txn_outcome"]

log = logging.getLogger(__name__)

_MAX_U64 = 2**64 - 1
_MAX_I64 = 2**63 - 1
_MAX_I32 = 2**31 - 1
_MAX_TOPIC = 1024
_INT = re.compile(r"-?[0-9]{1,20}")
_TOPIC = re.compile(r"persistent://[A-Za-z0-9_.=-]+/[A-Za-z0-9_.=-]+/[A-Za-z0-9_.=:-]+")


class PulsarTxnOutcome(enum.Enum):
    """What the anchor partition says about a transaction."""

    COMMITTED = "committed"
    ABORTED = "aborted"
    OPEN = "open"
    """Dispatch is held at an open transaction: this one, or an earlier one on the partition."""
    UNREADABLE = "unreadable"
    """The probe came without the anchor, and nothing shows the anchor's ledger is still stored
    (retention or a truncate may have deleted it): committed and aborted look the same."""


@dataclass(frozen=True)
class PulsarPreparedTxn:
    """Immutable name of one prepared Pulsar transaction; ``str()`` and :meth:`parse`
    round-trip. ``anchor`` is where the transaction's last message to ``anchor_topic`` (a full
    ``persistent://`` name of a partition or non-partitioned topic) was stored."""

    txn: TxnId
    anchor_topic: str
    anchor: MessageId

    def __post_init__(self) -> None:
        text = (f"txn {self.txn}, anchor {self.anchor_topic!r} "
                f"{self.anchor.ledger_id}:{self.anchor.entry_id}")
        checks = (
            (0 <= self.txn.most <= _MAX_U64 and 0 <= self.txn.least <= _MAX_U64,
             f"TxnID bits must be 0..{_MAX_U64}"),
            (0 <= self.anchor.ledger_id <= _MAX_I64 and 0 <= self.anchor.entry_id <= _MAX_I64,
             f"ledger and entry id must be 0..{_MAX_I64}"),
            (-1 <= self.anchor.partition <= _MAX_I32 and -1 <= self.anchor.batch_index <= _MAX_I32,
             f"partition and batch index must be -1..{_MAX_I32}"),
            (len(self.anchor_topic) <= _MAX_TOPIC and bool(_TOPIC.fullmatch(self.anchor_topic)),
             "the anchor topic must be a full persistent://tenant/namespace/topic name"),
        )
        for ok, reason in checks:
            if not ok:
                raise InvalidPreparedStateError(text, reason)

    def __str__(self) -> str:
        t, a = self.txn, self.anchor
        return (f"{_PREFIX}:{t.most}:{t.least}:{a.ledger_id}:{a.entry_id}:{a.partition}:"
                f"{a.batch_index}:{self.anchor_topic}")

    @classmethod
    def parse(cls, text: str) -> PulsarPreparedTxn:
        """Parse ``dwp1:<most>:<least>:<ledger>:<entry>:<partition>:<batch>:<topic>``."""
        if not isinstance(text, str):
            raise InvalidPreparedStateError(repr(text), "expected a string")
        if len(text) > _MAX_TOPIC + 200:
            raise InvalidPreparedStateError(text[:80] + "…", "too long")
        parts = text.split(":", 7)
        if len(parts) != 8 or parts[0] != _PREFIX:
            raise InvalidPreparedStateError(
                text, f"expected '{_PREFIX}:<most>:<least>:<ledger>:<entry>:<partition>:"
                "<batch>:<persistent://tenant/ns/topic>'")
        numbers = []
        for p in parts[1:7]:
            if not _INT.fullmatch(p):
                raise InvalidPreparedStateError(text, f"{p!r} is not a valid number")
            numbers.append(int(p))
        most, least, ledger, entry, partition, batch = numbers
        try:
            return cls(TxnId(most, least), parts[7],
                       MessageId(ledger, entry, partition, batch))
        except InvalidPreparedStateError as e:
            raise InvalidPreparedStateError(text, e.reason) from None


def txn_outcome(client: PulsarTxnClient, prepared: PulsarPreparedTxn,
                wait_s: float) -> PulsarTxnOutcome:
    """Whether ``prepared`` committed, aborted or is still open, from its anchor partition.

    Sends a probe (outside any transaction) to the anchor partition, then reads from the
    anchor on; waits at most ``wait_s`` for the probe to be dispatched (OPEN otherwise).
    """
    anchor = (prepared.anchor.ledger_id, prepared.anchor.entry_id)
    ledger = anchor[0]
    started = time.monotonic()
    probe_ids = client.send(prepared.anchor_topic,
                            [f"dualwrite-probe {prepared.txn} {uuid.uuid4().hex}".encode()],
                            None)
    probe = (probe_ids[0].ledger_id, probe_ids[0].entry_id)
    if probe <= anchor:
        raise PulsarProtocolError(f"outcome of {prepared.txn}: the probe was stored at {probe}, "
                                  f"not after the anchor {anchor} on {prepared.anchor_topic}")
    deadline = time.monotonic() + wait_s
    result = PulsarTxnOutcome.OPEN
    # Ledgers are deleted whole and never the current one: an entry read from the anchor's
    # ledger, or the probe stored in it, proves the anchor is still stored, so that a probe
    # read without it means the broker filtered it out (aborted).
    ledger_stored = probe[0] == ledger
    with client.reader(prepared.anchor_topic, prepared.anchor) as reader:
        try:
            while True:
                entry = reader.receive(deadline)
                ledger_stored = ledger_stored or entry.position[0] == ledger
                if entry.position == anchor:
                    if entry.txn != prepared.txn:
                        raise PulsarFatalError(
                            f"outcome of {prepared.txn}: the anchor {anchor} on "
                            f"{prepared.anchor_topic} belongs to transaction {entry.txn}: the "
                            "prepared state names another transaction's message")
                    result = PulsarTxnOutcome.COMMITTED
                    break
                if entry.position >= probe:
                    result = (PulsarTxnOutcome.ABORTED if ledger_stored
                              else PulsarTxnOutcome.UNREADABLE)
                    break
        except PulsarTimeoutError:
            if time.monotonic() < deadline:
                raise
        reader.close(time.monotonic() + min(2.0, client.timeout_s))
    log.info("pulsar transaction %s: outcome %s (anchor %s:%s on %s, %.3f s)", prepared.txn,
             result.value, *anchor, prepared.anchor_topic, time.monotonic() - started)
    return result


class PulsarParticipant:
    """One Pulsar transaction at a time over a :class:`PulsarTxnClient`: begin, send, prepare
    (the anchor last); commit or abort a prepared transaction by its state, from any process.

    ``outcome_wait_s``: how long :meth:`outcome` waits for its probe before answering OPEN.
    """

    def __init__(self, client: PulsarTxnClient, *, outcome_wait_s: float = 5.0) -> None:
        if outcome_wait_s <= 0:
            raise PulsarFatalError("outcome_wait_s must be positive")
        self.client = client
        self.outcome_wait_s = outcome_wait_s
        self._txn: TxnId | None = None
        self._partitions: set[str] = set()

    def __repr__(self) -> str:
        return f"PulsarParticipant({self.client!r}, txn={self._txn})"

    @property
    def txn(self) -> TxnId | None:
        """The transaction begun and not yet prepared, if any."""
        return self._txn

    def begin(self, timeout_ms: int) -> TxnId:
        """Open a transaction that the coordinator aborts after ``timeout_ms`` unless ended."""
        if self._txn is not None:
            raise PulsarFatalError(f"transaction {self._txn} is still open: prepare it first")
        self._txn = self.client.new_txn(timeout_ms)
        self._partitions = set()
        log.info("pulsar transaction %s: begun (timeout %d ms)", self._txn, timeout_ms)
        return self._txn

    def send(self, topic: str, payloads: Sequence[bytes],
             keys: Sequence[str | None] | None = None) -> list[MessageId]:
        """Send ``payloads`` to ``topic`` (a partition or non-partitioned topic) in the open
        transaction, registering the partition with it first; ``keys``: their partition keys."""
        txn = self._current()
        name = full_topic_name(topic)
        if name not in self._partitions:
            self.client.add_partitions(txn, [name])
            self._partitions.add(name)
        return self.client.send(name, payloads, txn, keys)

    def prepare(self, anchor_topic: str, anchor_payload: bytes) -> PulsarPreparedTxn:
        """Send ``anchor_payload`` as the transaction's last message, to ``anchor_topic``, and
        return the prepared state naming it. No more sends in this transaction after this."""
        txn = self._current()
        (anchor,) = self.send(anchor_topic, [anchor_payload])
        prepared = PulsarPreparedTxn(txn, full_topic_name(anchor_topic), anchor)
        self._txn = None
        log.info("pulsar transaction %s: prepared as %s", txn, prepared)
        return prepared

    def abort_open(self) -> None:
        """Abort the transaction begun and not prepared, if any (nothing decided it). A failure
        is only logged: the coordinator aborts it at its timeout all the same."""
        txn, self._txn = self._txn, None
        if txn is None:
            return
        try:
            self.client.end_txn(txn, commit=False)
            log.info("pulsar transaction %s: aborted before its prepare", txn)
        except PulsarError as e:
            log.warning("pulsar transaction %s: abort before its prepare failed (%s); its "
                        "timeout aborts it", txn, e)

    def abort_prepared_quietly(self, prepared: PulsarPreparedTxn) -> None:
        """Abort a prepared transaction that nothing decided to commit; a failure is only
        logged (the coordinator's timeout aborts it all the same)."""
        try:
            self.abort(prepared)
        except PulsarHeuristicCommitError as e:  # never silent, though nothing should commit it
            log.error("pulsar transaction %s: %s", prepared.txn, e)
        except PulsarError as e:
            log.warning("pulsar transaction %s: abort failed (%s); its timeout aborts it",
                        prepared.txn, e)

    def outcome(self, prepared: PulsarPreparedTxn) -> PulsarTxnOutcome:
        """See :func:`txn_outcome`."""
        return txn_outcome(self.client, prepared, self.outcome_wait_s)

    def commit(self, prepared: PulsarPreparedTxn) -> bool:
        """Commit by TxnID. Done if the coordinator commits it (True), or if it had been
        committed already (False); :class:`PulsarHeuristicAbortError` if Pulsar aborted it;
        :class:`PulsarTxnStillOpenError` (retriable) while the outcome cannot be read yet."""
        return self._end(prepared, commit=True)

    def abort(self, prepared: PulsarPreparedTxn) -> bool:
        """Abort by TxnID; the mirror of :meth:`commit` (:class:`PulsarHeuristicCommitError`
        if Pulsar had committed it)."""
        return self._end(prepared, commit=False)

    def _end(self, prepared: PulsarPreparedTxn, commit: bool) -> bool:
        action = "commit" if commit else "abort"
        txn = prepared.txn
        log.info("pulsar transaction %s: %s", txn, action)
        try:
            self.client.end_txn(txn, commit)
        except (TransactionNotFoundError, InvalidTxnStatusError, PulsarOutcomeUnknownError) as e:
            # Not found: already ended (or timed out). Invalid status: ending now, by another
            # process's END_TXN or the timeout. Either way the anchor tells the outcome.
            log.info("pulsar transaction %s: %s answered %s; reading its anchor", txn, action,
                     type(e).__name__)
            outcome = self.outcome(prepared)
            wanted = PulsarTxnOutcome.COMMITTED if commit else PulsarTxnOutcome.ABORTED
            if outcome is wanted:
                log.info("pulsar transaction %s: already %s", txn, outcome.value)
                return False
            if outcome is PulsarTxnOutcome.UNREADABLE:
                if not commit:
                    # Only a commit decision commits a prepared transaction: nothing but an
                    # outside commit can have made this one visible.
                    log.warning("pulsar transaction %s: abort could not be confirmed from the "
                                "anchor (its ledger is no longer stored); taken as aborted", txn)
                    return False
                log.error("pulsar transaction %s: outcome unreadable (anchor %s)", txn, prepared)
                raise PulsarOutcomeUnreadableError(
                    str(txn), str(prepared), f"commit answered {type(e).__name__}; the anchor's "
                    f"ledger {prepared.anchor.ledger_id} on {prepared.anchor_topic} is no longer "
                    "stored") from None
            if outcome is PulsarTxnOutcome.OPEN:
                raise PulsarTxnStillOpenError(
                    f"{action} of Pulsar transaction {txn}: the coordinator answered "
                    f"{type(e).__name__} but its anchor partition {prepared.anchor_topic} still "
                    f"holds dispatch at an open transaction after {self.outcome_wait_s} s; "
                    "retry") from None
            detail = (f"{action} answered {type(e).__name__}; the anchor "
                      f"{prepared.anchor.ledger_id}:{prepared.anchor.entry_id} on "
                      f"{prepared.anchor_topic} reads {outcome.value}")
            log.error("pulsar transaction %s: heuristic outcome: %s", txn, detail)
            if commit:
                raise PulsarHeuristicAbortError(str(txn), str(prepared), detail) from None
            raise PulsarHeuristicCommitError(str(txn), str(prepared), detail) from None
        log.info("pulsar transaction %s: %s done", txn, action)
        return True

    def _current(self) -> TxnId:
        if self._txn is None:
            raise PulsarFatalError("no open transaction: call begin() first")
        return self._txn
