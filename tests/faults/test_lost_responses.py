"""Lost responses, cut connections and late EndTxn copies, through a loopback proxy.

A 1-broker cluster of this module's own advertises its EXTERNAL listener on a proxy's port
(``LocalKafkaCluster(proxied=True)``), so every client of the test reaches the broker only
through :class:`tests.support.tcp_proxy.TcpProxy`; the PostgreSQL server is reached through another
proxy. After each fault: read_committed records == committed rows, no duplicate, nothing left
Ongoing at the coordinator.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import dualwrite
from dualwrite import DualWriteError, DualWriter, OutcomeUnknownError, RetriableError
from dualwrite.cli import main as cli_main
from dualwrite.dev import LocalKafkaCluster
from dualwrite.dev.security import application_acls, write_properties_file
from dualwrite.participant import Outcome, TxnState
from dualwrite.participant.control_plane import ControlPlane
from dualwrite.writer import PhaseHooks
from dualwrite.writer.lease import Leases
from dualwrite.writer.state_store import StateStore
from tests.support.kafka import in_thread, read_committed, unique, wait_for
from tests.support.tables import ORDERS
from tests.support.tcp_proxy import TcpProxy, contains, kafka_api

END_TXN = 26
PRODUCE = 0

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def topic(cluster: LocalKafkaCluster) -> str:
    return cluster.create_topic(unique("lost"), 1, 1)


def _config(cluster: LocalKafkaCluster, **extra: Any) -> dict[str, Any]:
    """Through the proxy; short request timeouts so that a held request times out quickly."""
    return {"bootstrap.servers": cluster.external_bootstrap_servers, "socket.timeout.ms": 3000,
            **extra}




@contextlib.contextmanager
def _database_proxy(url: str) -> Iterator[tuple[TcpProxy, str]]:
    """A proxy in front of the database of ``url``, and the URL that goes through it."""
    parsed = sa.engine.make_url(url)
    assert parsed.port is not None
    with TcpProxy(parsed.port) as proxy:
        yield proxy, parsed.set(port=proxy.port).render_as_string(hide_password=False)


def _rows(url: str) -> list[str]:
    engine = dualwrite.create_engine(url)
    try:
        with engine.connect() as conn:
            return sorted(r[0] for r in conn.execute(sa.select(ORDERS.c.id)))
    finally:
        engine.dispose()


def _check_invariant(cluster: LocalKafkaCluster, url: str, topic: str, tids: list[str]) -> int:
    """recover, then: records == rows, no duplicate, nothing in flight. Returns the count."""
    report = dualwrite.recover(url, {"bootstrap.servers": cluster.bootstrap_servers},
                               timeout_s=20)
    assert report.ok, report.as_dict()
    records = [r.decode() for r in read_committed(cluster.bootstrap_servers, topic)]
    rows = _rows(url)
    assert len(records) == len(set(records)), f"duplicate records: {records}"
    assert records == rows
    with ControlPlane({"bootstrap.servers": cluster.bootstrap_servers}) as cp:
        for tid, desc in cp.describe_transactions(tids).items():
            assert not desc.state.in_flight, f"{tid} left {desc.state.value}"
    return len(rows)


def _write(writer: DualWriter, topic: str, key: str) -> None:
    with writer.transaction() as tx:
        tx.produce(topic, key.encode(), key=key)
        tx.connection.execute(sa.insert(ORDERS).values(id=key))


def _write_expecting_typed(writer: DualWriter, topic: str, key: str) -> str:
    """Write; what reached the caller: "ok" or the name of a typed dualwrite error."""
    try:
        _write(writer, topic, key)
    except (RetriableError, OutcomeUnknownError) as exc:
        return type(exc).__name__
    return "ok"


# -- the EndTxn response lost, or late ----------------------------------------------------------

def test_lost_endtxn_response_commits_exactly_once(cluster: LocalKafkaCluster, proxy: TcpProxy,
                                                   topic: str, pg_url: str) -> None:
    """The commit's EndTxn reaches the coordinator and its answer is lost (connection cut)."""
    tid = unique("lost-endtxn")
    with DualWriter(pg_url, _config(cluster), transactional_id=tid, timeout_s=15) as writer:
        _write(writer, topic, "a")
        dropped = proxy.drop_next_response(kafka_api(END_TXN))
        outcome = _write_expecting_typed(writer, topic, "b")
        assert dropped.wait(5)
        _write(writer, topic, "c")  # the writer goes on
    assert outcome in ("ok", "RetriableError", "OutcomeUnknownError")
    assert _check_invariant(cluster, pg_url, topic, [tid]) == 3


def test_coordinator_answering_late(cluster: LocalKafkaCluster, proxy: TcpProxy, topic: str,
                                    pg_url: str) -> None:
    """Every connection blackholed during the commit for longer than the request timeout (3 s),
    then released: the late answers and requests arrive after librdkafka's own retry."""
    tid = unique("late-endtxn")
    with DualWriter(pg_url, _config(cluster), transactional_id=tid, timeout_s=15) as writer:
        _write(writer, topic, "a")
        caught = proxy.hold_next_request(kafka_api(END_TXN))

        def release_later() -> None:
            caught.wait(10)
            time.sleep(4.5)
            proxy.release()

        releaser = threading.Thread(target=release_later, daemon=True)
        releaser.start()
        started = time.monotonic()
        outcome = _write_expecting_typed(writer, topic, "b")
        took = time.monotonic() - started
        releaser.join(15)
        _write(writer, topic, "c")
    print(f"late coordinator: outcome={outcome} in {took:.1f} s")
    assert outcome in ("ok", "RetriableError", "OutcomeUnknownError")
    assert _check_invariant(cluster, pg_url, topic, [tid]) == 3


# -- KAFKA-17754 inside one session ---------------------------------------------------------


def _with_t1_prepared(cluster: LocalKafkaCluster, tid: str,
                      topic: str) -> dualwrite.TwoPhaseProducer:
    """A producer through the proxy whose transaction T1 (one record, ``t1``) is prepared."""
    producer = dualwrite.TwoPhaseProducer(_config(cluster, **{"transactional.id": tid,
                                                              "linger.ms": 0}), timeout_s=15)
    producer.init_transactions()
    producer.begin_transaction()
    producer.produce(topic, b"t1")
    producer.prepare_transaction()
    return producer


def test_late_endtxn_copy_cannot_end_the_next_transaction(cluster: LocalKafkaCluster,
                                                          proxy: TcpProxy, topic: str) -> None:
    """T1's EndTxn(commit) is held on its connection; librdkafka times it out and sends it again
    on a new one (T1 commits); T2 begins; then the held copy arrives. On the TV1 path with one
    (producer id, epoch) per session it would commit T2 (measured before the fix: T2 visible
    before its commit, and its abort refused with INVALID_TXN_STATE). The producer now starts a
    new session after such a commit, so the late copy carries a stale epoch and is refused."""
    tid = unique("kafka-17754")
    producer = _with_t1_prepared(cluster, tid, topic)
    try:
        before = producer.identity
        held = proxy.hold_next_request(kafka_api(END_TXN))
        producer.commit_transaction()  # librdkafka re-sends EndTxn after socket.timeout.ms
        assert held.is_set()
        print(f"librdkafka {confluent_kafka.libversion()[0]}: T1 session {before}, after the "
              f"commit {producer.identity}")
        producer.begin_transaction()
        producer.produce(topic, b"t2")
        producer.flush_and_state()
        proxy.release()  # the first EndTxn(commit) of T1 reaches the coordinator now
        time.sleep(2.0)
        assert read_committed(cluster.bootstrap_servers, topic, 10) == [b"t1"], \
            "a late EndTxn of T1 committed T2 before T2's own commit (KAFKA-17754)"
        producer.abort_transaction()
        assert read_committed(cluster.bootstrap_servers, topic, 10) == [b"t1"]
    finally:
        producer.close()


def test_late_abort_copy_cannot_end_the_next_transaction(cluster: LocalKafkaCluster,
                                                         proxy: TcpProxy, topic: str) -> None:
    """The same shape for an abort: T1's EndTxn(abort) is held, librdkafka sends it again (T1
    aborts), T2 begins and prepares; the held copy would abort T2 under the same (producer id,
    epoch), and T2's records would be lost after the database decided them. The producer starts
    a new session after such an abort too, so T2 commits."""
    tid = unique("abort-17754")
    producer = _with_t1_prepared(cluster, tid, topic)
    try:
        before = producer.identity
        held = proxy.hold_next_request(kafka_api(END_TXN))
        producer.abort_transaction()  # librdkafka re-sends EndTxn after socket.timeout.ms
        assert held.is_set()
        after = producer.identity
        producer.begin_transaction()
        producer.produce(topic, b"t2")
        producer.prepare_transaction()
        proxy.release()  # the first EndTxn(abort) of T1 reaches the coordinator now
        time.sleep(2.0)
        producer.commit_transaction()
        assert read_committed(cluster.bootstrap_servers, topic, 10) == [b"t2"]
        assert before is not None and after is not None and after.epoch != before.epoch
    finally:
        producer.close()


def test_an_abort_after_unacknowledged_records_starts_a_new_session(
        cluster: LocalKafkaCluster, proxy: TcpProxy, topic: str) -> None:
    """T1's Produce is held on its connection, so its flush times out with the record
    unacknowledged (the fault suite's "records not delivered" under a broker kill). Reusing the
    session after aborting T1 lost a record of a later transaction in a fault run; the abort now
    starts a new session, and the held Produce, released into it, is refused by the epoch."""
    tid = unique("unacked")
    # The flush gives up (2 s) before librdkafka's socket timeout (3 s) would resend the Produce.
    producer = dualwrite.TwoPhaseProducer(_config(cluster, **{"transactional.id": tid,
                                                              "linger.ms": 0}), timeout_s=2)
    try:
        producer.init_transactions()
        before = producer.identity
        held = proxy.hold_next_request(kafka_api(PRODUCE))
        producer.begin_transaction()
        producer.produce(topic, b"t1")
        with pytest.raises(RetriableError, match="not delivered"):
            producer.flush_and_state()
        assert held.is_set()
        producer.abort_transaction()
        after = producer.identity
        proxy.release()  # T1's Produce reaches the broker now
        producer.begin_transaction()
        producer.produce(topic, b"t2")
        producer.prepare_transaction()
        producer.commit_transaction()
        assert before is not None and after is not None and after.epoch != before.epoch
        assert read_committed(cluster.bootstrap_servers, topic, 10) == [b"t2"]
    finally:
        producer.close()


class _Resends(PhaseHooks):
    def __init__(self) -> None:
        self.records: list[int] = []

    def resending(self, records: int) -> None:
        self.records.append(records)


def test_a_stalled_flush_is_sent_again_in_a_new_session(
        cluster: LocalKafkaCluster, proxy: TcpProxy, topic: str, pg_url: str) -> None:
    """The Produce of a DualWriter transaction is held on its connection, longer than half the
    writer's timeout and shorter than librdkafka's request timeout (it would wait 30 s): the
    writer aborts by a new session and sends the records again, and the transaction commits
    without an error reaching the application. The held Produce, released, is refused."""
    tid = unique("stalled")
    hooks = _Resends()
    conf = _config(cluster, **{"socket.timeout.ms": 30000, "linger.ms": 0})
    with DualWriter(pg_url, conf, transactional_id=tid, timeout_s=8, hooks=hooks) as writer:
        _write(writer, topic, "a")
        held = proxy.hold_next_request(kafka_api(PRODUCE))
        started = time.monotonic()
        with writer.transaction() as tx:
            tx.produce(topic, b"b1", key="b1")
            tx.produce(topic, b"b2", key="b2")
            tx.connection.execute(sa.insert(ORDERS), [{"id": "b1"}, {"id": "b2"}])
        took = time.monotonic() - started
        assert held.is_set()
        proxy.release()  # the first session's Produce reaches the broker now
        _write(writer, topic, "c")
    print(f"stalled flush: committed in {took:.1f} s, resent {hooks.records}")
    assert hooks.records == [2]
    assert took < 8 + 8, "the transaction outlived the writer's timeout and the new session"
    assert _check_invariant(cluster, pg_url, topic, [tid]) == 4


def _prepared_then_crashed(cluster: LocalKafkaCluster, topic: str, tid: str
                           ) -> tuple[dict[str, Any], dualwrite.PreparedTxnState]:
    """A producer's configuration and the state of its transaction ("t1"), prepared, then
    left open as a crash between the two commits leaves it."""
    conf = _config(cluster, **{"transactional.id": tid, "linger.ms": 0})
    first = dualwrite.TwoPhaseProducer(conf, timeout_s=15)
    first.init_transactions()
    first.begin_transaction()
    first.produce(topic, b"t1")
    state = first.prepare_transaction()
    first.close()
    return conf, state


def test_late_control_plane_endtxn_cannot_end_the_next_transaction(
        cluster: LocalKafkaCluster, proxy: TcpProxy, topic: str) -> None:
    """Completing a prepared transaction by (producer id, epoch) through the control plane: the
    first EndTxn(commit) is held until it times out, the retry commits; the session then starts
    (InitProducerId bumps the epoch) and T2 begins; the held copy arrives and is fenced."""
    tid = unique("cp-17754")
    conf, state = _prepared_then_crashed(cluster, topic, tid)
    second = dualwrite.TwoPhaseProducer(conf, timeout_s=4)
    try:
        second.init_transactions(keep_prepared_txn=True)
        held = proxy.hold_next_request(kafka_api(END_TXN))
        with pytest.raises(DualWriteError) as failed:
            second.complete_transaction(state)
        assert held.is_set()
        print(f"held control-plane EndTxn: {type(failed.value).__name__}")
        second.complete_transaction(state)  # asked again: committed by the retry
        assert second.identity is not None and second.identity.epoch > state.epoch
        second.begin_transaction()
        second.produce(topic, b"t2")
        second.flush_and_state()
        proxy.release()
        time.sleep(2.0)
        assert read_committed(cluster.bootstrap_servers, topic, 10) == [b"t1"]
        second.abort_transaction()
        assert read_committed(cluster.bootstrap_servers, topic, 10) == [b"t1"]
    finally:
        second.close()


def test_a_control_plane_endtxn_whose_answer_is_lost_is_asked_about(
        cluster: LocalKafkaCluster, proxy: TcpProxy, topic: str) -> None:
    """Completing a prepared transaction by (producer id, epoch): the EndTxn(commit) is applied
    and its answer lost with the connection. The coordinator is asked again; the transaction is
    no longer open and its anchor is committed, so the completion succeeds (fault suite, CI at
    9ed9cb2: a restarted writer's start raised OutcomeUnknownError here)."""
    tid = unique("cp-lost-answer")
    conf, state = _prepared_then_crashed(cluster, topic, tid)
    second = dualwrite.TwoPhaseProducer(conf, timeout_s=15)
    try:
        second.init_transactions(keep_prepared_txn=True)
        dropped = proxy.drop_next_response(kafka_api(END_TXN))
        outcome = second.complete_transaction(state)
        assert dropped.is_set()
        assert outcome is Outcome.ALREADY_COMMITTED, outcome
        second.begin_transaction()
        second.produce(topic, b"t2")
        second.prepare_transaction()
        second.commit_transaction()
    finally:
        second.close()
    assert read_committed(cluster.bootstrap_servers, topic, 10) == [b"t1", b"t2"]


def test_late_recovery_endtxn_cannot_end_a_lock_first_writers_next_transaction(
        cluster: LocalKafkaCluster, proxy: TcpProxy, topic: str, pg_url: str) -> None:
    """A writer that locks first (another process holds its id's lease) is between its two
    commits of t1; the lease is freed and recovery commits t1 by (producer id, epoch), but its
    EndTxn is held on its connection and recovery gives up (no answer). The writer commits t1
    itself; its next lock shows recovery's claim. Before: it claimed again and began t2 in the
    same session, and the held EndTxn, delivered then, committed t2 before its decision (t2
    visible, its rows rolled back). Now a claim by another process starts a new session, and
    the held request carries a stale epoch."""
    tid = unique("lock-first-late")
    engine = dualwrite.create_engine(pg_url)
    leases = Leases(engine)
    holder = engine.connect()
    other = leases.try_acquire(holder, tid)  # someone else's lease: the writer locks first
    holder.commit()
    assert other is not None
    at_gate, gate = threading.Event(), threading.Event()
    # take_over: a writer may not start on an id whose lease another live process holds,
    # unless told to (it then fences that process and locks first, the path under test).
    writer = DualWriter(pg_url, _config(cluster, **{"linger.ms": 0}), transactional_id=tid,
                        timeout_s=15, take_over=True)
    try:
        _write(writer, topic, "t0")
        real_commit = writer.producer.commit_transaction
        before = writer.producer.identity

        def gated_commit() -> None:
            if not gate.is_set():
                at_gate.set()
                gate.wait(30)
            real_commit()

        writer.producer.commit_transaction = gated_commit  # type: ignore[method-assign]
        thread, errors = in_thread(_write, writer, topic, "t1")
        assert at_gate.wait(20)
        other.release()  # the lease is free: recovery takes it
        held = proxy.hold_next_request(kafka_api(END_TXN))
        report = dualwrite.recover(
            pg_url, {"bootstrap.servers": cluster.external_bootstrap_servers}, [tid],
            timeout_s=5)
        assert held.is_set() and not report.ok, report.as_dict()
        gate.set()
        thread.join(30)
        assert not thread.is_alive() and errors == []
        seen: list[bytes] = []
        with pytest.raises(ZeroDivisionError), writer.transaction() as tx:
            tx.produce(topic, b"t2", key="t2")
            tx.connection.execute(sa.insert(ORDERS).values(id="t2"))
            with ControlPlane({"bootstrap.servers": cluster.bootstrap_servers}) as cp:
                wait_for(lambda: _open_in_the_log(cp, tid), 10, what="t2 in the log")
            proxy.release()  # recovery's EndTxn(commit) of t1 reaches the coordinator now
            time.sleep(2.0)
            seen = read_committed(cluster.bootstrap_servers, topic, 10)
            _ = 1 / 0  # the block fails: t2 must not be visible
        after = writer.producer.identity
    finally:
        writer.close()
        holder.close()
        engine.dispose()
    assert seen == [b"t0", b"t1"], "recovery's late EndTxn committed t2 before its decision"
    assert before is not None and after is not None and after.epoch != before.epoch
    assert _check_invariant(cluster, pg_url, topic, [tid]) == 2


def _open_in_the_log(cp: ControlPlane, tid: str) -> bool:
    """The open transaction of ``tid`` has a record in a partition's log."""
    desc = cp.describe_transaction(tid)
    if desc is None or desc.state is not TxnState.ONGOING or not desc.partitions:
        return False
    return any(p.producer_id == desc.producer_id and p.current_txn_start_offset is not None
               for ps in cp.describe_producers(desc.partitions).values() for p in ps)


# -- the database connection cut during COMMIT ------------------------------------------------

def test_database_connection_cut_during_commit(cluster: LocalKafkaCluster, proxy: TcpProxy,
                                               topic: str, pg_url: str) -> None:
    """The writer reaches PostgreSQL through a proxy that forwards COMMIT and cuts the
    connection before its answer: the outcome is asked of the database (txid_status)."""
    with _database_proxy(pg_url) as (pg_proxy, through):
        tid = unique("pg-cut")
        outcomes = []
        with DualWriter(through, _config(cluster), transactional_id=tid, timeout_s=15) as writer:
            _write(writer, topic, "a")
            for key in ("b", "c"):
                cut = pg_proxy.drop_next_response(contains(b"COMMIT"))
                outcomes.append(_write_expecting_typed(writer, topic, key))
                assert cut.wait(5)
            _write(writer, topic, "d")
    print(f"database COMMIT cut: {outcomes}")
    assert all(o in ("ok", "DatabaseUnreachableError", "OutcomeUnknownError") for o in outcomes)
    assert _check_invariant(cluster, pg_url, topic, [tid]) >= 2


def test_commit_outcome_asked_until_the_database_answers(cluster: LocalKafkaCluster,
                                                         proxy: TcpProxy, topic: str,
                                                         pg_url: str) -> None:
    """The COMMIT's answer is lost and new database connections are refused for 3 s (a server
    restarting): the writer keeps asking within its timeout and finishes the transaction instead
    of reporting "database unreachable, retry" for a COMMIT that did apply."""
    with _database_proxy(pg_url) as (pg_proxy, through):
        # No pool: every question about the outcome needs a new connection.
        engine = dualwrite.create_engine(through, poolclass=sa.pool.NullPool)
        tid = unique("pg-ask")
        try:
            with DualWriter(engine, _config(cluster), transactional_id=tid,
                            timeout_s=15) as writer:
                _write(writer, topic, "a")
                cut = pg_proxy.drop_next_response(contains(b"COMMIT"))
                with writer.transaction() as tx:
                    tx.produce(topic, b"b", key="b")
                    tx.connection.execute(sa.insert(ORDERS).values(id="b"))
                    pg_proxy.refuse(True)
                    threading.Timer(3.0, pg_proxy.refuse, args=(False,)).start()
                assert cut.is_set()
                _write(writer, topic, "c")
        finally:
            engine.dispose()
    assert _rows(pg_url) == ["a", "b", "c"]
    assert _check_invariant(cluster, pg_url, topic, [tid]) == 3


# -- `dualwrite recover`: a fatal error is not "unresolved, retry" ------------------------------

def test_recover_exits_with_the_error_code_on_a_fatal_failure(
        tmp_path: Path, kafka_secured: LocalKafkaCluster) -> None:
    """An id whose recovery fails with a FatalError (WRITE on its transactional id missing):
    exit 1 ("an error ... the message says what to do"), not 5 ("unresolved, retry")."""
    topic = kafka_secured.create_topic(unique("fatal"), 1, 1)
    prefix = unique("fatal")
    user = kafka_secured.add_scram_user(prefix)
    acls = application_acls(user.principal, topics=[topic], transactional_id_prefix="other-")
    kafka_secured.create_acls(acls)
    kafka_secured.wait_for_authentication(kafka_secured.client_config(user))
    properties = write_properties_file(tmp_path / "client.properties",
                                       kafka_secured.client_config(user), "test principal")
    url = f"sqlite:///{tmp_path / 'fatal.db'}"
    dualwrite.upgrade_database(url)
    engine = dualwrite.create_engine(url)
    StateStore(engine).claim([f"{prefix}-w"])
    engine.dispose()
    result = CliRunner().invoke(cli_main, ["recover", "--db", url, "--kafka-properties",
                                           str(properties), "--timeout", "10"])
    assert "Traceback" not in result.output
    assert "Missing ACL" in result.output, result.output
    assert result.exit_code == 1, result.output
