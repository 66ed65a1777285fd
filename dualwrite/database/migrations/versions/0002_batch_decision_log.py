"""Create the decision log of batch sinks (the Spark foreachBatch sink).

``dualwrite_batch_sink`` holds, per sink, the last batch the sink decided and whether all of that
batch's Kafka participants were committed. ``dualwrite_batch_participant`` holds the prepared state
of each participant of that batch, written in the same database transaction as the decision, so
that a restarted driver (or ``dualwrite recover``) can finish the commit.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "dualwrite_batch_sink",
        sa.Column("sink_id", sa.String(200), nullable=False),
        sa.Column("last_batch_id", sa.BigInteger(), nullable=False),
        sa.Column("completed", sa.Boolean(), nullable=False),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("sink_id", name="pk_dualwrite_batch_sink"),
    )
    op.create_table(
        "dualwrite_batch_participant",
        sa.Column("sink_id", sa.String(200), nullable=False),
        sa.Column("transactional_id", sa.String(255), nullable=False),
        sa.Column("batch_id", sa.BigInteger(), nullable=False),
        sa.Column("partition_id", sa.Integer(), nullable=False),
        sa.Column("prepared_txn_state", sa.String(255), nullable=False),
        sa.Column("records", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("sink_id", "transactional_id",
                                name="pk_dualwrite_batch_participant"),
    )


def downgrade() -> None:
    op.drop_table("dualwrite_batch_participant")
    op.drop_table("dualwrite_batch_sink")
