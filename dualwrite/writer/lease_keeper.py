"""A writer's hold on its id's lease (:mod:`dualwrite.writer.lease`): taken at its start, checked
after each Kafka commit, and the verdict that says whether its next transaction may begin before
its state-row lock ("The lease under session loss" in docs/design.md)."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy import Connection

from dualwrite.database import database_error
from dualwrite.deadline import deadline_scope
from dualwrite.errors import DualWriteError, FatalError
from dualwrite.writer.handle import GuardedConnection
from dualwrite.writer.lease import Lease, Leases
from dualwrite.writer.settings import WriterSettings, log

if TYPE_CHECKING:
    from dualwrite.writer.connection import WriterConnection

__all__ = ["LeaseKeeper", "LeaseVerdict", "lease_verdict"]

# How long a starting writer waits for its id's lease (recovery holds it while it resolves the
# id) before it concludes that a live writer holds it (bounded by ``timeout_s`` too).
_LEASE_WAIT_S = 5.0


class LeaseVerdict(enum.Enum):
    """What the check after a Kafka commit found about the session holding the lease."""

    INTACT = "intact"
    """The writer's connection still runs the session that took the lease, and the id's
    fencing generation is still the writer's."""
    CLAIMED = "claimed"
    """The session is intact, but someone claimed the id."""
    MOVED = "moved"
    """The connection runs on another session while the lease's own still holds it (a
    transaction pooler)."""
    LOST = "lost"
    """The session is another one, or did not answer."""


def lease_verdict(*, same_session: bool | None, still_held: bool | None,
                  generation_kept: bool) -> LeaseVerdict:
    """The verdict from what the check saw: whether the connection answered as the session
    that took the lease (None: no answer), whether that session still holds the lease when it
    did not (None: not asked, or no answer), and whether the id's generation is unchanged."""
    if same_session is None:
        return LeaseVerdict.LOST
    if not same_session:
        return LeaseVerdict.MOVED if still_held else LeaseVerdict.LOST
    return LeaseVerdict.INTACT if generation_kept else LeaseVerdict.CLAIMED


class LeaseKeeper:
    """The lease a writer holds while it may begin transactions before taking the row lock,
    and the check of it begun after each Kafka commit."""

    def __init__(self, settings: WriterSettings) -> None:
        self._settings = settings
        self._leases = Leases(settings.engine)
        self.lease: Lease | None = None
        """Held while this writer may begin transactions before taking the row lock."""
        self._check: Future[LeaseVerdict] | None = None
        """The check of the lease begun after the last Kafka commit (:meth:`check`)."""

    @property
    def supported(self) -> bool:
        return self._leases.supported

    def check_sessions(self) -> None:
        """Refuse a pooler that would make the lease meaningless (:meth:`Leases.check_sessions`)."""
        self._leases.check_sessions()

    def take_at_start(self, connection: WriterConnection) -> None:
        """Before the first session fences anyone: take the id's lease, or refuse to start if
        a live process holds it (unless ``take_over``); see "Leases" in docs/design.md.

        Recovery holds a lease only while it resolves the id, so the writer waits a little
        for it first; a live writer holds it for its whole session.
        """
        if self.lease is not None or not self._leases.supported:
            return
        tid, take_over = self._settings.transactional_id, self._settings.take_over
        wait_s = 0.0 if take_over else min(self._settings.timeout_s, _LEASE_WAIT_S)
        deadline = time.monotonic() + wait_s
        while True:
            conn = connection.own()
            try:
                held = self.take(conn)
            finally:
                connection.rollback(conn)  # PostgreSQL's session-level lock outlives it
            if held or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if held:
            return
        if not take_over:
            raise FatalError(
                f"transactional_id={tid} is in use: another live process (a writer of "
                "this id, or recovery resolving it) holds its lease. Two writers must not share "
                "a transactional id: stop the other writer, or pass DualWriter(..., "
                "take_over=True) to fence it")
        log.warning("transactional_id=%s: another live process holds its lease; taking over "
                    "(take_over=True): that writer is fenced, and this one locks its state row "
                    "first until the lease is free", tid)

    def take(self, conn: Connection) -> bool:
        """Take this id's lease if free (on ``conn``'s session on PostgreSQL); True if held."""
        if self.lease is None and self._leases.supported:
            try:
                self.lease = self._leases.try_acquire(conn, self._settings.transactional_id)
            except sa.exc.SQLAlchemyError as exc:
                raise database_error(exc, self._settings.engine.url) from exc
            if self.lease is not None:
                log.info("transactional_id=%s: lease taken; later transactions lock the state "
                         "row after their first record", self._settings.transactional_id)
        return self.lease is not None

    def owner_alive(self, conn: Connection) -> Callable[[], bool] | None:
        """Whether another writer may still run the session that prepared the stored state.

        Only a lease holder begins transactions before the row lock, so only while another
        process holds the lease could an EndTxn by (producer id, epoch) land on a later
        transaction than the one the stored state names. None: nobody else can hold it.
        """
        if self.lease is not None or not self._leases.supported:
            return None
        return lambda: not self.take(conn)

    def verdict_before_next(self, conn: GuardedConnection | None, generation: int | None
                            ) -> LeaseVerdict | None:
        """Whether the next transaction may begin before its row lock (:attr:`LeaseVerdict.INTACT`);
        None when it must lock first anyway (no claim seen under the lock, or no lease).

        Only while this writer's lease has been held without a break since its last Kafka
        commit. Recovery (or a second writer) commits a transaction by (producer id, epoch) only
        once it holds the lease, and only if it found that transaction open: before this
        writer's Kafka commit of it. A check after that commit which finds the session that
        took the lease still running, and the id unclaimed, proves nobody did; the session lost
        instead (a restart, pg_terminate_backend, idle_session_timeout, a failover), someone
        may have, with an EndTxn still on its way that would land on the next transaction of
        this session. So the writer starts a new producer session (the epoch moves and such a
        request is refused) and locks first. The lease lost later than the check changes
        nothing: the transactions begun since are not decided yet, so whoever acts can only
        abort them, and the late lock shows their claim (then the writer starts over, again
        in a new session).
        """
        verdict = self.verdict()
        if generation is None or self.lease is None:
            return None
        if not self.lease.ends_with_connection:
            return LeaseVerdict.INTACT  # a file lock: held as long as this process lives
        if verdict is None:  # no Kafka commit since the lease was taken: ask now
            verdict = self.check(conn, generation)
            self._check = None
        if verdict is LeaseVerdict.CLAIMED:
            self._check = None  # locking first settles it
        return verdict

    def verdict(self) -> LeaseVerdict | None:
        """The answer of the check begun after the last Kafka commit (waited for), if any."""
        check = self._check
        return None if check is None else check.result()

    def check_after_commit(self, helper: ThreadPoolExecutor,
                           check: Callable[[], LeaseVerdict]) -> None:
        """Begin the check after a Kafka commit, on ``helper``: if the application pauses
        before its next transaction, the check costs that transaction nothing."""
        self._check = None
        if self.lease is not None and self.lease.ends_with_connection:
            self._check = helper.submit(check)

    def check(self, conn: GuardedConnection | None, generation: int | None) -> LeaseVerdict:
        """Ask, on ``conn``, whether the session that took the lease still runs it and the id's
        generation is still ``generation`` (see :class:`LeaseVerdict`)."""
        lease, tid = self.lease, self._settings.transactional_id
        timeout_s = self._settings.timeout_s
        if conn is None or lease is None:
            return lease_verdict(same_session=None, still_held=None, generation_kept=False)
        try:
            # Bounded on the helper thread too: a silent peer must not hold the next transaction.
            with conn.own_use(), deadline_scope(timeout_s):
                stored, backend_pid = self._settings.store.generation_on(conn, tid)
        except DualWriteError as exc:
            log.info("transactional_id=%s: checking the lease's session failed (%s)", tid, exc)
            return lease_verdict(same_session=None, still_held=None, generation_kept=False)
        same_session = lease.held_by_session(backend_pid)
        still_held: bool | None = None
        if not same_session:
            try:
                with conn.own_use(), deadline_scope(timeout_s):
                    still_held = self._leases.still_held_by_its_session(conn, lease)
            except DualWriteError as exc:
                log.info("transactional_id=%s: asking who holds the lease failed (%s)", tid, exc)
        return lease_verdict(same_session=same_session, still_held=still_held,
                             generation_kept=stored == generation)

    def release_with_connection(self) -> bool:
        """The writer's connection is let go: a lease that is the connection's goes with it
        (and its pending check). True if one did."""
        if self.lease is None or not self.lease.ends_with_connection:
            return False
        self.lease.release()
        self.lease = None
        self._check = None
        return True

    def release(self) -> None:
        """Give the lease back (idempotent)."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()
