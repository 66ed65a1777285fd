"""Our Pulsar protocol client (dualwrite.participant.pulsar) against known bytes, a scripted fake
broker, and a real Pulsar standalone (``LocalPulsar``), whose results Pulsar's own Java client
reads back (tests/support/pulsar/TxnProbe.java).

The broker tests share one broker and one scenario for the module; transactions are opened and
ended in separate Python processes (tests/participant/pulsar/_txn_helper.py), one SIGKILLed.
They need java, javac and mvn and are skipped otherwise; the unit tests need nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from dualwrite.errors import FatalError, OutcomeUnknownError, RetriableError
from dualwrite.participant.pulsar import (
    PulsarAuthError,
    PulsarOutcomeUnknownError,
    PulsarTimeoutError,
    PulsarTxnClient,
    TransactionNotFoundError,
    TxnId,
    full_topic_name,
)
from dualwrite.participant.pulsar import pulsar_api_pb2 as pb
from dualwrite.participant.pulsar._wire import (
    MAGIC_CRC32C,
    Frame,
    MessageId,
    crc32c,
    decode_frame,
    encode_command,
    encode_send,
)
from dualwrite.participant.pulsar.errors import error_info, server_error
from tests.support.pulsar.broker import HAS_JAVA

if TYPE_CHECKING:
    from dualwrite.dev.pulsar_cluster import LocalPulsar

ROOT = Path(__file__).resolve().parents[3]
needs_broker = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not HAS_JAVA, reason="needs java, javac and mvn (Pulsar from Maven jars)"),
]
N = 5
SECRET = "eyJhbGciOiJIUzI1NiJ9.c2VjcmV0LXRva2Vu.not-a-real-signature"


# -- unit: bytes, checksums, error table ---------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("data", "expected"), [
    (b"", 0x00000000),
    (b"a", 0xC1D04330),
    (b"123456789", 0xE3069283),  # the CRC-32C check value
    (bytes(32), 0x8A9136AA),  # RFC 3720 B.4
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
], ids=["empty", "a", "check", "zeros", "ones", "incrementing", "decrementing"])
def test_crc32c_known_vectors(data: bytes, expected: int) -> None:
    assert crc32c(data) == expected


@pytest.mark.unit
def test_crc32c_continues_across_chunks() -> None:
    assert crc32c(b"56789", crc32c(b"1234")) == crc32c(b"123456789")


@pytest.mark.unit
def test_command_frame_bytes() -> None:
    """PING: total size 9, command size 5, then type=18 and an empty ping (field 18)."""
    frame = encode_command(pb.BaseCommand(type=pb.BaseCommand.PING, ping=pb.CommandPing()))
    assert frame == bytes.fromhex("00000009" "00000005" "0812" "920100")
    assert decode_frame(frame[4:]).command.type == pb.BaseCommand.PING


@pytest.mark.unit
def test_send_frame_layout_and_round_trip() -> None:
    """SEND: sizes, magic 0x0e01, a CRC32C over metadata size + metadata + payload, and the
    transaction id in both the command and the metadata."""
    send = pb.CommandSend(producer_id=3, sequence_id=7, num_messages=1, txnid_most_bits=0,
                          txnid_least_bits=42)
    meta = pb.MessageMetadata(producer_name="p", sequence_id=7, publish_time=1_700_000_000_000,
                              txnid_most_bits=0, txnid_least_bits=42)
    frame = encode_send(pb.BaseCommand(type=pb.BaseCommand.SEND, send=send), meta, b"hello")
    total, cmd_size = struct.unpack_from(">II", frame)
    assert total == len(frame) - 4
    pos = 8 + cmd_size
    magic, checksum, meta_size = struct.unpack_from(">HII", frame, pos)
    assert magic == MAGIC_CRC32C
    assert checksum == crc32c(frame[pos + 6:])
    assert frame[pos + 10 + meta_size:] == b"hello"
    decoded = decode_frame(frame[4:])
    assert decoded.command.send == send
    assert decoded.metadata == meta and decoded.payload == b"hello"


@pytest.mark.unit
def test_corrupt_payload_is_refused() -> None:
    meta = pb.MessageMetadata(producer_name="p", sequence_id=0, publish_time=1)
    frame = bytearray(encode_send(pb.BaseCommand(type=pb.BaseCommand.SEND, send=pb.CommandSend(
        producer_id=0, sequence_id=0)), meta, b"payload"))
    frame[-1] ^= 1
    with pytest.raises(FatalError, match="CRC32C mismatch"):
        decode_frame(bytes(frame[4:]))
    with pytest.raises(FatalError, match="malformed frame"):
        decode_frame(b"\x00\x00\x00\x03\xff\xff\xff")


@pytest.mark.unit
def test_error_codes_map_to_what_the_caller_does_next() -> None:
    assert isinstance(server_error(24, "not found", "END_TXN"), TransactionNotFoundError)
    assert isinstance(server_error(24, "", ""), FatalError)
    for code in (6, 14, 20, 21):  # ServiceNotReady, TooManyRequests, TC not found, committing
        assert isinstance(server_error(code, "", ""), RetriableError), code
    assert isinstance(server_error(3, "", ""), PulsarAuthError)
    # The owner check (authorization on) answers TransactionNotFound for a transaction that
    # exists: a role to change, not an outcome to read (tests/writer/pulsar/test_pulsar_auth.py).
    other_role = server_error(24, "Client (bob) is neither the owner of the transaction (0,7) "
                              "nor a super user", "END_TXN COMMIT (0,7)")
    assert isinstance(other_role, PulsarAuthError) and other_role.code_name == "TransactionNotFound"
    assert "role that opened the transaction" in str(other_role)
    assert error_info(999).name == "ServerError999"
    e = server_error(20, "x" * 5000, "NEW_TXN")
    assert e.code == 20 and e.code_name == "TransactionCoordinatorNotFound" and len(str(e)) < 900


@pytest.mark.unit
def test_topic_names_are_completed_like_pulsars() -> None:
    assert full_topic_name("t") == "persistent://public/default/t"
    assert full_topic_name("a/b/t") == "persistent://a/b/t"
    assert full_topic_name("non-persistent://a/b/t") == "non-persistent://a/b/t"
    with pytest.raises(FatalError):
        full_topic_name("a/t")


# -- unit: a scripted fake broker ----------------------------------------------------------


def _read_frame(sock: socket.socket) -> Frame:
    """One frame (the client writes SENDs back to back, so read exactly one frame's bytes)."""
    head = sock.recv(4, socket.MSG_WAITALL)
    if len(head) < 4:
        raise EOFError
    body = sock.recv(struct.unpack(">I", head)[0], socket.MSG_WAITALL)
    return decode_frame(body)


def _read_command(sock: socket.socket) -> pb.BaseCommand:
    return _read_frame(sock).command


def _write(sock: socket.socket, **fields: object) -> None:
    sock.sendall(encode_command(pb.BaseCommand(**fields)))  # type: ignore[arg-type]


@dataclass
class FakeBroker:
    """A loopback listener running ``script`` on its first connection, in a thread."""

    script: Callable[[socket.socket, list[pb.BaseCommand]], None]
    seen: list[pb.BaseCommand] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"pulsar://127.0.0.1:{self._server.getsockname()[1]}"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn, _ = self._server.accept()
        with conn, contextlib.suppress(EOFError, OSError):
            self.script(conn, self.seen)

    def close(self) -> None:
        self._server.close()
        self._thread.join(5)


def _handshake(sock: socket.socket, seen: list[pb.BaseCommand]) -> None:
    seen.append(_read_command(sock))
    _write(sock, type=pb.BaseCommand.CONNECTED,
           connected=pb.CommandConnected(server_version="fake", protocol_version=20))


@pytest.mark.unit
def test_ping_is_answered_while_waiting_and_errors_are_typed() -> None:
    """The broker PINGs before answering: we PONG and still get the answer; an END_TXN answer
    with TransactionNotFound is the typed error, with the broker's message."""

    def script(sock: socket.socket, seen: list[pb.BaseCommand]) -> None:
        _handshake(sock, seen)
        for _ in range(2):  # PARTITIONED_METADATA, LOOKUP of the coordinator's topic
            cmd = _read_command(sock)
            seen.append(cmd)
            if cmd.type == pb.BaseCommand.PARTITIONED_METADATA:
                _write(sock, type=pb.BaseCommand.PING, ping=pb.CommandPing())
                seen.append(_read_command(sock))  # the PONG
                _write(sock, type=pb.BaseCommand.PARTITIONED_METADATA_RESPONSE,
                       partitionMetadataResponse=pb.CommandPartitionedTopicMetadataResponse(
                           partitions=1, request_id=cmd.partitionMetadata.request_id))
            else:
                _write(sock, type=pb.BaseCommand.LOOKUP_RESPONSE,
                       lookupTopicResponse=pb.CommandLookupTopicResponse(
                           brokerServiceUrl=url, request_id=cmd.lookupTopic.request_id,
                           response=pb.CommandLookupTopicResponse.Connect))
        cmd = _read_command(sock)
        seen.append(cmd)
        _write(sock, type=pb.BaseCommand.TC_CLIENT_CONNECT_RESPONSE,
               tcClientConnectResponse=pb.CommandTcClientConnectResponse(
                   request_id=cmd.tcClientConnectRequest.request_id))
        cmd = _read_command(sock)
        seen.append(cmd)
        _write(sock, type=pb.BaseCommand.END_TXN_RESPONSE, endTxnResponse=pb.CommandEndTxnResponse(
            request_id=cmd.endTxn.request_id, error=pb.TransactionNotFound,
            message="The transaction with this txdID `(0,9)`not found "))
        _read_command(sock)

    broker = FakeBroker(script)
    url = broker.url
    try:
        with PulsarTxnClient(url, timeout_s=5) as client, \
                pytest.raises(TransactionNotFoundError, match=r"\(0,9\)`not found"):
            client.end_txn(TxnId(0, 9), commit=True)
    finally:
        broker.close()
    types = [pb.BaseCommand.Type.Name(c.type) for c in broker.seen]
    assert types == ["CONNECT", "PARTITIONED_METADATA", "PONG", "LOOKUP",
                     "TC_CLIENT_CONNECT_REQUEST", "END_TXN"]
    assert broker.seen[0].connect.protocol_version == 20
    assert broker.seen[3].lookupTopic.topic == (
        "persistent://pulsar/system/transaction_coordinator_assign-partition-0")
    end = broker.seen[5].endTxn
    assert (end.txnid_most_bits, end.txnid_least_bits, end.txn_action) == (0, 9, pb.COMMIT)


@pytest.mark.unit
def test_lookup_redirect_then_produce_in_a_transaction() -> None:
    """LOOKUP on the service broker redirects (authoritative) to the owner; the owner's LOOKUP
    is asked as authoritative and answers Connect; PRODUCER and two SENDs go to the owner, each
    SEND with a valid checksum and the TxnID in both the command and the metadata."""

    def service(sock: socket.socket, seen: list[pb.BaseCommand]) -> None:
        _handshake(sock, seen)
        cmd = _read_command(sock)
        seen.append(cmd)
        _write(sock, type=pb.BaseCommand.LOOKUP_RESPONSE,
               lookupTopicResponse=pb.CommandLookupTopicResponse(
                   brokerServiceUrl=owner.url, request_id=cmd.lookupTopic.request_id,
                   response=pb.CommandLookupTopicResponse.Redirect, authoritative=True))
        _read_command(sock)  # until the client hangs up

    sends: list[Frame] = []

    def owner_script(sock: socket.socket, seen: list[pb.BaseCommand]) -> None:
        _handshake(sock, seen)
        while True:
            frame = _read_frame(sock)
            cmd = frame.command
            seen.append(cmd)
            if cmd.type == pb.BaseCommand.LOOKUP:
                _write(sock, type=pb.BaseCommand.LOOKUP_RESPONSE,
                       lookupTopicResponse=pb.CommandLookupTopicResponse(
                           brokerServiceUrl=owner.url, request_id=cmd.lookupTopic.request_id,
                           response=pb.CommandLookupTopicResponse.Connect, authoritative=True))
            elif cmd.type == pb.BaseCommand.PRODUCER:
                _write(sock, type=pb.BaseCommand.PRODUCER_SUCCESS,
                       producer_success=pb.CommandProducerSuccess(
                           request_id=cmd.producer.request_id, producer_name="standalone-0-1"))
            elif cmd.type == pb.BaseCommand.SEND:
                sends.append(frame)
                _write(sock, type=pb.BaseCommand.SEND_RECEIPT,
                       send_receipt=pb.CommandSendReceipt(
                           producer_id=cmd.send.producer_id, sequence_id=cmd.send.sequence_id,
                           message_id=pb.MessageIdData(ledgerId=9,
                                                       entryId=cmd.send.sequence_id)))

    owner = FakeBroker(owner_script)
    broker = FakeBroker(service)
    try:
        with PulsarTxnClient(broker.url, timeout_s=5) as client:
            ids = client.send("t", [b"x", b"y"], TxnId(0, 5))
    finally:
        broker.close()
        owner.close()
    assert ids == [MessageId(9, 0), MessageId(9, 1)]
    assert broker.seen[1].lookupTopic.authoritative is False
    lookup, producer = owner.seen[1].lookupTopic, owner.seen[2].producer
    assert (lookup.topic, lookup.authoritative) == ("persistent://public/default/t", True)
    assert producer.topic == "persistent://public/default/t" and producer.txn_enabled
    assert [f.payload for f in sends] == [b"x", b"y"]
    for seq, f in enumerate(sends):
        assert f.metadata is not None
        assert (f.command.send.sequence_id, f.metadata.sequence_id) == (seq, seq)
        assert (f.command.send.txnid_most_bits, f.command.send.txnid_least_bits) == (0, 5)
        assert (f.metadata.txnid_most_bits, f.metadata.txnid_least_bits) == (0, 5)
        assert f.metadata.producer_name == "standalone-0-1"


@pytest.mark.unit
def test_silent_broker_is_bounded_by_timeout_s() -> None:
    """A broker that accepts and never answers: the call fails after timeout_s, retriable."""
    def script(sock: socket.socket, seen: list[pb.BaseCommand]) -> None:
        seen.append(_read_command(sock))
        _read_command(sock)  # until the client hangs up

    broker = FakeBroker(script)
    try:
        with PulsarTxnClient(broker.url, timeout_s=0.5) as client, \
                pytest.raises(PulsarTimeoutError) as info:
            started = time.monotonic()
            client.new_txn(1000)
        elapsed = time.monotonic() - started
    finally:
        broker.close()
    assert 0.45 < elapsed < 1.5
    assert isinstance(info.value, RetriableError)


@pytest.mark.unit
def test_end_txn_without_answer_is_outcome_unknown() -> None:
    """END_TXN written, then the connection drops: OutcomeUnknown, not a retriable error."""

    def script(sock: socket.socket, seen: list[pb.BaseCommand]) -> None:
        _handshake(sock, seen)
        while True:
            cmd = _read_command(sock)
            seen.append(cmd)
            if cmd.type == pb.BaseCommand.PARTITIONED_METADATA:
                _write(sock, type=pb.BaseCommand.PARTITIONED_METADATA_RESPONSE,
                       partitionMetadataResponse=pb.CommandPartitionedTopicMetadataResponse(
                           partitions=1, request_id=cmd.partitionMetadata.request_id))
            elif cmd.type == pb.BaseCommand.LOOKUP:
                _write(sock, type=pb.BaseCommand.LOOKUP_RESPONSE,
                       lookupTopicResponse=pb.CommandLookupTopicResponse(
                           brokerServiceUrl=url, request_id=cmd.lookupTopic.request_id,
                           response=pb.CommandLookupTopicResponse.Connect))
            elif cmd.type == pb.BaseCommand.TC_CLIENT_CONNECT_REQUEST:
                _write(sock, type=pb.BaseCommand.TC_CLIENT_CONNECT_RESPONSE,
                       tcClientConnectResponse=pb.CommandTcClientConnectResponse(
                           request_id=cmd.tcClientConnectRequest.request_id))
            else:
                return  # END_TXN: close without answering

    broker = FakeBroker(script)
    url = broker.url
    try:
        with PulsarTxnClient(url, timeout_s=5) as client, \
                pytest.raises(PulsarOutcomeUnknownError) as info:
            client.end_txn(TxnId(0, 3), commit=False)
    finally:
        broker.close()
    assert isinstance(info.value, OutcomeUnknownError)
    assert "END_TXN ABORT (0,3)" in str(info.value)


@pytest.mark.unit
def test_token_reaches_the_broker_but_no_error_or_repr() -> None:
    """Token auth: the token is sent in CONNECT; the broker's refusal is a typed auth error that
    does not contain it, nor does the client's repr."""

    def script(sock: socket.socket, seen: list[pb.BaseCommand]) -> None:
        seen.append(_read_command(sock))
        _write(sock, type=pb.BaseCommand.ERROR, error=pb.CommandError(
            request_id=2**64 - 1, error=pb.AuthenticationError,
            message="Failed to authentication token: JWT expired"))

    broker = FakeBroker(script)
    try:
        client = PulsarTxnClient(broker.url, timeout_s=5, token=SECRET)
        with pytest.raises(PulsarAuthError) as info:
            client.new_txn(1000)
        client.close()
    finally:
        broker.close()
    connect = broker.seen[0].connect
    assert (connect.auth_method_name, connect.auth_data) == ("token", SECRET.encode())
    assert SECRET not in str(info.value) and SECRET not in repr(client)
    assert "JWT expired" in str(info.value)


# -- a real broker -------------------------------------------------------------------------


def _helper(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.participant.pulsar._txn_helper", *args]


@dataclass
class Scenario:
    """What one run against the broker observed; each test asserts a part of it."""

    topics: dict[str, str]
    ends: list[str] = field(default_factory=list)
    errors: dict[str, BaseException] = field(default_factory=dict)
    read: dict[str, list[str]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def scenario(pulsar_broker: LocalPulsar) -> Iterator[Scenario]:
    from tests.support.pulsar.probe import TxnProbe

    with contextlib.nullcontext(pulsar_broker) as broker:
        url, run = broker.service_url, uuid.uuid4().hex[:8]
        topics = {k: f"persistent://public/default/{k}-{run}"
                  for k in ("commit", "abort", "killed")}
        s = Scenario(topics)
        payloads = [f"m{i}".encode() for i in range(N)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        opener = subprocess.Popen(_helper("open", url, "600000", topics["killed"], str(N)),
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        try:
            with PulsarTxnClient(url, timeout_s=30) as client:
                started = time.monotonic()
                committed, aborted = client.new_txn(600_000), client.new_txn(600_000)
                for txn, key in ((committed, "commit"), (aborted, "abort")):
                    client.add_partitions(txn, [topics[key]])
                    client.send(topics[key], payloads, txn)
                s.seconds["open, add and send two transactions"] = time.monotonic() - started
                started = time.monotonic()
                out = subprocess.run(
                    _helper("end", url, str(committed.most), str(committed.least), "commit",
                            str(aborted.most), str(aborted.least), "abort"),
                    cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True)
                s.seconds["end both from a new process"] = time.monotonic() - started
                s.ends = [line for line in out.stdout.splitlines() if line.startswith("END ")]
                s.ends.insert(0, f"{committed.most} {committed.least} {aborted.most} "
                              f"{aborted.least}")
                for name, txn, commit in (("commit again", committed, True),
                                          ("abort after commit", committed, False),
                                          ("commit after abort", aborted, True),
                                          ("unknown", TxnId(0, 2**40), True),
                                          ("unknown coordinator", TxnId(7, 1), False)):
                    try:
                        client.end_txn(txn, commit)
                    except Exception as e:
                        s.errors[name] = e
                assert opener.stdout is not None
                line = opener.stdout.readline().split()
                assert line[:1] == ["TXN"], line
                os.kill(opener.pid, signal.SIGKILL)
                opener.wait(10)
                started = time.monotonic()
                client.end_txn(TxnId(int(line[1]), int(line[2])), commit=True)
                s.seconds["commit the killed opener's transaction"] = time.monotonic() - started
        finally:
            if opener.poll() is None:
                opener.kill()
                opener.wait(10)
        probe = TxnProbe(broker.classpath, url)
        s.read = probe.read(*topics.values(), idle_ms=500)
        yield s


class TestAgainstBroker:
    pytestmark = needs_broker

    def test_new_process_commits_and_aborts_by_txn_id(self, scenario: Scenario) -> None:
        """(1) Opened and sent here, ended by TxnID in a new process: commit → N read by
        Pulsar's Java client, abort → 0."""
        most_c, least_c, most_a, least_a = scenario.ends[0].split()
        assert scenario.ends[1:] == [f"END {most_c} {least_c} commit OK",
                                     f"END {most_a} {least_a} abort OK"]
        assert scenario.read[scenario.topics["commit"]] == [f"m{i}" for i in range(N)]
        assert scenario.read[scenario.topics["abort"]] == []

    def test_second_end_of_finished_transaction_is_not_found(self, scenario: Scenario) -> None:
        """(2) Commit again, abort after commit, commit after abort: TransactionNotFound."""
        for name in ("commit again", "abort after commit", "commit after abort"):
            error = scenario.errors[name]
            assert isinstance(error, TransactionNotFoundError), (name, error)
            assert error.code == 24 and "not found" in str(error)

    def test_unknown_txn_id_is_not_found(self, scenario: Scenario) -> None:
        """(3) A TxnID never issued, and one of a coordinator that does not exist."""
        error = scenario.errors["unknown"]
        assert isinstance(error, TransactionNotFoundError) and error.code == 24
        assert f"(0,{2**40})" in str(error)
        error = scenario.errors["unknown coordinator"]
        assert isinstance(error, TransactionNotFoundError) and error.code is None

    def test_killed_openers_transaction_is_committed_by_txn_id(self, scenario: Scenario) -> None:
        """(4) The opener (a process that opened, added and sent) is SIGKILLed; commit by
        TxnID from here: all N are read."""
        assert scenario.read[scenario.topics["killed"]] == [f"m{i}" for i in range(N)]
        print({k: round(v, 3) for k, v in scenario.seconds.items()})
