"""A loopback TCP proxy for fault tests: cut, blackhole, hold or drop what passes through it.

One listening socket forwards every accepted connection to one target, with a thread per
direction. On command it can cut every current connection, refuse new ones, hold the bytes of
one or both directions (a network partition: held bytes are delivered on :meth:`TcpProxy.release`,
and a side that closed meanwhile is closed only after them, as a kernel delivers an orphaned
socket's data), drop the response to one request (forward the request, then close the connection
instead of forwarding its answer), hold one request and everything after it on its connection, or
forward one request and hold its answer and everything after it (a connection that went
half-open after the request arrived: the server acted, the client never hears).

With ``kafka_framing`` requests and responses are split into Kafka frames (4-byte length), so a
rule can pick a request by API key and drop exactly its response (by correlation id); otherwise
each received chunk is one message and a rule matches bytes in it.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from typing import Literal

__all__ = ["Direction", "Match", "TcpProxy", "contains", "kafka_api"]

Match = Callable[[bytes], bool]
"""Tells whether a client-to-server message (a Kafka request frame, or a chunk) is the one."""

Direction = Literal["up", "down", "both"]
"""``up``: client to server; ``down``: server to client."""

def kafka_api(*api_keys: int) -> Match:
    """Match Kafka request frames of these API keys (e.g. 26 = EndTxn)."""
    keys = frozenset(api_keys)
    return lambda frame: len(frame) >= 6 and struct.unpack(">h", frame[4:6])[0] in keys


def contains(needle: bytes) -> Match:
    """Match messages containing ``needle`` (e.g. PostgreSQL's simple query ``b"COMMIT"``)."""
    return lambda message: needle in message


class _Framer:
    """Splits a byte stream into Kafka frames (length prefix included)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out = []
        while len(self._buf) >= 4:
            size = struct.unpack(">i", self._buf[:4])[0]
            if len(self._buf) < 4 + size:
                break
            out.append(self._buf[:4 + size])
            self._buf = self._buf[4 + size:]
        return out


def _correlation_id(frame: bytes, request: bool) -> int | None:
    offset = 8 if request else 4  # request: length, api key, version; response: length
    if len(frame) < offset + 4:
        return None
    return int(struct.unpack(">i", frame[offset:offset + 4])[0])


class _Pipe:
    """One direction of one connection."""

    def __init__(self, src: socket.socket, dst: socket.socket, direction: str,
                 framing: bool) -> None:
        self.src, self.dst, self.direction = src, dst, direction
        self.framer = _Framer() if framing else None
        self.lock = threading.Lock()
        self.held = False
        self.buffer: list[bytes] = []
        self.eof_pending = False


class _Connection:
    def __init__(self, proxy: TcpProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy = proxy
        self.client, self.server = client, server
        framing = proxy.kafka_framing
        self.up = _Pipe(client, server, "up", framing)
        self.down = _Pipe(server, client, "down", framing)
        self.drop_response: tuple[int | None, threading.Event] | None = None
        self.closed = False

    def start(self) -> None:
        for pipe in (self.up, self.down):
            threading.Thread(target=self._pump, args=(pipe,), daemon=True,
                             name=f"tcp-proxy-{self.proxy.port}-{pipe.direction}").start()

    def close(self) -> None:
        self.closed = True
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        self.proxy._forget(self)

    def _pump(self, pipe: _Pipe) -> None:
        while True:
            try:
                data = pipe.src.recv(65536)
            except OSError:
                data = b""
            with pipe.lock:
                if not data:
                    if pipe.held and not self.closed:
                        pipe.eof_pending = True  # delivered after the held bytes
                    else:
                        self.close()
                    return
                messages = pipe.framer.feed(data) if pipe.framer is not None else [data]
                for message in messages:
                    if not self._forward(pipe, message):
                        self.close()
                        return

    def _forward(self, pipe: _Pipe, message: bytes) -> bool:
        """Deliver or hold ``message``; False when the connection must be cut now."""
        framing = pipe.framer is not None
        if framing and pipe.direction == "up" and len(message) >= 6:
            self.proxy._count(struct.unpack(">h", message[4:6])[0])
        if pipe.direction == "down" and self.drop_response is not None:
            wanted, done = self.drop_response
            if not framing or wanted is None or _correlation_id(message, False) == wanted:
                done.set()
                return False
        if pipe.direction == "up" and not pipe.held:
            rule = self.proxy._take_rule(message)
            if rule is not None:
                kind, done = rule
                if kind == "drop":
                    wanted = _correlation_id(message, True) if framing else None
                    self.drop_response = (wanted, done)
                elif kind == "hold_response":  # forward it, hold what follows, both ways
                    self.down.held = True
                    try:
                        pipe.dst.sendall(message)
                    except OSError:
                        return False
                    self.up.held = True
                    done.set()
                    return True
                else:  # hold this request and everything after it, both ways
                    self.up.held = self.down.held = True
                    done.set()
        if pipe.held:
            pipe.buffer.append(message)
            return True
        try:
            pipe.dst.sendall(message)
        except OSError:
            return False
        return True

    def release(self, pipe: _Pipe) -> None:
        with pipe.lock:
            if self.closed:
                return
            try:
                for message in pipe.buffer:
                    pipe.dst.sendall(message)
            except OSError:
                self.close()
                return
            pipe.buffer.clear()
            pipe.held = False
            if pipe.eof_pending:
                # The sender closed while held: half-close after its bytes, as its kernel would;
                # the receiver reads them, then the end of the stream.
                with contextlib.suppress(OSError):
                    pipe.dst.shutdown(socket.SHUT_WR)


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``target_host:target_port``; faults on command.

    ``port=0`` picks a free port. Use as a context manager or call :meth:`start` / :meth:`stop`.
    """

    def __init__(self, target_port: int, *, target_host: str = "127.0.0.1", port: int = 0,
                 kafka_framing: bool = False) -> None:
        self.target = (target_host, target_port)
        self.kafka_framing = kafka_framing
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._connections: list[_Connection] = []
        self._rules: list[tuple[str, Match, threading.Event]] = []
        self._blackhole: set[str] = set()
        self._refusing = False
        self._stopped = False
        self.accepted = 0
        """Connections accepted so far (refused ones included)."""
        self._requests: collections.Counter[int] = collections.Counter()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        self._listener.listen(64)
        threading.Thread(target=self._accept, daemon=True,
                         name=f"tcp-proxy-{self.port}").start()
        return self

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- commands ------------------------------------------------------------------------------

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def cut(self) -> int:
        """Close every current connection at once; returns how many."""
        with self._lock:
            current = list(self._connections)
        for conn in current:
            conn.close()
        return len(current)

    def refuse(self, refusing: bool = True) -> None:
        """Accept new connections and close them at once (a broker that is down), or stop."""
        self._refusing = refusing

    def blackhole(self, direction: Direction = "both", *, existing_only: bool = False) -> None:
        """Forward nothing in ``direction`` (connections stay open) until :meth:`release`;
        with ``existing_only`` new connections pass normally."""
        dirs = {"up", "down"} if direction == "both" else {direction}
        with self._lock:
            if not existing_only:
                self._blackhole = set(dirs)
            current = list(self._connections)
        for conn in current:
            for pipe in (conn.up, conn.down):
                if pipe.direction in dirs:
                    pipe.held = True

    def release(self) -> None:
        """Deliver everything held, in order, and forward normally again."""
        with self._lock:
            self._blackhole = set()
            current = list(self._connections)
        for conn in current:
            conn.release(conn.up)
            conn.release(conn.down)

    def drop_next_response(self, match: Match | None = None) -> threading.Event:
        """Forward the next matching request, then close its connection instead of forwarding
        its response. The event is set once that happened."""
        return self._arm("drop", match)

    def hold_next_request(self, match: Match | None = None) -> threading.Event:
        """Hold the next matching request and everything after it on its connection (both
        ways) until :meth:`release`. The event is set once it was caught."""
        return self._arm("hold", match)

    def hold_next_response(self, match: Match | None = None) -> threading.Event:
        """Forward the next matching request, then hold its response and everything after it
        on its connection (both ways) until :meth:`release`: the server acts on the request
        and the client never hears back, while the connection stays open (half-open). The
        event is set once the request was forwarded."""
        return self._arm("hold_response", match)

    def _arm(self, kind: str, match: Match | None) -> threading.Event:
        done = threading.Event()
        with self._lock:
            self._rules.append((kind, match or (lambda _m: True), done))
        return done

    def requests(self, api_key: int) -> int:
        """How many requests of ``api_key`` reached the proxy so far (``kafka_framing`` only),
        forwarded or held."""
        with self._lock:
            return self._requests[api_key]

    def disarm(self) -> None:
        """Forget rules that have not fired."""
        with self._lock:
            self._rules.clear()

    # -- internals -----------------------------------------------------------------------------

    def _take_rule(self, message: bytes) -> tuple[str, threading.Event] | None:
        with self._lock:
            for i, (kind, match, done) in enumerate(self._rules):
                if match(message):
                    del self._rules[i]
                    return kind, done
        return None

    def _count(self, api_key: int) -> None:
        with self._lock:
            self._requests[api_key] += 1

    def _forget(self, conn: _Connection) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._connections.remove(conn)

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            if self._refusing:
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=5.0)
            except OSError:
                _reset(client)
                continue
            server.settimeout(None)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(self, client, server)
            with self._lock:
                self._connections.append(conn)
                for pipe in (conn.up, conn.down):
                    pipe.held = pipe.direction in self._blackhole
            conn.start()


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a port nobody listens on would answer."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
