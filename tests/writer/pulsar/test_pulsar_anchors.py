"""A writer's anchors outlive it on a broker that deletes inactive topics, as Pulsar does by
default (``brokerDeleteInactiveTopicsEnabled``: a topic without producers or subscriptions is
deleted once idle; here after 4 s instead of 60). Without the writer's durable subscription on
its anchor topic, a crash after a commit left ``dualwrite recover`` unable to read the outcome
(``outcome-unreadable``, exit 3) once the topic was gone."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from dualwrite.writer.pulsar_writer import ANCHOR_SUBSCRIPTION
from tests.support.pulsar.broker import HAS_JAVA
from tests.support.pulsar.checks import assert_invariant, recover_cli, worker

if TYPE_CHECKING:
    from dualwrite.dev.pulsar_cluster import LocalPulsar

pytestmark = pytest.mark.timeout(300)

IDLE_S = 4


@pytest.fixture(scope="module")
def deleting_broker() -> Iterator[LocalPulsar]:
    if not HAS_JAVA:
        pytest.skip("needs java, javac and mvn (Pulsar from Maven jars)")
    from dualwrite.dev.pulsar_cluster import DEFAULT_PULSAR_VERSION, LocalPulsar

    config = {"brokerDeleteInactiveTopicsEnabled": "true",
              "brokerDeleteInactiveTopicsFrequencySeconds": "2",
              "brokerDeleteInactiveTopicsMaxInactiveDurationSeconds": str(IDLE_S)}
    with LocalPulsar(DEFAULT_PULSAR_VERSION, extra_config=config) as broker:
        yield broker


def topics(broker: LocalPulsar) -> list[str]:
    status, names = broker.admin_request("GET", "/admin/v2/persistent/public/default")
    assert status == 200, names
    return list(names)


def test_a_crash_after_a_commit_is_recovered_after_the_idle_deletion(
        deleting_broker: LocalPulsar, db: str) -> None:
    broker = deleting_broker
    run = uuid.uuid4().hex[:8]
    topic, idle = (f"persistent://public/default/{name}-{run}" for name in ("orders", "idle"))
    path = "/admin/v2/" + topic.replace("persistent://", "persistent/")
    assert broker.admin_request("PUT", path + "/partitions", 3)[0] in (200, 204)
    # The orders' own consumers keep their topic (a subscription made before any message);
    # the idle topic has none and shows that this broker deletes such topics.
    assert broker.admin_request("PUT", path + "/subscription/orders-consumer")[0] in (200, 204)
    assert broker.admin_request(
        "PUT", "/admin/v2/" + idle.replace("persistent://", "persistent/"))[0] in (200, 204)
    writer = f"anchors-{run}"
    anchors = f"persistent://public/default/dualwrite-anchor-{writer}"
    killed = worker(broker, db, topic, writer, 0, 6, "--kill-at", "5", "--phase", "committed")
    assert killed.returncode == -9 and "KILL committed" in killed.stdout, killed.stdout

    # Older anchors are let go: the subscription's backlog holds the last one or two (the
    # last ACK may die with the process), not all six.
    status, stats = broker.admin_request(
        "GET", "/admin/v2/" + anchors.replace("persistent://", "persistent/") + "/stats")
    assert status == 200, stats
    assert stats["subscriptions"][ANCHOR_SUBSCRIPTION]["msgBacklog"] <= 2, stats

    deadline = time.monotonic() + 60
    while idle in topics(broker):
        assert time.monotonic() < deadline, "the broker did not delete the idle topic"
        time.sleep(1)
    time.sleep(2 * IDLE_S)  # well past the deletion the anchor topic would have met too
    assert anchors in topics(broker)
    result = recover_cli(broker, db)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{writer}: already-committed" in result.stdout, result.stdout
    assert_invariant(broker, db, topic, expected=set(range(6)))
