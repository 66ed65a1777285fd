"""Issue 23 part 1 (and the second-writer part of 5): the transaction handle cannot be misused
into an anomaly, on a real broker and real databases.

Each misuse of ``tx.connection`` that would end or replace the database transaction inside the
block is refused with :class:`TransactionStateError` before anything is committed or rolled
back, and the transaction is abandoned whole even when the application catches the error. Each
case then checks the invariant (rows == read_committed records), that nothing is left open (the
state row can be locked at once; read_committed reaches every partition's end), and that the
writer's next transaction commits.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import dualwrite
from dualwrite import DualWriter, FatalError, TransactionStateError
from dualwrite.writer import PhaseHooks
from tests.support.kafka import read_committed, unique
from tests.support.recipe import assert_clean, rows, write

pytestmark = pytest.mark.timeout(120)

INSERT = sa.text("INSERT INTO app_rows (value) VALUES (:v)")


def _misuse(name: str) -> Callable[[sa.Connection], object]:
    """The misuses of the lent connection that would end or replace its transaction."""
    def session_rollback(conn: sa.Connection) -> None:
        session = Session(bind=conn)
        session.execute(sa.text("SELECT 1"))
        session.rollback()

    def session_commit(conn: sa.Connection) -> None:
        session = Session(bind=conn, join_transaction_mode="control_fully")
        session.execute(INSERT, {"v": "session"})
        session.commit()
        session.close()

    return {
        "rollback": lambda c: c.rollback(),
        "commit": lambda c: c.commit(),
        "begin": lambda c: c.begin(),
        "close": lambda c: c.close(),
        "invalidate": lambda c: c.invalidate(),
        "detach": lambda c: c.detach(),
        "begin_twophase": lambda c: c.begin_twophase(),
        "transaction_object_rollback": lambda c: c.get_transaction().rollback(),  # type: ignore[union-attr]
        "transaction_object_commit": lambda c: c.get_transaction().commit(),  # type: ignore[union-attr]
        "raw_commit": lambda c: c.exec_driver_sql("COMMIT"),
        "raw_rollback": lambda c: c.execute(sa.text(" rollback")),
        "session_rollback": session_rollback,
        "session_commit": session_commit,
    }[name]


MISUSES = ["rollback", "commit", "begin", "close", "invalidate", "detach", "begin_twophase",
           "transaction_object_rollback", "transaction_object_commit", "raw_commit",
           "raw_rollback", "session_rollback", "session_commit"]


@pytest.mark.parametrize("misuse", MISUSES)
def test_misuse_inside_the_block_is_refused_and_abandons_the_transaction(
        misuse: str, writers: Any, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """The application catches the refusal and lets the block end normally: the block fails,
    nothing of it commits on either side."""
    writer = writers(engine, unique("guard"))
    write(writer, topic, ["before"])
    with pytest.raises(TransactionStateError, match=r"misused|refused"), \
            writer.transaction() as tx:
        tx.connection.execute(INSERT, {"v": "doomed"})
        tx.produce(topic, b"doomed", key=b"doomed")
        with pytest.raises(TransactionStateError):
            _misuse(misuse)(tx.connection)
        # Poisoned: nothing more can be added to the transaction.
        with pytest.raises(TransactionStateError):
            tx.connection.execute(INSERT, {"v": "after-misuse"})
        with pytest.raises(TransactionStateError):
            tx.produce(topic, b"after-misuse")
    assert_clean(writer, engine, bootstrap, topic, [b"before"])


def test_rollback_then_going_on_commits_neither_side(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """The SQLAlchemy habit: roll back after an error and go on. Before the guard the rows were
    dropped, the block went on in a new database transaction and the record committed: rows
    ``[b'other']``, records ``[b'doomed']``."""
    writer = writers(engine, unique("guard-habit"))
    with contextlib.suppress(TransactionStateError), writer.transaction() as tx:
        tx.connection.execute(INSERT, {"v": "doomed"})
        tx.produce(topic, b"doomed", key=b"doomed")
        with contextlib.suppress(TransactionStateError):
            tx.connection.rollback()
        with contextlib.suppress(TransactionStateError):
            tx.connection.execute(INSERT, {"v": "other"})
    assert_clean(writer, engine, bootstrap, topic, [])


def test_refusal_propagating_out_of_the_block(writers: Any, engine: sa.Engine, bootstrap: str,
                                              topic: str) -> None:
    writer = writers(engine, unique("guard-prop"))
    with pytest.raises(TransactionStateError), writer.transaction() as tx:
        tx.produce(topic, b"doomed", key=b"doomed")
        tx.connection.execute(INSERT, {"v": "doomed"})
        tx.connection.rollback()
    assert_clean(writer, engine, bootstrap, topic, [])


def test_the_handle_refuses_after_the_block(writers: Any, engine: sa.Engine, bootstrap: str,
                                            topic: str) -> None:
    writer = writers(engine, unique("guard-after"))
    with writer.transaction() as tx:
        kept = tx.connection
        kept.execute(INSERT, {"v": "inside"})
        tx.produce(topic, b"inside", key=b"inside")
    with pytest.raises(TransactionStateError):
        tx.connection.execute(INSERT, {"v": "late"})
    with pytest.raises(TransactionStateError):
        tx.produce(topic, b"late")
    with pytest.raises(TransactionStateError):  # a reference kept from inside the block
        kept.execute(INSERT, {"v": "late"})
    with pytest.raises(TransactionStateError):
        kept.commit()
    assert_clean(writer, engine, bootstrap, topic, [b"inside"])


def test_a_nested_transaction_fails_at_once(writers: Any, engine: sa.Engine, bootstrap: str,
                                            topic: str) -> None:
    writer = writers(engine, unique("guard-nested"))
    with writer.transaction() as tx:
        tx.connection.execute(INSERT, {"v": "outer"})
        tx.produce(topic, b"outer", key=b"outer")
        started = time.monotonic()
        with pytest.raises(TransactionStateError, match="already"), writer.transaction():
            pass
        assert time.monotonic() - started < 2
    assert_clean(writer, engine, bootstrap, topic, [b"outer"])


def test_another_thread_fails_at_once_while_a_transaction_is_open(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    writer = writers(engine, unique("guard-thread"))
    caught: list[BaseException] = []

    def other() -> None:
        try:
            with writer.transaction():
                pass
        except BaseException as exc:
            caught.append(exc)

    with writer.transaction() as tx:
        tx.connection.execute(INSERT, {"v": "first"})
        tx.produce(topic, b"first", key=b"first")
        thread = threading.Thread(target=other)
        started = time.monotonic()
        thread.start()
        thread.join(10)
        assert time.monotonic() - started < 2
    assert len(caught) == 1 and isinstance(caught[0], TransactionStateError), caught
    assert_clean(writer, engine, bootstrap, topic, [b"first"])


def test_savepoints_keep_working(writers: Any, engine: sa.Engine, bootstrap: str,
                                 topic: str) -> None:
    writer = writers(engine, unique("guard-savepoint"))
    with writer.transaction() as tx:
        conn = tx.connection
        conn.execute(INSERT, {"v": "kept"})
        tx.produce(topic, b"kept", key=b"kept")
        savepoint = conn.begin_nested()
        conn.execute(INSERT, {"v": "undone"})
        savepoint.rollback()
        with conn.begin_nested():
            conn.execute(INSERT, {"v": "released"})
        tx.produce(topic, b"released", key=b"released")
        with Session(bind=conn, join_transaction_mode="create_savepoint") as session:
            session.execute(INSERT, {"v": "by-session"})
            session.commit()  # releases the session's savepoint only
        tx.produce(topic, b"by-session", key=b"by-session")
    assert_clean(writer, engine, bootstrap, topic, [b"by-session", b"kept", b"released"])


class _FailOnceAtBegin(PhaseHooks):
    def __init__(self) -> None:
        self.armed = False

    def kafka_begun(self) -> None:
        if self.armed:
            self.armed = False
            raise ZeroDivisionError("hook")


def test_a_hook_failing_before_the_block_is_not_taken_for_a_misuse(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """The connection is already lent when ``kafka_begun`` runs: the writer takes it back
    before rolling back, so the hook's own error reaches the caller."""
    hooks = _FailOnceAtBegin()
    hooks.armed = True  # the first transaction locks first: its connection is lent at once
    writer = writers(engine, unique("guard-hook"), hooks=hooks)
    with pytest.raises(ZeroDivisionError), writer.transaction():
        pytest.fail("the block must not run")
    assert_clean(writer, engine, bootstrap, topic, [])


# -- a second writer of the same id (issue 23 §5) -------------------------------------------------


def _writer(engine: sa.Engine, bootstrap: str, tid: str, **kw: Any) -> DualWriter:
    return DualWriter(engine, {"bootstrap.servers": bootstrap, "transaction.timeout.ms": 60_000},
                      transactional_id=tid, timeout_s=2, **kw)


def test_a_second_writer_of_a_live_id_refuses_unless_taking_over(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str,
        caplog: pytest.LogCaptureFixture) -> None:
    tid = unique("guard-second")
    first = writers(engine, tid)
    write(first, topic, ["first"])
    second = _writer(engine, bootstrap, tid)
    try:
        with pytest.raises(FatalError, match=tid), second.transaction():
            pass
    finally:
        second.close()
    write(first, topic, ["first-again"])  # not fenced
    assert read_committed(bootstrap, topic, timeout_s=10) == rows(engine)

    with caplog.at_level(logging.WARNING, logger="dualwrite.writer.dual_writer"):
        taker = _writer(engine, bootstrap, tid, take_over=True)
        try:
            write(taker, topic, ["taken-over"])
        finally:
            taker.close()
    assert any("taking over" in r.getMessage() and tid in r.getMessage()
               for r in caplog.records), caplog.text
    with contextlib.suppress(dualwrite.DualWriteError):
        first.close()
    assert rows(engine) == [b"first", b"first-again", b"taken-over"]
    assert read_committed(bootstrap, topic, timeout_s=10) == rows(engine)
    # Once the first writer is gone, a plain new writer starts without being asked to.
    again = _writer(engine, bootstrap, tid)
    try:
        write(again, topic, ["again"])
    finally:
        again.close()
    assert read_committed(bootstrap, topic, timeout_s=10) == rows(engine)
