"""examples/http_service.py (Starlette + AsyncDualWriterPool) under load, SIGKILLed and restarted,
on PostgreSQL (psycopg 3 async for the app's engine) and MariaDB (aiomysql).

The invariant per request: the orders rows are exactly the read_committed records, each once,
and every order the service acknowledged (201) is among them. Bad requests (no body, not JSON,
fields missing, unknown or of the wrong type) get a 400 with a JSON error and write nothing; an
order posted again, also by clients at once, gets a 409; ``/metrics`` serves dualwrite's
families; the start-up line names the ids and the URL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

import dualwrite
from tests.support import REPO_ROOT, example
from tests.support.daemon import free_port
from tests.support.kafka import read_committed

pytestmark = pytest.mark.timeout(180)


def _serve(db_url: str, bootstrap: str, topic: str, port: int,
           stdout: int | None = None) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "examples" / "http_service.py"), "--db", db_url, "-b",
         bootstrap, "--topic", topic, "--port", str(port), "--size", "4"],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT, stdout=stdout)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            assert proc.poll() is None, "the service exited"
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("the service did not come up")


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"], indirect=True)
def test_sigkill_under_load_then_restart(db_url: str, engine: sa.Engine, bootstrap: str,
                                         topic: str, tmp_path: Path) -> None:
    load = example("load")
    port = free_port()
    acked = tmp_path / "acked.txt"
    server = _serve(db_url, bootstrap, topic, port)
    result: dict[str, Any] = {}
    loader = threading.Thread(target=lambda: result.update(load.run(
        f"http://127.0.0.1:{port}", 16, 8.0, str(acked))))
    try:
        loader.start()
        time.sleep(2.5)
        server.send_signal(signal.SIGKILL)  # requests and groups in flight
        server.wait()
        killed_at = len(acked.read_text().split())
        server = _serve(db_url, bootstrap, topic, port)  # finishes its ids' leftovers at start
        loader.join()
    finally:
        server.send_signal(signal.SIGTERM)  # a clean stop: the pool closes
        server.wait(60)
    assert killed_at > 0 and result["ok"] > killed_at, result  # served before and after
    assert result["failed"] > 0  # the kill was felt
    report = dualwrite.recover(engine, {"bootstrap.servers": bootstrap})
    assert report.ok, report.as_dict()
    records = [r.decode() for r in read_committed(bootstrap, topic)]
    with engine.connect() as conn:
        rows = [r[0] for r in conn.exec_driver_sql("SELECT order_id FROM http_orders")]
    ids = [json.loads(r)["order_id"] for r in records]
    assert [k for k, n in Counter(ids).items() if n > 1] == []
    assert sorted(rows) == sorted(ids)
    assert set(acked.read_text().split()) <= set(rows)


def _request(url: str, body: bytes | None = None,
             content_type: str = "application/json") -> tuple[int, str, str]:
    """(status, content type, body) of a GET (no ``body``) or a POST."""
    req = urllib.request.Request(url, data=body, method="GET" if body is None else "POST",
                                 headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()


BAD_BODIES: list[tuple[bytes, str]] = [
    (b"", "JSON object"),
    (b"not json", "JSON object"),
    (b"\xff\xfe", "JSON object"),
    (b"[1, 2]", "not list"),
    (b"null", "not NoneType"),
    (b"{}", "missing field(s): amount_cents, order_id"),
    (b'{"order_id": "bad-1"}', "missing field(s): amount_cents"),
    (b'{"amount_cents": 5}', "missing field(s): order_id"),
    (b'{"order_id": 7, "amount_cents": 5}', "order_id must be"),
    (b'{"order_id": "", "amount_cents": 5}', "order_id must be"),
    (json.dumps({"order_id": "x" * 65, "amount_cents": 5}).encode(), "order_id must be"),
    (b'{"order_id": "bad-2", "amount_cents": "12"}', "amount_cents must be"),
    (b'{"order_id": "bad-3", "amount_cents": 1.5}', "amount_cents must be"),
    (b'{"order_id": "bad-4", "amount_cents": true}', "amount_cents must be"),
    (b'{"order_id": "bad-5", "amount_cents": -1}', "amount_cents must be"),
    (b'{"order_id": "bad-6", "amount_cents": 2147483648}', "amount_cents must be"),
    (b'{"order_id": "bad-7", "amount_cents": 5, "note": "x"}', "unknown field(s): note"),
]


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"], indirect=True)
def test_bad_requests_get_400_and_write_nothing_and_metrics_are_served(
        db_url: str, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    port = free_port()
    server = _serve(db_url, bootstrap, topic, port, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        started = server.stdout.readline().decode()
        assert started.startswith(f"http_service: serving http://127.0.0.1:{port} with "
                                  "transactional ids http-orders-0..http-orders-3 (4)"), started
        orders = f"http://127.0.0.1:{port}/orders"
        for body, error in BAD_BODIES:
            status, content_type, text = _request(orders, body)
            assert (status, content_type) == (400, "application/json"), (body, status, text)
            assert error in json.loads(text)["error"], (body, text)
        status, _, text = _request(orders, b'{"order_id": "good-1", "amount_cents": 1200}')
        assert (status, json.loads(text)) == (201, {"order_id": "good-1"})
        status, _, text = _request(orders, b'{"order_id": "good-1", "amount_cents": 1}')
        assert (status, json.loads(text)) == (409, {"error": "order exists"})
        status, content_type, text = _request(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and content_type.startswith("text/plain"), (status, content_type)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("dualwrite_pool_writers", (("pool", "http-orders"),))] == 4
    # The warm-up's transactions and good-1's, committed; the 409 aborted.
    assert samples[("dualwrite_transactions_total",
                    (("outcome", "committed"), ("role", "pool")))] >= 2
    assert any(name == "dualwrite_phase_seconds_count" for name, _ in samples)
    assert any(name.startswith("process_") for name, _ in samples)  # the whole registry
    families = list(text_string_to_metric_families(text))
    assert all(f.samples for f in families)  # no empty family
    assert [json.loads(r) for r in read_committed(bootstrap, topic)] == \
        [{"order_id": "good-1", "amount_cents": 1200}]
    with engine.connect() as conn:
        rows = list(conn.exec_driver_sql("SELECT order_id, amount_cents FROM http_orders"))
    assert [tuple(r) for r in rows] == [("good-1", 1200)]


@pytest.mark.parametrize("backend", ["postgresql", "mariadb"], indirect=True)
def test_concurrent_clients_posting_the_same_orders_commit_each_once(
        db_url: str, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """8 clients post the same 12 orders at once, each client in its own order: the requests
    share groups and writers, and a duplicate fails alone in its group. Each order is answered
    ``201`` exactly once, every other time ``409`` (a ``503`` is sent again); rows ==
    read_committed records == the orders, each once."""
    clients, order_ids = 8, [f"same-{n}" for n in range(12)]
    port = free_port()
    server = _serve(db_url, bootstrap, topic, port)
    statuses: dict[str, list[int]] = {order_id: [] for order_id in order_ids}
    lock = threading.Lock()

    def client(i: int) -> None:
        mine = order_ids[i % len(order_ids):] + order_ids[:i % len(order_ids)]
        if i % 2:
            mine.reverse()
        for order_id in mine:
            body = json.dumps({"order_id": order_id, "amount_cents": i}).encode()
            # 503 (retriable: e.g. a deadlock between two groups inserting the same orders in
            # opposite order rolled one back) is sent again, as a client does.
            for _ in range(10):
                status, _, _ = _request(f"http://127.0.0.1:{port}/orders", body)
                if status != 503:
                    break
            with lock:
                statuses[order_id].append(status)

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    assert {o: sorted(s) for o, s in statuses.items()} == \
        {o: [201] + [409] * (clients - 1) for o in order_ids}
    records = [json.loads(r)["order_id"] for r in read_committed(bootstrap, topic)]
    with engine.connect() as conn:
        rows = [r[0] for r in conn.exec_driver_sql("SELECT order_id FROM http_orders")]
    assert sorted(records) == sorted(rows) == sorted(order_ids)
