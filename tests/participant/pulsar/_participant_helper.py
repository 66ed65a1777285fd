"""End a prepared Pulsar transaction in its own process, for test_participant.py.

``URL commit|abort STATE``: parse STATE, commit or abort it on a new client, print ``RESULT OK``
or ``RESULT <exception class> <message>``.
"""

from __future__ import annotations

import sys

from dualwrite.errors import DualWriteError
from dualwrite.participant.pulsar import PulsarParticipant, PulsarPreparedTxn, PulsarTxnClient


def main(argv: list[str]) -> None:
    url, action, state = argv
    with PulsarTxnClient(url, timeout_s=20) as client:
        participant = PulsarParticipant(client, outcome_wait_s=3.0)
        try:
            prepared = PulsarPreparedTxn.parse(state)
            if action == "commit":
                participant.commit(prepared)
            else:
                participant.abort(prepared)
            print("RESULT OK", flush=True)
        except DualWriteError as e:
            print(f"RESULT {type(e).__name__} {e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
