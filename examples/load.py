"""Load generator for examples/http_service.py: bounded concurrency, bounded duration.

    python examples/load.py [--url http://127.0.0.1:8000] [--concurrency 32] [--seconds 10]
                            [--acked acked.txt]

Each client thread posts new orders back to back; every order answered ``201`` is appended to
``--acked`` (one id a line, flushed at once, so the file survives a crash of the server); a
connection refused or reset (the server was killed) is counted and retried after a pause.
Prints requests/s and p50/p99 latency at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time
import uuid
from urllib.parse import urlsplit


def run(url: str, concurrency: int, seconds: float, acked_path: str | None) -> dict[str, float]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    deadline = time.monotonic() + seconds
    lock = threading.Lock()
    latencies: list[float] = []
    failures = 0
    acked = open(acked_path, "a") if acked_path else None  # noqa: SIM115 (shared by threads)

    def client(i: int) -> None:
        nonlocal failures
        conn: http.client.HTTPConnection | None = None
        n = 0
        while time.monotonic() < deadline:
            order_id = f"o-{uuid.uuid4().hex[:8]}-{i}-{n}"
            n += 1
            body = json.dumps({"order_id": order_id, "amount_cents": 100 + n})
            started = time.perf_counter()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(host, port, timeout=30)
                conn.request("POST", "/orders", body, {"Content-Type": "application/json"})
                status = conn.getresponse()
                status.read()
            except (OSError, http.client.HTTPException):
                with lock:
                    failures += 1
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.1)
                continue
            with lock:
                if status.status == 201:
                    latencies.append(time.perf_counter() - started)
                    if acked is not None:
                        acked.write(order_id + "\n")
                        acked.flush()
                else:
                    failures += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if acked is not None:
        acked.close()
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else 0.0

    return {"ok": len(latencies), "failed": failures, "per_s": len(latencies) / elapsed,
            "p50_ms": pct(0.5) * 1000, "p99_ms": pct(0.99) * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--acked")
    args = ap.parse_args()
    r = run(args.url, args.concurrency, args.seconds, args.acked)
    print(f"{r['ok']:.0f} orders acknowledged ({r['per_s']:.0f}/s, p50 {r['p50_ms']:.1f} ms, "
          f"p99 {r['p99_ms']:.1f} ms), {r['failed']:.0f} failed or refused")


if __name__ == "__main__":
    main()
