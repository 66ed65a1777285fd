"""Add dualwrite_transaction_state.fencing_generation.

A process that is about to end or fence a transactional id's Kafka transactions (a writer
starting its session, recovery) first raises the id's generation and commits that. A writer that
produced before its state-row lock was granted compares the generation under the lock with its
own: equal means nobody touched its Kafka transaction in between ("Claims" in docs/design.md).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "dualwrite_transaction_state",
        sa.Column("fencing_generation", sa.BigInteger(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    with op.batch_alter_table("dualwrite_transaction_state") as batch:
        batch.drop_column("fencing_generation")
