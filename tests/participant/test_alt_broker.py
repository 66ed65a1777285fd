"""dualwrite on a second, independent implementation of the Kafka protocol: franz-go's kfake
(``dualwrite dev up --flavour kfake``; built with ``go build`` on first use, then cached).

Apache Pulsar's Kafka protocol handler (KoP, ``io.streamnative.pulsar.handlers:
pulsar-protocol-handler-kafka``) is not served by Maven Central, so Pulsar cannot be tried here
(README, "Compatibility").

Per broker behaviour dualwrite relies on, by API key: EndTxn (26) by (producer id, epoch) from
another session, read_committed hiding aborted records, DescribeProducers (61)
CurrentTxnStartOffset, DescribeTransactions (65), ListTransactions (66), InitProducerId (22)
fencing, the coordinator's timeout abort; then the recipe, a SIGKILL between the two commits
finished by ``dualwrite recover``. Where kfake differs from Apache Kafka the test pins it (it
reports ``Empty``, never ``CompleteCommit``/``CompleteAbort``, after EndTxn; DescribeProducers
drops a producer whose transaction ended; InitProducerId bumps the epoch once). The same
program offering only Kafka 2.8's requests (``-as-version 2.8``: no DescribeTransactions or
ListTransactions) is refused at start-up by the writer, the sink's coordinator and recovery.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite import DualWriter, UnsupportedBrokerError, create_engine
from dualwrite.batch import BatchCoordinator
from dualwrite.dev import KafkaTarget
from dualwrite.dev._util import pid_alive
from dualwrite.dev.kfake_broker import LocalKfake, kfake_binary
from dualwrite.errors import HeuristicAbortError, OutcomeUnknownError
from dualwrite.participant import (
    ControlPlane,
    Outcome,
    PreparedTxnState,
    TopicPartition,
    TxnState,
    complete,
)
from dualwrite.participant.kafka_errors import FatalKafkaError, FencedKafkaError
from tests.support.crash_loop import CrashLoop
from tests.support.kafka import (
    TxnProducer,
    create_topic,
    first_offsets,
    prepare_open,
    read_committed,
    unique,
    wait_for,
)

pytestmark = pytest.mark.timeout(300)

VALUES = [b"a1", b"a2", b"a3"]
INVALID_TXN_STATE = 48
PRODUCER_FENCED = 90


@pytest.fixture(scope="module")
def kfake() -> Iterator[LocalKfake]:
    with LocalKfake() as broker:
        yield broker


@pytest.fixture(scope="module")
def kfake_28() -> Iterator[LocalKfake]:
    with LocalKfake(as_version="2.8") as broker:
        yield broker


@pytest.fixture
def bootstrap(kfake: LocalKfake) -> str:
    return kfake.bootstrap_servers


@pytest.fixture
def topic(bootstrap: str) -> str:
    return create_topic(bootstrap, unique("alt"), partitions=2)


def _open(bootstrap: str, topic: str, tid: str, timeout_ms: int = 60_000
          ) -> tuple[TxnProducer, int, int]:
    """A transaction holding VALUES on partition 0, its producer dropped without EndTxn."""
    producer = TxnProducer(bootstrap, tid, transaction_timeout_ms=timeout_ms).start()
    assert producer.producer is not None
    producer.producer.begin_transaction()
    producer.send(topic, VALUES, partition=0)
    pid, epoch = producer.identity()
    return producer, pid, epoch


# -- the protocol behaviours ---------------------------------------------------------------------


def _probe_behaviours(bootstrap: str) -> dict[str, object]:
    topic = create_topic(bootstrap, unique("alt-probe"), partitions=1)
    out = subprocess.run([sys.executable, "-m", "dualwrite.cli", "probe", "-b", bootstrap,
                          "--timeout", "15", "--json", "--behaviour-topic", topic],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def _api(check: dict[str, object]) -> str:
    """"EndTxn (26) by ..." -> "EndTxn (26)"."""
    return str(check["behaviour"]).split(")")[0] + ")"


BEHAVIOURS = ["DescribeProducers (61)", "ListTransactions (66)", "EndTxn (26)",
              "DescribeTransactions (65)", "Fetch (1)", "InitProducerId (22)"]


def test_probe_behaviours(bootstrap: str) -> None:
    """``dualwrite probe --behaviour-topic``: kfake does everything recovery needs; its
    DescribeTransactions says Empty, not CompleteAbort, after EndTxn (not required)."""
    result = _probe_behaviours(bootstrap)
    assert result["supported"] is True
    checks = result["behaviours"]
    assert isinstance(checks, list)
    assert [_api(c) for c in checks] == BEHAVIOURS
    lacking = [(_api(c), c["detail"]) for c in checks if not c["ok"]]
    assert lacking == [("DescribeTransactions (65)", "state Empty")]
    assert all(c["ok"] for c in checks if c["required"])


def test_probe_behaviours_on_apache_kafka(kafka: KafkaTarget) -> None:
    """The same probe on Apache Kafka: every behaviour, CompleteAbort included."""
    checks = _probe_behaviours(kafka.bootstrap_servers)["behaviours"]
    assert isinstance(checks, list)
    assert [(_api(c), c["ok"]) for c in checks] == [
        (b, True) for b in BEHAVIOURS]


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "abort"])
def test_end_txn_by_pid_epoch_from_another_session(cp: ControlPlane, bootstrap: str, topic: str,
                                                   commit: bool) -> None:
    """EndTxn (26) at v4 from the control plane's connection ends a transaction librdkafka
    opened; read_committed shows a commit and hides an abort; a repeated EndTxn is idempotent,
    the other decision is INVALID_TXN_STATE."""
    tid = unique("alt-end")
    producer, pid, epoch = _open(bootstrap, topic, tid)
    producer.destroy()
    cp.end_transaction(tid, pid, epoch, commit=commit)
    assert read_committed(bootstrap, topic) == (sorted(VALUES) if commit else [])
    cp.end_transaction(tid, pid, epoch, commit=commit)  # the resend of a lost answer
    with pytest.raises(FatalKafkaError) as other:
        cp.end_transaction(tid, pid, epoch, commit=not commit)
    assert other.value.info.code == INVALID_TXN_STATE
    # kfake: Empty after EndTxn (Apache Kafka: CompleteCommit / CompleteAbort).
    desc = cp.describe_transaction(tid)
    assert desc is not None and (desc.producer_id, desc.epoch) == (pid, epoch)
    assert desc.state is TxnState.EMPTY


def test_describe_producers_and_transactions(cp: ControlPlane, bootstrap: str,
                                             topic: str) -> None:
    """DescribeProducers (61) gives the open transaction's first offset (the anchor);
    DescribeTransactions (65) and ListTransactions (66) show it Ongoing with its partition."""
    warmup = TxnProducer(bootstrap, unique("alt-warm")).start()
    assert warmup.producer is not None
    warmup.producer.begin_transaction()
    warmup.send(topic, [b"w"], partition=0)
    warmup.producer.commit_transaction(30)
    tid = unique("alt-describe")
    producer, pid, epoch = _open(bootstrap, topic, tid)
    first = first_offsets(producer.deliveries)[0]
    assert first > 0
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    producers = cp.describe_producers([tp0, tp1])
    mine = [p for p in producers[tp0] if p.producer_id == pid]
    assert [(p.epoch, p.current_txn_start_offset) for p in mine] == [(epoch, first)]
    assert not [p for p in producers[tp1] if p.producer_id == pid]
    desc = cp.describe_transaction(tid)
    assert desc is not None and desc.state is TxnState.ONGOING
    assert (desc.producer_id, desc.epoch, desc.partitions) == (pid, epoch, frozenset({tp0}))
    listed = {t.transactional_id: t for t in cp.list_transactions(prefix="alt-describe-")}
    assert listed[tid].state is TxnState.ONGOING and listed[tid].producer_id == pid
    assert producer.producer is not None
    producer.producer.commit_transaction(30)
    # kfake lists only producers with an open transaction (Apache Kafka keeps it, offset -1).
    after = [p for p in cp.describe_producers([tp0])[tp0] if p.producer_id == pid]
    assert all(p.current_txn_start_offset is None for p in after)


def test_init_producer_id_fences(cp: ControlPlane, bootstrap: str, topic: str) -> None:
    """InitProducerId (22) without an identity aborts the open transaction and fences its epoch
    (kfake bumps it once; Apache Kafka twice)."""
    tid = unique("alt-fence")
    producer, pid, epoch = _open(bootstrap, topic, tid)
    identity = cp.fence(tid)
    assert identity.producer_id == pid and identity.epoch > epoch
    assert read_committed(bootstrap, topic) == []
    with pytest.raises(FencedKafkaError) as fenced:
        cp.end_transaction(tid, pid, epoch, commit=True)
    assert fenced.value.info.code == PRODUCER_FENCED
    producer.destroy()


def test_timeout_abort(cp: ControlPlane, bootstrap: str, topic: str) -> None:
    """The coordinator aborts a transaction older than its timeout and fences its epoch; the
    late commit is refused (PRODUCER_FENCED) and nothing becomes visible."""
    tid = unique("alt-timeout")
    producer, pid, epoch = _open(bootstrap, topic, tid, timeout_ms=1000)
    producer.destroy()
    started = time.monotonic()
    desc = wait_for(lambda: (d := cp.describe_transaction(tid)) and not d.state.in_flight and d,
                    15, interval_s=0.2, what="the coordinator's timeout abort")
    assert time.monotonic() - started < 10
    assert (desc.producer_id, desc.epoch) == (pid, epoch + 1)
    with pytest.raises(FencedKafkaError) as fenced:
        cp.end_transaction(tid, pid, epoch, commit=True)
    assert fenced.value.info.code == PRODUCER_FENCED
    assert read_committed(bootstrap, topic) == []


def test_anchorless_state_after_empty_is_outcome_unknown(cp: ControlPlane, bootstrap: str,
                                                         topic: str) -> None:
    """A stored Java-style "pid:epoch" state (no anchor) whose transaction committed: kfake's
    Empty does not say it committed, so recovery must not call it aborted (a heuristic abort
    would make the application re-publish committed records)."""
    tid = unique("alt-anchorless")
    state = prepare_open(bootstrap, topic, tid, ["x"], commit=True)
    bare = PreparedTxnState.parse(f"{state.producer_id}:{state.epoch}")
    assert bare.anchor is None
    with pytest.raises(OutcomeUnknownError, match="reports Empty"):
        complete(cp, {"bootstrap.servers": bootstrap}, tid, bare, timeout_s=10)
    # With its anchor, the same transaction reads as committed.
    assert complete(cp, {"bootstrap.servers": bootstrap}, tid, state,
                    timeout_s=10) is Outcome.ALREADY_COMMITTED


def test_anchorless_state_on_apache_kafka_is_already_committed(kafka: KafkaTarget) -> None:
    """The same anchor-less state on Apache Kafka: CompleteCommit at its (pid, epoch) says it
    committed, so the Empty guard above changes nothing there."""
    bootstrap = kafka.bootstrap_servers
    topic = create_topic(bootstrap, unique("alt-kafka"), partitions=1)
    tid = unique("alt-anchorless-kafka")
    state = prepare_open(bootstrap, topic, tid, ["x"], commit=True)
    bare = PreparedTxnState.parse(f"{state.producer_id}:{state.epoch}")
    with ControlPlane({"bootstrap.servers": bootstrap}, timeout_s=15) as plane:
        assert complete(plane, {"bootstrap.servers": bootstrap}, tid, bare,
                        timeout_s=10) is Outcome.ALREADY_COMMITTED


def test_broker_timeout_of_a_prepared_transaction_is_a_heuristic_abort(
        cp: ControlPlane, bootstrap: str, topic: str) -> None:
    """A prepared transaction the broker timed out reads as aborted at its anchor: completing
    it raises HeuristicAbortError (the records are lost, the application is told)."""
    tid = unique("alt-heuristic")
    state = prepare_open(bootstrap, topic, tid, ["h"], timeout_ms=1000)
    wait_for(lambda: (d := cp.describe_transaction(tid)) and d.epoch > state.epoch, 15,
             interval_s=0.2, what="the coordinator's timeout abort")
    with pytest.raises(HeuristicAbortError):
        complete(cp, {"bootstrap.servers": bootstrap}, tid, state, timeout_s=10)


# -- the participant end to end ------------------------------------------------------------------


def test_dev_up_flavour_kfake(kfake: LocalKfake, tmp_path: Path) -> None:
    """``dualwrite dev up --flavour kfake`` starts a detached broker that probe accepts and
    ``dev status`` shows; ``dev down`` stops it."""
    (tmp_path / "bin").mkdir()
    built = kfake_binary()
    shutil.copy2(built, tmp_path / "bin" / built.name)  # no second go build
    env = {**os.environ, "DUALWRITE_HOME": str(tmp_path)}
    cli = [sys.executable, "-m", "dualwrite.cli"]
    up = subprocess.run([*cli, "dev", "up", "--flavour", "kfake", "--topic", "t:2", "--json"],
                        capture_output=True, text=True, timeout=120, env=env)
    assert up.returncode == 0, up.stderr
    state = json.loads(up.stdout)
    try:
        assert state["flavour"] == "kfake" and state["topics"] == ["t"]
        probe = subprocess.run([*cli, "probe", "-b", state["bootstrap_servers"], "--json"],
                               capture_output=True, text=True, timeout=60)
        assert json.loads(probe.stdout)["supported"] is True
        status = subprocess.run([*cli, "dev", "status", "--json"], capture_output=True,
                                text=True, timeout=60, env=env)
        assert status.returncode == 0, status.stdout + status.stderr
        shown = json.loads(status.stdout)
        assert shown["running"] is True and shown["flavour"] == "kfake", shown
        assert shown["bootstrap_servers"] == state["bootstrap_servers"], shown
    finally:
        down = subprocess.run([*cli, "dev", "down"], capture_output=True, text=True,
                              timeout=60, env=env)
    assert down.returncode == 0 and "stopped the dev kfake broker" in down.stdout, down.stderr
    assert not pid_alive(int(state["pid"]))
    after = subprocess.run([*cli, "dev", "status"], capture_output=True, text=True, timeout=60,
                           env=env)
    assert after.returncode == 3 and "no dev cluster" in after.stdout, after.stdout



def test_crash_between_the_commits_finished_by_recover(bootstrap: str, pg_db_url: str,
                                                       tmp_path: Path) -> None:
    """crash_worker SIGKILLed after the database commit and after the prepare; ``dualwrite
    recover`` commits the first and aborts the second; rows and read_committed records agree."""
    loop = CrashLoop(pg_db_url, bootstrap, create_topic(bootstrap, unique("alt-crash"), 2),
                     tmp_path)
    loop.crash_round("after-db-commit", k=2)
    loop.crash_round("after-prepare", k=1)
    loop.run_worker(2)
    loop.check_invariant()
    assert dict(loop.outcomes) == {"after-db-commit: committed": 1, "after-prepare: aborted": 1}


# -- a broker without DescribeTransactions / ListTransactions is refused ------------------------


MISSING = "DescribeTransactions (API key 65); ListTransactions (API key 66)"


def test_probe_names_what_is_missing(kfake_28: LocalKfake) -> None:
    out = subprocess.run([sys.executable, "-m", "dualwrite.cli", "probe", "-b",
                          kfake_28.bootstrap_servers, "--timeout", "10", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["supported"] is False
    assert result["missing"] == ["DescribeTransactions (API key 65; broker 0)",
                                 "ListTransactions (API key 66; broker 0)"]


def test_writer_coordinator_and_recover_refuse(kfake_28: LocalKfake, tmp_path: Path) -> None:
    """DualWriter's first transaction, the Spark sink's BatchCoordinator and recover raise
    UnsupportedBrokerError naming the missing requests; nothing is written."""
    url = f"sqlite:///{tmp_path / 'alt.db'}"
    dualwrite.upgrade_database(url)
    engine = create_engine(url)
    config = {"bootstrap.servers": kfake_28.bootstrap_servers}
    writer = DualWriter(engine, config, transactional_id=unique("alt-refused"), timeout_s=10)
    with pytest.raises(UnsupportedBrokerError) as refused, writer.transaction():
        pass
    writer.close()
    assert MISSING in str(refused.value) and isinstance(refused.value, dualwrite.FatalError)
    with pytest.raises(UnsupportedBrokerError, match=re.escape(MISSING)):
        BatchCoordinator("alt-sink", engine, config, timeout_s=10)
    # recover: a state row to finish makes it talk to Kafka.
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO dualwrite_transaction_state (transactional_id, "
                             "prepared_txn_state, updated_at) VALUES ('alt-row', '', "
                             "CURRENT_TIMESTAMP)"))
    with pytest.raises(UnsupportedBrokerError, match=re.escape(MISSING)):
        dualwrite.recover(engine, config, timeout_s=10)
    out = subprocess.run([sys.executable, "-m", "dualwrite.cli", "recover", "-b",
                          kfake_28.bootstrap_servers, "--db", url, "--timeout", "10"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and MISSING in out.stderr, out.stderr
    engine.dispose()
