"""The open transactions of a cluster, as an application or an operator asks for them.

What ``dualwrite status`` prints as hanging, as a function: after a crash, which transactions are
still open (they hold the last stable offset of every partition they wrote, so read_committed
consumers of those partitions stall), of which producer, for how long.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dualwrite.participant.control_plane import ControlPlane, TransactionDescription, TxnState

__all__ = ["OPEN_STATES", "OpenTransaction", "open_transactions"]

OPEN_STATES = (TxnState.ONGOING, TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT,
               TxnState.PREPARE_EPOCH_FENCE)
"""Coordinator states of a transaction that is not finished (it pins the last stable offset)."""


@dataclass(frozen=True)
class OpenTransaction:
    """One transaction that its coordinator has not finished."""

    transactional_id: str
    producer_id: int
    epoch: int
    state: str
    """The coordinator's state: ``Ongoing``, ``PrepareCommit``, ``PrepareAbort`` or
    ``PrepareEpochFence`` (the last three while its markers are being written)."""
    partitions: tuple[tuple[str, int], ...]
    """(topic, partition) pairs it wrote to, sorted."""
    open_for_ms: int | None
    """Since the coordinator started it (None if the coordinator did not say)."""
    timeout_ms: int
    """Its ``transaction.timeout.ms``: the coordinator aborts it once it is open that long."""

    @classmethod
    def of(cls, d: TransactionDescription) -> OpenTransaction:
        return cls(d.transactional_id, d.producer_id, d.epoch, d.state.value,
                   tuple(sorted((tp.topic, tp.partition) for tp in d.partitions)),
                   d.open_for_ms(), d.timeout_ms)

    def as_dict(self) -> dict[str, Any]:
        return {"transactional_id": self.transactional_id, "producer_id": self.producer_id,
                "epoch": self.epoch, "state": self.state, "open_for_ms": self.open_for_ms,
                "timeout_ms": self.timeout_ms,
                "partitions": [f"{t}-{p}" for t, p in self.partitions]}

    def __str__(self) -> str:
        opened = f"{self.open_for_ms / 1000:.1f}s" if self.open_for_ms is not None else "?"
        return (f"{self.transactional_id} producer_id={self.producer_id} epoch={self.epoch} "
                f"{self.state} open for {opened}")


def describe_open(cp: ControlPlane, *, prefix: str | None = None,
                  exclude: Iterable[str] = ()) -> list[TransactionDescription]:
    """The descriptions of every open transaction (ids starting with ``prefix``, if given),
    without the ids in ``exclude``: ListTransactions on every broker, then DescribeTransactions
    (a listed transaction may have finished in between: only those still open are returned)."""
    skip = set(exclude)
    listed = cp.list_transactions(states=OPEN_STATES, prefix=prefix)
    ids = [t.transactional_id for t in listed if t.transactional_id not in skip]
    described = cp.describe_transactions(ids).values()
    return sorted((d for d in described if d.state.in_flight), key=lambda d: d.transactional_id)


def open_transactions(kafka_config: Mapping[str, Any], topics: Iterable[str] | None = None, *,
                      transactional_id_prefix: str | None = None, timeout_s: float = 30.0
                      ) -> list[OpenTransaction]:
    """Every transaction of the cluster that its coordinator has not finished, sorted by id.

    ``topics``: only transactions that wrote to one of these topics. ``transactional_id_prefix``:
    only ids starting with it. ``kafka_config`` is a confluent-kafka configuration (its
    ``bootstrap.servers`` and security settings are used). Needs DESCRIBE on the transactional
    ids (ListTransactions shows only those).
    """
    wanted = set(topics) if topics is not None else None
    with ControlPlane(kafka_config, timeout_s=timeout_s) as cp:
        described = describe_open(cp, prefix=transactional_id_prefix)
    return [OpenTransaction.of(d) for d in described
            if wanted is None or any(tp.topic in wanted for tp in d.partitions)]
