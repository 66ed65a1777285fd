"""PulsarParticipant and PulsarPreparedTxn: the state string, and the outcome-safe end of a
transaction against a real Pulsar standalone (the package's shared ``pulsar_broker``).

Commit and abort run in a new process from the parsed state string
(tests/participant/pulsar/_participant_helper.py); a finished transaction's outcome is read from
its anchor partition. Broker tests need java, javac and mvn; the unit tests need nothing.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from dualwrite.errors import (
    HeuristicAbortError,
    HeuristicCommitError,
    InvalidPreparedStateError,
    OutcomeUnreadableError,
)
from dualwrite.participant.pulsar import (
    MessageId,
    PulsarError,
    PulsarHeuristicAbortError,
    PulsarHeuristicCommitError,
    PulsarOutcomeUnreadableError,
    PulsarParticipant,
    PulsarPreparedTxn,
    PulsarTimeoutError,
    PulsarTxnClient,
    PulsarTxnOutcome,
    ReceivedEntry,
    TxnId,
)
from dualwrite.participant.pulsar import pulsar_api_pb2 as pb

if TYPE_CHECKING:
    from dualwrite.dev.pulsar_cluster import LocalPulsar

ROOT = Path(__file__).resolve().parents[3]
TOPIC = "persistent://public/default/orders-partition-3"

# -- unit: the state string ----------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("prepared", [
    PulsarPreparedTxn(TxnId(0, 7), TOPIC, MessageId(12, 0)),
    PulsarPreparedTxn(TxnId(2**64 - 1, 2**64 - 1), "persistent://t-1/ns.x/a:b=c",
                      MessageId(2**63 - 1, 2**63 - 1, 2**31 - 1, 2**31 - 1)),
    PulsarPreparedTxn(TxnId(3, 0), TOPIC, MessageId(5, 9, 3, -1)),
], ids=["plain", "bounds", "partition"])
def test_state_round_trips(prepared: PulsarPreparedTxn) -> None:
    text = str(prepared)
    assert text.startswith("dwp1:")
    assert PulsarPreparedTxn.parse(text) == prepared
    assert str(PulsarPreparedTxn.parse(text)) == text


@pytest.mark.unit
def test_state_string_layout() -> None:
    state = PulsarPreparedTxn(TxnId(0, 7), TOPIC, MessageId(12, 4))
    assert str(state) == f"dwp1:0:7:12:4:-1:-1:{TOPIC}"


@pytest.mark.unit
@pytest.mark.parametrize("text", [
    "",
    "dwp1:0:7:12:4:-1:-1",
    "dw1:0:7:12:4:-1:-1:" + TOPIC,
    "dwp1:0:x:12:4:-1:-1:" + TOPIC,
    "dwp1:0:7:12:4:-1:-1:public/default/orders",
    "dwp1:0:7:12:4:-1:-1:non-persistent://public/default/orders",
    "dwp1:0:7:12:4:-1:-1:persistent://public/default/",
    "dwp1:0:7:12:4:-1:-1:persistent://public/default/a b",
    f"dwp1:{2**64}:7:12:4:-1:-1:{TOPIC}",
    f"dwp1:-1:7:12:4:-1:-1:{TOPIC}",
    f"dwp1:0:7:{2**63}:4:-1:-1:{TOPIC}",
    f"dwp1:0:7:12:-1:-1:-1:{TOPIC}",
    f"dwp1:0:7:12:4:-2:-1:{TOPIC}",
    f"dwp1:0:7:12:4:-1:{2**31}:{TOPIC}",
    f"dwp1:0:7:12:4:-1:-1:persistent://a/b/{'x' * 5000}",
], ids=lambda t: t[:40] or "empty")
def test_bad_state_is_refused(text: str) -> None:
    with pytest.raises(InvalidPreparedStateError):
        PulsarPreparedTxn.parse(text)


@pytest.mark.unit
def test_bad_state_is_refused_on_creation() -> None:
    with pytest.raises(InvalidPreparedStateError, match="TxnID"):
        PulsarPreparedTxn(TxnId(-1, 0), TOPIC, MessageId(1, 1))
    with pytest.raises(InvalidPreparedStateError, match="persistent://"):
        PulsarPreparedTxn(TxnId(0, 0), "orders", MessageId(1, 1))
    with pytest.raises(InvalidPreparedStateError):
        PulsarPreparedTxn.parse(None)  # type: ignore[arg-type]


@pytest.mark.unit
def test_batch_entry_is_split_into_messages() -> None:
    payload = b""
    for i, body in enumerate((b"one", b"", b"three")):
        single = pb.SingleMessageMetadata(payload_size=len(body), sequence_id=i,
                                          properties=[pb.KeyValue(key="k", value=str(i))])
        raw = single.SerializeToString()
        payload += struct.pack(">I", len(raw)) + raw + body
    meta = pb.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1,
                              num_messages_in_batch=3)
    entry = ReceivedEntry(MessageId(4, 2, 0), meta, payload)
    messages = entry.messages()
    assert [m.payload for m in messages] == [b"one", b"", b"three"]
    assert [m.message_id for m in messages] == [MessageId(4, 2, 0, i) for i in range(3)]
    assert messages[2].properties == {"k": "2"}
    with pytest.raises(PulsarError, match="batch"):
        ReceivedEntry(MessageId(4, 2), meta, payload[:-2]).messages()


# -- a real broker -------------------------------------------------------------------------

needs_broker = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(pulsar_broker: LocalPulsar) -> Iterator[PulsarTxnClient]:
    with PulsarTxnClient(pulsar_broker.service_url, timeout_s=20) as c:
        yield c


def _topic(kind: str) -> str:
    return f"persistent://public/default/{kind}-{uuid.uuid4().hex[:8]}"


def _end_in_new_process(url: str, action: str, state: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "tests.participant.pulsar._participant_helper", url, action,
         state], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=60, check=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, out.stderr[-2000:]
    return lines[-1].removeprefix("RESULT ")


def _read(client: PulsarTxnClient, topic: str, start: MessageId, wait_s: float = 1.0
          ) -> list[bytes]:
    """Every payload dispatched from ``start`` on within ``wait_s``."""
    payloads = []
    deadline = time.monotonic() + wait_s
    with client.reader(topic, start) as reader:
        try:
            while True:
                payloads.append(reader.receive(deadline).payload)
        except PulsarTimeoutError:
            pass
    return payloads


def _prepared(participant: PulsarParticipant, timeout_ms: int = 60_000
              ) -> tuple[PulsarPreparedTxn, str, MessageId]:
    """Begin, send two messages to a data topic, prepare on an anchor topic."""
    participant.begin(timeout_ms)
    data = _topic("data")
    first, _ = participant.send(data, [b"d0", b"d1"])
    return participant.prepare(_topic("anchor"), b"anchor"), data, first


@needs_broker
def test_new_process_commits_by_state_and_retry_is_idempotent(
        pulsar_broker: LocalPulsar, client: PulsarTxnClient) -> None:
    participant = PulsarParticipant(client, outcome_wait_s=3.0)
    prepared, data, first = _prepared(participant)
    assert _end_in_new_process(pulsar_broker.service_url, "commit", str(prepared)) == "OK"
    assert _read(client, data, first) == [b"d0", b"d1"]
    started = time.monotonic()
    participant.commit(prepared)  # TransactionNotFound, then the anchor reads committed
    retry_s = time.monotonic() - started
    assert participant.outcome(prepared) is PulsarTxnOutcome.COMMITTED
    with pytest.raises(PulsarHeuristicCommitError) as info:
        participant.abort(prepared)
    assert isinstance(info.value, HeuristicCommitError)
    assert str(prepared.txn) in str(info.value)
    print(f"commit retry (end, probe, read) {retry_s:.3f} s")


@needs_broker
def test_new_process_aborts_by_state(pulsar_broker: LocalPulsar,
                                     client: PulsarTxnClient) -> None:
    participant = PulsarParticipant(client, outcome_wait_s=3.0)
    prepared, data, first = _prepared(participant)
    assert _end_in_new_process(pulsar_broker.service_url, "abort", str(prepared)) == "OK"
    assert _read(client, data, first, wait_s=0.5) == []
    participant.abort(prepared)  # again: the anchor reads aborted, so done
    assert participant.outcome(prepared) is PulsarTxnOutcome.ABORTED


@needs_broker
def test_commit_after_timeout_abort_is_heuristic(pulsar_broker: LocalPulsar,
                                                 client: PulsarTxnClient) -> None:
    participant = PulsarParticipant(client, outcome_wait_s=3.0)
    opened = time.monotonic()
    prepared, _, _ = _prepared(participant, timeout_ms=2_000)
    time.sleep(max(0.0, opened + 3.5 - time.monotonic()))
    result = ""
    for _ in range(20):  # the coordinator may still be aborting it (InvalidTxnStatus)
        result = _end_in_new_process(pulsar_broker.service_url, "commit", str(prepared))
        if not result.startswith(("PulsarRetriableError", "PulsarTxnStillOpenError")):
            break
        time.sleep(0.5)
    assert result.startswith("PulsarHeuristicAbortError "), result
    assert str(prepared.txn) in result and str(prepared) in result
    with pytest.raises(PulsarHeuristicAbortError) as info:
        participant.commit(prepared)
    assert isinstance(info.value, HeuristicAbortError)
    assert info.value.transactional_id == str(prepared.txn)
    assert str(prepared.txn) in str(info.value)


@needs_broker
def test_open_transaction_reads_open_until_ended(client: PulsarTxnClient) -> None:
    participant = PulsarParticipant(client, outcome_wait_s=1.5)
    prepared, _, _ = _prepared(participant)
    started = time.monotonic()
    assert participant.outcome(prepared) is PulsarTxnOutcome.OPEN
    assert time.monotonic() - started >= 1.5
    participant.abort(prepared)
    assert participant.outcome(prepared) is PulsarTxnOutcome.ABORTED


def _admin(broker: LocalPulsar, method: str, path: str) -> None:
    """An admin call that must succeed; a 500 right after the topic moved is asked again (seen:
    truncate answering "Cursor was already closed" while the topic reloads)."""
    for _ in range(20):
        code, answer = broker.admin_request(method, path)
        if code != 500:
            break
        time.sleep(0.5)
    assert code == 204, answer


@needs_broker
def test_an_anchor_whose_ledger_was_deleted_is_unreadable_not_aborted(
        pulsar_broker: LocalPulsar, client: PulsarTxnClient) -> None:
    """A committed transaction, then its anchor's ledger rolled over (topic unloaded) and
    deleted (truncate, as retention would): the probe comes alone, as after an abort, but
    nothing proves the anchor is still stored. Commit must not call it aborted (its advice,
    re-publish, would duplicate the messages); abort takes it as done."""
    participant = PulsarParticipant(client, outcome_wait_s=3.0)
    prepared, _, _ = _prepared(participant)
    participant.commit(prepared)
    path = prepared.anchor_topic.removeprefix("persistent://")
    _admin(pulsar_broker, "PUT", f"/admin/v2/persistent/{path}/unload")
    client.send(prepared.anchor_topic, [b"in the next ledger"], None)
    _admin(pulsar_broker, "DELETE", f"/admin/v2/persistent/{path}/truncate")
    assert participant.outcome(prepared) is PulsarTxnOutcome.UNREADABLE
    with pytest.raises(PulsarOutcomeUnreadableError) as info:
        participant.commit(prepared)
    assert isinstance(info.value, OutcomeUnreadableError)
    assert str(prepared.txn) in str(info.value)
    participant.abort(prepared)
