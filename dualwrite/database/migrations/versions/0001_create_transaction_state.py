"""Create dualwrite_transaction_state: one row per transactional id.

The row holds the prepared-state string of that id's last transaction. It is written in the same
database transaction as the application's rows, so the database commit is the decision. The row is
also the lock that serializes writers of one transactional id (SELECT ... FOR UPDATE).

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "dualwrite_transaction_state",
        sa.Column("transactional_id", sa.String(255), nullable=False),
        sa.Column("prepared_txn_state", sa.String(255), nullable=False, server_default=""),
        # MariaDB: microseconds, the row's version there (CommitInquiry.commit_status).
        sa.Column("updated_at", sa.DateTime(timezone=True).with_variant(
            mysql.DATETIME(fsp=6), "mysql", "mariadb"), nullable=False),
        sa.PrimaryKeyConstraint("transactional_id", name="pk_dualwrite_transaction_state"),
    )


def downgrade() -> None:
    op.drop_table("dualwrite_transaction_state")
