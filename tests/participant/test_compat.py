"""The compatibility tier: the broker behaviours dualwrite relies on, and the participant end to
end, on every supported Apache Kafka release line besides the default (4.3.1 runs the full suite).

One broker per version (``conftest.COMPAT_VERSIONS``), started once for that version's tests and
stopped before the next version's starts: ``compat`` is module-scoped and parametrized, so pytest
runs the tests version by version. The tests are the suite's own functions, imported from their
modules and run here on this module's ``bootstrap`` / ``topic`` / ``cp`` fixtures:

- EndTxn by (producer id, epoch) from another connection, at v4 (the control plane,
  kafka-python) after librdkafka's EndTxn ≤ v1; commit, abort, idempotent re-commit,
  INVALID_TXN_STATE, INVALID_PRODUCER_ID_MAPPING, PRODUCER_FENCED;
- DescribeProducers' CurrentTxnStartOffset, DescribeTransactions, ListTransactions with a prefix
  (a broker-side pattern from ListTransactions v2, Kafka 4.1; a client-side filter before);
- the coordinator's timeout abort (reported as HeuristicAbortError), InitProducerId fencing;
- a DualWriter transaction, a SIGKILL between the database and the Kafka commit finished by
  ``dualwrite recover``, the anchor check, a Spark sink run (on the oldest version; on all with
  ``--compat-full``), and (``--compat-full``) the stalled-flush resend.

The quick form runs in CI; ``pytest --compat-full`` adds the rest (marked ``compat_full``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ParamSpec

import pytest
import sqlalchemy as sa

from dualwrite import create_engine
from dualwrite.dev import LocalKafkaCluster
from dualwrite.dev.maven import major_version
from dualwrite.participant import ControlPlane, TxnState
from dualwrite.participant._kafka_python_seam import KafkaLink
from tests.faults import test_lost_responses as lost
from tests.participant import test_anchor_checks as anchors
from tests.participant import test_broker_facts as facts
from tests.participant import test_control_plane as control
from tests.participant import test_kafka_python_seam as seam_tests
from tests.support.crash_loop import CrashLoop
from tests.support.kafka import TxnProducer, create_topic, unique
from tests.support.settings import BACKEND, COMPAT_VERSIONS
from tests.support.tables import add_value_table
from tests.support.tcp_proxy import TcpProxy
from tests.writer import test_recipe as recipe

P = ParamSpec("P")


def _full_only(test: Callable[P, None]) -> Callable[P, None]:
    """A copy of ``test`` marked ``compat_full`` (marking the original would mark it in its own
    module too)."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        test(*args, **kwargs)

    marked: Callable[P, None] = pytest.mark.compat_full(run)
    return marked


# The suite's own tests, collected again here and run on this module's fixtures. The quick form
# keeps at least one test per broker behaviour; the others (_full_only) run with --compat-full.
F = _full_only
# EndTxn v4 by (pid, epoch) from another connection: commit, re-commit, abort after commit ...
test_another_process_commits_a_killed_producers_transaction = (
    facts.test_another_process_commits_a_killed_producers_transaction)
test_end_txn_request_at_v4_ends_another_producers_transaction = (
    seam_tests.test_end_txn_request_at_v4_ends_another_producers_transaction)
test_end_transaction = F(control.test_end_transaction)
test_end_transaction_after_an_abort = F(facts.test_end_transaction_after_an_abort)
test_end_transaction_on_an_empty_transactional_id = (
    F(facts.test_end_transaction_on_an_empty_transactional_id))
test_sigkilled_producer_leaves_transaction_ongoing = (
    F(facts.test_sigkilled_producer_leaves_transaction_ongoing))
# ... INVALID_PRODUCER_ID_MAPPING and PRODUCER_FENCED.
test_end_transaction_with_wrong_identity = facts.test_end_transaction_with_wrong_identity
# DescribeProducers' CurrentTxnStartOffset (the anchor), DescribeTransactions, ListTransactions.
test_pid_epoch_repeat_across_transactions_offsets_do_not = (
    facts.test_pid_epoch_repeat_across_transactions_offsets_do_not)
test_describe_producers = F(control.test_describe_producers)
test_describe_ongoing_transaction = control.test_describe_ongoing_transaction
test_list_transactions_prefix_and_state = F(control.test_list_transactions_prefix_and_state)
test_probe = control.test_probe
# The coordinator's timeout abort (seen by the writer as HeuristicAbortError).
test_heuristic_abort_stops_writer_without_hook = (
    recipe.test_heuristic_abort_stops_writer_without_hook)
test_timed_out_transaction_is_aborted_and_fenced = (
    F(facts.test_timed_out_transaction_is_aborted_and_fenced))
# InitProducerId fencing (recovery's fence, and librdkafka's init_transactions()).
test_fence = control.test_fence
test_init_producer_id_request_without_version_fences = (
    seam_tests.test_init_producer_id_request_without_version_fences)
test_init_transactions_aborts_the_ongoing_transaction = (
    F(facts.test_init_transactions_aborts_the_ongoing_transaction))
# The recipe and the anchor check.
test_happy_path_rows_equal_records = recipe.test_happy_path_rows_equal_records
test_committed_transaction_reads_as_committed = (
    anchors.test_committed_transaction_reads_as_committed)
test_aborted_transaction_still_reads_as_aborted = (
    F(anchors.test_aborted_transaction_still_reads_as_aborted))

pytestmark = pytest.mark.timeout(180)


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2])


@pytest.fixture(scope="module", params=COMPAT_VERSIONS, ids=[f"kafka-{v}" for v in COMPAT_VERSIONS])
def compat(request: pytest.FixtureRequest) -> Iterator[tuple[LocalKafkaCluster, TcpProxy]]:
    """One broker of this version (jars backend, with a proxied listener for the stall test)
    and the proxy in front of it; pytest stops it before the next version's starts."""
    if BACKEND == "docker":
        pytest.skip("the compatibility tier starts its brokers from Maven Central jars")
    version = str(request.param)
    cluster = LocalKafkaCluster(brokers=1, kafka_version=version, backend="jars", proxied=True)
    with cluster, TcpProxy(cluster.external_ports[0], port=cluster.proxy_ports[0],
                           kafka_framing=True) as proxy:
        yield cluster, proxy


@pytest.fixture
def cluster(compat: tuple[LocalKafkaCluster, TcpProxy]) -> LocalKafkaCluster:
    return compat[0]


@pytest.fixture
def version(cluster: LocalKafkaCluster) -> str:
    return cluster.kafka_version


@pytest.fixture
def proxy(compat: tuple[LocalKafkaCluster, TcpProxy]) -> Iterator[TcpProxy]:
    _, p = compat
    yield p
    p.disarm()
    p.refuse(False)
    p.release()


@pytest.fixture
def bootstrap(cluster: LocalKafkaCluster) -> str:
    return cluster.bootstrap_servers


@pytest.fixture
def topic(bootstrap: str) -> str:
    return create_topic(bootstrap, unique("compat"), partitions=3)


@pytest.fixture
def db_url(db_url: str) -> str:
    """dualwrite's tables and the recipe tests' table ``app_rows``."""
    return add_value_table(db_url, "app_rows")


@pytest.fixture
def link(bootstrap: str) -> Iterator[KafkaLink]:
    link = KafkaLink(bootstrap_servers=bootstrap, request_timeout_ms=15_000,
                     bootstrap_timeout_ms=15_000, reconnect_backoff_max_ms=1000)
    try:
        yield link
    finally:
        link.close()


@pytest.fixture
def is_kafka4(version: str) -> bool:
    """test_probe's switch: Kafka 4.x finalizes transaction.version 2 on a fresh cluster."""
    return major_version(version) >= 4


@pytest.fixture
def has_2pc_config(version: str) -> bool:
    """``transaction.two.phase.commit.enable`` exists from Kafka 4.1 (4.0 does not know it)."""
    return _version_key(version) >= (4, 1)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """The recipe tests run on SQLite here (PostgreSQL runs the crash test)."""
    return str(getattr(request, "param", "sqlite"))


# -- what differs between versions --------------------------------------------------------------


def test_list_transactions_pattern_only_from_41(link: KafkaLink, cp: ControlPlane,
                                                bootstrap: str, topic: str, version: str) -> None:
    """ListTransactions v2 (a transactional-id regex, KIP-1152) exists from Kafka 4.1; before it
    ``list_transactions(prefix=...)`` must not send a pattern (kafka-python refuses one below v2)
    and still return only the prefix's ids, filtered on the client."""
    link.run(link.bootstrap, 15_000)
    expected = 2 if _version_key(version) >= (4, 1) else 1
    assert link.max_version(66) == expected
    prefix = unique("compat-pattern") + "-"
    mine = TxnProducer(bootstrap, prefix + "a").start()
    other = TxnProducer(bootstrap, unique("compat-other")).start()
    for p in (mine, other):
        assert p.producer is not None
        p.producer.begin_transaction()
        p.send(topic, [b"x"])
    listed = cp.list_transactions(prefix=prefix, states=[TxnState.ONGOING])
    assert [t.transactional_id for t in listed] == [prefix + "a"]
    everything = {t.transactional_id for t in cp.list_transactions(states=[TxnState.ONGOING])}
    assert {prefix + "a", other.transactional_id} <= everything
    for p in (mine, other):
        assert p.producer is not None
        p.producer.abort_transaction(30)
        p.destroy()


def test_transaction_version_and_endtxn_range(link: KafkaLink, cp: ControlPlane,
                                              version: str) -> None:
    """What each version offers the requests dualwrite sends: EndTxn v5 (TV2) from 4.0, where a
    fresh cluster finalizes transaction.version 2; dualwrite caps EndTxn at v4 everywhere."""
    link.run(link.bootstrap, 15_000)
    probe = cp.probe(check_2pc=False)
    four = major_version(version) >= 4
    assert link.max_version(26) == (5 if four else 4)
    assert probe.transaction_version == (2 if four else 0)
    assert probe.init_producer_id_max_version == 5
    for api in (61, 65):  # DescribeProducers, DescribeTransactions
        assert link.max_version(api) == 0


# -- the participant end to end -----------------------------------------------------------------


@pytest.mark.timeout(300)
def test_crash_between_the_commits_finished_by_recover(cluster: LocalKafkaCluster,
                                                       pg_db_url: str, tmp_path: Path) -> None:
    """crash_worker SIGKILLed after the database commit, and after the prepare (before the
    decision); ``dualwrite recover --json`` commits the first and aborts the second; a new worker
    goes on; rows and read_committed records agree."""
    loop = CrashLoop(pg_db_url, cluster.bootstrap_servers,
                     create_topic(cluster.bootstrap_servers, unique("compat-crash"), 3), tmp_path)
    loop.crash_round("after-db-commit", k=2)
    loop.crash_round("after-prepare", k=1)
    loop.run_worker(2)
    loop.check_invariant()
    assert dict(loop.outcomes) == {"after-db-commit: committed": 1, "after-prepare: aborted": 1}


@pytest.mark.compat_full
@pytest.mark.timeout(300)
def test_stalled_flush_resend(cluster: LocalKafkaCluster, proxy: TcpProxy, pg_url: str) -> None:
    """test_lost_responses' stalled Produce (resent in a new session) on this version."""
    lost.test_a_stalled_flush_is_sent_again_in_a_new_session(
        cluster, proxy, cluster.create_topic(unique("compat-stall"), 1, 1), pg_url)


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_spark_sink_smoke(cluster: LocalKafkaCluster, empty_db_url: str, tmp_path: Path,
                          version: str, request: pytest.FixtureRequest) -> None:
    """tests/spark/test_sink.py's happy path (every batch once in Kafka and the table; the sink's
    pooled ids are found by ListTransactions with a prefix). 20-31 s per version here, as much as
    the rest of a version's quick form: the quick form runs it on the oldest version only."""
    if version != COMPAT_VERSIONS[0] and not request.config.getoption("--compat-full"):
        pytest.skip("the Spark smoke runs on the oldest version only; --compat-full for all")
    helpers = pytest.importorskip("tests.support.spark", reason="the Spark sink needs pyspark")
    source = tmp_path / "source"
    source.mkdir()
    for f in range(helpers.FILES):
        helpers.write_source_file(source, f, helpers.EVENTS_PER_FILE, mtime=1_700_000_000 + f)
    engine = create_engine(empty_db_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE events (event_id BIGINT PRIMARY KEY, payload TEXT)"))
    engine.dispose()
    pipeline = helpers.Pipeline(
        cluster.bootstrap_servers, empty_db_url,
        create_topic(cluster.bootstrap_servers, unique("compat-spark"), partitions=4),
        unique("sink"), source, tmp_path / "checkpoint")
    result = pipeline.run()
    assert helpers.batches(result.stdout, "committed") == list(range(helpers.FILES))
    pipeline.assert_exactly_once()
