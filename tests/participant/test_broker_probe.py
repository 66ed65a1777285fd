"""What a probe makes of the brokers' answers (``broker_probe``), without a broker."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from dualwrite.errors import FatalError
from dualwrite.participant.broker_probe import (
    ApiKey,
    ApiRange,
    BrokerProbe,
    ProbeResult,
)
from dualwrite.participant.identifiers import ProducerIdentity

pytestmark = pytest.mark.unit


class FakeRequests:
    """Answers a probe's requests from fixed brokers; InitProducerId v6 per KeepPreparedTxn."""

    def __init__(self, brokers: list[BrokerProbe], configs: dict[str, str],
                 keep_accepted: bool = False) -> None:
        self.brokers = brokers
        self.configs = configs
        self.keep_accepted = keep_accepted
        self.inits: list[tuple[str, bool, bool]] = []

    def broker_versions(self) -> list[BrokerProbe]:
        return self.brokers

    def broker_configs(self, node_id: int) -> dict[str, str]:
        return self.configs

    def init_producer_id_v6(self, transactional_id: str, *, enable_2pc: bool,
                            keep_prepared_txn: bool, transaction_timeout_ms: int = 60_000
                            ) -> ProducerIdentity:
        self.inits.append((transactional_id, enable_2pc, keep_prepared_txn))
        if keep_prepared_txn and not self.keep_accepted:
            raise FatalError("refused")
        return ProducerIdentity(7, 1)


def broker(node_id: int, keys: Sequence[int], ipid_max: int = 5, tv: int = 2) -> BrokerProbe:
    apis = {k: ApiRange(0, ipid_max if k == ApiKey.INIT_PRODUCER_ID else 4) for k in keys}
    return BrokerProbe(node_id, "h", 9092 + node_id, "Apache Kafka 4.1", apis,
                       {"transaction.version": tv})


def test_request_names_are_the_protocol_names() -> None:
    assert [k.request_name for k in ApiKey] == [
        "FindCoordinator", "InitProducerId", "EndTxn", "DescribeProducers",
        "DescribeTransactions", "ListTransactions"]


def test_a_cluster_with_every_request_is_supported() -> None:
    requests = FakeRequests([broker(1, list(ApiKey)), broker(2, list(ApiKey), tv=1)],
                            {"transaction.max.timeout.ms": "900000"})
    result = ProbeResult.gather(requests, check_2pc=False)
    assert result.supported and result.missing == []
    assert result.transaction_version == 1
    assert result.max_transaction_timeout_ms == 900_000
    assert result.two_phase_commit_enabled is None
    assert result.enable_2pc == result.keep_prepared_txn == "not tried"
    assert result.verdict == "dualwrite: supported — epoch-resume mode (transaction.version=1)"
    assert requests.inits == []


def test_missing_requests_name_the_brokers() -> None:
    lacking = [k for k in ApiKey if k is not ApiKey.DESCRIBE_PRODUCERS]
    result = ProbeResult.gather(FakeRequests([broker(1, lacking), broker(2, lacking)], {}),
                                check_2pc=False)
    assert result.missing == ["DescribeProducers (API key 61; brokers 1, 2)"]
    assert not result.supported
    assert result.as_dict()["missing"] == result.missing


def test_init_producer_id_v6_is_tried_only_where_offered() -> None:
    old = FakeRequests([broker(1, list(ApiKey), ipid_max=5)], {})
    assert ProbeResult.gather(old).enable_2pc.startswith("unsupported: brokers offer "
                                                         "InitProducerId up to v5")
    assert old.inits == []
    new = FakeRequests([broker(1, list(ApiKey), ipid_max=6)],
                       {"transaction.two.phase.commit.enable": "true"})
    result = ProbeResult.gather(new, probe_transactional_id="p")
    assert new.inits == [("p", True, False), ("p", True, True)]
    assert result.enable_2pc == "accepted (producer_id=7, epoch=1)"
    assert result.keep_prepared_txn == "rejected: refused"
    assert result.two_phase_commit_enabled is True


def test_no_broker_is_not_supported() -> None:
    result = ProbeResult.gather(FakeRequests([], {}), check_2pc=False)
    assert result.verdict == "dualwrite: not supported — no broker answered"

