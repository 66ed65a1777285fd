"""The exactly-once consumer's input positions and partition owners, in the database.

One row per (group, topic, partition) of ``dualwrite_consumer_position``: the next offset the
last decided transaction consumed up to, and the owner generation. A new owner raises the
generation (:meth:`PositionStore.take`) and reads the position in one transaction; every decision
writes the new positions of its input partitions only where the generation is still its own
(``UPDATE … WHERE owner_generation = mine``, which waits for the row lock and tests the row as
committed by whoever held it), in the application's transaction, whose COMMIT is the decision.
A zombie (a consumer whose partition was revoked without its knowing) finds a higher generation,
updates nothing and is refused; a new owner's :meth:`take` waits for a decision holding the lock
and reads what it decided.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from dualwrite.database import CONSUMER_POSITION, CONSUMER_POSITION_TABLE, database_error
from dualwrite.database import transaction as db_transaction
from dualwrite.errors import PartitionFencedError

__all__ = ["NO_POSITION", "Partition", "PositionStore"]

Partition = tuple[str, int]
"""(topic, partition)"""

NO_POSITION = -1
"""``next_offset`` of a partition no decision has consumed from yet."""

_T = CONSUMER_POSITION
_ATTEMPTS = 3

# A decision's write of one partition's position, only while its generation is the decider's.
_ADVANCE = (sa.update(_T)
            .where(_T.c.group_id == sa.bindparam("g"), _T.c.topic == sa.bindparam("t"),
                   _T.c.partition_id == sa.bindparam("p"),
                   _T.c.owner_generation == sa.bindparam("gen"))
            .values(next_offset=sa.bindparam("o"), updated_at=sa.bindparam("now")))


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class PositionStore:
    """Reads and writes one consumer group's rows (see the module docstring)."""

    def __init__(self, engine: Engine, group_id: str) -> None:
        self._engine = engine
        self._group = group_id

    def _key(self, topic: str, partition: int) -> sa.ColumnElement[bool]:
        return sa.and_(_T.c.group_id == self._group, _T.c.topic == topic,
                       _T.c.partition_id == partition)

    def take(self, partitions: list[Partition], owner: str) -> dict[Partition, tuple[int, int]]:
        """Become the owner of ``partitions``: raise each one's generation (waiting for a
        decision that holds its row) and return ``{partition: (next offset, generation)}``,
        committed before the consumer reads a record of them."""
        for attempt in range(_ATTEMPTS):
            try:
                with db_transaction(self._engine) as conn:
                    return {p: self._take_one(conn, p, owner) for p in sorted(partitions)}
            except sa.exc.IntegrityError as exc:  # two new owners inserted the first row
                if attempt == _ATTEMPTS - 1:
                    raise database_error(exc, self._engine.url,
                                         table=CONSUMER_POSITION_TABLE) from exc
            except sa.exc.SQLAlchemyError as exc:
                raise database_error(exc, self._engine.url, table=CONSUMER_POSITION_TABLE) \
                    from exc
        raise AssertionError("unreachable")

    def _take_one(self, conn: Connection, partition: Partition, owner: str) -> tuple[int, int]:
        topic, number = partition
        row = conn.execute(sa.select(_T.c.next_offset, _T.c.owner_generation)
                           .where(self._key(topic, number)).with_for_update()).first()
        if row is None:
            conn.execute(sa.insert(_T).values(
                group_id=self._group, topic=topic, partition_id=number,
                next_offset=NO_POSITION, owner_generation=1, owner=owner, updated_at=_now()))
            return NO_POSITION, 1
        generation = int(row.owner_generation) + 1
        conn.execute(sa.update(_T).where(self._key(topic, number)).values(
            owner_generation=generation, owner=owner, updated_at=_now()))
        return int(row.next_offset), generation

    def read(self, partitions: list[Partition]) -> dict[Partition, tuple[int, int]]:
        """``{partition: (next offset, generation)}`` as decided (for a consumer that must find
        its place again after a failed decision)."""
        try:
            with db_transaction(self._engine, read_only=True) as conn:
                out = {}
                for topic, number in partitions:
                    row = conn.execute(sa.select(_T.c.next_offset, _T.c.owner_generation)
                                       .where(self._key(topic, number))).first()
                    if row is not None:
                        out[(topic, number)] = (int(row.next_offset), int(row.owner_generation))
                return out
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, self._engine.url, table=CONSUMER_POSITION_TABLE) from exc

    def decide(self, conn: Connection, positions: Mapping[Partition, int],
               generations: Mapping[Partition, int]) -> None:
        """In the decision's transaction (``conn``): write the new positions of ``positions``'
        partitions where each generation is still the one in ``generations``, else refuse
        (:class:`PartitionFencedError`).

        One statement per partition, in partition order (the order :meth:`take` locks in), sent
        as one batch: on psycopg one round trip. The lock, the check and the write are one
        ``UPDATE``, so a batch that updates fewer rows than it has partitions was fenced.
        """
        now = _now()
        # (generations start at 1: a partition missing from ``generations`` updates nothing)
        rows = [{"g": self._group, "t": p[0], "p": p[1], "gen": generations.get(p, 0),
                 "o": positions[p], "now": now} for p in sorted(positions)]
        try:
            updated = conn.execute(_ADVANCE, rows).rowcount
        except sa.exc.SQLAlchemyError as exc:
            raise database_error(exc, self._engine.url, table=CONSUMER_POSITION_TABLE) from exc
        if updated != len(rows):
            self._refuse(conn, positions, generations)

    def _refuse(self, conn: Connection, positions: Mapping[Partition, int],
                generations: Mapping[Partition, int]) -> None:
        """Raise the :class:`PartitionFencedError` of the first partition not owned any more."""
        for partition in sorted(positions):
            topic, number = partition
            try:
                stored = conn.execute(sa.select(_T.c.owner_generation, _T.c.owner)
                                      .where(self._key(topic, number))).first()
            except sa.exc.SQLAlchemyError as exc:
                raise database_error(exc, self._engine.url, table=CONSUMER_POSITION_TABLE) \
                    from exc
            mine = generations.get(partition)
            if stored is None or mine is None or int(stored.owner_generation) != mine:
                owner = "nobody" if stored is None else f"{stored.owner} (generation " \
                    f"{stored.owner_generation})"
                raise PartitionFencedError(
                    f"group {self._group}: {topic}[{number}] is owned by {owner} now, not by "
                    f"this consumer (generation {mine}); its batch is abandoned, rows and "
                    "records rolled back")
        raise PartitionFencedError(
            f"group {self._group}: a partition of {sorted(positions)} changed owner while its "
            "batch was decided; the batch is abandoned, rows and records rolled back")
