"""One transaction step in its own process, for tests/participant/pulsar/test_wire.py.

``open URL TIMEOUT_MS TOPIC N``: open a transaction, add TOPIC, send ``m0``…, print
``TXN most least`` and wait to be killed. ``end URL (MOST LEAST commit|abort)…``: end each by
TxnID on one new client, print ``END most least action OK|<exception class>``.
"""

from __future__ import annotations

import sys
import time

from dualwrite.participant.pulsar import PulsarError, PulsarTxnClient, TxnId


def main(argv: list[str]) -> None:
    command, url, *args = argv
    with PulsarTxnClient(url, timeout_s=20) as client:
        if command == "open":
            timeout_ms, topic, n = int(args[0]), args[1], int(args[2])
            txn = client.new_txn(timeout_ms)
            client.add_partitions(txn, [topic])
            client.send(topic, [f"m{i}".encode() for i in range(n)], txn)
            print(f"TXN {txn.most} {txn.least}", flush=True)
            time.sleep(600)
        elif command == "end":
            for i in range(0, len(args), 3):
                txn, action = TxnId(int(args[i]), int(args[i + 1])), args[i + 2]
                try:
                    client.end_txn(txn, action == "commit")
                    outcome = "OK"
                except PulsarError as e:
                    outcome = type(e).__name__
                print(f"END {txn.most} {txn.least} {action} {outcome}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
