"""The lost COMMIT across a database failover, with a real streaming standby.

A private PostgreSQL primary with an asynchronous standby (``pg_basebackup -R``); the writer
reaches the database through a TCP proxy. The standby stops streaming, the writer's COMMIT is
applied on the primary and its answer lost, the primary crashes, the standby is promoted and
hands out the same transaction ids again (the committed transaction's WAL never reached it), and
the proxy points at it. Asked by transaction id, the new primary answers "committed" for a
transaction of its own: the writer must not commit Kafka on that answer. Afterwards, with
recovery: records == rows on the surviving server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite import DualWriter, OutcomeUnknownError
from dualwrite.dev import LocalPostgres
from dualwrite.participant.control_plane import ControlPlane
from dualwrite.writer.commit_inquiry import SERVER_IDENTITY
from tests.support.kafka import read_committed, unique
from tests.support.tcp_proxy import TcpProxy, contains

pytestmark = pytest.mark.timeout(180)

ORDERS = sa.Table("failover_orders", sa.MetaData(),
                  sa.Column("id", sa.String(64), primary_key=True))


@pytest.fixture
def primary() -> Iterator[LocalPostgres]:
    with LocalPostgres(backend="binaries") as pg:
        dualwrite.upgrade_database(pg.url)
        engine = dualwrite.create_engine(pg.url)
        ORDERS.create(engine)
        engine.dispose()
        yield pg


@pytest.fixture
def standby(primary: LocalPostgres) -> Iterator[LocalPostgres]:
    replica = primary.start_standby()
    try:
        yield replica
    finally:
        replica.stop()


def _dsn(pg: LocalPostgres) -> str:
    return pg.dsn


def _wait_replayed(standby: LocalPostgres, key: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    with psycopg.connect(_dsn(standby), autocommit=True) as conn:
        while not conn.execute("SELECT 1 FROM failover_orders WHERE id = %s",
                               (key,)).fetchone():
            assert time.monotonic() < deadline, f"the standby never replayed row {key!r}"
            time.sleep(0.05)


def _stop_streaming(standby: LocalPostgres, primary: LocalPostgres) -> None:
    """The standby stops receiving WAL (it keeps what it has); asynchronous replication lagging
    at the moment of the failover."""
    with psycopg.connect(_dsn(standby), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET primary_conninfo = ''")
        conn.execute("SELECT pg_reload_conf()")
    deadline = time.monotonic() + 20
    with psycopg.connect(_dsn(primary), autocommit=True) as conn:
        while conn.execute("SELECT count(*) FROM pg_stat_replication").fetchone() != (0,):
            assert time.monotonic() < deadline, "the standby kept streaming"
            time.sleep(0.05)


def _fail_over(primary: LocalPostgres, standby: LocalPostgres, proxy: TcpProxy,
               done: list[Any], replayed: str | None) -> None:
    """Crash the primary (once the standby has ``replayed`` that row, if given), promote the
    standby, let it hand out the primary's recent transaction ids again (each committed),
    point the proxy at it, accept connections."""
    try:
        if replayed is not None:
            _wait_replayed(standby, replayed)
        with psycopg.connect(_dsn(primary), autocommit=True) as conn:
            row = conn.execute("SELECT txid_current()").fetchone()
            assert row is not None
            last = int(row[0])
        primary.crash()
        standby.promote()
        with psycopg.connect(_dsn(standby), autocommit=True) as conn:
            reused = 0
            while True:
                row = conn.execute("SELECT txid_current()").fetchone()
                assert row is not None
                reused += 1
                if int(row[0]) >= last:
                    break
            identity = conn.execute(f"SELECT {SERVER_IDENTITY}").fetchone()
        proxy.target = ("127.0.0.1", int(standby.port or 0))
        proxy.refuse(False)
        done.append((reused, identity))
    except BaseException as exc:  # reported by the test
        done.append(exc)
        proxy.refuse(False)


def _rows(url: str) -> list[str]:
    engine = dualwrite.create_engine(url)
    try:
        with engine.connect() as conn:
            return sorted(r[0] for r in conn.execute(sa.select(ORDERS.c.id)))
    finally:
        engine.dispose()


@pytest.mark.parametrize("standby_has_it", [False, True], ids=["standby-lagging",
                                                              "standby-replayed"])
def test_lost_commit_answered_by_a_promoted_standby(
        primary: LocalPostgres, standby: LocalPostgres, bootstrap: str, topic: str,
        standby_has_it: bool) -> None:
    """Lagging: fails without the server check (CommitInquiry.commit_status): the promoted standby
    says "committed" for a transaction id it gave to a transaction of its own, and the writer
    commits Kafka records that have no rows. Replayed: the state row shows the transaction, so
    the writer commits Kafka itself."""
    kafka = {"bootstrap.servers": bootstrap}
    tid = unique("failover")
    direct = sa.make_url(primary.url)
    with TcpProxy(int(direct.port or 0)) as proxy:
        through = direct.set(port=proxy.port).render_as_string(hide_password=False)
        # No pool: each question about the outcome opens a connection (to the proxy's target).
        engine = dualwrite.create_engine(through, poolclass=sa.pool.NullPool)
        done: list[Any] = []
        outcome = "ok"
        try:
            with DualWriter(engine, kafka, transactional_id=tid, timeout_s=30) as writer:
                with writer.transaction() as tx:
                    tx.produce(topic, b"a", key="a")
                    tx.connection.execute(sa.insert(ORDERS).values(id="a"))
                _wait_replayed(standby, "a")
                if not standby_has_it:
                    _stop_streaming(standby, primary)
                cut = proxy.drop_next_response(contains(b"COMMIT"))
                try:
                    with writer.transaction() as tx:
                        tx.produce(topic, b"b", key="b")
                        tx.connection.execute(sa.insert(ORDERS).values(id="b"))
                        # The COMMIT goes through; new connections are refused until the
                        # failover is done (a server that is switching over).
                        proxy.refuse(True)
                        def fail_over_after_the_cut() -> None:
                            cut.wait(10)
                            _fail_over(primary, standby, proxy, done,
                                       "b" if standby_has_it else None)

                        threading.Thread(target=fail_over_after_the_cut, daemon=True).start()
                except OutcomeUnknownError as exc:
                    outcome = f"OutcomeUnknownError: {exc}"
                assert cut.is_set(), "the COMMIT's answer was never dropped"
        finally:
            engine.dispose()
    deadline = time.monotonic() + 30
    while not done and time.monotonic() < deadline:
        time.sleep(0.1)
    assert done and not isinstance(done[0], BaseException), done
    reused, identity = done[0]
    print(f"failover: {reused} transaction ids handed out again by the promoted standby "
          f"({identity[0]}); writer: {outcome}")
    records_before = sorted(r.decode() for r in read_committed(bootstrap, topic))
    survivor = standby.url
    if standby_has_it:
        assert outcome == "ok"
        assert _rows(survivor) == records_before == ["a", "b"]
    else:
        assert _rows(survivor) == ["a"]  # the COMMIT of "b" died with the old primary
        # Without the check, Kafka committed "b" on the standby's word: records without rows.
        assert records_before == ["a"], (
            f"records {records_before} but rows ['a'] after the failover ({outcome})")
        assert outcome.startswith("OutcomeUnknownError")
    report = dualwrite.recover(survivor, kafka, timeout_s=20)
    assert report.ok, report.as_dict()
    assert sorted(r.decode() for r in read_committed(bootstrap, topic)) == _rows(survivor)
    with ControlPlane(kafka) as cp:
        desc = cp.describe_transaction(tid)
        assert desc is not None and not desc.state.in_flight, desc
