"""``pool.run(fn, ...)`` and ``await apool.run(fn, ...)``: a request as a callable, run in a
writer's thread, against a real broker and PostgreSQL.

With group commit the calls of a group run without a savepoint; when one fails the group is
rolled back on both sides, its caller gets its own error, and the group's other calls run again
(each in a savepoint). The invariant of every test: rows == read_committed records, each once;
a call that returned committed exactly its last run, a call that raised left nothing, and no
call ran more than twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from dualwrite import (
    AsyncDualWriterPool,
    DualWriterPool,
    DualWriteTransaction,
    GroupedTransaction,
    TransactionStateError,
)
from tests.support.kafka import read_committed, unique
from tests.support.tables import add_value_table

pytestmark = pytest.mark.timeout(180)

Tx = DualWriteTransaction | GroupedTransaction
QUICK_S = 10.0
"""What "completes within a few seconds" means here (the writers' own timeouts are 20 s)."""


@pytest.fixture
def backend() -> str:
    return "postgresql"


@pytest.fixture
def db_url(db_url: str) -> str:
    """dualwrite's tables and the pool tests' table ``pool_rows``."""
    return add_value_table(db_url, "pool_rows")


@pytest.fixture
def no_replaced_writer(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fails the test if the pool replaced a writer (a failing call must not break one)."""
    caplog.set_level(logging.WARNING, logger="dualwrite.writer.pool")
    yield
    replaced = [r.getMessage() for r in caplog.get_records("call")
                if "replaced after" in r.getMessage()]
    assert replaced == []


class Boom(Exception):
    """The application's own failure inside a call."""


def insert(conn: sa.Connection, value: str) -> None:
    conn.execute(sa.text("INSERT INTO pool_rows (value) VALUES (:v)"), {"v": value})


def assert_invariant(engine: sa.Engine, bootstrap: str, topic: str) -> set[str]:
    """Rows == read_committed records, each once (read_committed also fails if a Kafka
    transaction is left open); the rows."""
    records = [r.decode() for r in read_committed(bootstrap, topic)]
    assert [v for v, n in Counter(records).items() if n > 1] == []
    with engine.connect() as conn:
        in_db = [r[0] for r in conn.exec_driver_sql("SELECT value FROM pool_rows")]
    assert sorted(in_db) == sorted(records)
    return set(in_db)


class Calls:
    """What the calls did, seen from inside them (in the writers' threads): how many times
    each key ran, and the exception each failing run raised."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.lock = threading.Lock()
        self.runs: Counter[str] = Counter()
        self.raised: dict[str, list[BaseException]] = {}

    def write(self, tx: Tx, key: str, *, fail: bool = False, pause_s: float = 0.003
              ) -> tuple[str, int]:
        """The call under test: one row and one record of ``key``; raises Boom after both if
        ``fail``; returns ``(key, this run's number)``."""
        with self.lock:
            self.runs[key] += 1
            run = self.runs[key]
        insert(tx.connection, key)
        tx.produce(self.topic, key, key)
        time.sleep(pause_s)  # calls pile up behind it: groups form
        if fail:
            exc = Boom(f"boom {key}")
            with self.lock:
                self.raised.setdefault(key, []).append(exc)
            raise exc
        return key, run

    def check(self, ok: dict[str, tuple[str, int]], failed: dict[str, BaseException],
              committed: set[str]) -> None:
        """Returned calls committed their last run's value, failed ones got their own
        exception and left nothing, nothing ran more than twice."""
        assert committed == set(ok)
        for key, value in ok.items():
            assert value == (key, self.runs[key]), "not the last run's return value"
        for key, exc in failed.items():
            assert type(exc) is Boom and str(exc) == f"boom {key}", (key, exc)
            assert self.raised[key] == [exc] and self.raised[key][0] is exc
            assert self.runs[key] == 1
        assert max(self.runs.values()) <= 2, self.runs.most_common(3)


def failing(i: int, n: int) -> bool:
    return n % 4 == 3 or (i + n) % 7 == 0


# -- 1. many threads ----------------------------------------------------------------------------


def test_concurrent_calls_commit_once_and_failures_roll_back_alone(
        engine: sa.Engine, bootstrap: str, topic: str, no_replaced_writer: None) -> None:
    """12 threads x 8 calls over 2 writers, some failing by key: every returned call's row and
    record exist once (its last run's return value), a failing call's caller gets exactly its
    own exception and nothing of it exists, each call ran at most twice, and some groups did
    run again (the path under test was taken).

    A rerun that committed its first run too would show as a duplicate record (the Kafka side)
    or as an IntegrityError reaching a caller (its own row already committed); a failing
    call's first-run records of the others, left in Kafka, as records without rows."""
    calls = Calls(topic)
    ok: dict[str, tuple[str, int]] = {}
    failed: dict[str, BaseException] = {}
    unexpected: list[BaseException] = []
    out = threading.Lock()
    pool = DualWriterPool(engine, {"bootstrap.servers": bootstrap}, id_prefix=unique("run"),
                          size=2, timeout_s=20)

    def client(i: int) -> None:
        for n in range(8):
            key = f"c{i}-{n}"
            try:
                value = pool.run(calls.write, key, fail=failing(i, n))
            except Boom as exc:
                with out:
                    failed[key] = exc
            except BaseException as exc:
                unexpected.append(exc)
                return
            else:
                with out:
                    ok[key] = value

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    pool.close()
    assert unexpected == []
    assert set(failed) == {f"c{i}-{n}" for i in range(12) for n in range(8) if failing(i, n)}
    calls.check(ok, failed, assert_invariant(engine, bootstrap, topic))
    assert 2 in calls.runs.values(), "no group ran again"


# -- 2. misuse of the connection ----------------------------------------------------------------


def _commit(tx: Tx) -> None:
    tx.connection.commit()  # raises TransactionStateError out of the call


def _commit_statement_caught(tx: Tx) -> None:
    with contextlib.suppress(TransactionStateError):  # it goes on: refused all the same
        tx.connection.exec_driver_sql("COMMIT")


def _failed_statement_went_on(tx: Tx) -> None:
    with contextlib.suppress(sa.exc.IntegrityError):  # the leader's key: a duplicate
        insert(tx.connection, "lead")


def _transaction_object_commit(tx: Tx) -> None:
    tx.connection.get_transaction().commit()  # type: ignore[union-attr]


@pytest.mark.parametrize("misuse", [
    _commit, _commit_statement_caught, _failed_statement_went_on,
    _transaction_object_commit,
], ids=["commit", "COMMIT-caught", "went-on-after-failure", "transaction-object-commit"])
def test_a_call_misusing_the_connection_fails_alone_and_the_others_commit_once(
        engine: sa.Engine, bootstrap: str, topic: str, misuse: Callable[[Tx], None]) -> None:
    """One writer: a slow leader call, then 6 calls queued behind it (one group of bare
    calls); the 4th misuses the connection. It gets TransactionStateError (IntegrityError
    never reaches it: it went on, which is the misuse); the group is rolled back and the
    leader and the two before the misuser run again (twice), the ones after join the next
    group; every other call commits exactly once."""
    calls = Calls(topic)
    pool = DualWriterPool(engine, {"bootstrap.servers": bootstrap}, id_prefix=unique("run"),
                          size=1, collectors=1, timeout_s=20)
    outcomes: dict[str, object] = {}
    leader_in = threading.Event()

    def lead(tx: Tx) -> tuple[str, int]:
        leader_in.set()
        return calls.write(tx, "lead", pause_s=0.4)

    def misusing(tx: Tx) -> str:
        with calls.lock:
            calls.runs["bad"] += 1
        insert(tx.connection, "bad")
        tx.produce(topic, "bad", "bad")
        misuse(tx)
        return "bad"

    def client(key: str) -> None:
        try:
            if key == "lead":
                outcomes[key] = pool.run(lead)
            elif key == "bad":
                outcomes[key] = pool.run(misusing)
            else:
                outcomes[key] = pool.run(calls.write, key)
        except BaseException as exc:
            outcomes[key] = exc

    threads = [threading.Thread(target=client, args=("lead",))]
    threads[0].start()
    assert leader_in.wait(QUICK_S)
    for key in ["m1", "m2", "m3", "bad", "m4", "m5"]:
        threads.append(threading.Thread(target=client, args=(key,)))
        threads[-1].start()
        time.sleep(0.03)  # queued in this order behind the leader
    for t in threads:
        t.join(60)
    try:
        with pool.transaction() as tx:  # the writer is fine after it
            insert(tx.connection, "after")
            tx.produce(topic, "after", "after")
    finally:
        pool.close()
    assert isinstance(outcomes.pop("bad"), TransactionStateError)
    ok = {k: v for k, v in outcomes.items() if isinstance(v, tuple)}
    assert ok.keys() == {"lead", "m1", "m2", "m3", "m4", "m5"}, outcomes
    assert calls.runs["bad"] == 1
    assert calls.runs["lead"] == 2, "the group did not run again"
    calls.check(ok, {}, assert_invariant(engine, bootstrap, topic) - {"after"})


# -- 3. blocks and calls mixed ------------------------------------------------------------------


def test_blocks_and_calls_mixed_in_groups(engine: sa.Engine, bootstrap: str, topic: str,
                                          no_replaced_writer: None) -> None:
    """12 threads over 2 writers alternate ``with pool.transaction()`` blocks and ``pool.run``
    calls, some of each failing: the same invariant (a call after a block in a group runs in a
    savepoint, a block never runs twice)."""
    calls = Calls(topic)
    ok: dict[str, tuple[str, int]] = {}
    failed: dict[str, BaseException] = {}
    unexpected: list[BaseException] = []
    out = threading.Lock()
    pool = DualWriterPool(engine, {"bootstrap.servers": bootstrap}, id_prefix=unique("mix"),
                          size=2, timeout_s=20)

    def client(i: int) -> None:
        for n in range(8):
            key = f"x{i}-{n}"
            fail = failing(i, n)
            try:
                if (i + n) % 2:
                    value = pool.run(calls.write, key, fail=fail)
                else:
                    with pool.transaction() as tx:
                        value = calls.write(tx, key, fail=fail)
            except Boom as exc:
                with out:
                    failed[key] = exc
            except BaseException as exc:
                unexpected.append(exc)
                return
            else:
                with out:
                    ok[key] = value

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    pool.close()
    assert unexpected == []
    calls.check(ok, failed, assert_invariant(engine, bootstrap, topic))
    blocks = {f"x{i}-{n}" for i in range(12) for n in range(8) if not (i + n) % 2}
    assert all(calls.runs[k] == 1 for k in blocks)


# -- 4. without group commit --------------------------------------------------------------------


def test_without_group_commit_a_call_is_one_transaction(engine: sa.Engine, bootstrap: str,
                                                        topic: str) -> None:
    """``group_commit=False``: each call is its own transaction, run once; it returns its value
    or raises its own exception with both sides rolled back."""
    calls = Calls(topic)
    ok: dict[str, tuple[str, int]] = {}
    failed: dict[str, BaseException] = {}
    out = threading.Lock()
    states: set[str] = set()
    pool = DualWriterPool(engine, {"bootstrap.servers": bootstrap}, id_prefix=unique("one"),
                          size=2, group_commit=False, timeout_s=20)

    def client(i: int) -> None:
        for n in range(6):
            key = f"s{i}-{n}"
            try:
                value = pool.run(calls.write, key, fail=failing(i, n))
            except Boom as exc:
                with out:
                    failed[key] = exc
            else:
                with out:
                    ok[key] = value

    def with_state(tx: Tx) -> str:
        insert(tx.connection, "state")
        tx.produce(topic, "state", "state")
        assert isinstance(tx, DualWriteTransaction)  # the writer's own handle
        return "state"

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        states.add(pool.run(with_state))
    finally:
        pool.close()
    assert len(failed) == sum(failing(i, n) for i in range(4) for n in range(6)) > 0
    calls.check(ok, failed, assert_invariant(engine, bootstrap, topic) - states)
    assert set(calls.runs.values()) == {1}


# -- 5. asyncio ---------------------------------------------------------------------------------


@pytest.mark.parametrize("group_commit", [True, False], ids=["group", "single"])
def test_async_run_from_many_tasks(db_url: str, engine: sa.Engine, bootstrap: str, topic: str,
                                   group_commit: bool) -> None:
    """40 tasks x 4 ``await apool.run(fn, key)`` over 2 writers, some failing: the same
    invariant; the event loop only awaits."""
    calls = Calls(topic)
    ok: dict[str, tuple[str, int]] = {}
    failed: dict[str, BaseException] = {}

    async def main() -> None:
        async with asyncio.timeout(120), AsyncDualWriterPool(
                db_url, {"bootstrap.servers": bootstrap}, id_prefix=unique("arun"), size=2,
                group_commit=group_commit, timeout_s=20) as apool:

            async def client(i: int) -> None:
                for n in range(4):
                    key = f"a{i}-{n}"
                    try:
                        ok[key] = await apool.run(calls.write, key, fail=failing(i, n))
                    except Boom as exc:
                        failed[key] = exc

            await asyncio.gather(*(client(i) for i in range(40)))

    asyncio.run(main())
    assert len(ok) + len(failed) == 160 and failed
    calls.check(ok, failed, assert_invariant(engine, bootstrap, topic))
    if group_commit:
        assert 2 in calls.runs.values(), "no group ran again"
    else:
        assert set(calls.runs.values()) == {1}


def test_async_run_cancelled_while_waiting_never_ran_or_committed(
        db_url: str, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """One writer, busy with a 1 s call; 30 tasks ``asyncio.wait_for(apool.run(...), t)`` with
    t from 0.02 to 2.4 s (each call takes 0.05 s in the writer, one of them fails so that its
    group runs again). A task cancelled before a group took its call: it never ran, nothing of
    it exists. After: its group decided it, it committed once. Then the pool serves at once."""
    calls = Calls(topic)
    ok: dict[str, tuple[str, int]] = {}
    failed: dict[str, BaseException] = {}
    cancelled: set[str] = set()

    async def main() -> float:
        async with asyncio.timeout(90), AsyncDualWriterPool(
                db_url, {"bootstrap.servers": bootstrap}, id_prefix=unique("acancel"), size=1,
                collectors=1, timeout_s=20) as apool:
            busy = asyncio.create_task(apool.run(calls.write, "busy", pause_s=1.0))
            while not calls.runs["busy"]:
                await asyncio.sleep(0.01)

            async def client(i: int) -> None:
                key = f"k{i}"
                try:
                    ok[key] = await asyncio.wait_for(
                        apool.run(calls.write, key, fail=i == 25, pause_s=0.05),
                        timeout=0.02 + 0.08 * i)
                except TimeoutError:
                    cancelled.add(key)
                except Boom as exc:
                    failed[key] = exc

            tasks = []
            for i in range(30):
                tasks.append(asyncio.create_task(client(i)))
                await asyncio.sleep(0)  # queued in order
            await asyncio.gather(*tasks)
            ok["busy"] = await busy
            started = time.monotonic()
            ok["after"] = await asyncio.wait_for(apool.run(calls.write, "after"), QUICK_S)
            return time.monotonic() - started

    took = asyncio.run(main())
    assert took < 5, took
    committed = assert_invariant(engine, bootstrap, topic)
    never_ran = {k for k in cancelled if calls.runs[k] == 0}
    ran = {k for k in cancelled - never_ran if k not in calls.raised}
    assert never_ran and ran, (never_ran, ran)
    assert not never_ran & committed
    assert ran <= committed, "a call cancelled after a group took it did not commit"
    calls.check(ok, failed, committed - ran)
    assert max(calls.runs.values()) <= 2
