"""Pool slots: which transactional ids of a prefix are this process's own (docs/design.md, "The
writer pool")."""

from __future__ import annotations

from sqlalchemy import Engine

from dualwrite.database import POOL_SLOT_LOCKS, SessionLocks


class Slots:
    """This process's hold on pool slots: a session lock per id, held by a connection of its
    own for the pool's life (a file lock beside an SQLite database file)."""

    def __init__(self, engine: Engine) -> None:
        self._locks = SessionLocks(engine, POOL_SLOT_LOCKS)
        self.held: set[str] = set()

    @property
    def exclusive(self) -> bool:
        """Whether slots exclude other processes (not for an in-memory SQLite database)."""
        return self._locks.exclusive

    def take(self, ids: list[str]) -> set[str]:
        """Take the free ones of ``ids``, without waiting; the ones taken."""
        got = set(self._locks.take(ids).names)
        self.held |= got
        return got

    def give_back(self, tid: str) -> None:
        """Release one slot (an id the pool only borrowed to finish it)."""
        self.held.discard(tid)
        self._locks.give_back(tid)

    def still_held(self) -> bool:
        """Whether the slots are still this process's: on a server, whether the session
        holding them is alive (a server restart ends it, and the locks with it)."""
        return not self.held or self._locks.still_held()

    def release_all(self) -> None:
        self.held.clear()
        self._locks.release_all()
