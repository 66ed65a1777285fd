"""The soak's load on the HTTP service: ``--clients`` threads post new orders back to back (a
short pause between two), until SIGTERM.

    python -m tests.soak.load_role --url http://127.0.0.1:P --clients 4 --journal FILE

Journal lines: ``ack`` (answered 201: the order id), ``error`` (a 5xx with the dualwrite error
class the service named, and its family), ``unavailable`` (no answer: the service was down or
killed mid-request; the order's outcome is unknown to the client, so it is not counted as
acknowledged). A 4xx is journaled as ``error`` of family ``client`` (an anomaly: the load only
sends valid, new orders).
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time
import uuid
from urllib.parse import urlsplit

from tests.soak.roles import on_sigterm, report_uncaught
from tests.support.journal import Journal, dualwrite_error_class, family_of_class


def family_of(name: str) -> str:
    """The family of the dualwrite error class ``name`` (``foreign`` for any other name)."""
    kind = dualwrite_error_class(name)
    return "foreign" if kind is None else family_of_class(kind)


def client(host: str, port: int, n: int, journal: Journal, stopping: threading.Event,
           pause_s: float) -> None:
    conn: http.client.HTTPConnection | None = None
    run = uuid.uuid4().hex[:8]
    i = 0
    while not stopping.is_set():
        order_id = f"o-{run}-{n}-{i}"
        i += 1
        body = json.dumps({"order_id": order_id, "amount_cents": 100 + i % 1000})
        try:
            if conn is None:
                conn = http.client.HTTPConnection(host, port, timeout=90)
            conn.request("POST", "/orders", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            answer = response.read()
        except (OSError, http.client.HTTPException) as exc:
            journal.write("unavailable", id=order_id, why=type(exc).__name__)
            if conn is not None:
                conn.close()
            conn = None
            time.sleep(0.5)
            continue
        if response.status == 201:
            journal.write("ack", id=order_id)
        else:
            try:
                fields = json.loads(answer)
            except ValueError:
                fields = {}
            name = str(fields.get("type", f"HTTP {response.status}"))
            kind = ("client" if response.status < 500
                    else str(fields.get("family") or family_of(name)))
            journal.write("error", id=order_id, status=response.status, type=name, family=kind,
                          msg=str(fields.get("error", answer[:200]))[:300])
            time.sleep(0.2)
        time.sleep(pause_s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--pause-s", type=float, default=0.01)
    ap.add_argument("--journal", required=True)
    args = ap.parse_args()
    report_uncaught()
    parts = urlsplit(args.url)
    journal = Journal(args.journal)
    stopping = threading.Event()
    on_sigterm(stopping.set)
    threads = [threading.Thread(target=client, args=(parts.hostname or "127.0.0.1",
                                                     parts.port or 80, n, journal, stopping,
                                                     args.pause_s), daemon=True)
               for n in range(args.clients)]
    for t in threads:
        t.start()
    while not stopping.wait(0.5):
        pass
    for t in threads:
        t.join(100)
    journal.write("stop")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
