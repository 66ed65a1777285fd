"""Issue 28 point 7: a closed DualWriter refuses to be used again, and gives its id's lease back.

A closed writer used again raises :class:`TransactionStateError` ("the writer is closed") before
it opens anything (no claim, no producer session, no connection, no lock, no lease); and once
closed, a new writer of the same transactional id in the same process starts at once instead of
waiting for the lease as if another live process held it. On a real broker and real databases.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa

from dualwrite import DualWriter, TransactionStateError
from dualwrite.writer import Leases, StateStore
from tests.support.kafka import read_committed, unique
from tests.support.recipe import rows, write

pytestmark = pytest.mark.timeout(120)

# A new writer's first transaction on a free id takes well under a second; one that finds the
# lease held waits 5 s (_LEASE_WAIT_S) before it refuses to start.
_QUICK_S = 2.0


def _assert_id_free(engine: sa.Engine, tid: str) -> None:
    """Nobody holds the id's lease or its state row's lock."""
    with Leases(engine).hold_free(engine, [tid]) as held:
        assert held.ids == {tid}, "the closed writer still holds its lease"
    with engine.connect() as conn, conn.begin():
        StateStore(engine).lock_row(conn, tid, timeout_s=2)


def test_closed_writer_refuses_with_typed_error(writers: Any, engine: sa.Engine, bootstrap: str,
                                                topic: str) -> None:
    tid = unique("closed")
    writer: DualWriter = writers(engine, tid)
    write(writer, topic, ["before-close"])
    writer.close()
    stored = StateStore(engine).read(tid)
    assert stored is not None

    ran = False
    with (pytest.raises(TransactionStateError, match=r"writer is closed") as refused,
          writer.transaction() as tx):
        ran = True
        tx.produce(topic, b"after-close")
    assert not ran
    assert tid in str(refused.value)
    with pytest.raises(TransactionStateError, match=r"writer is closed"):
        _ = writer.producer
    writer.close()  # idempotent

    # Nothing was opened: no claim (the fencing generation is the one at close), no lease, no lock.
    again = StateStore(engine).read(tid)
    assert again is not None and again.fencing_generation == stored.fencing_generation
    _assert_id_free(engine, tid)
    assert rows(engine) == [b"before-close"]
    assert read_committed(bootstrap, topic) == rows(engine)


def test_new_writer_starts_at_once_after_close(writers: Any, engine: sa.Engine, bootstrap: str,
                                               topic: str) -> None:
    """Even when the application tried the closed writer again before it made a new one."""
    tid = unique("reopen")
    first: DualWriter = writers(engine, tid)
    write(first, topic, ["first"])
    first.close()
    refused: BaseException | None = None
    try:
        write(first, topic, ["closed"])
    except Exception as exc:
        refused = exc

    second: DualWriter = writers(engine, tid)
    started = time.monotonic()
    write(second, topic, ["second"])
    took = time.monotonic() - started
    assert took < _QUICK_S, f"the second writer's first transaction took {took:.2f} s"
    assert isinstance(refused, TransactionStateError), refused
    assert rows(engine) == [b"first", b"second"]
    assert read_committed(bootstrap, topic) == rows(engine)


def test_close_releases_lease_when_clearing_the_state_fails(
        writers: Any, engine: sa.Engine, bootstrap: str, topic: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """close() gives the lease and the connection back even if a step before fails."""
    tid = unique("close-fails")
    first: DualWriter = writers(engine, tid)
    write(first, topic, ["first"])

    def failing(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("injected: clearing the state failed")

    with monkeypatch.context() as patched:
        patched.setattr(StateStore, "compare_and_set", failing)
        with pytest.raises(RuntimeError, match="injected"):
            first.close()
    _assert_id_free(engine, tid)
    with pytest.raises(TransactionStateError, match=r"writer is closed"):
        write(first, topic, ["closed"])

    second: DualWriter = writers(engine, tid)
    started = time.monotonic()
    write(second, topic, ["second"])
    took = time.monotonic() - started
    assert took < _QUICK_S, f"the second writer's first transaction took {took:.2f} s"
    assert rows(engine) == [b"first", b"second"]
    assert read_committed(bootstrap, topic) == rows(engine)
