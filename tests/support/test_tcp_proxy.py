"""The fault-injection proxy itself (tests/support/tcp_proxy.py), against a loopback echo server."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from tests.support.tcp_proxy import TcpProxy, contains, kafka_api

pytestmark = pytest.mark.unit


@pytest.fixture
def echo() -> Iterator[int]:
    """A server answering each chunk with ``b"re:" + chunk``; its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(b"re:" + data)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield int(listener.getsockname()[1])
    listener.close()


def _connect(proxy: TcpProxy) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=2.0)
    return sock


def _ask(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    return sock.recv(65536)


def test_forwards_and_cuts(echo: int) -> None:
    with TcpProxy(echo) as proxy:
        a, b = _connect(proxy), _connect(proxy)
        assert _ask(a, b"x") == b"re:x" and _ask(b, b"y") == b"re:y"
        assert proxy.cut() == 2
        for sock in (a, b):
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(10) == b""
        assert _ask(_connect(proxy), b"z") == b"re:z"  # new connections work again


def test_blackhole_holds_then_delivers(echo: int) -> None:
    with TcpProxy(echo) as proxy:
        sock = _connect(proxy)
        assert _ask(sock, b"1") == b"re:1"
        proxy.blackhole("up")
        sock.sendall(b"2")
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(10)
        proxy.release()
        sock.settimeout(2.0)
        assert sock.recv(10) == b"re:2"


def test_blackhole_existing_only_lets_new_connections_pass(echo: int) -> None:
    with TcpProxy(echo) as proxy:
        old = _connect(proxy)
        assert _ask(old, b"a") == b"re:a"
        proxy.blackhole("both", existing_only=True)
        assert _ask(_connect(proxy), b"b") == b"re:b"
        old.sendall(b"c")
        old.settimeout(0.5)
        with pytest.raises(TimeoutError):
            old.recv(10)
        proxy.release()
        old.settimeout(2.0)
        assert old.recv(10) == b"re:c"


def test_drop_next_response_forwards_the_request_and_cuts(echo: int) -> None:
    with TcpProxy(echo) as proxy:
        sock = _connect(proxy)
        assert _ask(sock, b"hello") == b"re:hello"
        dropped = proxy.drop_next_response(contains(b"COMMIT"))
        sock.sendall(b"COMMIT")
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(10) == b""  # closed, the answer never came
        assert dropped.wait(2.0)
        assert _ask(_connect(proxy), b"again") == b"re:again"


def _frame(api_key: int, correlation_id: int, body: bytes = b"") -> bytes:
    payload = struct.pack(">hhi", api_key, 0, correlation_id) + body
    return struct.pack(">i", len(payload)) + payload


def test_kafka_framing_drops_exactly_the_matching_response() -> None:
    """Requests pipelined on one connection: the EndTxn's response is dropped, the earlier
    request's answer still arrives."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    seen: list[int] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            buf = b""
            while data := conn.recv(65536):
                buf += data
                while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">i", buf[:4])[0]:
                    size = struct.unpack(">i", buf[:4])[0]
                    frame, buf = buf[:4 + size], buf[4 + size:]
                    api, _v, corr = struct.unpack(">hhi", frame[4:12])
                    seen.append(api)
                    answer = struct.pack(">i", corr) + b"ok"
                    conn.sendall(struct.pack(">i", len(answer)) + answer)

    threading.Thread(target=serve, daemon=True).start()
    with TcpProxy(int(listener.getsockname()[1]), kafka_framing=True) as proxy:
        dropped = proxy.drop_next_response(kafka_api(26))
        sock = _connect(proxy)
        sock.sendall(_frame(3, 1) + _frame(26, 2, b"txn"))
        got = b""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
        assert dropped.wait(2.0)
        assert seen == [3, 26]  # the EndTxn reached the server
        assert got == struct.pack(">ii", 6, 1) + b"ok"  # only the Metadata answer came back
    listener.close()


def test_hold_next_request_delivers_it_after_the_client_left(echo: int) -> None:
    with TcpProxy(echo) as proxy:
        sock = _connect(proxy)
        caught = proxy.hold_next_request(contains(b"late"))
        sock.sendall(b"late")
        assert caught.wait(2.0)
        sock.close()  # the client gave up; the request is still on its way
        time.sleep(0.2)
        proxy.release()  # delivered now; the echo's answer has nowhere to go


def test_refuse(echo: int) -> None:
    with TcpProxy(echo) as proxy:
        proxy.refuse()
        with contextlib.suppress(ConnectionResetError):  # the reset may beat connect()
            assert _connect(proxy).recv(10) == b""
        assert proxy.accepted == 1
        proxy.refuse(False)
        time.sleep(0.1)  # let the refused connection's reset settle
        assert _ask(_connect(proxy), b"up") == b"re:up"


def test_hold_next_response_forwards_the_request_and_holds_the_answer() -> None:
    """The server gets the request; its answer (and anything after it) waits for release()."""
    received: list[bytes] = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while data := conn.recv(65536):
                received.append(data)
                conn.sendall(b"re:" + data)

    threading.Thread(target=serve, daemon=True).start()
    with TcpProxy(int(listener.getsockname()[1])) as proxy:
        sock = _connect(proxy)
        assert _ask(sock, b"1") == b"re:1"
        forwarded = proxy.hold_next_response(contains(b"COMMIT"))
        sock.sendall(b"COMMIT")
        assert forwarded.wait(2.0)
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(10)  # the connection is open, the answer never comes
        assert received == [b"1", b"COMMIT"]  # but the server did get the request
        sock.sendall(b"after")
        time.sleep(0.2)
        assert received == [b"1", b"COMMIT"]  # what follows is held too
        proxy.release()
        sock.settimeout(2.0)
        got = b""
        while len(got) < len(b"re:COMMITre:after"):
            got += sock.recv(64)
        assert got == b"re:COMMITre:after"
    listener.close()
