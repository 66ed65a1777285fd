"""``dualwrite verify``: does a table hold exactly the rows its topic has records for?

After an incident, the check an operator runs on their own data: every row of ``table`` should
have exactly one record in ``topic`` whose key is the row's key, as a read_committed consumer
sees it, and every record a row. The rows are read first, then the topic up to the ends its
partitions had once the rows were read, waiting for the transactions open then to end (a
dual write's Kafka transaction is open before its database COMMIT, so a row read has its
record below those ends). Records whose key has no row are then looked up again, so writers
that keep running do not make rows committed after the first read look like phantoms.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL

from dualwrite.database import create_engine, database_error, mask_url
from dualwrite.errors import (
    ConfigurationError,
    DatabaseUnreachableError,
    LockTimeoutError,
)
from dualwrite.participant.client_config import check_kafka_config, check_timeout
from dualwrite.participant.topic_reader import read_committed

__all__ = ["KeyOfRecord", "VerifyReport", "record_key", "verify"]

log = logging.getLogger(__name__)

KeyOfRecord = Callable[[bytes | None, bytes | None], str | None]
"""From a record's (key, value) to the key of its row, or None for a record of something else
(it is counted in :attr:`VerifyReport.skipped_records` and otherwise ignored)."""


def record_key(key: bytes | None, value: bytes | None) -> str | None:
    """The default :data:`KeyOfRecord`: the record key as UTF-8 (None for a record without key)."""
    return None if key is None else key.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found. Keys are sorted; ``summary`` is the one-line verdict."""

    table: str
    key_column: str
    topic: str
    rows: int
    """Rows read (those with a non-NULL key)."""
    records: int
    """Records read (read_committed), skipped ones included."""
    lost: tuple[str, ...]
    """Keys of rows without a record: events that never reached the topic."""
    phantoms: tuple[str, ...]
    """Keys of records without a row: events of writes the database does not hold."""
    duplicates: tuple[tuple[str, int], ...]
    """(key, number of records) for each key with more than one record."""
    duplicate_rows: tuple[str, ...]
    """Keys held by more than one row (the key column is not unique)."""
    open_partitions: tuple[int, ...]
    """Partitions a transaction kept open past the timeout: records beyond it were not read
    (``dualwrite status`` shows it; ``dualwrite recover`` ends an in-doubt one)."""
    unread_partitions: tuple[int, ...]
    """Partitions not read to their end within the timeout (a slow or unreachable broker)."""
    skipped_records: int = 0
    """Records ``key_of_record`` returned None for."""
    null_key_rows: int = 0
    """Rows whose key column is NULL (not compared)."""
    elapsed_s: float = 0.0

    @property
    def duplicate_records(self) -> int:
        """Records beyond the first of each duplicated key."""
        return sum(n - 1 for _, n in self.duplicates)

    @property
    def ok(self) -> bool:
        """Every row has exactly one record, every record a row, and the topic was read to
        its end."""
        return not (self.lost or self.phantoms or self.duplicates or self.duplicate_rows
                    or self.open_partitions or self.unread_partitions)

    @property
    def summary(self) -> str:
        """``verified: lost=0 duplicates=0 open=0`` and, when not zero, ``phantoms=``,
        ``duplicate_rows=``, ``unread=`` (partitions)."""
        extra = "".join(f" {name}={n}" for name, n in (
            ("phantoms", len(self.phantoms)), ("duplicate_rows", len(self.duplicate_rows)),
            ("unread", len(self.unread_partitions))) if n)
        return (f"verified: lost={len(self.lost)} duplicates={self.duplicate_records} "
                f"open={len(self.open_partitions)}{extra}")

    def __str__(self) -> str:
        return self.summary

    def as_dict(self, limit: int | None = None) -> dict[str, Any]:
        """A JSON-ready dict; ``limit`` caps each list of example keys."""
        def cut(keys: tuple[Any, ...]) -> list[Any]:
            return list(keys if limit is None else keys[:limit])

        return {
            "ok": self.ok, "summary": self.summary, "table": self.table,
            "key_column": self.key_column, "topic": self.topic,
            "counts": {"rows": self.rows, "records": self.records, "lost": len(self.lost),
                       "phantoms": len(self.phantoms), "duplicate_keys": len(self.duplicates),
                       "duplicate_records": self.duplicate_records,
                       "duplicate_rows": len(self.duplicate_rows),
                       "open_partitions": len(self.open_partitions),
                       "unread_partitions": len(self.unread_partitions),
                       "skipped_records": self.skipped_records,
                       "null_key_rows": self.null_key_rows},
            "lost": cut(self.lost), "phantoms": cut(self.phantoms),
            "duplicates": [{"key": k, "records": n} for k, n in cut(self.duplicates)],
            "duplicate_rows": cut(self.duplicate_rows),
            "open_partitions": list(self.open_partitions),
            "unread_partitions": list(self.unread_partitions),
            "elapsed_s": round(self.elapsed_s, 3),
        }


def _split_name(table: str) -> tuple[str | None, str]:
    if not isinstance(table, str) or not table.strip():
        raise ConfigurationError(f"table must be a table name, not {table!r}")
    schema, _, name = table.strip().rpartition(".")
    return (schema or None), name


@contextmanager
def _engine(engine_or_url: Engine | str | URL) -> Iterator[Engine]:
    """The caller's engine, or one of our own for a URL (disposed of afterwards)."""
    if isinstance(engine_or_url, Engine):
        yield engine_or_url
        return
    engine = create_engine(engine_or_url)
    try:
        yield engine
    finally:
        engine.dispose()


def _check_names(conn: Connection, schema: str | None, name: str, key_column: str) -> None:
    """ConfigurationError naming what is missing: the table, or the column (with those there
    are)."""
    inspector = sa.inspect(conn)
    if not inspector.has_table(name, schema=schema):
        where = f" in schema {schema!r}" if schema else ""
        raise ConfigurationError(f"table {name!r} does not exist{where} in the database "
                                 f"{mask_url(conn.engine.url)}")
    columns = [c["name"] for c in inspector.get_columns(name, schema=schema)]
    if key_column not in columns:
        raise ConfigurationError(f"table {name!r} has no column {key_column!r}; its columns: "
                                 f"{', '.join(columns)}")


def _row_keys(engine: Engine, schema: str | None, name: str, key_column: str,
              where: str | None, *, check: bool) -> tuple[Counter[str], int]:
    """How many rows hold each key (str of the column's value), and how many have NULL."""
    query: sa.Select[Any] = sa.select(sa.column(key_column)).select_from(
        sa.table(name, schema=schema))
    if where:
        query = query.where(sa.text(where))
    keys: Counter[str] = Counter()
    nulls = 0
    try:
        with engine.connect() as conn:
            if check:
                _check_names(conn, schema, name, key_column)
            result = conn.execution_options(stream_results=True, yield_per=10_000).execute(query)
            for (value,) in result:
                if value is None:
                    nulls += 1
                else:
                    keys[value.decode() if isinstance(value, bytes) else str(value)] += 1
    except sa.exc.SQLAlchemyError as exc:
        error = database_error(exc, engine.url, table=name)
        if isinstance(error, (DatabaseUnreachableError, LockTimeoutError)) or not where:
            raise error from exc
        raise ConfigurationError(f"the filter {where!r} on table {name!r} failed: "
                                 f"{error}") from exc
    return keys, nulls


def verify(engine_or_url: Engine | str | URL, kafka_config: Mapping[str, Any], *, table: str,
           key_column: str, topic: str, where: str | None = None,
           key_of_record: KeyOfRecord = record_key, timeout_s: float = 60.0,
           progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Compare ``table``'s rows with ``topic``'s records: each row's ``key_column`` (as str)
    should be the key of exactly one record a read_committed consumer sees, and each record's
    key that of a row.

    ``table`` may be ``schema.table``; ``where`` is an SQL condition on it (trusted text, e.g.
    ``"created_at > '2024-05-01'"``) for tables that hold more than the topic.
    ``key_of_record`` maps a record's (key, value) to its row's key (default: the record key
    as UTF-8); None skips the record. ``timeout_s`` bounds reading the topic, the wait for
    transactions open at the start included (then reported in ``open_partitions``).
    ``progress(records read, offsets to read)`` is called as the topic is read.

    Keys are held in memory (a few tens of bytes each). Raises only dualwrite errors:
    :class:`ConfigurationError` for a missing table, column or topic or a bad filter,
    :class:`DatabaseUnreachableError` / :class:`BrokerUnreachableError` when a side does not
    answer.
    """
    started = time.monotonic()
    config = check_kafka_config(kafka_config)
    timeout_s = check_timeout(timeout_s)
    schema, name = _split_name(table)
    if not isinstance(key_column, str) or not key_column:
        raise ConfigurationError(f"key_column must be a column name, not {key_column!r}")
    if not isinstance(topic, str) or not topic:
        raise ConfigurationError(f"topic must be a topic name, not {topic!r}")
    with _engine(engine_or_url) as engine:
        rows, nulls = _row_keys(engine, schema, name, key_column, where, check=True)
        seen: Counter[str] = Counter()
        skipped = 0

        def take(key: bytes | None, value: bytes | None) -> None:
            nonlocal skipped
            try:
                row_key = key_of_record(key, value)
            except Exception as exc:  # the caller's code
                raise ConfigurationError(f"key_of_record failed on a record of {topic!r} (key "
                                         f"{key!r}): {type(exc).__name__}: {exc}") from exc
            if row_key is None:
                skipped += 1
            else:
                seen[row_key] += 1

        read = read_committed(config, topic, timeout_s=timeout_s, on_record=take,
                              progress=progress)
        phantoms = seen.keys() - rows.keys()
        if phantoms:  # rows committed since the first read are no phantoms
            again, _ = _row_keys(engine, schema, name, key_column, where, check=False)
            phantoms -= again.keys()
    report = VerifyReport(
        table=table, key_column=key_column, topic=topic, rows=sum(rows.values()),
        records=read.count, lost=tuple(sorted(rows.keys() - seen.keys())),
        phantoms=tuple(sorted(phantoms)),
        duplicates=tuple(sorted((k, n) for k, n in seen.items() if n > 1)),
        duplicate_rows=tuple(sorted(k for k, n in rows.items() if n > 1)),
        open_partitions=read.open_partitions, unread_partitions=read.unread_partitions,
        skipped_records=skipped, null_key_rows=nulls, elapsed_s=time.monotonic() - started)
    log.info("verify %s.%s against %s: %s (%d rows, %d records, %.1f s)", table, key_column,
             topic, report.summary, report.rows, report.records, report.elapsed_s)
    return report
