"""examples/http_service.py (Starlette + AsyncDualWriterPool) under load, SIGKILLed and restarted.

The invariant per request: the orders rows are exactly the read_committed records, each once,
and every order the service acknowledged (201) is among them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import dualwrite
from tests._kafka_helpers import read_committed

pytestmark = [pytest.mark.timeout(180), pytest.mark.parametrize("backend", ["postgresql"],
                                                                 indirect=True)]

ROOT = Path(__file__).resolve().parents[1]


def _load_module() -> Any:
    spec = importlib.util.spec_from_file_location("example_load", ROOT / "examples" / "load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(db_url: str, bootstrap: str, topic: str, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "http_service.py"), "--db", db_url, "-b",
         bootstrap, "--topic", topic, "--port", str(port), "--size", "4"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
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


def test_sigkill_under_load_then_restart(db_url: str, engine: sa.Engine, bootstrap: str,
                                         topic: str, tmp_path: Path) -> None:
    load = _load_module()
    port = _free_port()
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
