"""Completion on a real broker: what ending an open transaction may touch.

The soak found a heuristic abort (a transaction the database decided to commit, aborted in
Kafka): recovery decided from a view taken under its row locks, a terminated database session
freed those locks while it went on, a writer claimed the id and began a transaction in a new
session, and recovery, its abort of the old transaction fenced, described the id again and
aborted the writer's instead.
"""

from __future__ import annotations

import pytest
from confluent_kafka import Producer

from dualwrite import PreparedTxnState
from dualwrite.errors import RetriableError
from dualwrite.participant import ControlPlane, TxnState
from dualwrite.participant.completion import Completion, Prefetched
from tests.support.kafka import read_committed, unique

pytestmark = pytest.mark.timeout(120)


def _session(bootstrap: str, tid: str) -> Producer:
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": tid})
    producer.init_transactions(30)
    return producer


def test_a_transaction_begun_after_the_first_view_is_not_ended(bootstrap: str,
                                                               topic: str) -> None:
    tid = unique("completion-race")
    control_plane = ControlPlane({"bootstrap.servers": bootstrap})
    old = _session(bootstrap, tid)
    old.begin_transaction()
    old.produce(topic, b"old")
    old.flush(30)
    seen = control_plane.describe_transaction(tid)  # the view recovery decides from
    assert seen is not None and seen.state is TxnState.ONGOING
    # A writer claims the id: its new session aborts the old transaction (the epoch moves on)
    # and begins its own, which it will decide to commit.
    writer = _session(bootstrap, tid)
    writer.begin_transaction()
    writer.produce(topic, b"writer")
    writer.flush(30)
    completion = Completion(control_plane, {"bootstrap.servers": bootstrap}, timeout_s=10)
    with pytest.raises(RetriableError, match="another transaction"):
        completion.end_open_transaction(tid, PreparedTxnState.empty(),
                                        prefetched=Prefetched({tid: seen}, {}))
    writer.commit_transaction(30)  # left alone: its commit goes through
    assert read_committed(bootstrap, topic) == [b"writer"]
