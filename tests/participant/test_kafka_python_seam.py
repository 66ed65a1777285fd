"""dualwrite.participant._kafka_python_seam: the pinned kafka-python range, and every seam function
against a real broker, so that a kafka-python upgrade that renames or reshapes what the control
plane relies on fails here, loudly, and not during a recovery. """

from __future__ import annotations

import ast
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kafka
import pytest
from kafka import KafkaAdminClient
from kafka.protocol.admin.transactions import DescribeTransactionsRequest
from kafka.protocol.metadata import ApiVersionsRequest, CoordinatorType, FindCoordinatorRequest

import dualwrite.participant._kafka_python_seam as seam
from dualwrite.errors import FatalError
from dualwrite.participant.kafka_errors import raise_for_code
from dualwrite.participant.prepared_state import PreparedTxnState
from tests.support import REPO_ROOT
from tests.support.kafka import prepare_open, unique

pytestmark = pytest.mark.timeout(120)

ONGOING = "Ongoing"
COMPLETE_ABORT = "CompleteAbort"
COMPLETE_COMMIT = "CompleteCommit"


# -- the version range -------------------------------------------------------------------------


@pytest.mark.unit
def test_installed_kafka_python_is_in_the_supported_range() -> None:
    seam.check_kafka_python_version(kafka.__version__)
    assert kafka.__version__ == seam.KAFKA_PYTHON_VERSION


@pytest.mark.unit
def test_supported_range_matches_the_requirement_and_the_pin() -> None:
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    assert f'"kafka-python{seam.SUPPORTED_KAFKA_PYTHON}"' in pyproject
    pinned = re.search(r"^kafka-python==(\S+)$", (REPO_ROOT / "constraints.txt").read_text(), re.M)
    assert pinned is not None
    seam.check_kafka_python_version(pinned.group(1))


@pytest.mark.unit
@pytest.mark.parametrize("version", ["3.0.11", "3.1.0", "3.1.0rc1", "4.0", "2.2.15", "nonsense"])
def test_versions_outside_the_range_are_refused(version: str) -> None:
    with pytest.raises(seam.UnsupportedKafkaPythonError) as info:
        seam.check_kafka_python_version(version)
    assert isinstance(info.value, FatalError) and isinstance(info.value, ImportError)
    assert seam.SUPPORTED_KAFKA_PYTHON in str(info.value) and version in str(info.value)


@pytest.mark.unit
@pytest.mark.parametrize("version", ["3.0.12", "3.0.13", "3.0.99.post1"])
def test_versions_inside_the_range_are_accepted(version: str) -> None:
    seam.check_kafka_python_version(version)


def _private_uses(path: Path) -> list[str]:
    """``x._name`` attribute uses in ``path`` where ``x`` is not ``self``."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return found


@pytest.mark.unit
def test_control_plane_touches_no_private_names_but_its_own() -> None:
    assert _private_uses(REPO_ROOT / "dualwrite" / "participant" / "control_plane.py") == []


@pytest.mark.unit
def test_the_seam_touches_no_kafka_python_private_names() -> None:
    assert _private_uses(REPO_ROOT / "dualwrite" / "participant" / "_kafka_python_seam.py") == []


@pytest.mark.unit
def test_only_the_seam_imports_kafka_net() -> None:
    offenders = [
        str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "dualwrite").rglob("*.py")
        if p.name != "_kafka_python_seam.py"
        and re.search(r"^\s*(from|import)\s+kafka\.net\b", p.read_text(), re.M)
    ]
    assert offenders == []


# -- every seam function against a real broker -------------------------------------------------


@pytest.fixture
def link(bootstrap: str) -> Iterator[seam.KafkaLink]:
    link = seam.KafkaLink(bootstrap_servers=bootstrap, request_timeout_ms=15_000,
                          bootstrap_timeout_ms=15_000, reconnect_backoff_max_ms=1000)
    try:
        yield link
    finally:
        link.close()


def _coordinator(link: seam.KafkaLink, tid: str) -> int:
    """FindCoordinator v4 through ``send``, registered with ``add_coordinator``."""

    async def find() -> Any:
        return await link.send(FindCoordinatorRequest(
            key_type=CoordinatorType.TRANSACTION.value, coordinator_keys=[tid], min_version=4))

    deadline = time.monotonic() + 30
    while True:
        answer = link.run(find).coordinators[0]
        if answer.error_code not in (14, 15) or time.monotonic() > deadline:  # loading / n.a.
            break
        time.sleep(0.2)
    node = link.add_coordinator(answer, CoordinatorType.TRANSACTION, tid)
    assert node == answer.node_id and node in link.broker_ids()
    return node


def _send_settled(link: seam.KafkaLink, request: Any, tid: str) -> Any:
    """Send ``request`` to ``tid``'s coordinator until it is done loading / finishing markers
    (a fresh broker creates its transaction log first: NOT_COORDINATOR, then loading)."""
    deadline = time.monotonic() + 60
    while True:
        node = _coordinator(link, tid)

        async def send(node: int = node) -> Any:
            return await link.send(request, node)

        response = link.run(send)
        # COORDINATOR_LOAD_IN_PROGRESS, COORDINATOR_NOT_AVAILABLE, NOT_COORDINATOR,
        # CONCURRENT_TRANSACTIONS
        if response.error_code not in (14, 15, 16, 51) or time.monotonic() > deadline:
            return response
        time.sleep(0.2)


def _describe(link: seam.KafkaLink, node: int, tid: str) -> Any:
    async def describe() -> Any:
        return await link.send(DescribeTransactionsRequest(transactional_ids=[tid]), node)

    return link.run(describe).transaction_states[0]


def test_link_is_a_public_admin_client_on_the_same_connections(link: seam.KafkaLink) -> None:
    assert isinstance(link.admin, KafkaAdminClient)
    # The public admin API works on the link's connection manager.
    node = link.broker_ids()[0]
    assert link.admin.get_broker_version_data(node).broker_version_str
    assert link.admin.describe_cluster()["brokers"]


def test_bootstrap_brokers_and_versions(link: seam.KafkaLink) -> None:
    link.run(link.bootstrap, 15_000)
    brokers = link.broker_ids()
    assert brokers and all(isinstance(b, int) for b in brokers)
    host, port = link.broker_address(brokers[0])
    assert isinstance(host, str) and isinstance(port, int) and port > 0
    for api_key in (10, 22, 26, 61, 65, 66):  # FindCoordinator ... ListTransactions
        version = link.max_version(api_key)
        assert isinstance(version, int) and version >= 0, api_key
    assert link.max_version(10) is not None and link.max_version(10) >= 4  # type: ignore[operator]
    assert link.max_version(32_000) is None


def test_send_to_a_node_and_to_any(link: seam.KafkaLink) -> None:
    node = link.broker_ids()[0]

    async def both() -> tuple[Any, Any]:
        request = ApiVersionsRequest(client_software_name="dualwrite-test",
                                     client_software_version="0")
        return await link.send(request, node), await link.send(request)

    to_node, to_any = link.run(both)
    assert to_node.error_code == 0 and to_any.error_code == 0
    assert {k.api_key for k in to_node.api_keys} >= {22, 26, 61, 65, 66}


def test_sleep_runs_on_the_io_thread(link: seam.KafkaLink) -> None:
    async def nap() -> float:
        started = time.monotonic()
        await link.sleep(0.2)
        return time.monotonic() - started

    assert 0.15 <= link.run(nap) < 5


def test_spawned_coroutines_run_at_once_and_are_joined(link: seam.KafkaLink) -> None:
    async def nap(seconds: float) -> float:
        await link.sleep(seconds)
        return seconds

    async def fail() -> None:
        raise ValueError("boom")

    async def three() -> tuple[list[float], float]:
        started = time.monotonic()
        naps = [link.spawn(nap, 0.3) for _ in range(3)]
        done = [await n for n in naps]
        return done, time.monotonic() - started

    done, took = link.run(three)
    assert done == [0.3] * 3 and 0.25 <= took < 0.8  # together, not 0.9 s one after another

    async def joined_failure() -> None:
        await link.spawn(fail)

    with pytest.raises(ValueError, match="boom"):
        link.run(joined_failure)


def test_run_raises_the_coroutines_error(link: seam.KafkaLink) -> None:
    async def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        link.run(fail)


@pytest.mark.parametrize("commit", [True, False])
def test_end_txn_request_at_v4_ends_another_producers_transaction(
        link: seam.KafkaLink, bootstrap: str, topic: str, commit: bool) -> None:
    tid = unique("seam-endtxn")
    state: PreparedTxnState = prepare_open(bootstrap, topic, tid, ["a"])
    node = _coordinator(link, tid)
    assert _describe(link, node, tid).transaction_state == ONGOING
    request = seam.end_txn_request(tid, state.producer_id, state.epoch, commit, 4)
    response = _send_settled(link, request, tid)
    raise_for_code(response.error_code, "EndTxn")
    # Capped at v4 (transaction version 1) even where the broker offers v5.
    assert request.version == response.version == min(4, link.max_version(26) or 0)
    final = COMPLETE_COMMIT if commit else COMPLETE_ABORT
    deadline = time.monotonic() + 30
    while _describe(link, node, tid).transaction_state != final:
        assert time.monotonic() < deadline, "the transaction did not complete"
        time.sleep(0.1)


def test_init_producer_id_request_without_version_fences(
        link: seam.KafkaLink, bootstrap: str, topic: str) -> None:
    tid = unique("seam-fence")
    state = prepare_open(bootstrap, topic, tid, ["a"])
    request = seam.init_producer_id_request(tid, 60_000, None, False, False)
    response = _send_settled(link, request, tid)
    raise_for_code(response.error_code, "InitProducerId")
    assert request.version == response.version <= 5
    assert response.producer_id == state.producer_id and response.producer_epoch > state.epoch


@pytest.mark.unit
def test_init_producer_id_v6_request_shape() -> None:
    request = seam.init_producer_id_request("t", 60_000, 6, True, False)
    assert request.version == 6
    assert request.enable2_pc is True and request.keep_prepared_txn is False
    assert request.encode()  # the v6 schema (with KIP-939's fields) still encodes


def test_init_producer_id_v6_request_on_a_2pc_broker(kafka_2pc: Any) -> None:
    link = seam.KafkaLink(bootstrap_servers=kafka_2pc.bootstrap_servers,
                          request_timeout_ms=15_000, bootstrap_timeout_ms=30_000)
    try:
        tid = unique("seam-v6")
        request = seam.init_producer_id_request(tid, 60_000, 6, True, False)
        response = _send_settled(link, request, tid)
        assert response.version == 6
        raise_for_code(response.error_code, "InitProducerId v6")
        assert response.producer_id >= 0 and response.producer_epoch >= 0
    finally:
        link.close()
