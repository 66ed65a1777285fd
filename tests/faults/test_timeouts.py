"""``timeout_s`` bounds every call (issue 23 §3, issue 22 hole 5), measured in wall time.

Kafka gone (nothing listening, a broker SIGKILLed or SIGSTOPped under a live writer), the
database gone (server stopped; a half-open connection: a proxy that forwards nothing, or forwards
the request and never the answer, during the row lock and during the COMMIT), or both: each call
returns within ``timeout_s + MARGIN_S`` (dualwrite.deadline; README "Timeouts and what they
trade") with the typed error that names what was unreachable (bootstrap servers, database
host:port; never a password). Afterwards recovery leaves rows == read_committed records and
nothing open. The brokers and the PostgreSQL server that are killed here are this module's own.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite import (
    BrokerUnreachableError,
    DatabaseUnreachableError,
    DualWriter,
    FatalError,
    OutcomeUnknownError,
)
from dualwrite.database import transaction
from dualwrite.deadline import MARGIN_S, deadline_scope
from dualwrite.dev import DevClusterError, LocalKafkaCluster, LocalPostgres
from dualwrite.participant.control_plane import ControlPlane, TxnState
from dualwrite.participant.identifiers import TopicPartition
from dualwrite.recovery.report import Condition
from tests.support.db import fresh_schema, pg_ctl, private_postgres
from tests.support.kafka import closed_port, read_committed, unique
from tests.support.settings import KAFKA_VERSION
from tests.support.tcp_proxy import TcpProxy, contains

pytestmark = pytest.mark.timeout(240)

TIMEOUT_S = 6.0
BOUND_S = TIMEOUT_S + MARGIN_S
ROWS = sa.Table("timeout_rows", sa.MetaData(), sa.Column("id", sa.String(64), primary_key=True))


# -- servers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalKafkaCluster]:
    """A 1-broker cluster of this module's own: its broker is killed and paused."""
    with LocalKafkaCluster(brokers=1, kafka_version=KAFKA_VERSION, backend="jars") as c:
        yield c


@pytest.fixture
def kafka(cluster: LocalKafkaCluster) -> LocalKafkaCluster:
    """The module's cluster, its broker running (restarted or resumed after a test)."""
    if not cluster.is_running(0):
        cluster.restart_broker(0)
    cluster.wait_until_ready(60.0)
    return cluster


def _schema_url(base: str) -> Iterator[str]:
    """A fresh schema on the database of ``base`` with dualwrite's tables and ROWS."""
    with fresh_schema(base, "dw_tmo", quiet_drop=True) as text:
        dualwrite.upgrade_database(text)
        engine = dualwrite.create_engine(text)
        ROWS.create(engine)
        engine.dispose()
        yield text


@pytest.fixture
def pg_url(postgres_url: str) -> Iterator[str]:
    yield from _schema_url(postgres_url)


@pytest.fixture
def pg_proxy(pg_url: str) -> Iterator[tuple[TcpProxy, str]]:
    """A proxy in front of the database, and the URL that goes through it."""
    parsed = sa.engine.make_url(pg_url)
    assert parsed.port is not None
    with TcpProxy(parsed.port) as proxy:
        yield proxy, parsed.set(port=proxy.port).render_as_string(hide_password=False)


@pytest.fixture
def private_pg() -> Iterator[LocalPostgres]:
    """A PostgreSQL server of this test's own (it is stopped)."""
    with private_postgres(stop_mode="immediate") as pg:
        yield pg


@pytest.fixture
def writers() -> Iterator[Callable[..., DualWriter]]:
    """``make(url, bootstrap, tid=None)``: a DualWriter with timeout_s=TIMEOUT_S, closed at the
    end of the test."""
    made: list[DualWriter] = []

    def make(url: str, bootstrap: str, tid: str | None = None) -> DualWriter:
        writer = DualWriter(url, {"bootstrap.servers": bootstrap,
                                  "transaction.timeout.ms": 120_000},
                            transactional_id=tid or unique("tmo"), timeout_s=TIMEOUT_S)
        made.append(writer)
        return writer

    yield make
    for writer in made:
        with contextlib.suppress(Exception):
            writer.close()


# -- helpers ----------------------------------------------------------------------------------


def _write(writer: DualWriter, topic: str, key: str) -> None:
    with writer.transaction() as tx:
        tx.connection.execute(ROWS.insert().values(id=key))
        tx.produce(topic, key.encode(), key=key)


def _write_late(writer: DualWriter, topic: str, key: str) -> None:
    """The record first (a leased writer takes its row lock then), then the row."""
    with writer.transaction() as tx:
        tx.produce(topic, key.encode(), key=key)
        tx.connection.execute(ROWS.insert().values(id=key))


def _timed(call: Callable[[], object], expected: type[Exception], names: str) -> float:
    """Run ``call``: it raises exactly ``expected``, naming ``names``, within BOUND_S."""
    started = time.monotonic()
    with pytest.raises(expected) as failed:
        call()
    elapsed = time.monotonic() - started
    assert elapsed <= BOUND_S, f"{elapsed:.1f} s > {BOUND_S} s: {failed.value!r}"
    assert type(failed.value) is expected, repr(failed.value)
    assert names in str(failed.value), str(failed.value)
    return elapsed


def _host_port(url: str) -> str:
    parsed = sa.engine.make_url(url)
    return f"{parsed.host}:{parsed.port}"


def _rows(url: str) -> list[str]:
    engine = dualwrite.create_engine(url)
    try:
        with engine.connect() as conn:
            return sorted(r[0] for r in conn.execute(sa.select(ROWS.c.id)))
    finally:
        engine.dispose()


def _settled(url: str, bootstrap: str, topic: str, tids: list[str]
             ) -> tuple[list[str], dualwrite.RecoveryReport]:
    """recover, then rows == read_committed records, nothing open; returns the rows and the
    recovery report.

    Recovery is run again while it says so (up to a minute): after a SIGKILL the restarted
    coordinator completes the markers of a commit it had accepted before dying, and until then
    the anchor of that transaction is not readable with read_committed.
    """
    deadline = time.monotonic() + 60
    while True:
        report = dualwrite.recover(url, {"bootstrap.servers": bootstrap}, timeout_s=20)
        if report.ok or time.monotonic() > deadline:
            break
    assert report.ok, report.as_dict()
    records = sorted(r.decode() for r in read_committed(bootstrap, topic))
    rows = _rows(url)
    assert records == rows
    with ControlPlane({"bootstrap.servers": bootstrap}) as cp:
        for tid, desc in cp.describe_transactions(tids).items():
            assert not desc.state.in_flight, f"{tid} left {desc.state.value}"
    return rows, report


# -- Kafka gone -------------------------------------------------------------------------------


def test_kafka_absent_before_start(writers: Any, pg_url: str) -> None:
    """Nothing listens at the bootstrap address: the first transaction, recover and status."""
    bootstrap = f"127.0.0.1:{closed_port()}"
    writer = writers(pg_url, bootstrap)
    _timed(lambda: _write(writer, "t", "a"), BrokerUnreachableError, bootstrap)
    config = {"bootstrap.servers": bootstrap}
    _timed(lambda: dualwrite.recover(pg_url, config, timeout_s=TIMEOUT_S),
           BrokerUnreachableError, bootstrap)
    _timed(lambda: dualwrite.status(pg_url, config, timeout_s=TIMEOUT_S),
           BrokerUnreachableError, bootstrap)
    assert _rows(pg_url) == []


def _rejoined(kafka: LocalKafkaCluster, fault: str) -> None:
    """Wait for the broker to rejoin the metadata; a resumed broker that does not within a
    minute is killed and started again, with a warning. Twice in CI (late 2026, in this
    test and test_both_gone_under_a_live_writer) a resumed 4.3.1 broker was unfenced and
    loaded its transaction coordinator, yet a new client's metadata requests failed with a
    transport failure for the whole minute: Kafka's doing (or the machine's), not dualwrite's,
    and recovery after a restart proves the same invariant."""
    try:
        kafka.wait_until_ready(60.0)
    except DevClusterError as exc:
        if fault != "SIGSTOP":
            raise
        warnings.warn(f"the resumed broker did not rejoin; restarting it: {exc}\n"
                      f"{_why_not_serving(kafka)}", stacklevel=2)
        kafka.kill_broker(0)
        kafka.restart_broker(0)


def _why_not_serving(kafka: LocalKafkaCluster) -> str:
    """What a broker that serves no client does: a raw ApiVersions request to its port (does it
    accept, answer, close?) and its network and request threads' stacks (jstack), for the
    warning; the cause of the two CI occurrences is not known."""
    host, _, port = kafka.bootstrap_servers.split(",")[0].rpartition(":")
    request = struct.pack(">hhih5s", 18, 0, 1, 5, b"probe")  # ApiVersions v0, client "probe"
    try:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(struct.pack(">i", len(request)) + request)
            answer = sock.recv(4)
            probe = (f"answered ({len(answer)} bytes)" if answer
                     else "accepted, then closed without an answer")
    except TimeoutError:
        probe = "no answer within 5 s"
    except OSError as exc:
        probe = f"failed: {exc!r}"
    pid = kafka.broker_pid(0)
    stacks = "no broker process"
    if pid is not None:
        try:
            dump = subprocess.run(["jstack", str(pid)], capture_output=True, text=True,
                                  timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            dump = f"jstack failed: {exc!r}"
        wanted = ("network-thread", "acceptor", "request-handler")
        alike: dict[str, list[str]] = {}  # top frames -> the threads there
        for block in dump.split("\n\n"):
            first, *frames = block.strip().split("\n")
            if any(w in first for w in wanted):
                top = "\n".join(f.strip() for f in frames[:6] if not f.strip().startswith("-"))
                alike.setdefault(top, []).append(first.split('"')[1] if '"' in first else first)
        stacks = "\n".join(f"{len(names)} thread(s) {', '.join(names)}:\n{top}"
                            for top, names in alike.items())[:6000] or dump[:2000]
    return f"ApiVersions to {host}:{port}: {probe}\nbroker threads:\n{stacks}"


@pytest.mark.timeout(360)  # _rejoined may restart the broker after waiting a minute
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_kafka_gone_under_a_live_writer(writers: Any, kafka: LocalKafkaCluster, pg_url: str,
                                        fault: str) -> None:
    """The broker is killed or paused between two transactions of a live writer: the next one
    fails within the bound (it took 44.7 s at timeout_s=10 before), and so do status and
    recover; once the broker is back, recovery settles it: rows == records."""
    topic = kafka.create_topic(f"tmo-{uuid.uuid4().hex[:8]}", 1)
    bootstrap = kafka.bootstrap_servers
    writer = writers(pg_url, bootstrap)
    _write(writer, topic, "before")
    _write(writer, topic, "before-2")  # the lease is held: the lock waits for the record
    if fault == "SIGKILL":
        kafka.kill_broker(0)
    else:
        kafka.pause_broker(0)
    try:
        elapsed = _timed(lambda: _write_late(writer, topic, "while-gone"),
                         BrokerUnreachableError, bootstrap)
        print(f"transaction with Kafka {fault}: {elapsed:.1f} s (timeout_s={TIMEOUT_S})")
        config = {"bootstrap.servers": bootstrap}
        _timed(lambda: dualwrite.status(pg_url, config, timeout_s=TIMEOUT_S),
               BrokerUnreachableError, bootstrap)
    finally:
        if fault == "SIGKILL":
            kafka.restart_broker(0)
        else:
            kafka.resume_broker(0)
    _rejoined(kafka, fault)
    writer.close()
    hanging = _marker_lost(bootstrap, writer.transactional_id, topic)
    if hanging:
        (row,) = dualwrite.status(pg_url, {"bootstrap.servers": bootstrap}, timeout_s=20).rows
        assert row.condition is Condition.IN_DOUBT, row
        assert f"{topic}-0 never got the commit marker" in row.detail, row.detail
    rows, report = _settled(pg_url, bootstrap, topic, [writer.transactional_id])
    assert rows == ["before", "before-2"]
    (result,) = report.results
    if hanging:
        # The broker restarted within its old registration's session: fenced, leaderless, then
        # elected again, its coordinator completed the reloaded PrepareCommit of "before-2"
        # without writing the marker (TransactionMarkerChannelManager: "Couldn't find leader
        # endpoint ... likely deleted already"). Recovery wrote it, from the coordinator's own
        # decision; without that, read_committed stays stuck below the anchor for ever.
        print("Kafka completed the commit without its marker; recovery wrote the marker")
        assert result.outcome is dualwrite.Outcome.COMMITTED, result
    else:
        # "before-2" committed; requests of "while-gone" still queued in the writer's client may
        # reach the broker once it is back (seen after SIGSTOP), and recovery then aborts that
        # transaction and reports the id as aborted.
        assert result.outcome in (dualwrite.Outcome.ALREADY_COMMITTED,
                                  dualwrite.Outcome.ABORTED), result


def _marker_lost(bootstrap: str, tid: str, topic: str) -> bool:
    """Whether the coordinator completed ``tid``'s commit while ``topic``'s partition 0 still
    has that producer's transaction open (a lost marker), once the coordinator settled."""
    with ControlPlane({"bootstrap.servers": bootstrap}) as cp:
        deadline = time.monotonic() + 30
        desc = cp.describe_transaction(tid)
        while desc is not None and desc.state.in_flight and time.monotonic() < deadline:
            time.sleep(0.2)
            desc = cp.describe_transaction(tid)
        if desc is None or desc.state is not TxnState.COMPLETE_COMMIT:
            return False
        tp = TopicPartition(topic, 0)
        return any(p.producer_id == desc.producer_id
                   and p.current_txn_start_offset is not None
                   for p in cp.describe_producers([tp]).get(tp, []))


# -- the database gone ------------------------------------------------------------------------


def test_database_stopped(writers: Any, private_pg: LocalPostgres, bootstrap: str,
                          topic: str) -> None:
    """The server is stopped under a live writer and before a new one: both fail within the
    bound, naming host:port; so does recover."""
    url = private_pg.url
    dualwrite.upgrade_database(url)
    engine = dualwrite.create_engine(url)
    ROWS.create(engine)
    engine.dispose()
    writer = writers(url, bootstrap)
    _write(writer, topic, "before")
    pg_ctl(private_pg, "stop", "-m", "immediate", "-w")
    where = _host_port(url)
    _timed(lambda: _write_late(writer, topic, "while-down"), DatabaseUnreachableError, where)
    fresh = writers(url, bootstrap)
    _timed(lambda: _write(fresh, topic, "new-writer"), DatabaseUnreachableError, where)
    _timed(lambda: dualwrite.recover(url, {"bootstrap.servers": bootstrap},
                                     timeout_s=TIMEOUT_S), DatabaseUnreachableError, where)


def test_database_silent_during_the_row_lock(writers: Any, pg_proxy: tuple[TcpProxy, str],
                                             pg_url: str, kafka: LocalKafkaCluster) -> None:
    """The lock reaches the server (the row is locked), its answer never comes back: the
    writer's wait ends at its deadline (the connection is abandoned); the server keeps an
    orphaned session, idle in transaction, holding the row lock and the lease. A second
    writer of the id is refused (the lease is held) within the bound, recover leaves the id to the
    orphan's lease within the bound; once the orphan is gone, recovery settles the id."""
    proxy, through = pg_proxy
    topic = kafka.create_topic(f"tmo-{uuid.uuid4().hex[:8]}", 1)
    bootstrap = kafka.bootstrap_servers
    tid = unique("tmo-lock")
    writer = writers(through, bootstrap, tid)
    _write(writer, topic, "before")
    locked = proxy.hold_next_response(contains(b"INSERT INTO"))
    _timed(lambda: _write_late(writer, topic, "lost-lock"), DatabaseUnreachableError,
           _host_port(through))
    assert locked.is_set()
    second = writers(pg_url, bootstrap, tid)
    _timed(lambda: _write(second, topic, "second"), FatalError, "in use")  # its lease
    started = time.monotonic()
    report = dualwrite.recover(pg_url, {"bootstrap.servers": bootstrap}, timeout_s=TIMEOUT_S)
    assert time.monotonic() - started <= BOUND_S
    assert [r.transactional_id for r in report.results] == [tid]
    proxy.cut()  # the orphaned session ends; its transaction rolls back
    writer.close()
    time.sleep(0.5)
    assert _settled(pg_url, bootstrap, topic, [tid])[0] == ["before"]


@pytest.mark.parametrize("lost", ["request", "answer"])
def test_database_silent_during_the_commit(writers: Any, pg_proxy: tuple[TcpProxy, str],
                                           pg_url: str, kafka: LocalKafkaCluster,
                                           lost: str) -> None:
    """The COMMIT's connection goes silent. ``request``: the COMMIT never arrives, so the
    outcome asked on a new connection is "in progress" until the deadline:
    OutcomeUnknownError, the Kafka transaction left open (never aborted); the late COMMIT
    lands once the proxy lets it through, and recovery commits Kafka. ``answer``: the COMMIT
    applies and its answer is lost: asked on a new connection, "committed", and Kafka
    commits. Either way within the bound, and rows == records afterwards."""
    proxy, through = pg_proxy
    topic = kafka.create_topic(f"tmo-{uuid.uuid4().hex[:8]}", 1)
    bootstrap = kafka.bootstrap_servers
    tid = unique("tmo-commit")
    writer = writers(through, bootstrap, tid)
    _write(writer, topic, "before")
    if lost == "request":
        caught = proxy.hold_next_request(contains(b"COMMIT"))
        _timed(lambda: _write(writer, topic, "in-doubt"), OutcomeUnknownError, tid)
        assert caught.is_set()
        writer.close()
        proxy.release()  # the held COMMIT reaches the server now, then the session ends
        time.sleep(0.5)
    else:
        caught = proxy.hold_next_response(contains(b"COMMIT"))
        started = time.monotonic()
        _write(writer, topic, "in-doubt")  # the outcome was asked, not guessed
        assert time.monotonic() - started <= BOUND_S
        assert caught.is_set()
        writer.close()
        proxy.cut()
    assert _settled(pg_url, bootstrap, topic, [tid])[0] == ["before", "in-doubt"]


@pytest.mark.timeout(360)  # _rejoined may restart the broker after waiting a minute
def test_both_gone_under_a_live_writer(writers: Any, pg_proxy: tuple[TcpProxy, str],
                                       pg_url: str, kafka: LocalKafkaCluster) -> None:
    """The broker paused and the database silent at once: within the bound, and the error
    names the database (the first wait on the path)."""
    proxy, through = pg_proxy
    topic = kafka.create_topic(f"tmo-{uuid.uuid4().hex[:8]}", 1)
    bootstrap = kafka.bootstrap_servers
    writer = writers(through, bootstrap)
    _write(writer, topic, "before")
    kafka.pause_broker(0)
    proxy.blackhole("both")
    try:
        _timed(lambda: _write_late(writer, topic, "while-gone"), DatabaseUnreachableError,
               _host_port(through))
    finally:
        kafka.resume_broker(0)
        proxy.cut()
        proxy.release()
    _rejoined(kafka, "SIGSTOP")
    writer.close()
    assert _settled(pg_url, bootstrap, topic, [writer.transactional_id])[0] == ["before"]


def test_a_pooled_connection_gone_silent(pg_proxy: tuple[TcpProxy, str]) -> None:
    """The pool's pre-ping of an idle connection whose peer went silent is bounded by the
    deadline too: the connection is abandoned and replaced (new connections pass here), so the
    short transaction succeeds within the bound instead of waiting for the ping forever."""
    proxy, through = pg_proxy
    engine = dualwrite.create_engine(through)
    try:
        with engine.connect() as conn:  # one idle connection left in the pool
            conn.execute(sa.text("SELECT 1"))
        proxy.blackhole("both", existing_only=True)
        started = time.monotonic()
        with deadline_scope(TIMEOUT_S), transaction(engine) as conn:
            assert conn.execute(sa.text("SELECT 2")).scalar() == 2
        assert time.monotonic() - started <= BOUND_S
    finally:
        proxy.release()
        engine.dispose()
