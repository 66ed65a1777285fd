"""A writer that stops the way applications stop, for tests/cli/test_operator_output.py::

    python tests/support/workers/status_worker.py DB BOOTSTRAP TOPIC TID MODE

``unclosed``: two committed transactions, then exit without ``close()``. ``abort-last``: one
committed transaction and one whose block raises (Kafka aborts it), then exit without
``close()``. ``kill-after-db-commit``: one committed transaction, then SIGKILL between the
second one's database COMMIT and its Kafka commit. Prints ``DONE`` when it gets that far.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from dualwrite import DualWriter
from dualwrite.participant import PreparedTxnState, TxnState
from dualwrite.writer import PhaseHooks


class KillAfterDatabaseCommit(PhaseHooks):
    armed = False

    def database_committed(self, state: PreparedTxnState) -> None:
        if self.armed:
            print("DONE", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def wait_until_open(writer: DualWriter) -> None:
    cp = writer.producer.control_plane
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        desc = cp.describe_transaction(writer.transactional_id)
        if desc is not None and desc.state is TxnState.ONGOING:
            return
        time.sleep(0.02)
    raise SystemExit("the transaction never opened at the coordinator")


def main() -> None:
    db, bootstrap, topic, tid, mode = sys.argv[1:6]
    hooks = KillAfterDatabaseCommit()
    writer = DualWriter(db, {"bootstrap.servers": bootstrap}, transactional_id=tid, hooks=hooks)
    with writer.transaction() as tx:
        tx.produce(topic, b"first")
    if mode == "unclosed":
        with writer.transaction() as tx:
            tx.produce(topic, b"second")
    elif mode == "abort-last":
        try:
            with writer.transaction() as tx:
                tx.produce(topic, b"aborted")
                wait_until_open(writer)  # so that Kafka has something to abort
                raise KeyError("the application's block failed")
        except KeyError:
            pass
    elif mode == "kill-after-db-commit":
        hooks.armed = True
        with writer.transaction() as tx:
            tx.produce(topic, b"in-doubt")
    print("DONE", flush=True)
    os._exit(0)  # no close(): the state row stays as the last transaction left it


if __name__ == "__main__":
    main()
