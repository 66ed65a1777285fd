"""DualWriterPool (many requests at once, group commit) against a real broker and databases.

The invariant of every test: the rows committed in the database are exactly the records a
read_committed consumer sees, each once — per request, also when requests share a transaction.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite import DualWriterPool, ProducerFencedError, TwoPhaseProducer
from dualwrite.database.backends import backend_for
from dualwrite.writer.pool import sync_engine_for
from tests.support import REPO_ROOT
from tests.support.kafka import read_committed, unique
from tests.support.tables import EVERY_BACKEND, add_value_table
from tests.support.workers import POOL_WORKER, worker_env

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=EVERY_BACKEND)
def backend(request: pytest.FixtureRequest) -> str:
    """Every database; on MariaDB the slot locks' test always, the rest with
    ``--mariadb-full``."""
    return str(request.param)

@pytest.fixture
def db_url(db_url: str) -> str:
    """dualwrite's tables and the application table ``pool_rows``."""
    return add_value_table(db_url, "pool_rows")


def insert(conn: sa.Connection, value: str) -> None:
    conn.execute(sa.text("INSERT INTO pool_rows (value) VALUES (:v)"), {"v": value})


def rows(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return [r[0] for r in conn.exec_driver_sql("SELECT value FROM pool_rows")]


def assert_invariant(engine: sa.Engine, bootstrap: str, topic: str) -> set[str]:
    """Rows == read_committed records, each once; the rows."""
    records = [r.decode() for r in read_committed(bootstrap, topic)]
    counts = Counter(records)
    assert [v for v, n in counts.items() if n > 1] == []
    in_db = rows(engine)
    assert sorted(in_db) == sorted(records)
    return set(in_db)


class Boom(Exception):
    """The application's own failure inside a request."""


@pytest.mark.parametrize("group_commit", [True, False], ids=["group", "single"])
def test_concurrent_requests_are_atomic_each_and_a_failing_one_alone_rolls_back(
        engine: sa.Engine, bootstrap: str, topic: str, group_commit: bool) -> None:
    """12 threads over 2 writers; every 4th request raises after writing and producing: its
    row and record never appear, the requests grouped with it commit."""
    pool = DualWriterPool(engine, {"bootstrap.servers": bootstrap}, id_prefix=unique("pool"),
                          size=2, group_commit=group_commit, timeout_s=20)
    states: dict[str, str] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for n in range(6):
            value = f"c{i}-{n}"
            try:
                with pool.transaction() as tx:
                    insert(tx.connection, value)
                    tx.produce(topic, value, value)
                    time.sleep(0.005)  # requests pile up: groups form
                    if n % 4 == 3:
                        raise Boom(value)
            except Boom:
                continue
            except BaseException as exc:
                errors.append(exc)
                return
            with lock:
                states[value] = str(tx.state)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.close()
    assert errors == []
    committed = assert_invariant(engine, bootstrap, topic)
    assert committed == set(states)
    assert len(committed) == 12 * 5  # n = 3 failed in each thread
    shared = Counter(states.values())
    if group_commit:
        assert max(shared.values()) > 1, "no two requests shared a transaction"
    else:
        assert max(shared.values()) == 1


def test_a_failing_statement_in_a_group_rolls_back_its_request_alone(
        engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """Requests queued behind a slow first one form one group; those whose own statement fails
    (duplicate key) are rolled back alone (their savepoints), the others of the group commit."""
    pool = DualWriterPool(engine, {"bootstrap.servers": bootstrap}, id_prefix=unique("pool"),
                          size=1, group_commit=True, timeout_s=20)
    try:
        with pool.transaction() as tx:
            insert(tx.connection, "dup")
            tx.produce(topic, "dup", "dup")
        outcomes: dict[int, str] = {}
        states: dict[int, str] = {}
        leader_in = threading.Event()

        def client(i: int) -> None:
            if i:
                leader_in.wait()
            value = "dup" if i % 2 else f"fresh-{i}"
            try:
                with pool.transaction() as tx:
                    if i == 0:
                        leader_in.set()
                        time.sleep(0.3)  # the others queue behind it: one group
                    tx.produce(topic, value, value)
                    if i % 2:
                        insert(tx.connection, f"partial-{i}")  # rolled back with the request
                    insert(tx.connection, value)
                outcomes[i] = "ok"
                states[i] = str(tx.state)
            except sa.exc.IntegrityError:
                outcomes[i] = "duplicate"

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert outcomes == {i: "duplicate" if i % 2 else "ok" for i in range(8)}
        assert len(set(states.values())) < len(states)  # some shared a transaction
    finally:
        pool.close()
    assert assert_invariant(engine, bootstrap, topic) == {"dup", "fresh-0", "fresh-2",
                                                          "fresh-4", "fresh-6"}


@pytest.mark.parametrize("group_commit", [True, False], ids=["group", "single"])
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_fenced_writer_is_replaced_not_handed_to_the_next_request(
        engine: sa.Engine, bootstrap: str, topic: str, group_commit: bool) -> None:
    prefix = unique("pool")
    pool = DualWriterPool(engine, {"bootstrap.servers": bootstrap}, id_prefix=prefix, size=1,
                          group_commit=group_commit, timeout_s=20)
    try:
        with pool.transaction() as tx:
            insert(tx.connection, "before")
            tx.produce(topic, "before", "before")
        # Another producer of the id takes over (as a misconfigured process would).
        usurper = TwoPhaseProducer({"bootstrap.servers": bootstrap,
                                    "transactional.id": f"{prefix}-0"}, timeout_s=20)
        usurper.init_transactions()
        usurper.close()
        with pytest.raises(ProducerFencedError), pool.transaction() as tx:
            tx.produce(topic, "fenced", "fenced")
            insert(tx.connection, "fenced")
        for value in ("after-1", "after-2"):
            with pool.transaction() as tx:
                tx.produce(topic, value, value)
                insert(tx.connection, value)
    finally:
        pool.close()
    assert assert_invariant(engine, bootstrap, topic) == {"before", "after-1", "after-2"}


def test_close_leaves_nothing_open_and_frees_the_ids(engine: sa.Engine, bootstrap: str,
                                                     topic: str) -> None:
    prefix = unique("pool")
    kafka = {"bootstrap.servers": bootstrap}
    pool = DualWriterPool(engine, kafka, id_prefix=prefix, size=3)
    assert pool.transactional_ids == [f"{prefix}-{n}" for n in range(3)]
    for n in range(5):
        with pool.transaction() as tx:
            tx.produce(topic, f"v{n}", f"v{n}")
            insert(tx.connection, f"v{n}")
    pool.close()
    pool.close()  # idempotent
    report = dualwrite.status(engine, kafka, prefix=prefix)
    mine = [r for r in report.rows if r.transactional_id.startswith(prefix)]
    assert [(r.state, r.in_doubt) for r in mine] == [("", False)] * 3
    assert all(r.broker is None or not r.broker.state.in_flight for r in mine)
    assert report.hanging == ()
    again = DualWriterPool(engine, kafka, id_prefix=prefix, size=3)  # the same ids are free
    assert again.transactional_ids == pool.transactional_ids
    again.close()
    assert_invariant(engine, bootstrap, topic)


def _worker(db_url: str, bootstrap: str, topic: str, prefix: str, *extra: str
            ) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(POOL_WORKER), "--db", db_url, "--bootstrap", bootstrap,
         "--topic", topic, "--prefix", prefix, *extra],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=worker_env(),
        cwd=REPO_ROOT)


def _read_ids(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("IDS "), line
    return line.split()[1:]


@pytest.mark.parametrize("backend", ["postgresql", "sqlite", "mariadb"], indirect=True)
def test_two_pools_in_two_processes_take_different_ids(db_url: str, engine: sa.Engine,
                                                       bootstrap: str, topic: str) -> None:
    prefix = unique("pool")
    other = _worker(db_url, bootstrap, topic, prefix, "--size", "3", "--ids-only")
    try:
        theirs = _read_ids(other)
        pool = DualWriterPool(engine, {"bootstrap.servers": bootstrap}, id_prefix=prefix,
                              size=3)
        ours = pool.transactional_ids
        assert theirs == [f"{prefix}-{n}" for n in range(3)]
        assert ours == [f"{prefix}-{n}" for n in range(3, 6)]
        with pool.transaction() as tx:
            tx.produce(topic, "ours", "ours")
            insert(tx.connection, "ours")
        pool.close()
    finally:
        assert other.stdin is not None
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.wait(60) == 0
    assert assert_invariant(engine, bootstrap, topic) == {"ours"}


@pytest.fixture
def killed() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.mark.parametrize("finish, clients", [("recover", "threads"), ("smaller-pool", "threads"),
                                             ("recover", "asyncio"), ("recover", "threads-run"),
                                             ("recover", "asyncio-run")])
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_sigkill_with_decided_groups_in_flight_then_recover(
        db_url: str, engine: sa.Engine, bootstrap: str, topic: str,
        killed: list[subprocess.Popen[str]], finish: str, clients: str) -> None:
    """16 threads (or 16 tasks over an AsyncDualWriterPool of an AsyncEngine) over 2 writers
    with group commit; once 60 requests returned, every writer stops after its group's database
    COMMIT; SIGKILL. ``dualwrite recover`` — or the start of a pool of one writer with the
    prefix (its own id by its warm-up, the other as an id nobody runs) — finishes the groups
    (each with several requests): every committed row's record appears once, every returned
    request is among them; then a pool serves again. ``-run``: the requests are ``pool.run``
    calls (``await apool.run``), every 5th failing, so that groups run their calls again."""
    prefix = unique("pool")
    proc = _worker(db_url, bootstrap, topic, prefix, "--size", "2", "--threads", "16",
                   "--block-after", "60",
                   *(["--asyncio"] if clients.startswith("asyncio") else []),
                   *(["--run"] if clients.endswith("-run") else []))
    killed.append(proc)
    assert _read_ids(proc) == [f"{prefix}-0", f"{prefix}-1"]
    returned: list[tuple[str, str]] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("AT "):
            break
        _, value, state = line.split()
        returned.append((value, state))
    time.sleep(1.0)  # let the other writer reach its COMMIT too
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert max(Counter(s for _, s in returned).values()) > 1, "no group of several requests"
    in_doubt = [r for r in dualwrite.status(engine, {"bootstrap.servers": bootstrap},
                                            prefix=prefix).rows if r.in_doubt]
    assert in_doubt, "no decided group was left for recovery"
    decided = len(rows(engine))
    if finish == "recover":
        report = dualwrite.recover(engine, {"bootstrap.servers": bootstrap})
        assert report.ok, report.as_dict()
    else:
        smaller = DualWriterPool(engine, {"bootstrap.servers": bootstrap}, id_prefix=prefix,
                                 size=1)
        assert smaller.transactional_ids == [f"{prefix}-0"]
        smaller.close()
    assert [r.transactional_id for r in dualwrite.status(
        engine, {"bootstrap.servers": bootstrap}, prefix=prefix).rows if r.in_doubt] == []
    committed = assert_invariant(engine, bootstrap, topic)
    assert {v for v, _ in returned} <= committed
    assert len(committed) == decided > len(returned)  # the decided, unreturned groups too
    if clients.endswith("-run"):  # the worker's failing calls (every 5th) left nothing
        assert [v for v in committed if int(v.split("-")[1]) % 5 == 4] == []
    pool = DualWriterPool(engine, {"bootstrap.servers": bootstrap}, id_prefix=prefix, size=2)
    assert pool.transactional_ids == [f"{prefix}-0", f"{prefix}-1"]
    with pool.transaction() as tx:
        tx.produce(topic, "after", "after")
        insert(tx.connection, "after")
    pool.close()
    assert assert_invariant(engine, bootstrap, topic) == committed | {"after"}


@pytest.mark.parametrize("group_commit", [True, False], ids=["group", "single"])
def test_async_pool_requests_are_atomic_each(db_url: str, engine: sa.Engine, bootstrap: str,
                                             topic: str, group_commit: bool) -> None:
    """32 tasks on one event loop over 2 writers; every 4th request raises after its insert and
    produce. The loop is never blocked: a ticker task keeps running meanwhile."""
    import asyncio

    async def main() -> tuple[set[str], int]:
        ok: set[str] = set()
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        async with dualwrite.AsyncDualWriterPool(
                db_url, {"bootstrap.servers": bootstrap}, id_prefix=unique("apool"), size=2,
                group_commit=group_commit, timeout_s=20) as pool:
            tick = asyncio.create_task(ticker())

            async def client(i: int) -> None:
                for n in range(4):
                    value = f"a{i}-{n}"
                    try:
                        async with pool.transaction() as tx:
                            await tx.connection.execute(
                                sa.text("INSERT INTO pool_rows (value) VALUES (:v)"),
                                {"v": value})
                            seen = await tx.connection.execute(
                                sa.text("SELECT count(*) FROM pool_rows WHERE value = :v"),
                                {"v": value})
                            assert seen.scalar() == 1
                            tx.produce(topic, value, value)
                            if n == 3:
                                raise Boom(value)
                    except Boom:
                        continue
                    ok.add(value)

            await asyncio.gather(*(client(i) for i in range(32)))
            stop.set()
            await tick
        return ok, ticks

    ok, ticks = asyncio.run(main())
    assert len(ok) == 32 * 3
    assert assert_invariant(engine, bootstrap, topic) == ok
    assert ticks > 10


def test_a_failed_group_commit_reaches_every_request_as_the_same_error(
        engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """The group's prepare fails (a hook raises there, as a failed flush would): each request of
    the group gets that same error object, none of their rows or records exist, and the next
    requests commit on a new writer."""
    from dualwrite import DeliveryTimeoutError
    from dualwrite.participant import PreparedTxnState
    from dualwrite.writer import PhaseHooks

    class FailOnce(PhaseHooks):
        armed = False

        def prepared(self, state: PreparedTxnState) -> None:
            if self.armed:
                self.armed = False
                raise DeliveryTimeoutError("injected: the group's flush failed")

    hooks = FailOnce()
    pool = DualWriterPool(engine, {"bootstrap.servers": bootstrap}, id_prefix=unique("pool"),
                          size=1, group_commit=True, timeout_s=20, hooks=hooks)
    try:
        hooks.armed = True
        raised: dict[int, BaseException] = {}
        first_in = threading.Event()

        def client(i: int) -> None:
            if i:
                first_in.wait()
            try:
                with pool.transaction() as tx:
                    if i == 0:
                        first_in.set()
                        time.sleep(0.3)  # the others queue behind: one group
                    insert(tx.connection, f"g{i}")
                    tx.produce(topic, f"g{i}", f"g{i}")
            except DeliveryTimeoutError as exc:
                raised[i] = exc

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(raised) == list(range(6))
        assert len({id(e) for e in raised.values()}) == 1
        with pool.transaction() as tx:
            insert(tx.connection, "after")
            tx.produce(topic, "after", "after")
    finally:
        pool.close()
    assert assert_invariant(engine, bootstrap, topic) == {"after"}


@pytest.mark.parametrize("group_commit", [True, False], ids=["group", "single"])
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_pool_whose_slot_session_died_gives_up_ids_another_pool_took(
        engine: sa.Engine, bootstrap: str, topic: str, group_commit: bool) -> None:
    """The session holding a pool's slots ends (a server restart, a cut connection); another
    process's pool takes those ids meanwhile. The first pool notices within its check interval
    and stops using them (its requests are refused as retriable) instead of running the same ids
    as the other pool."""
    from dualwrite import RetriableError
    from dualwrite.database import advisory_keys

    prefix = unique("pool")
    kafka = {"bootstrap.servers": bootstrap}
    first = DualWriterPool(engine, kafka, id_prefix=prefix, size=2, group_commit=group_commit,
                           acquire_timeout_s=2)
    k1, k2 = advisory_keys(b"dualwrite-pool-slot", f"{prefix}-0")
    with engine.begin() as conn:
        pid = conn.execute(sa.text(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = :c "
            "AND objid = :o AND objsubid = 2"),
            {"c": k1 & 0xFFFFFFFF, "o": k2 & 0xFFFFFFFF}).scalar_one()
        conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})
    # pg_terminate_backend only signals: wait until the session (and its slot locks) is gone,
    # or the second pool, under load, still finds the slots held and takes other numbers.
    for _ in range(100):
        with engine.connect() as conn:
            if not conn.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"),
                                {"p": pid}).scalar_one():
                break
        time.sleep(0.05)
    second = DualWriterPool(engine, kafka, id_prefix=prefix, size=2)
    try:
        assert second.transactional_ids == first.transactional_ids
        time.sleep(6)  # the first pool's check runs every 5 s
        with pytest.raises(RetriableError), first.transaction() as tx:
            insert(tx.connection, "first")
            tx.produce(topic, "first", "first")
        with second.transaction() as tx:
            insert(tx.connection, "second")
            tx.produce(topic, "second", "second")
    finally:
        second.close()
        first.close()
    assert assert_invariant(engine, bootstrap, topic) == {"second"}


def _async_url(url: str) -> str:
    """The application's async form of a test database URL."""
    if url.startswith("sqlite:"):
        return url.replace("sqlite:", "sqlite+aiosqlite:", 1)
    if url.startswith(("mysql+pymysql:", "mariadb+pymysql:")):
        return url.replace("+pymysql:", "+aiomysql:", 1)
    return url


@pytest.mark.unit
@pytest.mark.parametrize("async_url, sync_driver", [
    ("postgresql+asyncpg://u:pw@h:5433/db", "postgresql+psycopg"),
    ("postgresql+psycopg_async://u:pw@h:5433/db", "postgresql+psycopg"),
    ("sqlite+aiosqlite:///x.db", "sqlite"),
    ("mysql+aiomysql://u:pw@h:3307/db", "mysql+pymysql"),
    ("mysql+asyncmy://u:pw@h:3307/db", "mysql+pymysql"),
    ("mariadb+aiomysql://u:pw@h:3307/db", "mariadb+pymysql"),
    ("mariadb+asyncmy://u:pw@h:3307/db", "mariadb+pymysql"),
])
def test_sync_engine_for_an_async_url_takes_the_sync_driver_of_its_database(
        async_url: str, sync_driver: str) -> None:
    """Each async driver's URL becomes dualwrite's sync driver on the same database (dialect,
    user, password, host, port, database kept); an asyncmy URL needs no asyncmy installed."""
    engine = sync_engine_for(async_url)
    try:
        assert not engine.dialect.is_async
        want = sa.make_url(async_url).set(drivername=sync_driver)
        assert engine.url.render_as_string(hide_password=False) == \
            want.render_as_string(hide_password=False)
        if sync_driver.endswith("+pymysql"):
            assert backend_for(engine).name == "mariadb"
            assert engine.dialect.name == sync_driver.split("+")[0]
    finally:
        engine.dispose()


@pytest.mark.unit
def test_sync_engine_for_an_aiomysql_async_engine_is_pymysql() -> None:
    """An application's aiomysql ``AsyncEngine`` (what examples/http_service.py hands the
    pool on MariaDB) gives a PyMySQL engine on the same server and database."""
    from sqlalchemy.ext.asyncio import create_async_engine

    app_engine = create_async_engine("mariadb+aiomysql://app:pw@db.example:3307/shop")
    engine = sync_engine_for(app_engine)
    try:
        assert (engine.url.drivername, engine.url.host, engine.url.port, engine.url.database,
                engine.url.password) == ("mariadb+pymysql", "db.example", 3307, "shop", "pw")
        assert not engine.dialect.is_async
    finally:
        engine.dispose()
        app_engine.sync_engine.dispose()


@pytest.mark.parametrize("backend", [
    "postgresql", "sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb_full)],
    indirect=True)
def test_async_pool_takes_an_async_engine(db_url: str, engine: sa.Engine, bootstrap: str,
                                          topic: str) -> None:
    """An application's own ``AsyncEngine`` (psycopg 3 async on PostgreSQL, aiosqlite on
    SQLite, aiomysql on MariaDB) is what it hands the pool: ``await tx.connection.execute(...)``
    writes in the request's transaction, a request whose block raises leaves neither row nor
    record, and the application's engine reads what the requests committed."""
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    async def main() -> tuple[set[str], list[str]]:
        app_engine = create_async_engine(_async_url(db_url))
        ok: set[str] = set()
        try:
            async with dualwrite.AsyncDualWriterPool(
                    app_engine, {"bootstrap.servers": bootstrap}, id_prefix=unique("aeng"),
                    size=2, timeout_s=20) as pool:

                async def client(i: int) -> None:
                    for n in range(3):
                        value = f"e{i}-{n}"
                        try:
                            async with pool.transaction() as tx:
                                await tx.connection.execute(
                                    sa.text("INSERT INTO pool_rows (value) VALUES (:v)"),
                                    {"v": value})
                                tx.produce(topic, value, value)
                                if n == 1:
                                    raise Boom(value)
                        except Boom:
                            continue
                        ok.add(value)

                await asyncio.gather(*(client(i) for i in range(6)))
            async with app_engine.connect() as conn:
                seen = [r[0] for r in await conn.execute(sa.text("SELECT value FROM pool_rows"))]
        finally:
            await app_engine.dispose()
        return ok, seen

    ok, seen = asyncio.run(main())
    assert len(ok) == 6 * 2
    assert sorted(seen) == sorted(ok)
    assert assert_invariant(engine, bootstrap, topic) == ok


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_group_deeper_than_the_kept_savepoints_commits(db_url: str, engine: sa.Engine,
                                                         bootstrap: str, topic: str) -> None:
    """Grouped requests' savepoints are kept unreleased up to a depth, then released: 1,100
    requests of one writer's group (asyncio tasks, so no thread each) all commit. Kept without
    a bound, SQLAlchemy's recursive end of the savepoint chain raised RecursionError at the
    COMMIT (and PostgreSQL's subtransaction cache overflows past 64)."""
    import asyncio

    n = 1100

    async def main() -> tuple[set[str], int]:
        ok: set[str] = set()
        states: Counter[str] = Counter()
        async with dualwrite.AsyncDualWriterPool(
                db_url, {"bootstrap.servers": bootstrap}, id_prefix=unique("deep"), size=1,
                max_group_size=n + 10, timeout_s=60, acquire_timeout_s=120) as pool:

            async def client(i: int) -> None:
                async with pool.transaction() as tx:
                    await tx.connection.execute(
                        sa.text("INSERT INTO pool_rows (value) VALUES (:v)"), {"v": f"d{i}"})
                    tx.produce(topic, f"d{i}", f"d{i}")
                ok.add(f"d{i}")
                states[str(tx.state)] += 1

            await asyncio.gather(*(client(i) for i in range(n)))
        return ok, max(states.values())

    ok, biggest = asyncio.run(main())
    assert len(ok) == n
    assert biggest > 100, "no deep group formed"
    assert assert_invariant(engine, bootstrap, topic) == ok


_INTERRUPTED_WORKER = r'''
import sys, threading, time
import sqlalchemy as sa
from dualwrite import DualWriterPool
db, bootstrap, topic, prefix = sys.argv[1:5]
pool = DualWriterPool(db, {"bootstrap.servers": bootstrap}, id_prefix=prefix, size=1,
                      timeout_s=5, acquire_timeout_s=60)
holding = threading.Event()
def hold() -> None:
    with pool.transaction() as tx:
        tx.connection.execute(sa.text("INSERT INTO pool_rows VALUES ('held')"))
        holding.set()
        time.sleep(3)
threading.Thread(target=hold, daemon=True).start()
holding.wait()
print("WAITING", flush=True)
try:
    with pool.transaction() as tx:  # waits for its turn behind the held request: Ctrl-C here
        tx.produce(topic, "never")
finally:
    started = time.monotonic()
    pool.close()
    print(f"CLOSED {time.monotonic() - started:.2f}", flush=True)
'''


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_ctrl_c_while_waiting_for_a_turn_leaves_close_bounded(db_url: str, bootstrap: str,
                                                             topic: str) -> None:
    """Ctrl-C while a request waits for its group (issue 31): the group must not take the
    request its caller left, or its thread waits for that block forever and close() for the
    thread (30.0 s before the fix). Exit within the pool's timeout_s + 3 s."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED_WORKER, db_url, bootstrap, topic, unique("sigint")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "WAITING"
    time.sleep(0.5)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=40)
    finally:
        proc.kill()
    took = time.monotonic() - started
    assert "CLOSED" in out, err[-2000:]
    assert "KeyboardInterrupt" in err
    assert took < 5 + 3, (took, out, err[-2000:])
