"""Create the exactly-once consumers' position table.

``dualwrite_consumer_position`` holds, per (consumer group, topic, partition), the next input
offset the last decided transaction consumed up to, written in the same database transaction as
the application's rows and the writer's prepared state (that COMMIT decides all three), and the
partition's owner generation, raised by each new owner so that a zombie of a revoked partition
cannot decide ("Exactly-once consumer" in docs/design.md).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "dualwrite_consumer_position",
        sa.Column("group_id", sa.String(200), nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("partition_id", sa.Integer(), nullable=False),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.Column("owner_generation", sa.BigInteger(), nullable=False),
        sa.Column("owner", sa.String(255), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("group_id", "topic", "partition_id",
                                name="pk_dualwrite_consumer_position"),
    )


def downgrade() -> None:
    op.drop_table("dualwrite_consumer_position")
