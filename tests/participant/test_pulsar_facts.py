"""Pin, on a real Pulsar standalone broker, the transaction behaviour issue 33's design relies on.

One broker (``LocalPulsar``, Maven jars) and one scenario for the module, driven by Pulsar's own
Java client (tests/support/pulsar/TxnProbe.java), one step a process: opener processes are
SIGKILLed and their transactions are ended by TxnID from a new process. docs/broker-facts.md
("Pulsar transactions (measured)") records the results. Needs java, javac and mvn; skipped
otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from dualwrite.dev.pulsar_cluster import DEFAULT_PULSAR_VERSION, LocalPulsar
from tests.support.pulsar.broker import token_auth_pulsar
from tests.support.pulsar.probe import EndResult, TxnProbe

pytestmark = [
    pytest.mark.pulsar_full,  # CI runs tests/participant/pulsar/ (our client) instead
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not all(shutil.which(t) for t in ("java", "javac", "mvn")),
        reason="needs java, javac and mvn (Pulsar runs from Maven jars)",
    ),
]

NOT_FOUND = ("org.apache.pulsar.client.api.transaction."
             "TransactionCoordinatorClientException$TransactionNotFoundException")
NO_HANDLER = ("org.apache.pulsar.client.api.transaction."
              "TransactionCoordinatorClientException$MetaStoreHandlerNotExistsException")
COMMITTED_N, ABORTED_N, TIMED_OUT_N, PLAIN_N = 5, 3, 2, 3
SHORT_TIMEOUT_MS = 5000
LONG_TIMEOUT_MS = 600_000
UNKNOWN = (0, 2**40)


@dataclass
class Scenario:
    """What one run observed; each test asserts a part of it."""

    committed: tuple[int, int]
    aborted: tuple[int, int]
    timed_out: tuple[int, int]
    blocking: tuple[int, int]
    topics: dict[str, str]
    meta_open: tuple[int, Any] = (0, None)
    buffer_open: tuple[int, Any] = (0, None)
    read_while_open: dict[str, list[str]] = field(default_factory=dict)
    ends: list[EndResult] = field(default_factory=list)
    timeout_seen_after_s: float = 0.0
    timeout_ends: list[EndResult] = field(default_factory=list)
    read_after: dict[str, list[str]] = field(default_factory=dict)
    meta_after: dict[str, tuple[int, Any]] = field(default_factory=dict)
    buffer_after: dict[str, tuple[int, Any]] = field(default_factory=dict)


@pytest.fixture(scope="module")
def pulsar() -> Iterator[LocalPulsar]:
    with LocalPulsar(DEFAULT_PULSAR_VERSION) as broker:
        yield broker


def _meta(pulsar: LocalPulsar, txn: tuple[int, int]) -> tuple[int, Any]:
    return pulsar.admin_get(f"/admin/v3/transactions/transactionMetadata/{txn[0]}/{txn[1]}")


def _buffer(pulsar: LocalPulsar, topic: str, txn: tuple[int, int]) -> tuple[int, Any]:
    path = topic.removeprefix("persistent://")
    return pulsar.admin_get(
        f"/admin/v3/transactions/transactionInBufferStats/{path}/{txn[0]}/{txn[1]}")


@pytest.fixture(scope="module")
def scenario(pulsar: LocalPulsar) -> Scenario:
    probe = TxnProbe(pulsar.classpath, pulsar.service_url)
    run = uuid.uuid4().hex[:8]
    topics = {k: f"persistent://public/default/{k}-{run}"
              for k in ("commit", "abort", "timeout", "blocked")}
    opened = probe.open([
        (SHORT_TIMEOUT_MS, {topics["timeout"]: TIMED_OUT_N}),
        (LONG_TIMEOUT_MS, {topics["commit"]: COMMITTED_N}),
        (LONG_TIMEOUT_MS, {topics["abort"]: ABORTED_N}),
        (LONG_TIMEOUT_MS, {topics["blocked"]: 1}),
    ])
    timed_out_opened_at = time.monotonic()
    for proc, _, _ in opened:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    (_, *t), (_, *c), (_, *a), (_, *b) = opened
    s = Scenario(committed=(c[0], c[1]), aborted=(a[0], a[1]), timed_out=(t[0], t[1]),
                 blocking=(b[0], b[1]), topics=topics)
    probe.send(topics["blocked"], PLAIN_N)
    s.meta_open = _meta(pulsar, s.committed)
    s.buffer_open = _buffer(pulsar, topics["commit"], s.committed)
    s.read_while_open = probe.read(topics["commit"], topics["blocked"], idle_ms=500)
    s.ends = probe.end(
        (*s.committed, "commit"), (*s.committed, "commit"), (*s.committed, "abort"),
        (*s.aborted, "abort"), (*s.aborted, "abort"), (*s.aborted, "commit"),
        (*UNKNOWN, "commit"), (*UNKNOWN, "abort"), (7, 1, "commit"), (*s.blocking, "abort"),
    )
    while _meta(pulsar, s.timed_out)[0] == 200 and time.monotonic() - timed_out_opened_at < 30:
        time.sleep(0.2)
    s.timeout_seen_after_s = time.monotonic() - timed_out_opened_at
    s.timeout_ends = probe.end((*s.timed_out, "commit"), (*s.timed_out, "abort"))
    s.read_after = probe.read(*topics.values(), idle_ms=500)
    for name, txn in (("commit", s.committed), ("abort", s.aborted), ("timeout", s.timed_out)):
        s.meta_after[name] = _meta(pulsar, txn)
        s.buffer_after[name] = _buffer(pulsar, topics[name], txn)
    s.meta_after["unknown"] = _meta(pulsar, UNKNOWN)
    s.buffer_after["unknown"] = _buffer(pulsar, topics["commit"], UNKNOWN)
    return s


def _error(result: EndResult) -> tuple[str | None, str | None]:
    return result.error_class, result.error_message


def _not_found(txn: tuple[int, int]) -> tuple[str, str]:
    return NOT_FOUND, f"The transaction with this txdID `({txn[0]},{txn[1]})`not found"


def test_standalone_initialises_one_transaction_coordinator(pulsar: LocalPulsar) -> None:
    """Standalone creates pulsar/system and the coordinator assign topic with 1 partition."""
    status, meta = pulsar.admin_get(
        "/admin/v2/persistent/pulsar/system/transaction_coordinator_assign/partitions")
    assert (status, meta["partitions"]) == (200, 1)
    assert pulsar.admin_get("/admin/v2/namespaces/pulsar")[1] == ["pulsar/system"]


def test_open_transaction_is_visible_in_admin_and_hidden_from_consumers(
        scenario: Scenario) -> None:
    """While open: the coordinator lists it (status OPEN, timeout in ms), the buffer has a start
    position, and a consumer gets none of its messages."""
    status, meta = scenario.meta_open
    assert status == 200
    assert meta["status"] == "OPEN"
    assert meta["timeoutAt"] == LONG_TIMEOUT_MS
    assert list(meta["producedPartitions"]) == [scenario.topics["commit"]]
    status, buf = scenario.buffer_open
    assert status == 200 and buf["aborted"] is False and buf.get("startPosition")
    assert scenario.read_while_open[scenario.topics["commit"]] == []


def test_open_transaction_blocks_later_plain_messages(scenario: Scenario) -> None:
    """Messages sent outside any transaction after an open transaction's first message reach no
    consumer until that transaction ends (here: aborted by TxnID, then all of them arrive)."""
    blocked = scenario.topics["blocked"]
    assert scenario.read_while_open[blocked] == []
    assert _error(scenario.ends[9]) == (None, None)
    assert scenario.read_after[blocked] == [f"plain{i}" for i in range(PLAIN_N)]


def test_new_process_commits_killed_openers_transaction(scenario: Scenario) -> None:
    """(a) A SIGKILLed opener's transaction, committed by TxnID from a new process: all N read."""
    assert _error(scenario.ends[0]) == (None, None)
    assert scenario.read_after[scenario.topics["commit"]] == [f"m{i}" for i in range(COMMITTED_N)]


def test_new_process_aborts_killed_openers_transaction(scenario: Scenario) -> None:
    """(a) The same with abort: nothing is read."""
    assert _error(scenario.ends[3]) == (None, None)
    assert scenario.read_after[scenario.topics["abort"]] == []


def test_end_of_committed_transaction_is_not_found(scenario: Scenario) -> None:
    """(b) Commit again and abort after commit: TransactionNotFound (commit is not idempotent)."""
    assert _error(scenario.ends[1]) == _not_found(scenario.committed)
    assert _error(scenario.ends[2]) == _not_found(scenario.committed)


def test_end_of_aborted_transaction_is_not_found(scenario: Scenario) -> None:
    """(b) Abort again and commit after abort: TransactionNotFound, as for a committed one."""
    assert _error(scenario.ends[4]) == _not_found(scenario.aborted)
    assert _error(scenario.ends[5]) == _not_found(scenario.aborted)


def test_end_of_unknown_transaction_is_not_found(scenario: Scenario) -> None:
    """(b) A TxnID never issued: TransactionNotFound; an unknown coordinator id fails in the
    client before anything is sent."""
    assert _error(scenario.ends[6]) == _not_found(UNKNOWN)
    assert _error(scenario.ends[7]) == _not_found(UNKNOWN)
    assert _error(scenario.ends[8]) == (
        NO_HANDLER, "Transaction meta store handler for transaction meta store {} not exists.")


def test_timed_out_transaction_is_aborted_then_not_found(scenario: Scenario) -> None:
    """(b) The coordinator aborts at the client-chosen timeout (here 5 s); a later commit or
    abort is TransactionNotFound and nothing of it is read."""
    assert SHORT_TIMEOUT_MS / 1000 - 1 < scenario.timeout_seen_after_s < 15
    assert _error(scenario.timeout_ends[0]) == _not_found(scenario.timed_out)
    assert _error(scenario.timeout_ends[1]) == _not_found(scenario.timed_out)
    assert scenario.read_after[scenario.topics["timeout"]] == []
    assert scenario.buffer_after["timeout"] == (200, {"aborted": True})


def test_finished_transactions_are_forgotten_by_the_coordinator(scenario: Scenario) -> None:
    """(c) After the end, transactionMetadata answers 404 for committed, aborted, timed out and
    unknown alike: the coordinator cannot tell the outcome."""
    for name in ("commit", "abort", "timeout", "unknown"):
        status, body = scenario.meta_after[name]
        assert status == 404, (name, status, body)
        assert "not found" in body["reason"], (name, body)


def test_transaction_buffer_stats_tell_aborted_only(scenario: Scenario) -> None:
    """(c) The partition's buffer stats keep the abort (aborted=true) but a committed TxnID reads
    exactly as one never written there: committed is only inferable, e.g. from the messages."""
    assert scenario.buffer_after["abort"] == (200, {"aborted": True})
    assert scenario.buffer_after["commit"] == (200, {"aborted": False})
    assert scenario.buffer_after["unknown"] == (200, {"aborted": False})


# Authentication and authorization on (JWT, HS256): the coordinator's owner check.

OWNER_ROLE, OTHER_ROLE, SUPER_ROLE = "alice", "bob", "admin"


@dataclass
class AuthScenario:
    """Ends of transactions a SIGKILLed ``alice`` opened, by other roles and by alice again."""

    owned: tuple[int, int]
    for_super: tuple[int, int]
    by_other: EndResult | None = None
    by_owner: EndResult | None = None
    by_super: EndResult | None = None
    read: dict[str, list[str]] = field(default_factory=dict)
    topics: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def auth_scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthScenario]:
    with token_auth_pulsar(tmp_path_factory.mktemp("pulsar-auth"), (OWNER_ROLE, OTHER_ROLE),
                           SUPER_ROLE) as (pulsar, tokens):
        probes = {role: TxnProbe(pulsar.classpath, pulsar.service_url, token)
                  for role, token in tokens.items()}
        run = uuid.uuid4().hex[:8]
        topics = [f"persistent://public/default/auth-{k}-{run}" for k in ("owner", "super")]
        opened = probes[OWNER_ROLE].open([(LONG_TIMEOUT_MS, {topics[0]: 2}),
                                          (LONG_TIMEOUT_MS, {topics[1]: 2})])
        for proc, _, _ in opened:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        s = AuthScenario(owned=opened[0][1:], for_super=opened[1][1:], topics=topics)
        s.by_other, = probes[OTHER_ROLE].end((*s.owned, "commit"))
        s.by_owner, = probes[OWNER_ROLE].end((*s.owned, "commit"))
        s.by_super, = probes[SUPER_ROLE].end((*s.for_super, "abort"))
        s.read = probes[OWNER_ROLE].read(*topics)
        yield s


def test_auth_other_role_cannot_end_transaction(auth_scenario: AuthScenario) -> None:
    """With authN+authZ on, another role's END_TXN fails as TransactionNotFound (not owner)."""
    assert auth_scenario.by_other is not None
    assert auth_scenario.by_other.error_class == NOT_FOUND
    txn = "({},{})".format(*auth_scenario.owned)
    assert auth_scenario.by_other.error_message == (
        f"Client ({OTHER_ROLE}) is neither the owner of the transaction {txn} nor a super user")


def test_auth_owner_role_in_new_process_commits(auth_scenario: AuthScenario) -> None:
    """The same role from a new process (the opener SIGKILLed) commits; the messages are read."""
    assert auth_scenario.by_owner is not None
    assert _error(auth_scenario.by_owner) == (None, None)
    assert auth_scenario.read[auth_scenario.topics[0]] == ["m0", "m1"]


def test_auth_super_user_ends_any_transaction(auth_scenario: AuthScenario) -> None:
    """A super-user role (authorization on) ends another role's transaction."""
    assert auth_scenario.by_super is not None
    assert _error(auth_scenario.by_super) == (None, None)
    assert auth_scenario.read[auth_scenario.topics[1]] == []
