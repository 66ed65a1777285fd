"""A batch sink's target table: its columns, and streaming Arrow batches into a table by COPY.

Both SQL modes of the sink write the tasks' rows with one ``COPY ... FROM STDIN`` per task on
PostgreSQL: the staging mode into ``<target>_dw_staging`` (:class:`~dualwrite.batch.decision_log.
StagingTable`), the write-once mode straight into the target inside a transaction it prepares
(:mod:`dualwrite.batch.prepared_writes`).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy import Engine

from dualwrite.database.engine import database_error, mask_url
from dualwrite.errors import FatalError

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["ArrowCopy", "target_columns"]


def target_columns(engine: Engine, target: str, columns: Sequence[str] | None
                   ) -> tuple[sa.Table, tuple[str, ...]]:
    """The reflected target table and the columns the sink writes (default: all of them).

    Raises :class:`FatalError` for a missing table or a column it does not have, and the
    :func:`~dualwrite.database.database_error` of a failed reflection (a lost connection:
    :class:`DatabaseUnreachableError`).
    """
    try:
        table = sa.Table(target, sa.MetaData(), autoload_with=engine)
    except sa.exc.NoSuchTableError as exc:
        raise FatalError(f"the target table {target!r} does not exist in "
                         f"{mask_url(engine.url)}; create it first") from exc
    except sa.exc.SQLAlchemyError as exc:
        raise database_error(exc, engine.url) from exc
    names = list(columns) if columns is not None else [c.name for c in table.columns]
    unknown = [c for c in names if c not in table.columns]
    if unknown or not names:
        raise FatalError(f"columns {unknown or names} are not columns of {target!r}")
    return table, tuple(names)


def _csv_safe(kind: pa.DataType) -> bool:
    """Whether pyarrow's CSV writer renders ``kind`` as PostgreSQL's COPY reads it back."""
    import pyarrow as pa  # here, not at import: the CLI never needs it

    return bool(pa.types.is_integer(kind) or pa.types.is_floating(kind)
                or pa.types.is_boolean(kind) or pa.types.is_string(kind)
                or pa.types.is_large_string(kind) or pa.types.is_decimal(kind)
                or pa.types.is_date(kind) or pa.types.is_null(kind))


class ArrowCopy:
    """One ``COPY <table> (<columns>, <constants>) FROM STDIN`` fed with Arrow record batches.

    The first non-empty batch chooses the format: CSV written by pyarrow (no Python per row)
    when every column survives CSV, else text rows one by one (e.g. binary columns).
    ``constants`` are appended to every row (the staging table's tags). The caller owns the
    psycopg cursor and its transaction; use it as a context manager.
    """

    def __init__(self, cursor: Any, table: str, columns: Sequence[str],
                 constants: Sequence[tuple[str, Any]] = ()) -> None:
        self._cursor = cursor
        self._table = table
        self._columns = tuple(columns)
        self._constants = tuple(constants)
        self._names = [*self._columns, *(name for name, _ in self._constants)]
        self._copy: Any = None
        self._context: Any = None  # psycopg's copy() is a generator context manager: kept alive
        self._csv = False
        self.rows = 0

    def write(self, batch: pa.RecordBatch) -> int:
        """COPY ``batch``'s :attr:`columns` (taken by name); returns its row count."""
        import pyarrow as pa
        import pyarrow.csv as pa_csv

        n = int(batch.num_rows)
        if n == 0:
            return 0
        table = pa.table([batch.column(c) for c in self._columns]
                         + [pa.repeat(value, n) for _, value in self._constants],
                         names=self._names)
        if self._copy is None:
            self._csv = all(_csv_safe(f.type) for f in table.schema)
            self._context = self._cursor.copy(self._statement(csv=self._csv))
            self._copy = self._context.__enter__()
        if self._csv:
            out = io.BytesIO()
            pa_csv.write_csv(table, out, pa_csv.WriteOptions(include_header=False))
            self._copy.write(out.getbuffer())
        else:
            for row in zip(*(table.column(c).to_pylist() for c in self._names), strict=True):
                self._copy.write_row(row)
        self.rows += n
        return n

    def __enter__(self) -> ArrowCopy:
        return self

    def __exit__(self, *exc: Any) -> None:
        """End the COPY (the server reports a bad row here), or cancel it on an error."""
        if self._context is not None:
            context, self._context, self._copy = self._context, None, None
            context.__exit__(*exc)

    def _statement(self, *, csv: bool) -> Any:
        from psycopg import sql

        return sql.SQL("COPY {} ({}) FROM STDIN{}").format(
            sql.Identifier(self._table), sql.SQL(", ").join(map(sql.Identifier, self._names)),
            sql.SQL(" (FORMAT csv)" if csv else ""))
