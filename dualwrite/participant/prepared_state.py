"""PreparedTxnState: the string that names one prepared Kafka transaction.

KIP-939's Java client names a prepared transaction ``"<producerId>:<epoch>"``, which is unique only
because KIP-890 part 2 bumps the epoch on every commit. librdkafka does not (the TV1 path,
docs/broker-facts.md, "Fact 3"), so one (producer id, epoch) spans a whole producer session.
dualwrite adds an *anchor*: one partition the transaction wrote to and the transaction's first
offset there. An offset is written once, so the anchor names exactly one transaction; recovery
checks it against the partition leader's DescribeProducers (``CurrentTxnStartOffset``) and, once
the transaction has ended, against what a read_committed consumer sees at that offset.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from dualwrite.errors import InvalidPreparedStateError
from dualwrite.participant.identifiers import TopicPartition

__all__ = ["MAX_STATE_LENGTH", "PULSAR_STATE_PREFIX", "Anchor", "PreparedTxnState",
           "is_pulsar_state"]

MAX_STATE_LENGTH = 255
_PREFIX = "dw1"
PULSAR_STATE_PREFIX = "dwp1"
"""The prefix of a Pulsar transaction's state (:class:`~dualwrite.participant.pulsar.
PulsarPreparedTxn`), kept in the same state table by a ``PulsarDualWriter``."""

_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")
_HASHED_TOPIC = re.compile(r"#[0-9a-f]{16}")
_INT = re.compile(r"-?[0-9]{1,19}")
# Wire-protocol bounds: producer id and offset are int64, partition int32, epoch int16.
_MAX_INT64 = 2**63 - 1
_MAX_INT32 = 2**31 - 1
_MAX_EPOCH = 32767


def is_pulsar_state(text: str) -> bool:
    """Whether a stored state names a Pulsar transaction, not a Kafka one."""
    return text.startswith(PULSAR_STATE_PREFIX + ":")


def topic_digest(topic: str) -> str:
    """Stand-in for a topic name too long to fit the state column."""
    return "#" + hashlib.sha256(topic.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Anchor:
    """A partition the transaction wrote to and its first offset there.

    ``topic`` is the topic name, or ``#<digest>`` when the name would not fit in 255 characters;
    :meth:`matches` compares either form.
    """

    topic: str
    partition: int
    offset: int

    def matches(self, tp: TopicPartition) -> bool:
        if tp.partition != self.partition:
            return False
        return tp.topic == self.topic or topic_digest(tp.topic) == self.topic

    def resolve(self, partitions: frozenset[TopicPartition] | set[TopicPartition]
                ) -> TopicPartition | None:
        """The partition this anchor names, among ``partitions`` (needed for hashed topics)."""
        if not self.topic.startswith("#"):
            return TopicPartition(self.topic, self.partition)
        return next((tp for tp in sorted(partitions) if self.matches(tp)), None)


@dataclass(frozen=True)
class PreparedTxnState:
    """Immutable name of one prepared transaction; ``str()`` and :meth:`parse` round-trip.

    The empty state (``PreparedTxnState()``, text ``""``) means "no prepared transaction".
    """

    producer_id: int = -1
    epoch: int = -1
    anchor: Anchor | None = None

    def __post_init__(self) -> None:
        if (self.producer_id < 0) != (self.epoch < 0):
            raise ValueError("producer_id and epoch must both be set or both be -1")
        if self.anchor is not None and self.producer_id < 0:
            raise ValueError("an anchor needs a producer id and epoch")

    @classmethod
    def empty(cls) -> PreparedTxnState:
        return cls()

    @classmethod
    def of(cls, producer_id: int, epoch: int, tp: TopicPartition | None, offset: int | None
           ) -> PreparedTxnState:
        """The state of a transaction whose first offset on ``tp`` is ``offset``."""
        anchor = None
        if tp is not None and offset is not None:
            full = Anchor(tp.topic, tp.partition, offset)
            anchor = full
            if len(str(cls(producer_id, epoch, full))) > MAX_STATE_LENGTH:
                anchor = Anchor(topic_digest(tp.topic), tp.partition, offset)
        return cls(producer_id, epoch, anchor)

    @property
    def is_empty(self) -> bool:
        return self.producer_id < 0

    def __str__(self) -> str:
        if self.is_empty:
            return ""
        if self.anchor is None:
            return f"{self.producer_id}:{self.epoch}"
        a = self.anchor
        return f"{_PREFIX}:{self.producer_id}:{self.epoch}:{a.topic}:{a.partition}:{a.offset}"

    @classmethod
    def parse(cls, text: str) -> PreparedTxnState:
        """Parse dualwrite's form, the Java client's ``"producerId:epoch"``, or ``""``."""
        if not isinstance(text, str):
            raise InvalidPreparedStateError(repr(text), "expected a string")
        if text == "":
            return cls()
        if len(text) > MAX_STATE_LENGTH:
            raise InvalidPreparedStateError(text, f"longer than {MAX_STATE_LENGTH} characters")
        parts = text.split(":")
        if len(parts) == 2:
            pid, epoch = (_int(text, p, "producer id/epoch") for p in parts)
            return cls._checked(text, pid, epoch, None)
        if len(parts) == 6 and parts[0] == _PREFIX:
            _, pid_s, epoch_s, topic, part_s, off_s = parts
            if not (_TOPIC.fullmatch(topic) or _HASHED_TOPIC.fullmatch(topic)):
                raise InvalidPreparedStateError(text, f"{topic!r} is not a valid topic name")
            pid, epoch, partition, offset = (
                _int(text, p, "number") for p in (pid_s, epoch_s, part_s, off_s))
            if not 0 <= partition <= _MAX_INT32:
                raise InvalidPreparedStateError(text, f"partition must be 0..{_MAX_INT32}")
            if not 0 <= offset <= _MAX_INT64:
                raise InvalidPreparedStateError(text, f"offset must be 0..{_MAX_INT64}")
            return cls._checked(text, pid, epoch, Anchor(topic, partition, offset))
        raise InvalidPreparedStateError(
            text, "expected '', '<producerId>:<epoch>' or "
            "'dw1:<producerId>:<epoch>:<topic>:<partition>:<offset>'")

    @classmethod
    def _checked(cls, text: str, pid: int, epoch: int, anchor: Anchor | None
                 ) -> PreparedTxnState:
        if not 0 <= pid <= _MAX_INT64 or not 0 <= epoch <= _MAX_EPOCH:
            raise InvalidPreparedStateError(
                text, f"producer id must be 0..{_MAX_INT64}, epoch 0..{_MAX_EPOCH}")
        return cls(pid, epoch, anchor)


def _int(text: str, value: str, what: str) -> int:
    if not _INT.fullmatch(value):
        raise InvalidPreparedStateError(text, f"{value!r} is not a valid {what}")
    return int(value)
