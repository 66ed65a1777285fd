"""Add dualwrite_batch_sink.pending_apply.

A batch sink's decision no longer copies the batch's staged rows into the target table: it
records where they are (staging table, target, columns, winning attempts) in this column, and
the rows move in a transaction of their own after the decision, which clears it and marks the
batch completed ("Batch sinks" in docs/design.md).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("dualwrite_batch_sink", sa.Column("pending_apply", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("dualwrite_batch_sink") as batch:
        batch.drop_column("pending_apply")
