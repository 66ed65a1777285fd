"""Issue 28: atomicity holds whatever a block sends, on a real broker and real databases.

A statement that would end the transaction is refused before it runs, however it is dressed; one
the lexer cannot read is caught after it ran by the driver's own transaction state (shown here
with the lexer switched off), and a commit it made is reported as the heuristic outcome it is. In
a group commit a request's misuse, swallowed error or refused record fails that request alone.
Every case ends with rows == read_committed records and nothing left open.
"""

from __future__ import annotations

import _thread
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dualwrite
from dualwrite import (
    BlockCommittedError,
    DualWriter,
    DualWriterPool,
    HeuristicAbortError,
    InvalidRecordError,
    RecordTooLargeError,
    TransactionStateError,
    UnknownTopicError,
)
from dualwrite.writer import handle
from tests.support.kafka import read_committed, unique
from tests.support.recipe import assert_clean, rows
from tests.support.statements import dressed

pytestmark = pytest.mark.timeout(180)

INSERT = sa.text("INSERT INTO app_rows (value) VALUES (:v)")


def insert(conn: sa.Connection, value: str) -> None:
    conn.execute(INSERT, {"v": value})


# -- a lone writer: the table's first two rows ----------------------------------------------------

SNEAKED = ["/* audit */ ROLLBACK", "-- tag\nCOMMIT", "SELECT 1; COMMIT", "/* x */ commit /* y */"]


@pytest.mark.parametrize("sneaked", SNEAKED)
def test_a_sneaked_statement_is_refused_before_it_runs(
        sneaked: str, writers: Any, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """Before the lexer (main at fc6a726): "/* audit */ ROLLBACK" left the second row committed
    without its record, "-- tag\\nCOMMIT" both rows."""
    writer = writers(engine, unique("sneak"))
    with pytest.raises(RuntimeError, match="the block's own"), writer.transaction() as tx:
        insert(tx.connection, "first")
        tx.produce(topic, b"first", key=b"first")
        with pytest.raises(TransactionStateError, match="refused"):
            tx.connection.exec_driver_sql(sneaked)
        with contextlib.suppress(TransactionStateError):
            insert(tx.connection, "second")
        with contextlib.suppress(TransactionStateError):
            tx.produce(topic, b"second", key=b"second")
        raise RuntimeError("the block's own failure")
    assert_clean(writer, engine, bootstrap, topic, [])


def test_an_interrupted_statement_lets_the_interrupt_through(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """Ctrl-C while a statement of the block waits: SQLAlchemy invalidates the connection, and
    the KeyboardInterrupt (not a TransactionStateError about invalidate()) leaves the block; the
    transaction is abandoned and the writer goes on. Before: "tx.connection.invalidate()
    refused" replaced the interrupt, so a service's Ctrl-C ended in exit 1 with that error."""
    if engine.dialect.name != "postgresql":
        pytest.skip("sqlite3 runs a statement without checking for signals")
    writer = writers(engine, unique("interrupt"))
    interrupt = threading.Timer(0.5, _thread.interrupt_main)
    with pytest.raises(KeyboardInterrupt), writer.transaction() as tx:
        insert(tx.connection, "first")
        tx.produce(topic, b"first", key=b"first")
        interrupt.start()
        tx.connection.execute(sa.text("SELECT pg_sleep(5)"))
    interrupt.join()
    assert_clean(writer, engine, bootstrap, topic, [])


@pytest.fixture
def without_lexer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lexer reads nothing: only the driver's transaction state guards."""
    monkeypatch.setattr(handle, "statement_effects", lambda sql, dialect: frozenset())


@pytest.mark.usefixtures("without_lexer")
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_rollback_the_lexer_missed_is_caught_by_the_driver_state(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """Without the state check (main at fc6a726) the block's later insert committed on its
    own (autocommit) and this test saw rows [b'second']."""
    writer = writers(engine, unique("state-rb"))
    with pytest.raises(TransactionStateError), writer.transaction() as tx:
        insert(tx.connection, "first")
        tx.produce(topic, b"first", key=b"first")
        tx.connection.exec_driver_sql("/* audit */ ROLLBACK")
        with contextlib.suppress(TransactionStateError):
            insert(tx.connection, "second")
    assert_clean(writer, engine, bootstrap, topic, [])


@pytest.mark.usefixtures("without_lexer")
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_commit_the_lexer_missed_is_reported_as_a_heuristic_outcome(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """The rows before the sneaked COMMIT are committed and cannot be taken back: the writer
    says so (BlockCommittedError, to the hook too), nothing after it commits, and the writer
    goes on."""
    handed: list[HeuristicAbortError] = []
    writer = writers(engine, unique("state-commit"),
                     on_heuristic_abort=lambda exc, conn: handed.append(exc))
    with pytest.raises(BlockCommittedError, match="committed the database transaction"), \
            writer.transaction() as tx:
        insert(tx.connection, "first")
        tx.produce(topic, b"first", key=b"first")
        tx.connection.exec_driver_sql("-- tag\nCOMMIT")
        with contextlib.suppress(TransactionStateError):
            insert(tx.connection, "second")
        raise RuntimeError("the block's own failure")
    assert len(handed) == 1 and isinstance(handed[0], BlockCommittedError)
    assert rows(engine) == [b"first"]  # committed by the block itself, reported above
    assert read_committed(bootstrap, topic, timeout_s=10) == []
    with engine.begin() as conn:  # the application repairs: undo the row
        conn.exec_driver_sql("DELETE FROM app_rows")
    assert_clean(writer, engine, bootstrap, topic, [])


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_failed_statement_the_block_went_on_after_commits_nothing(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    writer = writers(engine, unique("swallowed"))
    with pytest.raises(TransactionStateError, match="failed and the block went on"), \
            writer.transaction() as tx:
        insert(tx.connection, "first")
        tx.produce(topic, b"first", key=b"first")
        with contextlib.suppress(sa.exc.IntegrityError):
            insert(tx.connection, "first")
    assert_clean(writer, engine, bootstrap, topic, [])


# -- a group commit: one request's failure stays its own ------------------------------------------


@pytest.fixture
def pool(engine: sa.Engine, bootstrap: str) -> Iterator[DualWriterPool]:
    """One writer, so that requests queued behind the first form one group."""
    made = DualWriterPool(engine, {"bootstrap.servers": bootstrap}, id_prefix=unique("guard"),
                          size=1, group_commit=True, timeout_s=20)
    yield made
    made.close()


def run_group(pool: DualWriterPool, blocks: list[Callable[[Any], None]]
              ) -> list[BaseException | str]:
    """Run ``blocks`` as one group (the first waits until the others queued behind it); each
    one's outcome: "ok" (told success) or the exception it got."""
    outcomes: list[BaseException | str] = ["?"] * len(blocks)
    queued = threading.Event()

    def request(i: int) -> None:
        if i:
            queued.wait()
        try:
            with pool.transaction() as tx:
                if i == 0:
                    queued.set()
                    time.sleep(0.3)
                blocks[i](tx)
            outcomes[i] = "ok"
        except Exception as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=request, args=(i,)) for i in range(len(blocks))]
    for t in threads:
        t.start()
        time.sleep(0.02)  # in order
    for t in threads:
        t.join(60)
    return outcomes


def writes(value: str) -> Callable[[Any], None]:
    def block(tx: Any) -> None:
        insert(tx.connection, value)
        tx.produce(TOPIC[0], value.encode(), key=value.encode())
    return block


TOPIC = [""]


def _misbehaving(case: str) -> Callable[[Any], None]:
    def caught(fn: Callable[[Any], object]) -> Callable[[Any], None]:
        def block(tx: Any) -> None:
            writes("b")(tx)
            with contextlib.suppress(dualwrite.DualWriteError, sa.exc.DBAPIError):
                fn(tx)
        return block

    return {
        "raw_rollback": caught(lambda tx: tx.connection.exec_driver_sql("/* x */ ROLLBACK")),
        "raw_commit": caught(lambda tx: tx.connection.exec_driver_sql("-- y\nCOMMIT")),
        "rollback_method": caught(lambda tx: tx.connection.rollback()),
        "release_own_savepoint": caught(
            lambda tx: tx.connection.exec_driver_sql("RELEASE SAVEPOINT dualwrite_request_3")),
        "rollback_to_another_requests_savepoint": caught(
            lambda tx: tx.connection.exec_driver_sql(
                "ROLLBACK TO SAVEPOINT dualwrite_request_2")),
        "own_savepoints": caught(_own_savepoints),
        "swallowed_error": caught(lambda tx: insert(tx.connection, "a")),
        "wrong_type": caught(lambda tx: tx.produce(TOPIC[0], 123)),
        "unknown_topic": caught(lambda tx: tx.produce("no-such-topic-" + unique("t"), b"b")),
        "too_large": caught(lambda tx: tx.produce(TOPIC[0], b"x" * 2_000_000)),
    }[case]


def _own_savepoints(tx: Any) -> None:
    """SQLAlchemy's savepoints of the request's own: allowed."""
    undone = tx.connection.begin_nested()
    insert(tx.connection, "undone")
    undone.rollback()
    with tx.connection.begin_nested():
        insert(tx.connection, "b-nested")
    tx.produce(TOPIC[0], b"b-nested", key=b"b-nested")


EXPECTED: dict[str, type[Exception] | None] = {
    "own_savepoints": None,
    "raw_rollback": TransactionStateError, "raw_commit": TransactionStateError,
    "rollback_method": TransactionStateError, "release_own_savepoint": TransactionStateError,
    "rollback_to_another_requests_savepoint": TransactionStateError,
    "swallowed_error": TransactionStateError, "wrong_type": InvalidRecordError,
    "unknown_topic": UnknownTopicError, "too_large": RecordTooLargeError,
}


@pytest.mark.parametrize("case", list(EXPECTED))
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_requests_misuse_fails_it_alone(case: str, pool: DualWriterPool, engine: sa.Engine,
                                          bootstrap: str, topic: str) -> None:
    """Request "b" misbehaves in a group with "a" (first), "a2" and "c": it alone fails,
    typed; the others are told success and have both their row and their record.

    On main at fc6a726: raw_rollback told all of them success with no rows at all; the record
    cases and swallowed_error failed every request of the group."""
    TOPIC[0] = topic
    if case == "swallowed_error":
        with pool.transaction() as tx:  # "a" exists: "b"'s insert of "a" fails
            writes("a")(tx)
        first = writes("a0")
    else:
        first = writes("a")
    outcomes = run_group(pool, [first, writes("a2"), _misbehaving(case), writes("c")])
    assert [outcomes[i] for i in (0, 1, 3)] == ["ok"] * 3, outcomes
    expected = {"a", "a2", "c"} | ({"a0"} if case == "swallowed_error" else set())
    failure = EXPECTED[case]
    if failure is None:
        assert outcomes[2] == "ok", outcomes
        expected |= {"b", "b-nested"}
    else:
        assert isinstance(outcomes[2], failure), outcomes
    assert {r.decode() for r in rows(engine)} == expected
    assert read_committed(bootstrap, topic, timeout_s=10) == rows(engine)
    with pool.transaction() as tx:
        writes("after")(tx)
    assert read_committed(bootstrap, topic, timeout_s=10) == rows(engine)


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_a_misuse_that_costs_the_transaction_fails_the_group_and_tells_no_one_success(
        pool: DualWriterPool, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """A Transaction object's rollback: SQLAlchemy deactivates it before the refusal, so the
    group's transaction cannot go on: the requests in it fail, none is told success; "c",
    not yet in it, commits in the next group."""
    TOPIC[0] = topic

    def object_rollback(tx: Any) -> None:
        writes("b")(tx)
        with contextlib.suppress(TransactionStateError):
            tx.connection.get_transaction().rollback()

    outcomes = run_group(pool, [writes("a"), object_rollback, writes("c")])
    assert all(isinstance(o, TransactionStateError) for o in outcomes[:2]), outcomes
    assert outcomes[2] == "ok", outcomes
    assert rows(engine) == [b"c"] == read_committed(bootstrap, topic, timeout_s=10)
    with pool.transaction() as tx:
        writes("after")(tx)
    assert read_committed(bootstrap, topic, timeout_s=10) == rows(engine) == [b"after", b"c"]


# -- the property: any dressing of a control statement, lone and grouped --------------------------

_SETTINGS = settings(max_examples=10, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])
_CONTROL = st.sampled_from(["ends", "savepoint"]).flatmap(
    lambda kind: dressed("postgresql", dualwrite.database.statements.Effect.ENDS
                          if kind == "ends" else
                          dualwrite.database.statements.Effect.SAVEPOINT))


@_SETTINGS
@given(sql=_CONTROL)
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_property_lone_writer(sql: str, lone_writer: DualWriter, engine: sa.Engine,
                              bootstrap: str, topic: str) -> None:
    """Insert + produce, the dressed statement (its error caught), insert + produce: both rows
    and both records, or neither; nothing left open."""
    writer = lone_writer
    n = len(rows(engine))
    with contextlib.suppress(dualwrite.DualWriteError), writer.transaction() as tx:
        for part in ("1", "2"):
            with contextlib.suppress(dualwrite.DualWriteError, sa.exc.DBAPIError):
                value = f"{n}-{part}"
                insert(tx.connection, value)
                tx.produce(topic, value.encode(), key=value.encode())
                if part == "1":
                    tx.connection.exec_driver_sql(sql)
    assert read_committed(bootstrap, topic, timeout_s=10) == rows(engine)
    with engine.connect() as conn, conn.begin():  # nobody holds the state row's lock
        dualwrite.writer.StateStore(engine).lock_row(conn, writer.transactional_id,
                                                     timeout_s=2)


@_SETTINGS
@given(sql=_CONTROL)
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_property_group(sql: str, engine: sa.Engine, bootstrap: str, topic: str,
                        pool: DualWriterPool) -> None:
    """The dressed statement in the second of three requests of one group: it alone may fail;
    every request told success has its row and its record."""
    TOPIC[0] = topic
    n = len(rows(engine))

    def dressed(tx: Any) -> None:
        writes(f"{n}-b")(tx)
        with contextlib.suppress(dualwrite.DualWriteError, sa.exc.DBAPIError):
            tx.connection.exec_driver_sql(sql)

    outcomes = run_group(pool, [writes(f"{n}-a"), dressed, writes(f"{n}-c")])
    assert outcomes[0] == "ok" and outcomes[2] == "ok", outcomes
    assert isinstance(outcomes[1], TransactionStateError), outcomes
    assert read_committed(bootstrap, topic, timeout_s=10) == rows(engine)
    assert {f"{n}-a", f"{n}-c"} <= {r.decode() for r in rows(engine)}


@pytest.fixture
def lone_writer(writers: Any, engine: sa.Engine) -> DualWriter:
    """One writer for every example of a property test."""
    made: DualWriter = writers(engine, unique("prop-lone"))
    return made


# -- MariaDB: implicit commits ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["mariadb"], indirect=True)
def test_mariadb_implicit_commits_are_refused_or_reported(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """DDL commits implicitly on MariaDB: refused before it runs. A stored procedure that
    commits cannot be read from its CALL: the OK packet's status shows the transaction ended,
    and the writer reports a possible commit (the database cannot tell which)."""
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE PROCEDURE sneaky() BEGIN INSERT INTO app_rows VALUES "
                             "('by-procedure'); COMMIT; END")
    writer = writers(engine, unique("maria-implicit"))
    with pytest.raises(TransactionStateError, match="misused"), writer.transaction() as tx:
        insert(tx.connection, "first")
        tx.produce(topic, b"first", key=b"first")
        with pytest.raises(TransactionStateError, match="refused"):
            tx.connection.exec_driver_sql("/* migration */ CREATE TABLE later (a int)")
    assert_clean(writer, engine, bootstrap, topic, [])

    with pytest.raises(BlockCommittedError, match="cannot tell"), writer.transaction() as tx:
        insert(tx.connection, "before-call")
        tx.produce(topic, b"before-call", key=b"before-call")
        tx.connection.exec_driver_sql("CALL sneaky()")
        with pytest.raises(TransactionStateError):
            insert(tx.connection, "after-call")
    assert rows(engine) == [b"before-call", b"by-procedure", b"next"]
    assert read_committed(bootstrap, topic, timeout_s=10) == [b"next"]
    with engine.begin() as conn:  # the application repairs
        conn.exec_driver_sql("DELETE FROM app_rows WHERE value IN ('before-call', "
                             "'by-procedure')")
    assert read_committed(bootstrap, topic, timeout_s=10) == rows(engine)
