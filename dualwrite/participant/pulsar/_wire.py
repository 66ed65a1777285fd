"""Pulsar's binary protocol over a plain TCP socket: frames, CRC32C, one connection.

The one place that speaks the protocol. A frame is ``[total size u32][command size u32]
[BaseCommand]``; a SEND frame adds ``[magic 0x0e01 u16][CRC32C u32][metadata size u32]
[MessageMetadata][payload]``, the checksum covering everything from the metadata size on. All
integers are big-endian. :class:`Connection` is synchronous: a request is written and frames are
read until its answer comes, answering the broker's PINGs meanwhile; every read and write is
bounded by the caller's deadline. Nothing here logs or raises a credential.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

try:
    from dualwrite.participant.pulsar import pulsar_api_pb2 as pb
except ImportError as e:  # pragma: no cover - depends on the installed extras
    raise ImportError("dualwrite's Pulsar participant needs protobuf 7.35+: "
                      "pip install 'dualwrite[pulsar]'") from e
from dualwrite.participant.pulsar.errors import (
    PulsarConnectionError,
    PulsarError,
    PulsarFatalError,
    PulsarProtocolError,
    PulsarRetriableError,
    PulsarTimeoutError,
    server_error,
)

__all__ = [
    "CLIENT_VERSION",
    "MAGIC_CRC32C",
    "PROTOCOL_VERSION",
    "Connection",
    "Frame",
    "MessageId",
    "TxnId",
    "crc32c",
    "decode_frame",
    "encode_command",
    "encode_send",
    "remaining",
]

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 20
"""v19 added TC_CLIENT_CONNECT; v20 is the newest the protocol definition we copy names (it is
also what the Go client sends)."""
CLIENT_VERSION = "dualwrite"
MAGIC_CRC32C = 0x0E01
_MAGIC_BROKER_ENTRY_METADATA = 0x0E02
_DEFAULT_MAX_MESSAGE_SIZE = 5 * 1024 * 1024
_FRAME_PADDING = 10 * 1024
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")

Type = pb.BaseCommand.Type

# Which BaseCommand field holds each answer that carries a request_id.
_ANSWER_FIELD: dict[int, str] = {
    pb.BaseCommand.SUCCESS: "success",
    pb.BaseCommand.ERROR: "error",
    pb.BaseCommand.PRODUCER_SUCCESS: "producer_success",
    pb.BaseCommand.PARTITIONED_METADATA_RESPONSE: "partitionMetadataResponse",
    pb.BaseCommand.LOOKUP_RESPONSE: "lookupTopicResponse",
    pb.BaseCommand.TC_CLIENT_CONNECT_RESPONSE: "tcClientConnectResponse",
    pb.BaseCommand.NEW_TXN_RESPONSE: "newTxnResponse",
    pb.BaseCommand.ADD_PARTITION_TO_TXN_RESPONSE: "addPartitionToTxnResponse",
    pb.BaseCommand.END_TXN_RESPONSE: "endTxnResponse",
}


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC-32C (Castagnoli, as iSCSI and Pulsar use it) of ``data``, continuing from ``crc``."""
    table = _CRC32C_TABLE
    c = crc ^ 0xFFFFFFFF
    for byte in bytes(data):
        c = table[(c ^ byte) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


@dataclass(frozen=True)
class TxnId:
    """A Pulsar transaction id: ``most`` is the coordinator's id, ``least`` its counter."""

    most: int
    least: int

    def __str__(self) -> str:
        return f"({self.most},{self.least})"


@dataclass(frozen=True)
class MessageId:
    """Where the broker stored a message: ledger, entry, partition (-1: not partitioned)."""

    ledger_id: int
    entry_id: int
    partition: int = -1
    batch_index: int = -1


@dataclass(frozen=True)
class Frame:
    """A decoded frame: the command, and for a payload frame its metadata and payload."""

    command: pb.BaseCommand
    metadata: pb.MessageMetadata | None = None
    payload: bytes | None = None


def encode_command(command: pb.BaseCommand) -> bytes:
    """A frame without payload: ``[total size][command size][command]``."""
    body = command.SerializeToString()
    return _U32.pack(len(body) + 4) + _U32.pack(len(body)) + body


def encode_send(command: pb.BaseCommand, metadata: pb.MessageMetadata, payload: bytes) -> bytes:
    """A payload frame (SEND): the command, then magic, CRC32C, metadata size, metadata and
    payload; the checksum covers the metadata size, the metadata and the payload."""
    body = command.SerializeToString()
    meta = metadata.SerializeToString()
    checked = _U32.pack(len(meta)) + meta + payload
    total = 4 + len(body) + 2 + 4 + len(checked)
    return b"".join((_U32.pack(total), _U32.pack(len(body)), body, _U16.pack(MAGIC_CRC32C),
                     _U32.pack(crc32c(checked)), checked))


def decode_frame(frame: bytes) -> Frame:
    """Decode one frame given without its leading total size. A payload's checksum is checked;
    a broker entry metadata block (magic 0x0e02) before it is skipped."""
    try:
        (cmd_size,) = _U32.unpack_from(frame, 0)
        if 4 + cmd_size > len(frame):
            raise PulsarProtocolError(f"command size {cmd_size} exceeds the frame "
                                      f"({len(frame)} bytes)")
        command = pb.BaseCommand()
        command.ParseFromString(frame[4:4 + cmd_size])
        pos = 4 + cmd_size
        if pos == len(frame):
            return Frame(command)
        (magic,) = _U16.unpack_from(frame, pos)
        if magic == _MAGIC_BROKER_ENTRY_METADATA:
            (size,) = _U32.unpack_from(frame, pos + 2)
            pos += 6 + size
            (magic,) = _U16.unpack_from(frame, pos)
        if magic != MAGIC_CRC32C:
            raise PulsarProtocolError(f"payload magic {magic:#06x}, expected {MAGIC_CRC32C:#06x}")
        (checksum,) = _U32.unpack_from(frame, pos + 2)
        checked = frame[pos + 6:]
        if crc32c(checked) != checksum:
            raise PulsarProtocolError("payload CRC32C mismatch")
        (meta_size,) = _U32.unpack_from(checked, 0)
        metadata = pb.MessageMetadata()
        metadata.ParseFromString(checked[4:4 + meta_size])
        return Frame(command, metadata, bytes(checked[4 + meta_size:]))
    except PulsarProtocolError:
        raise
    except Exception as e:  # struct.error, protobuf's DecodeError
        raise PulsarProtocolError(f"malformed frame ({type(e).__name__}: {e})") from None


def remaining(deadline: float, what: str, *, sent: bool = False) -> float:
    """Seconds left until ``deadline`` (``time.monotonic``); past it, a timeout error."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise PulsarTimeoutError(f"{what}: no answer within the timeout", sent=sent)
    return left


class Connection:
    """One TCP connection to one broker, after the CONNECT handshake. Not thread-safe.

    ``address`` (``host:port``) is what errors name; a token given to :meth:`open` is sent in
    CONNECT and AUTH_RESPONSE and kept nowhere else.
    """

    def __init__(self, sock: socket.socket, address: str) -> None:
        self._sock = sock
        self.address = address
        self._buf = bytearray()
        self._request_ids = itertools.count()
        self.closed = False
        self.max_message_size = _DEFAULT_MAX_MESSAGE_SIZE
        self.server_version = ""
        self.tc_connected: set[int] = set()
        """Coordinator ids this connection sent TC_CLIENT_CONNECT for."""
        self.closed_producers: set[int] = set()
        """Producer ids the broker closed (CLOSE_PRODUCER: topic unloaded or moved)."""

    def __repr__(self) -> str:
        return f"Connection({self.address!r}, closed={self.closed})"

    @classmethod
    def open(cls, host: str, port: int, deadline: float, *, token: str | None = None,
             proxy_to_broker_url: str | None = None) -> Connection:
        """Connect to ``host:port`` and do the CONNECT / CONNECTED handshake (token auth if
        ``token``; through a proxy to ``proxy_to_broker_url`` if given)."""
        address = f"{host}:{port}"
        what = f"connect to pulsar://{address}"
        sock: socket.socket | None = None
        try:
            sock = socket.create_connection((host, port), timeout=remaining(deadline, what))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except PulsarError:
            raise
        except OSError as e:
            if sock is not None:
                sock.close()
            raise PulsarConnectionError(f"{what}: {e.strerror or type(e).__name__}") from None
        conn = cls(sock, address)
        try:
            conn.handshake(deadline, token, proxy_to_broker_url)
        except BaseException:
            conn.close()
            raise
        return conn

    def handshake(self, deadline: float, token: str | None, proxy_to: str | None) -> None:
        """CONNECT and its answer (and an auth challenge, if any); run once, by :meth:`open`."""
        connect = pb.CommandConnect(client_version=CLIENT_VERSION,
                                    protocol_version=PROTOCOL_VERSION)
        if token is not None:
            connect.auth_method_name = "token"
            connect.auth_data = token.encode()
        if proxy_to:
            connect.proxy_to_broker_url = proxy_to
        self._write(encode_command(pb.BaseCommand(type=pb.BaseCommand.CONNECT, connect=connect)),
                    deadline, "CONNECT")
        while True:
            cmd = self.read_frame(deadline, "CONNECT", sent=True).command
            if cmd.type == pb.BaseCommand.CONNECTED:
                self.server_version = cmd.connected.server_version
                if cmd.connected.HasField("max_message_size"):
                    self.max_message_size = cmd.connected.max_message_size
                return
            if cmd.type == pb.BaseCommand.AUTH_CHALLENGE:
                auth = pb.AuthData(auth_method_name="token",
                                   auth_data=(token or "").encode())
                answer = pb.CommandAuthResponse(client_version=CLIENT_VERSION, response=auth,
                                                protocol_version=PROTOCOL_VERSION)
                self._write(encode_command(pb.BaseCommand(
                    type=pb.BaseCommand.AUTH_RESPONSE, authResponse=answer)), deadline,
                    "AUTH_RESPONSE")
            elif cmd.type == pb.BaseCommand.ERROR:
                raise server_error(cmd.error.error, cmd.error.message,
                                   f"CONNECT to pulsar://{self.address}")
            elif cmd.type == pb.BaseCommand.PING:
                self._pong(deadline)
            else:
                raise PulsarProtocolError(f"CONNECT to pulsar://{self.address}: unexpected "
                                          f"{Type.Name(cmd.type)}")

    def next_request_id(self) -> int:
        return next(self._request_ids)

    def request(self, command: pb.BaseCommand, request_id: int, deadline: float,
                what: str) -> pb.BaseCommand:
        """Write ``command`` and return the answer carrying ``request_id``. An ERROR answer, or
        an answer whose ``error`` is set, is raised as its typed exception."""
        self._write(encode_command(command), deadline, what)
        return self.await_answer(request_id, deadline, what)

    def await_answer(self, request_id: int, deadline: float, what: str) -> pb.BaseCommand:
        """Read frames until the answer carrying ``request_id`` (see :meth:`request`)."""
        while True:
            cmd = self.read_frame(deadline, what, sent=True).command
            field = _ANSWER_FIELD.get(cmd.type)
            if field is None:
                self.handle_unsolicited(cmd, deadline)
                continue
            answer = getattr(cmd, field)
            if answer.request_id != request_id:
                continue  # the late answer of an earlier request that timed out
            if cmd.type == pb.BaseCommand.ERROR:
                raise server_error(answer.error, answer.message, what)
            if "error" in answer.DESCRIPTOR.fields_by_name and answer.HasField("error"):
                raise server_error(answer.error, answer.message, what)
            return cmd

    def send_messages(self, producer_id: int, producer_name: str, first_sequence_id: int,
                      payloads: Sequence[bytes], txn: TxnId | None, deadline: float,
                      what: str, keys: Sequence[str | None] | None = None) -> list[MessageId]:
        """SEND every payload (one message each, pipelined) with the transaction id in both
        CommandSend and MessageMetadata, then wait for every receipt, in order. ``keys``: each
        message's partition key (None: none), as many as payloads."""
        if keys is not None and len(keys) != len(payloads):
            raise PulsarFatalError(f"{what}: {len(keys)} keys for {len(payloads)} messages")
        frames = []
        now_ms = int(time.time() * 1000)
        for i, payload in enumerate(payloads):
            seq = first_sequence_id + i
            send = pb.CommandSend(producer_id=producer_id, sequence_id=seq, num_messages=1)
            meta = pb.MessageMetadata(producer_name=producer_name, sequence_id=seq,
                                      publish_time=now_ms)
            key = keys[i] if keys is not None else None
            if key is not None:
                meta.partition_key = key
            if txn is not None:
                send.txnid_most_bits, send.txnid_least_bits = txn.most, txn.least
                meta.txnid_most_bits, meta.txnid_least_bits = txn.most, txn.least
            frame = encode_send(pb.BaseCommand(type=pb.BaseCommand.SEND, send=send), meta,
                                payload)
            if len(frame) > self.max_message_size + _FRAME_PADDING:
                raise PulsarFatalError(f"{what}: message {i} is {len(payload)} bytes, over the "
                                       f"broker's max_message_size {self.max_message_size}")
            frames.append(frame)
        self._write(b"".join(frames), deadline, what)
        pending = {first_sequence_id + i: i for i in range(len(payloads))}
        ids: list[MessageId | None] = [None] * len(payloads)
        while pending:
            cmd = self.read_frame(deadline, what, sent=True).command
            if cmd.type == pb.BaseCommand.SEND_RECEIPT:
                r = cmd.send_receipt
                if r.producer_id == producer_id and r.sequence_id in pending:
                    m = r.message_id
                    ids[pending.pop(r.sequence_id)] = MessageId(
                        m.ledgerId, m.entryId, m.partition, m.batch_index)
            elif cmd.type == pb.BaseCommand.SEND_ERROR:
                e = cmd.send_error
                if e.producer_id == producer_id:
                    raise server_error(e.error, e.message, f"{what} (sequence id "
                                       f"{e.sequence_id})")
            else:
                self.handle_unsolicited(cmd, deadline)
                if producer_id in self.closed_producers:
                    raise PulsarRetriableError(
                        f"{what}: the broker closed the producer (topic unloaded or moved) "
                        f"with {len(pending)} of {len(payloads)} messages unacknowledged")
        return [i for i in ids if i is not None]

    def poll(self) -> bool:
        """Handle what the broker sent while this connection was idle (PING, CLOSE_PRODUCER);
        False if it is closed or broken."""
        if self.closed:
            return False
        try:
            self._sock.setblocking(False)
            try:
                while chunk := self._sock.recv(65536):
                    self._buf += chunk
                else:
                    self.close()
                    return False
            except (BlockingIOError, InterruptedError):
                pass
            finally:
                if not self.closed:
                    self._sock.setblocking(True)
            deadline = time.monotonic() + 5.0
            while self._frame_ready():
                self.handle_unsolicited(self.read_frame(deadline, "poll").command, deadline)
        except (OSError, PulsarError):
            self.close()
            return False
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self._sock.close()

    def write_command(self, command: pb.BaseCommand, deadline: float, what: str) -> None:
        """Write ``command`` without waiting for an answer (FLOW has none)."""
        self._write(encode_command(command), deadline, what)

    def handle_unsolicited(self, cmd: pb.BaseCommand, deadline: float) -> None:
        """Answer a PING, note a CLOSE_PRODUCER; log and drop anything else."""
        if cmd.type == pb.BaseCommand.PING:
            self._pong(deadline)
        elif cmd.type == pb.BaseCommand.CLOSE_PRODUCER:
            self.closed_producers.add(cmd.close_producer.producer_id)
        else:
            log.debug("ignoring %s from pulsar://%s", Type.Name(cmd.type), self.address)

    def _pong(self, deadline: float) -> None:
        self._write(encode_command(pb.BaseCommand(type=pb.BaseCommand.PONG,
                                                  pong=pb.CommandPong())), deadline, "PONG")

    def _frame_ready(self) -> bool:
        return len(self._buf) >= 4 and len(self._buf) >= 4 + _U32.unpack_from(self._buf)[0]

    def _write(self, data: bytes, deadline: float, what: str) -> None:
        if self.closed:
            raise PulsarConnectionError(f"{what}: the connection to pulsar://{self.address} "
                                        "is closed")
        try:
            self._sock.settimeout(remaining(deadline, what))
            self._sock.sendall(data)
        except PulsarError:
            self.close()
            raise
        except TimeoutError:
            self.close()
            raise PulsarTimeoutError(f"{what}: pulsar://{self.address} did not take the "
                                     "request within the timeout", sent=True) from None
        except OSError as e:
            self.close()
            raise PulsarConnectionError(f"{what}: connection to pulsar://{self.address} lost "
                                        f"({e.strerror or type(e).__name__})",
                                        sent=True) from None

    def read_frame(self, deadline: float, what: str, *, sent: bool = False) -> Frame:
        """The next frame, reading from the socket as needed. A failure closes the connection:
        a frame read in part cannot be resumed."""
        try:
            while len(self._buf) < 4:
                self._recv(deadline, what, sent)
            (size,) = _U32.unpack_from(self._buf)
            if size > self.max_message_size + _FRAME_PADDING or size < 4:
                raise PulsarProtocolError(f"{what}: frame of {size} bytes from "
                                          f"pulsar://{self.address}")
            while len(self._buf) < 4 + size:
                self._recv(deadline, what, sent)
        except BaseException:
            self.close()
            raise
        frame = bytes(self._buf[4:4 + size])
        del self._buf[:4 + size]
        return decode_frame(frame)

    def _recv(self, deadline: float, what: str, sent: bool) -> None:
        if self.closed:
            raise PulsarConnectionError(f"{what}: the connection to pulsar://{self.address} "
                                        "is closed", sent=sent)
        try:
            self._sock.settimeout(remaining(deadline, what, sent=sent))
            chunk = self._sock.recv(65536)
        except TimeoutError:
            raise PulsarTimeoutError(f"{what}: no answer from pulsar://{self.address} within "
                                     "the timeout", sent=sent) from None
        except OSError as e:
            raise PulsarConnectionError(f"{what}: connection to pulsar://{self.address} lost "
                                        f"({e.strerror or type(e).__name__})",
                                        sent=sent) from None
        if not chunk:
            raise PulsarConnectionError(f"{what}: pulsar://{self.address} closed the "
                                        "connection", sent=sent)
        self._buf += chunk
