"""What the batch tests share: a task attempt left prepared (``prepare``), the sink's open
pool, and coordinator hooks that call back at each point."""

from __future__ import annotations

from collections.abc import Callable

from dualwrite import TwoPhaseProducer
from dualwrite.batch.coordinator import CoordinatorHooks
from dualwrite.batch.decision_log import Participant
from dualwrite.batch.naming import transactional_id
from dualwrite.participant import ControlPlane, TxnState

OPEN = [TxnState.ONGOING, TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT]


def prepare(bootstrap: str, cp: ControlPlane, sink: str, topic: str, batch: int, partition: int,
            attempt: int, values: list[str], *, attempt_key: str = "") -> Participant:
    """One task attempt: produce ``values`` to ``partition``, prepare, drop the producer."""
    tid = transactional_id(sink, batch, partition, attempt)
    p = TwoPhaseProducer({"bootstrap.servers": bootstrap, "transactional.id": tid,
                          "linger.ms": 0, "transaction.timeout.ms": 600_000},
                         control_plane=cp, timeout_s=20)
    try:
        p.init_transactions()
        p.begin_transaction()
        for v in values:
            p.produce(topic, v.encode(), key=v.encode(), partition=partition)
        state = p.prepare_transaction()
    finally:
        p.close()  # the transaction stays open for the driver
    return Participant(partition, tid, state, len(values), attempt_key)


def open_in_pool(cp: ControlPlane, sink: str) -> list[str]:
    return sorted(t.transactional_id for t in cp.list_transactions(states=OPEN, prefix=sink)
                  if t.transactional_id.startswith(f"{sink}-b"))


def encoded(*values: str) -> list[bytes]:
    return sorted(v.encode() for v in values)


class Hooks(CoordinatorHooks):
    """Calls ``on(point, batch)`` at the coordinator's points while it is set."""

    def __init__(self, on: Callable[[str, int], None] | None = None) -> None:
        self.on = on

    def at(self, point: str, batch_id: int) -> None:
        if self.on is not None:
            self.on(point, batch_id)
