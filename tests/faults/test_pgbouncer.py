"""PgBouncer (Debian's package, started by the tests) between dualwrite and PostgreSQL.

Session pooling keeps a client on one server session, so the writer leases (session advisory
locks) work: crashes, recovery beside live writers, the invariant. Transaction (and statement)
pooling hands each transaction whatever server session is free: dualwrite refuses it at start
with a FatalError that names it and says what works, before any lease is taken, and never lets
a psycopg error through. psycopg's automatic prepared statements, which a transaction pooler
breaks, are off on dualwrite's engines.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite import DualWriter, FatalError
from dualwrite.database import advisory_keys, normalize_url
from dualwrite.dev import LocalPgBouncer
from dualwrite.dev.pgbouncer import PoolMode
from dualwrite.writer import PhaseHooks
from tests.support.crash_loop import ROWS, TID_PREFIX, CrashLoop
from tests.support.db import fresh_postgres_database
from tests.support.kafka import read_committed
from tests.support.tables import prepare_database
from tests.support.workers import CRASH_WORKER, worker_env
from tests.support.workers.crash_worker import EVENTS, row_ids

pytestmark = pytest.mark.timeout(240)

@pytest.fixture(scope="module")
def bouncers(postgres_url: str) -> Iterator[dict[str, LocalPgBouncer]]:
    """One PgBouncer per pool mode in front of the session's PostgreSQL server, and one in
    transaction mode that hands out its idle server sessions oldest first (round robin)."""
    kinds: dict[str, tuple[PoolMode, dict[str, str]]] = {
        "session": ("session", {}), "transaction": ("transaction", {}),
        "statement": ("statement", {}),
        "transaction-round-robin": ("transaction", {"server_round_robin": "1"})}
    started: dict[str, LocalPgBouncer] = {}
    try:
        for name, (mode, settings) in kinds.items():
            bouncer = LocalPgBouncer(postgres_url, pool_mode=mode, settings=settings)
            bouncer.start()
            started[name] = bouncer
        yield started
    finally:
        for bouncer in started.values():
            bouncer.stop()


@pytest.fixture
def database(postgres_url: str) -> Iterator[str]:
    """A fresh database (dualwrite's tables and ``events``) on the server; its name."""
    with fresh_postgres_database(postgres_url, "pool") as direct:
        prepare_database(direct)
        name = sa.make_url(direct).database
        assert name is not None
        yield name


class LiveWriter(threading.Thread):
    """A DualWriter writing ``events`` rows and the same ids as records until stopped."""

    def __init__(self, url: str, bootstrap: str, topic: str, first_txn: int) -> None:
        super().__init__(daemon=True)
        self.url, self.bootstrap, self.topic = url, bootstrap, topic
        self.tid = f"{TID_PREFIX}live-{uuid.uuid4().hex[:8]}"
        self.txn = first_txn
        self.committed = 0
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with DualWriter(self.url, {"bootstrap.servers": self.bootstrap},
                            transactional_id=self.tid, timeout_s=30) as writer:
                while not self.stop_event.is_set():
                    with writer.transaction() as tx:
                        ids = row_ids(self.txn, ROWS)
                        for key in ids:
                            tx.produce(self.topic, key, key=key)
                        tx.connection.execute(sa.insert(EVENTS),
                                              [{"id": i, "txn": self.txn} for i in ids])
                    self.txn += 1
                    self.committed += 1
        except BaseException as exc:
            self.error = exc


def test_session_pooling_crashes_and_recover_beside_live_writers(
        bouncers: dict[str, LocalPgBouncer], database: str, kafka: Any, new_topic: Any,
        tmp_path: Path) -> None:
    """Through PgBouncer in session pooling: two live writers commit in a loop while a third
    is killed at crash points and `dualwrite recover` runs beside them after each kill; the
    live ones are left to themselves, the killed one is finished, records == rows."""
    url = bouncers["session"].url(database)
    loop = CrashLoop(url, kafka.bootstrap_servers, new_topic(kafka, partitions=3), tmp_path)
    live = [LiveWriter(url, kafka.bootstrap_servers, loop.topic, first) for first in
            (100_000, 200_000)]
    for writer in live:
        writer.start()
    left_to_live: Counter[str] = Counter()
    try:
        for point in ("after-db-commit", "after-state-row", "before-lock", "mid-produce"):
            loop.crash_round(point, 2)
            report = loop.recover()
            for result in report["results"]:
                if result["transactional_id"] != loop.tid:
                    left_to_live[result["outcome"]] += 1
            assert all(w.error is None for w in live), [w.error for w in live]
    finally:
        for writer in live:
            writer.stop_event.set()
        for writer in live:
            writer.join(60)
    assert all(w.error is None for w in live), [w.error for w in live]
    loop.recover()
    loop.check_invariant()
    commits = [w.committed for w in live]
    print(f"session pooling: crash outcomes {dict(loop.outcomes)}; live writers committed "
          f"{commits}; their ids in recover beside them: {dict(left_to_live)}")
    assert all(n > 0 for n in commits)
    assert left_to_live["left-to-live-writer"] > 0, left_to_live


@pytest.mark.parametrize("mode", ["transaction", "transaction-round-robin", "statement"])
def test_transaction_pooling_is_refused_at_start(
        bouncers: dict[str, LocalPgBouncer], database: str, mode: str,
        bootstrap: str, topic: str) -> None:
    """The writer and recovery refuse a pooler that moves a client between server sessions,
    with a FatalError naming it and what works, before anything is written."""
    url = bouncers[mode].url(database)
    tid = f"{TID_PREFIX}refused-{uuid.uuid4().hex[:8]}"
    with (DualWriter(url, {"bootstrap.servers": bootstrap}, transactional_id=tid) as writer,
          pytest.raises(FatalError) as refused, writer.transaction() as tx):
        tx.produce(topic, b"x", key="x")
    message = str(refused.value)
    assert "pooling" in message and "session pooling" in message and "directly" in message
    assert "psycopg.errors" not in message and "sqlalche" not in message
    try:
        report = dualwrite.recover(url, {"bootstrap.servers": bootstrap}, [tid], timeout_s=15)
    except FatalError as exc:  # statement pooling: not even the state table can be read
        details = [str(exc)]
    else:
        assert {r.outcome.value for r in report.results} == {"failed"}, report.as_dict()
        details = [r.detail for r in report.results]
    assert all("session pooling" in d for d in details), details


def test_a_writer_killed_behind_a_transaction_pooler_is_not_left_to_a_ghost(
        bouncers: dict[str, LocalPgBouncer], database: str, bootstrap: str,
        topic: str) -> None:
    """A writer killed between its two commits behind PgBouncer in transaction pooling: its
    lease (a session lock) would stay on the pooled server session, and recovery would leave
    the id to a "live writer" that is dead until the broker aborts the committed decision. The
    writer must be refused at start instead (fails without Leases.check_sessions)."""
    url = bouncers["transaction"].url(database)
    tid = f"{TID_PREFIX}ghost-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(
        [sys.executable, str(CRASH_WORKER), "--db", url, "--bootstrap", bootstrap, "--topic", topic,
         "--tid", tid, "--first-txn", "1", "--count", "2", "--rows", str(ROWS),
         "--crash-point", "after-db-commit"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=worker_env())
    assert proc.stdout is not None
    reached = False
    for line in proc.stdout:
        if line.startswith("AT "):
            reached = True
            proc.kill()
            break
    proc.wait(60)
    stderr = proc.stderr.read() if proc.stderr else ""
    if reached:
        report = dualwrite.recover(url, {"bootstrap.servers": bootstrap}, [tid], timeout_s=15)
        outcomes = [r.outcome.value for r in report.results]
        pytest.fail(f"the writer ran behind a transaction pooler and was killed after its "
                    f"database commit; recover then reported {outcomes} for its id")
    assert proc.returncode not in (0, None)
    assert "FatalError" in stderr and "session pooling" in stderr, stderr[-2000:]


def test_prepared_statements_are_off_on_dualwrites_engines(
        bouncers: dict[str, LocalPgBouncer], database: str) -> None:
    """psycopg prepares a statement it has run 5 times on that server session; behind a
    transaction pooler the next run can land on another session. dualwrite's create_engine turns
    that off; an engine made without it fails as the README warns."""
    url = bouncers["transaction"].url(database)

    def run(engine: sa.Engine) -> None:
        with engine.connect() as a, engine.connect() as b:
            for i in range(16):
                if i % 2 == 0:
                    b.exec_driver_sql("SELECT 1")  # b holds a server session meanwhile
                a.execute(sa.text("SELECT count(*) FROM events WHERE txn > :n"), {"n": i})
                a.commit()
                b.rollback()

    ours = dualwrite.create_engine(url)
    try:
        run(ours)
    finally:
        ours.dispose()
    plain = sa.create_engine(normalize_url(url))
    try:
        with pytest.raises(sa.exc.ProgrammingError, match="prepared statement"):
            run(plain)
    finally:
        plain.dispose()


def test_a_writer_whose_session_a_pooler_moves_later_is_refused(
        postgres_url: str, database: str, bootstrap: str, topic: str) -> None:
    """The start-up check can pass on a busy transaction pooler (other clients take and give
    back server sessions in between); then the first transaction that runs on another server
    session than the lease's is refused in the lock's round trip (fails without the check in
    WriterConnection.begin_and_lock: the writer commits beside a lease it no longer runs on).
    Staged: PgBouncer starts in session pooling (the check passes), is switched to transaction
    pooling on its admin console, the writer's server session is terminated (it reconnects, in
    transaction pooling, and takes its lease again), and another client holds the lease's server
    session in a transaction. The writer may be refused earlier than that last step, as soon as
    the pooler happens to run one of its transactions on another server session than its
    lease's (its lease check after each commit runs a statement of its own): any of the three
    writes after the switch may meet the refusal, and none may commit beside it."""
    direct = sa.make_url(postgres_url).set(database=database)
    with LocalPgBouncer(postgres_url, pool_mode="session") as bouncer:
        url = bouncer.url(database)
        dsn = bouncer.url("pgbouncer").replace("postgresql+psycopg://", "postgresql://")
        admin = sa.create_engine(direct, isolation_level="AUTOCOMMIT")
        tid = f"{TID_PREFIX}moved-{uuid.uuid4().hex[:8]}"
        holders: list[Any] = []
        committed = [1]
        try:
            with DualWriter(url, {"bootstrap.servers": bootstrap}, transactional_id=tid,
                            timeout_s=20) as writer:
                _write_event(writer, topic, 1)
                with pytest.raises(FatalError) as refusal:
                    with psycopg.connect(dsn, autocommit=True) as console:
                        console.execute("SET pool_mode = 'transaction'")
                    with admin.connect() as conn:
                        conn.execute(sa.text(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE datname = :db AND pid <> pg_backend_pid()"), {"db": database})
                    for txn in (2, 3):  # reconnected (in transaction pooling), locked first: the
                        _write_event(writer, topic, txn)  # lease again
                        committed.append(txn)
                    with admin.connect() as conn:
                        lease_pid = conn.execute(sa.text(
                            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                            "AND database = (SELECT oid FROM pg_database WHERE datname = :db)"),
                            {"db": database}).scalar_one()
                    client = bouncer.url(database).replace("postgresql+psycopg://", "postgresql://")
                    while not any(pid == lease_pid for _, pid in holders):
                        assert len(holders) < 20, "no client got the lease's server session"
                        holder = psycopg.connect(client, prepare_threshold=None)
                        row = holder.execute("SELECT pg_backend_pid()").fetchone()
                        assert row is not None
                        holders.append((holder, row[0]))  # its transaction stays open
                    _write_event(writer, topic, 4)
        finally:
            for holder, _ in holders:
                holder.close()
            admin.dispose()
    assert "transaction" in str(refusal.value) and "session pooling" in str(refusal.value)
    _assert_settled(direct, bootstrap, tid, topic, committed)


class _PinLeaseSession(PhaseHooks):
    """Once armed: when the database has committed, client connections of the pooler's are
    opened (each in an open transaction, pinning its server session) until one runs on the
    session holding the writer's lease, so that the writer's next statement runs elsewhere."""

    def __init__(self, admin: sa.Engine, database: str, client_dsn: str) -> None:
        self.armed = False
        self.pinned: int | None = None
        self.holders: list[Any] = []
        self._admin, self._database, self._dsn = admin, database, client_dsn

    def database_committed(self, state: Any) -> None:
        if not self.armed or self.pinned is not None:
            return
        with self._admin.connect() as conn:
            lease_pid = conn.execute(sa.text(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND database = (SELECT oid FROM pg_database WHERE datname = :db)"),
                {"db": self._database}).scalar_one()
        while self.pinned is None:
            assert len(self.holders) < 20, "no client got the lease's server session"
            holder = psycopg.connect(self._dsn, prepare_threshold=None)
            row = holder.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            self.holders.append(holder)
            if row[0] == lease_pid:
                self.pinned = lease_pid


def test_a_writer_whose_lease_check_a_pooler_moves_is_refused(
        postgres_url: str, database: str, bootstrap: str, topic: str) -> None:
    """The check after a Kafka commit runs on another server session than the lease's, and the
    lease's session still holds the lease: a transaction pooler moved the writer's connection
    (a lost session loses its locks). The next transaction is refused before it begins (fails
    without the "moved" verdict of LeaseKeeper.check: the writer took the check for a
    lost session, could not take its lease again, and went on committing without one, leaving
    the lease on a pooled server session where recovery takes it for a live writer's).
    Staged: PgBouncer starts in session pooling (the start-up check passes) and is switched to
    transaction pooling, which the writer's connection meets when its transaction ends; then
    its session is pinned by other clients between a database commit and its Kafka commit, so
    the check after that commit runs elsewhere. (Most likely how the test above failed once in CI:
    DID NOT RAISE.) The writer may be refused earlier, by a lock or a check that the pooler
    happened to run elsewhere; never may a transaction commit after the pinned one."""
    direct = sa.make_url(postgres_url).set(database=database)
    with LocalPgBouncer(postgres_url, pool_mode="session") as bouncer:
        url = bouncer.url(database)
        dsn = bouncer.url("pgbouncer").replace("postgresql+psycopg://", "postgresql://")
        client = bouncer.url(database).replace("postgresql+psycopg://", "postgresql://")
        admin = sa.create_engine(direct, isolation_level="AUTOCOMMIT")
        hooks = _PinLeaseSession(admin, database, client)
        tid = f"{TID_PREFIX}moved-check-{uuid.uuid4().hex[:8]}"
        committed = [1]
        try:
            with DualWriter(url, {"bootstrap.servers": bootstrap}, transactional_id=tid,
                            timeout_s=20, hooks=hooks) as writer:
                _write_event(writer, topic, 1)
                with pytest.raises(FatalError) as refusal:
                    with psycopg.connect(dsn, autocommit=True) as console:
                        console.execute("SET pool_mode = 'transaction'")
                    _write_event(writer, topic, 2)
                    committed.append(2)
                    hooks.armed = True
                    _write_event(writer, topic, 3)
                    committed.append(3)
                    _write_event(writer, topic, 4)
        finally:
            for holder in hooks.holders:
                holder.close()
            admin.dispose()
    message = str(refusal.value)
    assert "transaction" in message and "session pooling" in message, message
    if hooks.pinned is not None:  # refused at the check after the pinned commit
        assert committed == [1, 2, 3]
        assert f"still held by backend {hooks.pinned}" in message, message
    _assert_settled(direct, bootstrap, tid, topic, committed)


def _assert_settled(direct: sa.URL, bootstrap: str, tid: str, topic: str,
                    committed: list[int]) -> None:
    """Recovery, on the database directly, settles ``tid``: rows == read_committed records ==
    those of the ``committed`` transactions."""
    report = dualwrite.recover(direct.render_as_string(hide_password=False),
                               {"bootstrap.servers": bootstrap}, [tid], timeout_s=15)
    assert report.ok, report.as_dict()
    engine = dualwrite.create_engine(direct)
    try:
        with engine.connect() as conn:
            rows = sorted(r[0] for r in conn.execute(sa.select(EVENTS.c.id)))
    finally:
        engine.dispose()
    records = sorted(r.decode() for r in read_committed(bootstrap, topic))
    assert rows == records == sorted(i for txn in committed for i in row_ids(txn, ROWS))


def _write_event(writer: DualWriter, topic: str, txn: int) -> None:
    with writer.transaction() as tx:
        ids = row_ids(txn, ROWS)
        for key in ids:
            tx.produce(topic, key, key=key)
        tx.connection.execute(sa.insert(EVENTS), [{"id": i, "txn": txn} for i in ids])


def test_a_lease_left_on_a_pooled_server_session_is_not_taken_again(
        postgres_url: str, database: str, bootstrap: str, topic: str) -> None:
    """PgBouncer in session pooling without ``server_reset_query``: a client that held a
    writer's lease goes away (as a killed writer does) and its server session, lock and all,
    serves the next client. ``pg_try_advisory_lock`` would "take" that lease again (advisory
    locks are re-entrant) beside its holder; the writer and recovery refuse instead, naming the
    pooler and DISCARD ALL (fails without Leases' check of locks a new connection inherited)."""
    tid = f"{TID_PREFIX}inherit-{uuid.uuid4().hex[:8]}"
    k1, k2 = advisory_keys(b"dualwrite-lease", tid)
    with LocalPgBouncer(postgres_url, pool_mode="session",
                        settings={"server_reset_query": ""}) as bouncer:
        url = bouncer.url(database)
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"),
                             autocommit=True) as holder:
            assert holder.execute("SELECT pg_try_advisory_lock(%s, %s)", (k1, k2)).fetchone()
        # Each connection a new client: PgBouncer hands out the last released server session.
        engine = dualwrite.create_engine(url, poolclass=sa.pool.NullPool)
        try:
            with (DualWriter(engine, {"bootstrap.servers": bootstrap},
                             transactional_id=tid) as writer,
                  pytest.raises(FatalError) as refused, writer.transaction() as tx):
                tx.produce(topic, b"x", key="x")
            report = dualwrite.recover(engine, {"bootstrap.servers": bootstrap}, [tid],
                                       timeout_s=15)
        finally:
            engine.dispose()
    assert "DISCARD ALL" in str(refused.value), refused.value
    assert [r.outcome.value for r in report.results] == ["failed"], report.as_dict()
    assert "DISCARD ALL" in report.results[0].detail
    assert read_committed(bootstrap, topic, 5) == []
