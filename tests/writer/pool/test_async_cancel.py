"""AsyncDualWriterPool: every way an asyncio request ends (issue 28, point 4).

A request may be cancelled (a client disconnect, ``asyncio.timeout``, a TaskGroup's shutdown)
while it waits for its turn, while its block runs, while one of its statements is queued in or
running on the writer's thread, and while it waits for its group's commit. Each case: the
cancelled request's effects are rolled back (or, once its group is decided, ``tx.state`` tells
the outcome), the other requests of its group finish normally, no writer is replaced and nothing
is kept (lock, Kafka transaction, collector slot): rows == read_committed records and a
following request succeeds quickly. Small pools (``size=1``, ``collectors=1``) so that requests
queue.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite import AsyncDualWriterPool, TransactionStateError
from dualwrite.participant import PreparedTxnState
from dualwrite.writer import PhaseHooks
from tests.support.kafka import read_committed, unique
from tests.support.tables import add_value_table

pytestmark = pytest.mark.timeout(240)

INSERT = sa.text("INSERT INTO pool_rows (value) VALUES (:v)")
# The row is written after half a second on the server: a statement still running when its
# caller times out.
SLOW_INSERT = sa.text("INSERT INTO pool_rows (value) SELECT :v FROM pg_sleep(0.5)")
QUICK_S = 10.0
"""What "completes within a few seconds" means here (the writers' own timeouts are 20 s)."""


@pytest.fixture
def backend() -> str:
    """PostgreSQL (the cancelled statement's case sleeps on the server)."""
    return "postgresql"


@pytest.fixture
def db_url(db_url: str) -> str:
    """dualwrite's tables and the pool tests' table ``pool_rows``."""
    return add_value_table(db_url, "pool_rows")


@pytest.fixture
def no_replaced_writer(caplog: pytest.LogCaptureFixture) -> Any:
    """Fails the test if the pool replaced a writer (a cancellation must not break one)."""
    caplog.set_level(logging.WARNING, logger="dualwrite.writer.pool")
    yield
    replaced = [r.getMessage() for r in caplog.get_records("call")
                if "replaced after" in r.getMessage()]
    assert replaced == []


class Sibling(Exception):
    """A task of the same TaskGroup fails."""


def rows(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return {r[0] for r in conn.exec_driver_sql("SELECT value FROM pool_rows")}


def assert_invariant(engine: sa.Engine, bootstrap: str, topic: str) -> set[str]:
    """Rows == read_committed records, each once (read_committed also fails if a Kafka
    transaction is left open: the partition's end is never reached); the rows."""
    records = [r.decode() for r in read_committed(bootstrap, topic)]
    assert len(records) == len(set(records))
    in_db = rows(engine)
    assert in_db == set(records)
    return in_db


def make_pool(db_url: str, bootstrap: str, **kw: Any) -> AsyncDualWriterPool:
    settings: dict[str, Any] = {"size": 1, "collectors": 1, "timeout_s": 20,
                                "acquire_timeout_s": 5, **kw}
    return AsyncDualWriterPool(db_url, {"bootstrap.servers": bootstrap},
                               id_prefix=unique("acancel"), **settings)


async def write(pool: AsyncDualWriterPool, topic: str, value: str,
                seen: list[dualwrite.AsyncTransaction] | None = None) -> PreparedTxnState | None:
    """One request: a row and its record; the transaction's state."""
    async with pool.transaction() as tx:
        if seen is not None:
            seen.append(tx)
        await tx.connection.execute(INSERT, {"v": value})
        tx.produce(topic, value, value)
    return tx.state


async def follow_up(pool: AsyncDualWriterPool, topic: str, value: str) -> None:
    """A following request succeeds, quickly."""
    state = await asyncio.wait_for(write(pool, topic, value), QUICK_S)
    assert state is not None


class Held:
    """A request that writes its row and record, then stays in its block until released."""

    def __init__(self, pool: AsyncDualWriterPool, topic: str, value: str) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.tx: dualwrite.AsyncTransaction | None = None
        self.task = asyncio.create_task(self._run(pool, topic, value))

    async def _run(self, pool: AsyncDualWriterPool, topic: str,
                   value: str) -> PreparedTxnState | None:
        async with pool.transaction() as tx:
            self.tx = tx
            await tx.connection.execute(INSERT, {"v": value})
            tx.produce(topic, value, value)
            self.entered.set()
            await self.release.wait()
        return tx.state

    async def wait_entered(self) -> None:
        await asyncio.wait_for(self.entered.wait(), QUICK_S)

    async def finish(self) -> PreparedTxnState | None:
        """Release it; it completes, committed, within a few seconds."""
        self.release.set()
        state = await asyncio.wait_for(self.task, QUICK_S)
        assert state is not None
        return state


async def queued(make: Callable[[], Coroutine[Any, Any, Any]]) -> asyncio.Task[Any]:
    """A request's task, run until it waits for its turn (handed to the writers)."""
    task = asyncio.create_task(make())
    for _ in range(3):
        await asyncio.sleep(0)
    return task


async def cancelled(task: asyncio.Task[Any]) -> None:
    """Cancel ``task``; it ends with CancelledError within a few seconds."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=QUICK_S)
    assert done, "the cancelled request did not end"
    assert task.cancelled()


def block_loop_until_taken(pool: AsyncDualWriterPool) -> None:
    """Block the event loop (so the request's task cannot see its turn) until a writer took the
    queued request, and a little longer: a cancellation then finds it taken."""
    deadline = time.monotonic() + QUICK_S
    waiting = getattr(pool.pool._policy, "_requests", None)  # group commit's queue
    while waiting is not None and not waiting.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)


# -- cancelled while waiting for its turn ------------------------------------------------------


@pytest.mark.parametrize("group_commit", [True, False], ids=["group", "single"])
def test_a_request_cancelled_in_the_queue_leaves_the_pool_serving(
        db_url: str, engine: sa.Engine, bootstrap: str, topic: str, group_commit: bool,
        no_replaced_writer: None) -> None:
    """The issue's table row: A in its block, B queued for its turn is cancelled (by
    ``asyncio.timeout``, by ``task.cancel()``, by its TaskGroup's shutdown): A completes, the
    next request C succeeds. Three times over a pool of one writer and one collector: the pool
    still serves."""

    async def main() -> set[str]:
        ok: set[str] = set()
        async with make_pool(db_url, bootstrap, group_commit=group_commit) as pool:
            for n in range(3):
                a = Held(pool, topic, f"a{n}")
                await a.wait_entered()
                if n == 0:
                    async def timed_out(v: str = f"b{n}") -> None:
                        async with asyncio.timeout(0.3):
                            await write(pool, topic, v)
                    with pytest.raises(TimeoutError):
                        await timed_out()
                elif n == 1:
                    b = await queued(functools.partial(write, pool, topic, f"b{n}"))
                    await asyncio.sleep(0.1)
                    await cancelled(b)
                else:  # a TaskGroup shuts down: a sibling task failed
                    async def sibling_fails() -> None:
                        await asyncio.sleep(0.3)
                        raise Sibling

                    with pytest.raises(ExceptionGroup) as failed:
                        async with asyncio.TaskGroup() as group:
                            group.create_task(write(pool, topic, f"b{n}"))
                            group.create_task(sibling_fails())
                    assert failed.group_contains(Sibling)
                await a.finish()
                await follow_up(pool, topic, f"c{n}")
                ok |= {f"a{n}", f"c{n}"}
        return ok

    ok = asyncio.run(main())
    assert assert_invariant(engine, bootstrap, topic) == ok


@pytest.mark.parametrize("role", ["first", "member"])
def test_a_request_cancelled_once_a_writer_took_it_is_rolled_back_alone(
        db_url: str, engine: sa.Engine, bootstrap: str, topic: str, role: str,
        no_replaced_writer: None) -> None:
    """B is cancelled after a writer took it into a group, before its task saw its turn: as the
    group's first request (on the writer's own transaction) or as a member behind A. The writer
    rolls B back alone and goes on: A commits, C succeeds."""

    async def main() -> set[str]:
        async with make_pool(db_url, bootstrap) as pool:
            ok: set[str] = set()
            a = None
            if role == "member":
                a = Held(pool, topic, "a")
                await a.wait_entered()
            b = await queued(lambda: write(pool, topic, "b"))
            if a is not None:
                a.release.set()
                for _ in range(3):  # A's block ends (its task then waits for the group)
                    await asyncio.sleep(0)
            block_loop_until_taken(pool)
            await cancelled(b)
            if a is not None:
                state = await asyncio.wait_for(a.task, QUICK_S)
                assert state is not None
                ok.add("a")
            await follow_up(pool, topic, "c")
            ok.add("c")
        return ok

    ok = asyncio.run(main())
    assert assert_invariant(engine, bootstrap, topic) == ok


# -- cancelled while its block runs ------------------------------------------------------------


def test_a_member_cancelled_in_its_block_is_rolled_back_and_its_group_commits(
        db_url: str, engine: sa.Engine, bootstrap: str, topic: str,
        no_replaced_writer: None) -> None:
    """H (the group's first), then M and X as members: M is cancelled in its block after its
    insert and produce. M's row and record never appear; H and X commit in the same group."""

    async def main() -> None:
        async with make_pool(db_url, bootstrap) as pool:
            h = Held(pool, topic, "h")
            await h.wait_entered()
            m = Held(pool, topic, "m")
            for _ in range(3):
                await asyncio.sleep(0)
            x = await queued(lambda: write(pool, topic, "x"))
            h.release.set()
            await m.wait_entered()
            await cancelled(m.task)
            h_state = await asyncio.wait_for(h.task, QUICK_S)
            x_state = await asyncio.wait_for(x, QUICK_S)
            assert h_state is not None and str(h_state) == str(x_state)
            assert m.tx is not None and m.tx.state is None
            await follow_up(pool, topic, "c")

    asyncio.run(main())
    assert assert_invariant(engine, bootstrap, topic) == {"h", "x", "c"}


@pytest.mark.parametrize("group_commit", [True, False], ids=["group", "single"])
def test_a_first_request_cancelled_in_its_block_is_rolled_back_on_both_sides(
        db_url: str, engine: sa.Engine, bootstrap: str, topic: str, group_commit: bool,
        no_replaced_writer: None) -> None:
    """F, the group's first request (or, without group commit, a request on a writer of its
    own), is cancelled in its block: its transaction is rolled back on both sides, the writer is
    kept (a cancellation never reaches it as an interrupt), Y (queued behind it) and C commit."""

    async def main() -> None:
        async with make_pool(db_url, bootstrap, group_commit=group_commit) as pool:
            f = Held(pool, topic, "f")
            await f.wait_entered()
            y = await queued(lambda: write(pool, topic, "y"))
            await cancelled(f.task)
            assert await asyncio.wait_for(y, QUICK_S) is not None
            await follow_up(pool, topic, "c")

    asyncio.run(main())
    assert assert_invariant(engine, bootstrap, topic) == {"y", "c"}


# -- a statement cancelled -----------------------------------------------------------------------


@pytest.mark.parametrize("group_commit", [True, False], ids=["group", "single"])
def test_a_statement_timed_out_while_it_runs_spoils_its_request(
        db_url: str, engine: sa.Engine, bootstrap: str, topic: str, group_commit: bool,
        no_replaced_writer: None) -> None:
    """``asyncio.wait_for(tx.connection.execute(...), 0.05)`` on a statement still running on
    the server: the caller sees TimeoutError and goes on, but the statement reached the
    database. The request ends with TransactionStateError and nothing of it commits — whether
    the block just ends (S1) or runs another statement (S2, refused at once). With group commit,
    S1 and S2 are members of H's group, which commits."""

    async def spoiled(value: str, more: bool) -> None:
        async with pool_ref[0].transaction() as tx:
            await tx.connection.execute(INSERT, {"v": value + "-before"})
            tx.produce(topic, value, value)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(tx.connection.execute(SLOW_INSERT, {"v": value}), 0.05)
            if more:
                await tx.connection.execute(INSERT, {"v": value + "-after"})

    pool_ref: list[AsyncDualWriterPool] = []

    async def main() -> set[str]:
        ok: set[str] = set()
        async with make_pool(db_url, bootstrap, group_commit=group_commit) as pool:
            pool_ref.append(pool)
            h = None
            if group_commit:
                h = Held(pool, topic, "h")
                await h.wait_entered()
            s1 = await queued(lambda: spoiled("s1", False))
            s2 = await queued(lambda: spoiled("s2", True))
            if h is not None:
                await h.finish()
                ok.add("h")
            for task in (s1, s2):
                with pytest.raises(TransactionStateError, match="cancelled"):
                    await asyncio.wait_for(task, QUICK_S)
            await follow_up(pool, topic, "c")
            ok.add("c")
        return ok

    ok = asyncio.run(main())
    assert assert_invariant(engine, bootstrap, topic) == ok


@pytest.mark.parametrize("group_commit", [True, False], ids=["group", "single"])
def test_a_statement_timed_out_while_queued_never_runs(
        db_url: str, engine: sa.Engine, bootstrap: str, topic: str, group_commit: bool,
        no_replaced_writer: None) -> None:
    """A statement queued behind the request's own slow statement times out before the writer
    reaches it: it never runs (as its caller saw), and the request goes on and commits."""

    async def main() -> None:
        async with make_pool(db_url, bootstrap, group_commit=group_commit) as pool:
            async with pool.transaction() as tx:
                slow = asyncio.create_task(
                    tx.connection.execute(sa.text("SELECT pg_sleep(0.5)")))
                await asyncio.sleep(0.05)  # the slow statement runs
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(
                        tx.connection.execute(INSERT, {"v": "skipped"}), 0.05)
                await slow
                await tx.connection.execute(INSERT, {"v": "kept"})
                tx.produce(topic, "kept", "kept")
            assert tx.state is not None
            await follow_up(pool, topic, "c")

    asyncio.run(main())
    assert assert_invariant(engine, bootstrap, topic) == {"kept", "c"}


# -- cancelled while waiting for its group's commit ------------------------------------------------


class Gate(PhaseHooks):
    """Holds the writer at ``prepared`` (the group's block is over) once armed."""

    def __init__(self) -> None:
        self.armed = False
        self.reached = threading.Event()
        self.go = threading.Event()

    def prepared(self, state: PreparedTxnState) -> None:
        if self.armed:
            self.armed = False
            self.reached.set()
            self.go.wait(QUICK_S * 2)


def test_a_request_cancelled_during_its_groups_commit_learns_the_outcome_from_tx_state(
        db_url: str, engine: sa.Engine, bootstrap: str, topic: str,
        no_replaced_writer: None) -> None:
    """H, A and M share a group; M is cancelled while the group commits (held at ``prepared``).
    M's work is part of the decided group: the group commits, M's row and record with it, and
    M's ``tx.state`` (None while undecided) becomes the group's state."""
    gate = Gate()

    async def main() -> None:
        async with make_pool(db_url, bootstrap, hooks=gate) as pool:
            h = Held(pool, topic, "h")
            await h.wait_entered()
            a = await queued(lambda: write(pool, topic, "a"))
            seen: list[dualwrite.AsyncTransaction] = []
            m = await queued(lambda: write(pool, topic, "m", seen))
            gate.armed = True
            h.release.set()
            assert await asyncio.to_thread(gate.reached.wait, QUICK_S)
            await cancelled(m)
            assert seen[0].state is None and not seen[0].decided
            gate.go.set()
            h_state = await asyncio.wait_for(h.task, QUICK_S)
            a_state = await asyncio.wait_for(a, QUICK_S)
            assert h_state is not None and str(h_state) == str(a_state)
            # The writer tells each request of the group in turn: M may be told last.
            deadline = time.monotonic() + QUICK_S
            while not seen[0].decided and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert seen[0].decided and str(seen[0].state) == str(h_state)
            await follow_up(pool, topic, "c")

    asyncio.run(main())
    assert assert_invariant(engine, bootstrap, topic) == {"h", "a", "m", "c"}
