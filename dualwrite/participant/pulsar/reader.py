"""A non-durable reader of one Pulsar topic partition, over its own connection.

An Exclusive subscription with ``durable=false`` starting at a given :class:`MessageId` (the
broker steps one entry back from it, so the start message itself is delivered), no compaction.
The broker forgets the subscription when the consumer closes. Entries come as MESSAGE commands
after FLOW permits; a batch entry is split into its messages on demand. Every call is bounded by
a deadline; a timeout or a lost connection ends the reader (its connection is closed).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import struct
import uuid
from dataclasses import dataclass
from typing import Any

from dualwrite.participant.pulsar import pulsar_api_pb2 as pb
from dualwrite.participant.pulsar._wire import Connection, MessageId, TxnId
from dualwrite.participant.pulsar.errors import (
    PulsarError,
    PulsarFatalError,
    PulsarProtocolError,
    PulsarRetriableError,
    PulsarTopicError,
    PulsarUnsupportedError,
)

__all__ = ["AnchorSubscription", "PartitionReader", "ReceivedEntry", "ReceivedMessage"]

log = logging.getLogger(__name__)

_U32 = struct.Struct(">I")
_DEFAULT_PERMITS = 1000
_consumer_ids = itertools.count()
"""Consumer ids of this process (each connection is a consumer's own, so any unique id does)."""


@dataclass(frozen=True)
class ReceivedMessage:
    """One message of an entry: its id (``batch_index`` set inside a batch), payload,
    properties and partition key (None without one)."""

    message_id: MessageId
    payload: bytes
    properties: dict[str, str]
    key: str | None = None


@dataclass(frozen=True)
class ReceivedEntry:
    """One stored entry as the broker dispatched it: a message, or a batch of them."""

    message_id: MessageId
    metadata: pb.MessageMetadata
    payload: bytes

    @property
    def position(self) -> tuple[int, int]:
        """``(ledger_id, entry_id)``: entries of one partition are ordered by it."""
        return self.message_id.ledger_id, self.message_id.entry_id

    @property
    def txn(self) -> TxnId | None:
        """The transaction the entry was written in, if any."""
        m = self.metadata
        if m.HasField("txnid_most_bits") and m.HasField("txnid_least_bits"):
            return TxnId(m.txnid_most_bits, m.txnid_least_bits)
        return None

    @property
    def is_batch(self) -> bool:
        return self.metadata.HasField("num_messages_in_batch")

    def messages(self) -> list[ReceivedMessage]:
        """The entry's messages; a batch is split (uncompressed batches only)."""
        meta = self.metadata
        if meta.compression != pb.NONE:
            raise PulsarUnsupportedError(
                f"entry {self.position}: compressed payload "
                f"({pb.CompressionType.Name(meta.compression)}) is not supported")
        if not self.is_batch:
            return [ReceivedMessage(self.message_id, self.payload,
                                    {kv.key: kv.value for kv in meta.properties},
                                    meta.partition_key if meta.HasField("partition_key")
                                    else None)]
        out: list[ReceivedMessage] = []
        pos, data = 0, self.payload
        try:
            for i in range(meta.num_messages_in_batch):
                (size,) = _U32.unpack_from(data, pos)
                single = pb.SingleMessageMetadata()
                single.ParseFromString(data[pos + 4:pos + 4 + size])
                pos += 4 + size
                payload = data[pos:pos + single.payload_size]
                if len(payload) != single.payload_size:
                    raise PulsarProtocolError(f"entry {self.position}: batch message {i} is cut")
                pos += single.payload_size
                if single.compacted_out:
                    continue
                mid = MessageId(self.message_id.ledger_id, self.message_id.entry_id,
                                self.message_id.partition, i)
                out.append(ReceivedMessage(mid, payload,
                                           {kv.key: kv.value for kv in single.properties},
                                           single.partition_key
                                           if single.HasField("partition_key") else None))
        except PulsarProtocolError:
            raise
        except Exception as e:  # struct.error, protobuf's DecodeError
            raise PulsarProtocolError(f"entry {self.position}: malformed batch "
                                      f"({type(e).__name__}: {e})") from None
        return out


def _next_command(conn: Connection, deadline: float, what: str
                  ) -> tuple[pb.BaseCommand, ReceivedEntry | None]:
    """The next command on ``conn``, with its entry when it is a MESSAGE."""
    frame = conn.read_frame(deadline, what, sent=True)
    cmd = frame.command
    if cmd.type == pb.BaseCommand.MESSAGE:
        if frame.metadata is None or frame.payload is None:
            raise PulsarProtocolError(f"{what}: MESSAGE without a payload")
        m = cmd.message.message_id
        return cmd, ReceivedEntry(MessageId(m.ledgerId, m.entryId, m.partition),
                                  frame.metadata, frame.payload)
    return cmd, None


def _subscribe(host: str, port: int, deadline: float, token: str | None,
               proxy_to_broker_url: str | None, **fields: Any) -> tuple[Connection, int]:
    """A new connection to the topic's broker with one Exclusive consumer subscribed
    (``fields`` of ``CommandSubscribe`` besides the ids); the connection and the consumer id."""
    conn = Connection.open(host, port, deadline, token=token,
                           proxy_to_broker_url=proxy_to_broker_url)
    try:
        consumer_id = next(_consumer_ids)
        rid = conn.next_request_id()
        subscribe = pb.CommandSubscribe(subType=pb.CommandSubscribe.Exclusive,
                                        consumer_id=consumer_id, request_id=rid,
                                        read_compacted=False, **fields)
        conn.request(pb.BaseCommand(type=pb.BaseCommand.SUBSCRIBE, subscribe=subscribe), rid,
                     deadline, f"SUBSCRIBE {fields['subscription']} to {fields['topic']}")
    except BaseException:
        conn.close()
        raise
    return conn, consumer_id


class PartitionReader:
    """Reads one topic partition from a start message on, without a durable cursor.

    Made by :meth:`open` (or ``PulsarTxnClient.reader``); use as a context manager or call
    :meth:`close`. Not thread-safe.
    """

    def __init__(self, conn: Connection, topic: str, consumer_id: int,
                 permits: int) -> None:
        self._conn = conn
        self.topic = topic
        self._consumer_id = consumer_id
        self._permits = permits
        self._available = 0
        self.closed = False

    def __repr__(self) -> str:
        return f"PartitionReader({self.topic!r}, closed={self.closed})"

    def __enter__(self) -> PartitionReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def open(cls, host: str, port: int, topic: str, start: MessageId, deadline: float, *,
             token: str | None = None, proxy_to_broker_url: str | None = None,
             permits: int = _DEFAULT_PERMITS) -> PartitionReader:
        """Connect to the broker owning ``topic`` (a full name of a partition or of a
        non-partitioned topic), subscribe from ``start`` (inclusive) and grant permits."""
        if start.ledger_id < 0 or start.entry_id < 0:
            raise PulsarFatalError(f"read {topic}: invalid start message id {start}")
        conn, consumer_id = _subscribe(
            host, port, deadline, token, proxy_to_broker_url, topic=topic,
            subscription=f"dualwrite-reader-{uuid.uuid4().hex[:12]}",
            durable=False, force_topic_creation=False,
            start_message_id=pb.MessageIdData(ledgerId=start.ledger_id, entryId=start.entry_id,
                                              partition=start.partition,
                                              batch_index=start.batch_index))
        reader = cls(conn, topic, consumer_id, permits)
        try:
            reader.flow(deadline)
        except BaseException:
            conn.close()
            raise
        log.debug("reading %s from %s", topic, start)
        return reader

    def receive(self, deadline: float) -> ReceivedEntry:
        """The next entry; :class:`PulsarTimeoutError` if none comes before ``deadline``
        (the reader is closed then). Transaction markers are skipped."""
        what = f"read {self.topic}"
        if self.closed:
            raise PulsarRetriableError(f"{what}: the reader is closed")
        try:
            while True:
                cmd, entry = _next_command(self._conn, deadline, what)
                if entry is not None:
                    if cmd.message.consumer_id != self._consumer_id:
                        continue
                    self._available -= max(1, entry.metadata.num_messages_in_batch)
                    if self._available <= self._permits // 2:
                        self.flow(deadline)
                    if entry.metadata.HasField("marker_type"):
                        continue
                    return entry
                if cmd.type == pb.BaseCommand.CLOSE_CONSUMER:
                    raise PulsarRetriableError(f"{what}: the broker closed the consumer (topic "
                                               "unloaded or moved); read again")
                if cmd.type == pb.BaseCommand.REACHED_END_OF_TOPIC:
                    raise PulsarTopicError(f"{what}: the topic was terminated and every "
                                           "message has been read")
                if cmd.type != pb.BaseCommand.ACTIVE_CONSUMER_CHANGE:
                    self._conn.handle_unsolicited(cmd, deadline)
        except BaseException:
            self.close_now()
            raise

    def close(self, deadline: float | None = None) -> None:
        """Close the consumer (the broker drops the non-durable subscription), then the
        connection. Best effort: closing the connection alone has the same effect."""
        if self.closed:
            return
        if deadline is not None and not self._conn.closed:
            rid = self._conn.next_request_id()
            with contextlib.suppress(PulsarError):
                self._conn.request(pb.BaseCommand(
                    type=pb.BaseCommand.CLOSE_CONSUMER, close_consumer=pb.CommandCloseConsumer(
                        consumer_id=self._consumer_id, request_id=rid)),
                    rid, deadline, f"CLOSE_CONSUMER on {self.topic}")
        self.close_now()

    def close_now(self) -> None:
        """Close the connection without asking the broker first."""
        self.closed = True
        self._conn.close()

    def flow(self, deadline: float) -> None:
        """Grant the broker permits up to the reader's window (FLOW)."""
        grant = self._permits - self._available
        self._conn.write_command(pb.BaseCommand(type=pb.BaseCommand.FLOW, flow=pb.CommandFlow(
            consumer_id=self._consumer_id, messagePermits=grant)), deadline,
            f"FLOW on {self.topic}")
        self._available += grant


class AnchorSubscription:
    """A durable subscription on a writer's anchor topic that keeps what a stored state may
    still name: Pulsar deletes a topic without subscriptions once it is inactive (by default
    60 s after its last producer left) and trims the ledgers every subscription has consumed,
    either of which leaves a committed transaction's outcome unreadable after a crash.

    The consumer takes no messages (no FLOW); :meth:`keep_from` acknowledges cumulatively up
    to the entry before the anchor the writer's row names now, so older anchors may go.
    Made by :meth:`open` (or ``PulsarTxnClient.anchor_subscription``). Not thread-safe.
    """

    def __init__(self, conn: Connection, topic: str, consumer_id: int) -> None:
        self._conn = conn
        self.topic = topic
        self._consumer_id = consumer_id

    def __repr__(self) -> str:
        return f"AnchorSubscription({self.topic!r}, closed={self.closed})"

    @property
    def closed(self) -> bool:
        return self._conn.closed

    @classmethod
    def open(cls, host: str, port: int, topic: str, subscription: str, deadline: float, *,
             token: str | None = None,
             proxy_to_broker_url: str | None = None) -> AnchorSubscription:
        """Subscribe to ``topic`` as ``subscription`` (Exclusive, durable; made at the topic's
        earliest entry the first time, so nothing stored is given up by making it)."""
        conn, consumer_id = _subscribe(
            host, port, deadline, token, proxy_to_broker_url, topic=topic,
            subscription=subscription, durable=True,
            initialPosition=pb.CommandSubscribe.Earliest, force_topic_creation=True)
        log.debug("keeping anchors of %s with subscription %s", topic, subscription)
        return cls(conn, topic, consumer_id)

    def keep_from(self, anchor: MessageId, deadline: float) -> None:
        """Let the entries before ``anchor`` go: a cumulative ACK of the one before it (the
        broker does not answer; a lost ACK only keeps more). An anchor at an entry 0 keeps
        its whole ledger and what came before."""
        if anchor.entry_id == 0:
            return
        self._conn.write_command(pb.BaseCommand(type=pb.BaseCommand.ACK, ack=pb.CommandAck(
            consumer_id=self._consumer_id, ack_type=pb.CommandAck.Cumulative,
            message_id=[pb.MessageIdData(ledgerId=anchor.ledger_id,
                                         entryId=anchor.entry_id - 1)])),
            deadline, f"ACK on {self.topic}")

    def close(self) -> None:
        """Close the connection: the subscription stays, at the position last acknowledged."""
        self._conn.close()
