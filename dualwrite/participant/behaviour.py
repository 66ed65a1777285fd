"""The broker behaviours dualwrite's recovery relies on, checked with one real transaction.

``dualwrite probe --behaviour-topic T`` runs this: it prepares a one-record transaction on
partition 0 of ``T`` under a fresh transactional id, then checks, by API key, what recovery
does with such a transaction on any broker (Apache Kafka, or another implementation of the
protocol). The record is aborted, so no consumer sees it; the id is left fenced.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dualwrite.errors import DualWriteError
from dualwrite.participant.anchor_reader import AnchorReader
from dualwrite.participant.control_plane import ControlPlane, TxnState
from dualwrite.participant.identifiers import TopicPartition
from dualwrite.participant.kafka_errors import FencedKafkaError
from dualwrite.participant.producer import TwoPhaseProducer

__all__ = ["BehaviourCheck", "check_behaviours"]

log = logging.getLogger(__name__)

_PROBE_PREFIX = "dualwrite-probe-behaviour-"


@dataclass(frozen=True)
class BehaviourCheck:
    """One behaviour: what was asked (with its API key), whether the broker did it, and what
    it answered."""

    behaviour: str
    ok: bool
    detail: str

    @property
    def required(self) -> bool:
        """False for what dualwrite works without (it then asks the anchor instead)."""
        return not self.behaviour.startswith("DescribeTransactions (65) after EndTxn")


def check_behaviours(config: Mapping[str, Any], topic: str, *, timeout_s: float = 30.0
                     ) -> list[BehaviourCheck]:
    """Run the checks on ``topic`` (it must exist) with the application's client ``config``."""
    tid = f"{_PROBE_PREFIX}{uuid.uuid4().hex[:12]}"
    out: list[BehaviourCheck] = []

    def check(behaviour: str, run: Callable[[], tuple[bool, str]]) -> bool:
        try:
            ok, detail = run()
        except DualWriteError as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        out.append(BehaviourCheck(behaviour, ok, detail))
        return ok

    producer = TwoPhaseProducer({**config, "transactional.id": tid,
                                 "transaction.timeout.ms": 60_000}, timeout_s=timeout_s)
    try:
        producer.init_transactions()
        producer.begin_transaction()
        producer.produce(topic, b"dualwrite probe (aborted)", partition=0)
        state = producer.prepare_transaction()
    finally:
        producer.close()  # leaves the prepared transaction open, as a crashed writer would
    anchor = state.anchor
    assert anchor is not None
    tp = TopicPartition(topic, 0)
    pid, epoch = state.producer_id, state.epoch
    with ControlPlane(config, timeout_s=timeout_s) as cp:
        def producers() -> tuple[bool, str]:
            offsets = [p.current_txn_start_offset for p in cp.describe_producers([tp])[tp]
                       if p.producer_id == pid]
            return offsets == [anchor.offset], f"CurrentTxnStartOffset {offsets}, first offset " \
                                               f"{anchor.offset}"

        def listed() -> tuple[bool, str]:
            found = [t for t in cp.list_transactions(prefix=tid) if t.transactional_id == tid]
            states = [t.state.value for t in found]
            return states == [TxnState.ONGOING.value], f"listed as {states}"

        def end() -> tuple[bool, str]:
            cp.end_transaction(tid, pid, epoch, commit=False)
            return True, "accepted"

        def described() -> tuple[bool, str]:
            desc = cp.describe_transaction(tid)
            deadline = time.monotonic() + min(timeout_s, 10.0)
            while desc is not None and desc.state.in_flight and time.monotonic() < deadline:
                time.sleep(0.05)  # PrepareAbort while the markers are written
                desc = cp.describe_transaction(tid)
            got = desc.state.value if desc is not None else "unknown id"
            return got == TxnState.COMPLETE_ABORT.value, f"state {got}"

        def hidden() -> tuple[bool, str]:
            committed = AnchorReader(config).committed(tp, anchor.offset, timeout_s,
                                                       transactional_id=tid, state=str(state))
            return not committed, "hidden" if not committed else "visible to read_committed"

        def fenced() -> tuple[bool, str]:
            new = cp.fence(tid)
            try:
                cp.end_transaction(tid, pid, epoch, commit=True)
            except FencedKafkaError as exc:
                return True, f"epoch {epoch} -> {new.epoch}; old epoch: {exc.info.name}"
            return False, f"epoch {epoch} -> {new.epoch}; EndTxn at the old epoch accepted"

        check("DescribeProducers (61): CurrentTxnStartOffset of an open transaction", producers)
        check("ListTransactions (66): the open transaction, by prefix", listed)
        if check("EndTxn (26) by (producer id, epoch) from another session", end):
            check("DescribeTransactions (65) after EndTxn: CompleteAbort", described)
            check("Fetch (1) read_committed: the aborted record hidden", hidden)
        check("InitProducerId (22): fences the old epoch (PRODUCER_FENCED 90)", fenced)
    log.info("behaviour probe on %s: %s", topic,
             "; ".join(f"{c.behaviour}: {'ok' if c.ok else 'NO'}" for c in out))
    return out
